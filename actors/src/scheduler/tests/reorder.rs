//! The plan rebuilt in the order gradients arrive, driven message by message.

use super::*;
use crate::scheduler::REORDER_AFTER;

/// A rank of `world` that rebuilds its plan, buckets of at most two values
/// (one at the end of the plan).
fn reordering(world: usize, rank: usize, numels: &[usize]) -> Rank {
    rank_configured(world, rank, numels, 8, AbortPolicy::Skip, Divisor::Contributors, |c| c.reorder = true)
}

/// Whether a control job's vote asks to rebuild the plan (its last word).
fn votes_reorder(job: &CommJob) -> bool {
    let CommPayload::Words(words) = &job.payload else { panic!("control words") };
    *words.last().expect("a control vector is never empty") != 0
}

/// One step of a one-rank world whose control vote is checked: arrivals
/// `(param, value)` in that order; returns the result and the vote. What
/// the previous step left in flight (an order collective, a plan agreement)
/// completes first, as it would during the forward pass.
fn step_voting(r: &mut Rank, step: Step, arrivals: &[(usize, f32)]) -> (StepResult, bool) {
    while let Ok(job) = r.jobs.try_recv() {
        r.done(job);
    }
    for &(p, v) in arrivals {
        r.inc(step, p, v);
    }
    let answer = r.end(step, StepEnd::Finish);
    let used: Vec<usize> = arrivals.iter().map(|a| a.0).collect();
    r.flushed(step, &used);
    let mut vote = None;
    loop {
        if let Ok(result) = answer.try_recv() {
            return (result.expect("the step succeeds"), vote.expect("the step had a control vote"));
        }
        let job = r.job();
        if matches!(kind(&job), CollectiveKind::Control { .. }) {
            vote = Some(votes_reorder(&job));
        }
        r.done(job);
    }
}

/// The case: registration order is the reverse of backward's, so
/// the first plan's bucket 0 (the last registered parameter) fills last and
/// nothing launches before backward ends. After step 0 the ranks rebuild:
/// from step 1 each bucket launches as soon as its gradient arrives.
#[test]
fn a_plan_backward_does_not_follow_is_rebuilt_after_the_first_step() {
    let mut r = reordering(1, 0, &[2, 2, 2]);
    r.agree_plan();
    // Step 0: backward produces p0, p1, p2 (the first plan wants p2 first).
    r.inc(0, 0, 1.0);
    r.inc(0, 1, 2.0);
    r.no_job();
    r.inc(0, 2, 3.0);
    let buckets: Vec<CommJob> = (0..3).map(|_| r.job()).collect();
    let (answer, control) = r.finish_to_control(0, &[0, 1, 2]);
    assert!(votes_reorder(&control), "the first step's order does not fit");
    for job in buckets {
        r.done(job);
    }
    r.done(control);
    let first = answer.try_recv().expect("answered").expect("applied");
    assert_eq!(values(&first, r.p(0)), Some(vec![1.0, 1.0]));
    // The order collective: each parameter's position in step 0.
    let order = r.job();
    assert_eq!(kind(&order), CollectiveKind::Order { len: 3 });
    let CommPayload::Words(words) = &order.payload else { panic!("order words") };
    assert_eq!(words, &[1, 2, 3]);
    // Step 1 begins while the order collective is in flight: it waits.
    r.inc(1, 0, 4.0);
    r.no_job();
    r.done(order);
    // The new plan is agreed before anything of step 1 launches.
    r.agree_plan();
    let mut launched = vec![r.job()];
    r.inc(1, 1, 5.0);
    launched.push(r.job());
    r.inc(1, 2, 6.0);
    launched.push(r.job());
    for (b, job) in launched.iter().enumerate() {
        assert_eq!(kind(job), CollectiveKind::Bucket { index: b, numel: 2 }, "bucket {b} launches on its arrival");
    }
    let (answer, control) = r.finish_to_control(1, &[0, 1, 2]);
    assert!(!votes_reorder(&control), "the rebuilt plan fits");
    for job in launched {
        r.done(job);
    }
    r.done(control);
    let second = answer.try_recv().expect("answered").expect("applied");
    assert_eq!(second.report.buckets_launched_before_finish, 3);
    for (p, v) in [(0, 4.0), (1, 5.0), (2, 6.0)] {
        assert_eq!(values(&second, r.p(p)), Some(vec![v, v]), "p{p} in its new slot");
    }
    // The first step's loan is still readable in its own layout.
    assert_eq!(values(&first, r.p(2)), Some(vec![3.0, 3.0]));
}

#[test]
fn a_plan_that_fits_is_kept() {
    let mut r = reordering(1, 0, &[2, 2]);
    r.agree_plan();
    for step in 0..5 {
        let (_, vote) = step_voting(&mut r, step, &[(1, 1.0), (0, 2.0)]);
        assert!(!vote, "step {step}: backward follows reverse registration");
    }
    r.no_job();
}

/// Gradients that arrive together (hooks racing on two threads) may come in
/// any order: a plan in that order would launch nothing earlier, so the
/// ranks keep their plan (and their buffers).
#[test]
fn gradients_arriving_together_in_another_order_keep_the_plan() {
    let mut r = reordering(1, 0, &[2, 2, 2]);
    r.tick = Duration::from_micros(5);
    r.agree_plan();
    for step in 0..5 {
        let (_, vote) = step_voting(&mut r, step, &[(0, 1.0), (1, 2.0), (2, 3.0)]);
        assert!(!vote, "step {step}: 10 µs of backward cannot be won back");
    }
}

/// After the first decision, one odd step does not rebuild the plan; an
/// order that persists for `REORDER_AFTER` steps does, and sums stay exact
/// throughout.
#[test]
fn a_changed_order_rebuilds_only_once_it_persists() {
    let mut r = reordering(1, 0, &[2, 2, 2]);
    r.agree_plan();
    let usual = [(2, 1.0), (1, 2.0), (0, 3.0)];
    let flipped = [(0, 3.0), (1, 2.0), (2, 1.0)];
    let (_, vote) = step_voting(&mut r, 0, &usual);
    assert!(!vote);
    let (_, vote) = step_voting(&mut r, 1, &flipped);
    assert!(!vote, "one odd step");
    let (_, vote) = step_voting(&mut r, 2, &usual);
    assert!(!vote);
    for step in 3..3 + u64::from(REORDER_AFTER) {
        let (result, vote) = step_voting(&mut r, step, &flipped);
        assert_eq!(vote, step == 2 + u64::from(REORDER_AFTER), "step {step}");
        for (p, v) in flipped {
            assert_eq!(values(&result, r.p(p)), Some(vec![v, v]));
        }
    }
    // The rebuild runs between steps (the order collective, then the plan
    // agreement); the next step packs into the new layout.
    let (result, vote) = step_voting(&mut r, 3 + u64::from(REORDER_AFTER), &flipped);
    assert!(!vote, "the rebuilt plan fits the new order");
    assert_eq!(result.report.buckets_launched_before_finish, 3);
    for (p, v) in flipped {
        assert_eq!(values(&result, r.p(p)), Some(vec![v, v]));
    }
}

/// Buffers lent under the old plan come home after the rebuild: a set of the
/// old layout is freed, not packed into.
#[test]
fn a_loan_of_the_old_layout_is_freed_when_it_comes_home() {
    // Cap of two values, tapered to one at the end: the first plan is
    // [p2] [p1] [p0]; in the order p0 p1 p2 it becomes [p0] [p1] [p2].
    let mut r = reordering(1, 0, &[1, 1, 3]);
    r.agree_plan();
    let (held, vote) = step_voting(&mut r, 0, &[(0, 1.0), (1, 2.0), (2, 3.0)]);
    assert!(vote);
    let allocated = r.sched.allocated_bytes();
    let bytes = || allocated.load(std::sync::atomic::Ordering::Relaxed);
    let one_set = r.plan.bucket_bytes();
    let (result, _) = step_voting(&mut r, 1, &[(0, 4.0), (1, 5.0), (2, 6.0)]);
    assert_eq!(result.report.buckets_launched_before_finish, 3);
    assert_eq!(values(&result, r.p(2)), Some(vec![6.0; 3]));
    drop(result);
    let returned = r.home.try_recv().expect("the new layout's loan comes home");
    r.send(returned);
    assert_eq!(bytes(), 2 * one_set, "the old loan and one set of the new layout");
    assert_eq!(values(&held, r.p(1)), Some(vec![2.0]));
    drop(held);
    let returned = r.home.try_recv().expect("the old layout's loan comes home");
    r.send(returned);
    assert_eq!(bytes(), one_set, "the old layout's set is freed");
    let (result, _) = step_voting(&mut r, 2, &[(0, 7.0), (1, 8.0), (2, 9.0)]);
    assert_eq!(values(&result, r.p(0)), Some(vec![7.0]));
    assert_eq!(values(&result, r.p(2)), Some(vec![9.0; 3]));
    assert_eq!(bytes(), one_set, "the spare set of the new layout was reused");
}

/// Two ranks saw different orders: each contributes its positions and both
/// build the plan of the summed positions.
#[test]
fn ranks_that_saw_different_orders_build_the_same_plan() {
    let mut a = reordering(2, 0, &[2, 2, 2]);
    let mut b = reordering(2, 1, &[2, 2, 2]);
    a.agree_plan();
    b.agree_plan();
    let arrivals = [[0, 1, 2], [1, 0, 2]];
    let mut orders = Vec::new();
    for (r, order) in [&mut a, &mut b].into_iter().zip(arrivals) {
        for p in order {
            r.inc(0, p, 1.0);
        }
        let jobs: Vec<CommJob> = (0..3).map(|_| r.job()).collect();
        let (answer, mut control) = r.finish_to_control(0, &[0, 1, 2]);
        for job in jobs {
            r.done(job);
        }
        // Play the other rank's vote: it asks for a rebuild too.
        let CommPayload::Words(words) = &mut control.payload else { panic!() };
        *words.last_mut().expect("vote") += 1;
        let own_fp = words[2 + r.rank];
        words[2 + (1 - r.rank)] = own_fp;
        r.done(control);
        answer.try_recv().expect("answered").expect("applied");
        orders.push(r.job());
    }
    // Sum the two ranks' positions into both order collectives.
    let positions: Vec<Vec<u64>> = orders
        .iter()
        .map(|job| match &job.payload {
            CommPayload::Words(w) => w.clone(),
            _ => panic!("order words"),
        })
        .collect();
    assert_eq!(positions, vec![vec![1, 2, 3], vec![2, 1, 3]]);
    for (r, mut job) in [&mut a, &mut b].into_iter().zip(orders) {
        let CommPayload::Words(words) = &mut job.payload else { panic!() };
        *words = vec![3, 3, 6];
        r.done(job);
    }
    // Ties go to reverse registration: p1 before p0. Both ranks propose the
    // same plan fingerprint.
    let fingerprints: Vec<u64> = [&mut a, &mut b]
        .into_iter()
        .map(|r| {
            let job = r.job();
            assert!(matches!(kind(&job), CollectiveKind::Plan { .. }));
            match &job.payload {
                CommPayload::Words(w) => w[r.rank],
                _ => panic!("plan words"),
            }
        })
        .collect();
    assert_eq!(fingerprints[0], fingerprints[1]);
}
