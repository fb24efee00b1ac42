//! A rank that cannot finish a step: every rank skips it, or (partial policy) it is left out.

use super::*;

#[test]
fn an_aborting_rank_sends_zeros_and_every_rank_skips() {
    let mut r = rank(2, 0, &[2, 2]);
    r.agree_plan();
    r.inc(0, 0, 7.0); // packed into bucket 1, which waits for bucket 0
    let answer = r.end(0, StepEnd::Abort(AbortReason::OutOfMemory));
    r.flushed(0, &[0]);
    for index in 0..2 {
        let job = r.job();
        assert_eq!(kind(&job), CollectiveKind::Bucket { index, numel: 2 });
        let CommPayload::Grads(buf) = &job.payload else { panic!() };
        assert_eq!(buf.piece(0), &[0.0, 0.0], "an aborting rank contributes zeros");
        r.done(job);
    }
    let control = r.job();
    let CommPayload::Words(words) = &control.payload else { panic!() };
    assert_eq!(words[0], AbortReason::OutOfMemory.code());
    r.control(control, &[peer(1, RankStatus::Finished, &[false; 2], &[true; 2])]);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::Skipped { aborted: vec![(0, AbortReason::OutOfMemory)] });
    assert!(result.gradients.is_none(), "a skipped step lends nothing");
}

/// Invariant: under the partial policy the aborting rank's launched values
/// are retracted, the result is averaged over the ranks that finished, and
/// the aborting rank gets the same gradients.
#[test]
fn a_partial_abort_retracts_what_was_sent_and_averages_over_the_rest() {
    let mut r = rank_with(3, 2, &[2, 2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    r.inc(0, 1, 6.0); // bucket 0 = p1, launched with 6 from this rank
    let b0 = r.job();
    assert_eq!(b0.factor, 1.0 / 3.0);
    r.reduce_bucket(b0, (6.0 + 3.0 + 3.0) / 3.0); // ranks 0 and 1 sent 3
    let answer = r.end(0, StepEnd::Abort(AbortReason::OutOfMemory));
    r.flushed(0, &[1]);
    let b1 = r.job(); // p0: zeros from this rank
    r.reduce_bucket(b1, (0.0 + 9.0 + 9.0) / 3.0);
    let control = r.job();
    let (none, both) = ([false; 2], [true; 2]);
    r.control(
        control,
        &[
            Peer { retract: Some(&none), ..peer(0, RankStatus::Finished, &none, &both) },
            Peer { retract: Some(&none), ..peer(1, RankStatus::Finished, &none, &both) },
        ],
    );
    let mut correction = r.job();
    assert_eq!(kind(&correction), CollectiveKind::Correction { numel: 2 });
    let CommPayload::Grads(buf) = &mut correction.payload else { panic!() };
    assert_eq!(buf.piece(0), &[-6.0, -6.0], "the aborting rank retracts what it sent");
    buf.write(0, &[-2.0, -2.0], WriteMode::Set); // (-6 + 0 + 0) / 3
    r.done(correction);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::Partial { excluded: vec![(2, AbortReason::OutOfMemory)] });
    assert_eq!(result.report.contributors, 2);
    assert_eq!(values(&result, r.p(1)), Some(vec![3.0, 3.0]), "(3 + 3) / 2");
    assert_eq!(values(&result, r.p(0)), Some(vec![9.0, 9.0]), "(9 + 9) / 2");
}

#[test]
fn a_partial_step_nobody_finished_is_skipped() {
    let mut r = rank_with(2, 0, &[2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    let answer = r.end(0, StepEnd::Abort(AbortReason::BadBatch));
    r.flushed(0, &[]);
    let b = r.job();
    r.done(b);
    let control = r.job();
    r.control(
        control,
        &[Peer { retract: Some(&[false]), ..peer(1, RankStatus::Aborted(AbortReason::BadBatch), &[false], &[false]) }],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert!(matches!(result.report.outcome, Outcome::Skipped { ref aborted } if aborted.len() == 2));
}

/// A NaN already summed cannot be subtracted out: a non-finite abort skips
/// the step even under the partial policy.
#[test]
fn a_non_finite_abort_is_skipped_even_under_the_partial_policy() {
    let mut r = rank_with(3, 0, &[2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    let (none, one) = ([false], [true]);
    r.control(
        control,
        &[
            Peer { retract: Some(&one), ..peer(1, RankStatus::Aborted(AbortReason::NonFinite), &none, &one) },
            Peer { retract: Some(&none), ..peer(2, RankStatus::Finished, &none, &one) },
        ],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::Skipped { aborted: vec![(1, AbortReason::NonFinite)] });
    assert!(result.gradients.is_none());
}
