//! A step's lifecycle: buckets launched in plan order, the control collective, the next step opened; loans of the result.

use super::*;

#[test]
fn buckets_launch_in_plan_order_and_only_once_the_plan_is_agreed() {
    let mut r = rank(1, 0, &[2, 2]);
    r.no_job(); // the agreement is submitted when the first step begins
                // Bucket 0 holds p1 (the last registered: backward produces it first), bucket 1 holds p0.
    r.inc(0, 0, 1.0);
    let mut plan = r.job();
    assert!(matches!(kind(&plan), CollectiveKind::Plan { len: 1 }));
    r.inc(0, 1, 2.0);
    r.no_job(); // both buckets are complete, but the plan is not agreed yet
    let CommPayload::Words(words) = &mut plan.payload else { panic!() };
    mirror_vote(words, 1, 1);
    r.done(plan);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 });
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 1, numel: 2 });
    r.no_job();
}

#[test]
fn a_bucket_waits_for_the_buckets_before_it() {
    let mut r = rank(1, 0, &[2, 2]);
    r.agree_plan();
    r.inc(0, 0, 1.0); // completes bucket 1, but bucket 0 is not launched
    r.no_job();
    r.inc(0, 1, 2.0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 });
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 1, numel: 2 });
}

#[test]
fn the_lifecycle_goes_open_flushing_draining_control_and_opens_the_next_step() {
    let mut r = rank(1, 0, &[2, 2]);
    r.inc(0, 1, 2.0);
    let plan = r.job(); // hold the plan agreement: launches wait for it
    assert_eq!(r.sched.phase(), "open");
    let answer = r.end(0, StepEnd::Finish);
    assert_eq!(r.sched.phase(), "flushing", "waits for the shard's flush");
    r.no_job();
    r.flushed(0, &[1]);
    assert_eq!(r.sched.phase(), "draining", "waits for the plan agreement to launch");
    r.no_job();
    let mut plan = plan;
    let CommPayload::Words(words) = &mut plan.payload else { panic!() };
    mirror_vote(words, 1, 1);
    r.done(plan);
    // Agreed: both buckets launch, and the control vote right behind them.
    assert_eq!(r.sched.phase(), "control");
    let b0 = r.job();
    let b1 = r.job(); // p0 never arrived: its bucket launches with zeros
    let CommPayload::Grads(buf) = &b1.payload else { panic!() };
    assert_eq!(buf.piece(0), &[0.0, 0.0]);
    let control = r.job();
    assert!(matches!(kind(&control), CollectiveKind::Control { .. }));
    r.done(b0);
    r.done(b1);
    r.done(control);
    let result = answer.try_recv().expect("answered").expect("applied");
    assert_eq!(result.report.outcome, Outcome::Applied);
    assert_eq!(values(&result, r.p(1)), Some(vec![2.0, 2.0]));
    assert_eq!(values(&result, r.p(0)), None, "unused on every rank");
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 1));
}

#[test]
fn the_next_steps_messages_wait_until_the_current_step_completes() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.inc(1, 0, 2.0); // step 1 begins while step 0 is in its control collective
    r.no_job();
    r.done(control);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.step, 0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 }, "replayed at completion");
}

#[test]
fn finishing_a_step_other_than_the_current_one_is_refused() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    let err = r.end(3, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert_eq!(err, SyncError::NotCurrentStep { expected: 0, got: 3 });
    let _answer = r.end(0, StepEnd::Finish);
    let twice = r.end(0, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert_eq!(twice, SyncError::NotCurrentStep { expected: 0, got: 0 });
}

#[test]
fn a_collective_tag_names_step_kind_and_size() {
    let tag = CollectiveTag { step: 4, kind: CollectiveKind::Bucket { index: 2, numel: 9 } };
    assert_eq!(tag.to_string(), "step 4 bucket 2 (9 values)");
    let _ = BucketBuf::<f32>::zeroed(1, 1);
}

/// Invariant: a refusal counts in the report of the step it names, if that
/// report is still to come.
#[test]
fn refusals_count_in_the_report_of_the_step_they_name() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    let p = r.p(0);
    let refuse = |r: &mut Rank, step: Step| {
        r.send(SchedMsg::Rejected { step, why: Rejection::WrongLength { param: p, expected: 2, got: step as usize } })
    };
    refuse(&mut r, 0);
    refuse(&mut r, 2);
    refuse(&mut r, u64::MAX);
    let s0 = r.step_alone(0, &[(0, 1.0)]);
    refuse(&mut r, 0); // step 0's report is out: metrics only
    drop(s0.gradients);
    let returned = r.home.try_recv().unwrap();
    r.send(returned);
    let s1 = r.step_alone(1, &[(0, 1.0)]);
    let s2 = r.step_alone(2, &[(0, 1.0)]);
    assert_eq!((s0.report.rejected, s1.report.rejected, s2.report.rejected), (1, 0, 1));
    assert_eq!(s2.report.rejections, vec![Rejection::WrongLength { param: p, expected: 2, got: 2 }]);
}

/// Invariant: the next step packs and launches while the caller still holds
/// the previous step's gradients (a second set of buffers), and the loan's
/// set is reused once it comes home.
#[test]
fn a_held_loan_does_not_stall_the_next_step() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    let held = r.step_alone(0, &[(0, 1.0)]);
    let one_set = r.sched.allocated_bytes().load(std::sync::atomic::Ordering::Relaxed);
    r.inc(1, 0, 2.0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 }, "launched during the loan");
    assert_eq!(r.sched.allocated_bytes().load(std::sync::atomic::Ordering::Relaxed), 2 * one_set);
    assert_eq!(values(&held, r.p(0)), Some(vec![1.0, 1.0]), "the loan is untouched");
    drop(held);
    let returned = r.home.try_recv().expect("the loan comes home");
    r.send(returned);
}

#[test]
fn a_returned_loan_is_reused_instead_of_allocating() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    for step in 0..4 {
        let result = r.step_alone(step, &[(0, step as f32)]);
        assert_eq!(values(&result, r.p(0)), Some(vec![step as f32; 2]));
        drop(result);
        let returned = r.home.try_recv().expect("the loan comes home");
        r.send(returned);
    }
    let one_set = r.plan.bucket_bytes();
    assert_eq!(
        r.sched.allocated_bytes().load(std::sync::atomic::Ordering::Relaxed),
        one_set,
        "loans returned before the next step starts need no second set"
    );
}

/// A progress request that waits for buckets in flight, answered when the
/// shard settled it and at most that many are in flight (none here).
fn wait_in_flight(r: &mut Rank, id: u64, most: usize) -> mpsc::Receiver<crate::report::Progress> {
    let (tx, rx) = mpsc::sync_channel(1);
    r.send(SchedMsg::Progress { id, in_flight_at_most: Some(most), reply: Reply::Blocking(tx) });
    r.send(SchedMsg::Settled { id });
    rx
}

#[test]
fn a_wait_for_buckets_in_flight_is_answered_once_enough_of_them_are_reduced() {
    let mut r = rank(1, 0, &[2, 2]);
    r.agree_plan();
    r.inc(0, 1, 2.0);
    r.inc(0, 0, 1.0);
    let (b0, b1) = (r.job(), r.job());
    let none = wait_in_flight(&mut r, 1, 0);
    let one = wait_in_flight(&mut r, 2, 1);
    assert!(none.try_recv().is_err() && one.try_recv().is_err(), "two buckets are in flight");
    r.done(b0);
    let got = one.try_recv().expect("one bucket in flight is at most one");
    assert_eq!((got.buckets_launched, got.buckets_done), (2, 1));
    assert!(none.try_recv().is_err(), "one bucket is still in flight");
    r.done(b1);
    let got = none.try_recv().expect("every launched bucket is reduced");
    assert_eq!((got.buckets_launched, got.buckets_done), (2, 2));
    // Nothing in flight: answered at once.
    assert!(wait_in_flight(&mut r, 3, 0).try_recv().is_ok());
}

#[test]
fn a_wait_for_buckets_in_flight_is_answered_when_the_step_fails() {
    let mut r = rank(1, 0, &[2, 2]);
    r.agree_plan();
    r.inc(0, 1, 2.0);
    let b0 = r.job();
    let waiting = wait_in_flight(&mut r, 1, 0);
    assert!(waiting.try_recv().is_err());
    let tag = b0.tag;
    r.fail(b0, CommError::Timeout { rank: 0, tag, missing: vec![], waited: Duration::from_secs(1) });
    waiting.try_recv().expect("a failed step answers the wait: the caller goes on to the failure");
}
