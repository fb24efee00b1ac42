//! Bad input on the public entry points: a typed error or a counted refusal,
//! never a panic, a hang or a wrong sum.

use crate::common;

use common::{build_world, on_ranks, pid};
use gradsync::{BuildError, DType, GradSync, LocalWorld, Rejection, SyncError, Token};

#[test]
fn registration_errors_are_typed() {
    let mut b = GradSync::builder();
    b.param("w", 4, DType::F32).unwrap();
    assert!(matches!(b.param("w", 4, DType::F32), Err(BuildError::DuplicateParam { .. })));
    assert!(matches!(b.param("z", 0, DType::F32), Err(BuildError::ZeroSizedParam { .. })));
    assert!(matches!(b.expect_arrivals(pid(9), 1), Err(BuildError::InvalidSetting { .. })));
    assert!(matches!(LocalWorld::connect(0), Err(BuildError::InvalidWorld { world: 0, .. })));
    let empty = GradSync::builder();
    let ep = LocalWorld::connect(1).unwrap().pop().unwrap();
    assert!(matches!(empty.build(ep), Err(BuildError::NoParams)));
}

/// Every refusal the hook can decide is returned at the call site, and
/// counted in the report of the step it names while that report is to come.
#[test]
fn hook_refusals_are_returned_and_counted() {
    let syncs = build_world(2, &[3, 3], |_| {});
    let reports = on_ranks(syncs, |_, mut sync| {
        let hook = sync.hook();
        assert_eq!(hook.increment(0, pid(7), Token(0), vec![1.0; 3]), Err(Rejection::UnknownParam { param: pid(7) }));
        assert_eq!(
            hook.increment(0, pid(0), Token(0), vec![1.0; 2]),
            Err(Rejection::WrongLength { param: pid(0), expected: 3, got: 2 })
        );
        for future in [5, u64::MAX] {
            assert_eq!(
                hook.increment(future, pid(0), Token(0), vec![1.0; 3]),
                Err(Rejection::FutureStep { param: pid(0), step: future, current: 0 })
            );
        }
        hook.increment(0, pid(1), Token(0), vec![2.0; 3]).unwrap();
        let r = sync.finish_step(0).unwrap();
        // After finish: an arrival for the finished step is refused at once.
        assert_eq!(
            hook.increment(0, pid(1), Token(1), vec![2.0; 3]),
            Err(Rejection::StepFinished { param: pid(1), step: 0 })
        );
        let g = r.gradients.unwrap();
        assert_eq!(g.to_vec(pid(1)).unwrap(), vec![2.0; 3], "refusals never touch a sum");
        assert!(g.to_vec(pid(0)).is_none(), "refused arrivals do not make a parameter used");
        drop(g);
        let r1 = sync.finish_step(1).unwrap();
        (r.report, r1.report)
    });
    for (step0, step1) in reports {
        // Step 0's report names the refusals of step 0; the future steps' wait
        // for their own reports; the late arrival's step had reported already.
        assert_eq!(step0.rejected, 2);
        assert!(step0.rejections.contains(&Rejection::UnknownParam { param: pid(7) }));
        assert!(step0.rejections.contains(&Rejection::WrongLength { param: pid(0), expected: 3, got: 2 }));
        assert_eq!(step1.rejected, 0);
    }
}

#[test]
fn mixing_payload_kinds_in_a_step_is_refused_without_touching_the_sum() {
    let syncs = build_world(2, &[2], |b| {
        b.divisor(gradsync::Divisor::Sum);
    });
    let out = on_ranks(syncs, |_, mut sync| {
        let hook = sync.hook();
        hook.increment(0, pid(0), Token(0), vec![1.0, 1.0]).unwrap();
        assert_eq!(
            hook.accumulated(0, pid(0), Token(1), vec![100.0, 100.0]),
            Err(Rejection::MixedKinds { param: pid(0) })
        );
        let r = sync.finish_step(0).unwrap();
        (r.report.rejections.clone(), r.gradients.unwrap().to_vec(pid(0)).unwrap())
    });
    for (rejections, g) in out {
        assert_eq!(rejections, vec![Rejection::MixedKinds { param: pid(0) }]);
        assert_eq!(g, vec![2.0, 2.0]);
    }
}

#[test]
fn settings_that_cannot_work_are_refused() {
    let build = |configure: &dyn Fn(&mut gradsync::GradSyncBuilder)| {
        let mut b = GradSync::builder();
        b.param("w", 4, DType::F32).unwrap();
        configure(&mut b);
        b.build(LocalWorld::connect(1).unwrap().pop().unwrap()).map(|_| ())
    };
    let invalid = |r: Result<(), BuildError>| matches!(r, Err(BuildError::InvalidSetting { .. }));
    assert!(invalid(build(&|b| {
        b.param_shards(0);
    })));
    assert!(invalid(build(&|b| {
        b.collective_timeout(std::time::Duration::ZERO);
    })));
    assert!(invalid(build(&|b| {
        b.divisor(gradsync::Divisor::Fixed(0));
    })));
}

#[test]
fn finishing_out_of_order_or_twice_is_an_error() {
    let syncs = build_world(1, &[2], |_| {});
    on_ranks(syncs, |_, mut sync| {
        assert_eq!(sync.finish_step(3).unwrap_err(), SyncError::NotCurrentStep { expected: 0, got: 3 });
        let r = sync.finish_step(0).unwrap();
        drop(r);
        assert_eq!(sync.finish_step(0).unwrap_err(), SyncError::NotCurrentStep { expected: 1, got: 0 });
    });
}

#[test]
fn hooks_outliving_their_gradsync_get_closed() {
    let sync = build_world(1, &[2], |_| {}).pop().unwrap();
    let hook = sync.hook();
    drop(sync);
    assert_eq!(hook.increment(0, pid(0), Token(0), vec![0.0; 2]), Err(Rejection::Closed));
}
