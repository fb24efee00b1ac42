//! Arrivals after their bucket was launched: corrected by a second collective.

use super::*;

#[test]
fn a_late_accumulated_value_is_corrected_by_its_difference() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    r.ready(0, 0, 0, PayloadKind::Accumulated, 1.0, Readiness::Complete);
    let bucket = r.job();
    r.ready(0, 0, 1, PayloadKind::Accumulated, 3.0, Readiness::Extra); // after launch: late
    r.done(bucket);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.done(control);
    assert_eq!(r.sched.phase(), "correcting");
    let correction = r.job();
    assert_eq!(kind(&correction), CollectiveKind::Correction { numel: 2 });
    let CommPayload::Grads(buf) = &correction.payload else { panic!() };
    assert_eq!(buf.piece(0), &[2.0, 2.0], "final minus what was sent");
    r.done(correction);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![3.0, 3.0]));
    assert_eq!((result.report.corrected.clone(), result.report.corrections), (vec![r.p(0)], 1));
    assert_eq!(result.report.late_arrivals, 1);
}

#[test]
fn late_increments_are_summed_and_added() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 1.0);
    let bucket = r.job();
    r.ready(0, 0, 1, PayloadKind::Increment, 2.0, Readiness::Extra);
    r.ready(0, 0, 2, PayloadKind::Increment, 4.0, Readiness::Extra);
    r.done(bucket);
    let answer = r.end(0, StepEnd::Finish);
    r.flushed(0, &[0]);
    let result = r.run_alone(&answer).unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![7.0, 7.0]));
}

/// Invariant: among `Accumulated` values the highest token wins, whatever
/// the order they reach the scheduler in, before launch and after.
#[test]
fn a_lower_accumulated_token_never_replaces_a_higher_one() {
    let mut r = rank_with(1, 0, &[2, 2], 1 << 20, AbortPolicy::Skip, Divisor::Sum);
    r.agree_plan();
    r.ready(0, 0, 5, PayloadKind::Accumulated, 5.0, Readiness::Complete);
    r.ready(0, 0, 3, PayloadKind::Accumulated, 3.0, Readiness::Extra); // stale, before launch
    r.inc(0, 1, 1.0); // completes the (single) bucket
    let bucket = r.job();
    let CommPayload::Grads(buf) = &bucket.payload else { panic!() };
    let mut packed = [0.0; 2];
    buf.read(2, &mut packed); // p0 sits after p1
    assert_eq!(packed, [5.0, 5.0]);
    r.done(bucket);
    r.ready(0, 0, 4, PayloadKind::Accumulated, 4.0, Readiness::Extra); // stale, after launch
    let answer = r.end(0, StepEnd::Finish);
    r.flushed(0, &[0, 1]);
    let result = r.run_alone(&answer).unwrap();
    assert_eq!(result.report.corrections, 0, "a stale value is not late");
    assert_eq!(values(&result, r.p(0)), Some(vec![5.0, 5.0]));
}
