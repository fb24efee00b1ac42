//! A failed collective poisons the scheduler until a reset; ranks that disagree are named.

use super::*;

/// Invariant: a failed collective fails the step; the same step's
/// finish gets that error, later ones `Poisoned`; a reset agrees on the
/// restart step and drops what the actors sent before it.
#[test]
fn a_failure_poisons_until_a_reset_agrees_on_the_restart_step() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 1.0);
    let bucket = r.job();
    let tag = bucket.tag;
    let timeout = CommError::Timeout { rank: 0, tag, missing: vec![1], waited: Duration::from_secs(5) };
    r.fail(bucket, timeout.clone());
    assert_eq!(r.sched.phase(), "failed");
    assert_eq!(r.end(0, StepEnd::Finish).try_recv().unwrap().unwrap_err(), SyncError::Comm(timeout.clone()));
    let later = r.end(1, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert!(matches!(later, SyncError::Poisoned { step: 0, .. }), "{later}");
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset { proposed: 1, membership: None, reply: Reply::Blocking(tx) });
    assert_eq!(r.sched.phase(), "resetting");
    let mut agreement = r.job();
    assert_eq!(kind(&agreement), CollectiveKind::Reset { len: 2 });
    assert_eq!(agreement.timeout, Duration::from_secs(15), "peers reach their reset up to a deadline later");
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    assert_eq!(words, &vec![2, 0]);
    words[1] = 3; // rank 1 proposes step 2
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 2, redo: None }));
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 2));
    r.inc(2, 0, 5.0); // sent by the actors before their reset: dropped
    r.no_job();
    r.epoch = 1;
    r.inc(2, 0, 5.0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 });
}

/// Invariant: a desync names the ranks outside the majority, even when
/// the odd rank is rank 0.
#[test]
fn a_desync_names_the_minority() {
    let mut r = rank(4, 1, &[2]);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    let (n, u) = ([false], [true]);
    r.control(
        control,
        &[
            Peer { fingerprint: Some(12345), ..peer(0, RankStatus::Finished, &n, &u) },
            peer(2, RankStatus::Finished, &n, &u),
            peer(3, RankStatus::Finished, &n, &u),
        ],
    );
    match answer.try_recv().unwrap().unwrap_err() {
        SyncError::Desync { step, ranks, majority, groups, .. } => {
            assert_eq!((step, ranks, majority), (0, vec![0], true));
            assert_eq!(groups, vec![vec![1, 2, 3], vec![0]]);
        }
        other => panic!("expected a desync, got {other}"),
    }
    assert_eq!(r.sched.phase(), "failed");
}

/// Invariant: ranks with different plans fail together at the plan
/// agreement, before any gradient is summed.
#[test]
fn a_plan_mismatch_fails_before_the_first_bucket() {
    let mut r = rank(4, 0, &[2]);
    r.inc(0, 0, 1.0);
    let mut plan = r.job();
    let CommPayload::Words(words) = &mut plan.payload else { panic!() };
    let ours = words[0];
    words[1] = ours;
    words[2] = ours;
    words[3] = ours ^ 1;
    r.done(plan);
    r.no_job();
    let err = r.end(0, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert!(matches!(&err, SyncError::Desync { ranks, majority: true, .. } if ranks == &vec![3]), "{err}");
}

/// Invariant: a rank that reduce-scatters its buckets (sharded) and one that
/// all-reduces them propose different plan digests, so they fail together at
/// the plan agreement instead of issuing mismatched collectives.
#[test]
fn a_partitioned_rank_disagrees_with_an_all_reducing_one() {
    let digest = |partitioned: bool| {
        let mut r = super::rank_configured(2, 0, &[2], 8, AbortPolicy::Skip, Divisor::Contributors, |c| {
            c.partitioned = partitioned
        });
        r.inc(0, 0, 1.0);
        let plan = r.job();
        let CommPayload::Words(words) = &plan.payload else { panic!("plan words") };
        words[0]
    };
    assert_ne!(digest(true), digest(false));
    assert_eq!(digest(true), digest(true), "equal settings agree");
    let with_buddies = {
        let mut r = super::rank_configured(2, 0, &[2], 8, AbortPolicy::Skip, Divisor::Contributors, |c| {
            c.partitioned = true;
            c.buddy_stride = 1;
        });
        r.inc(0, 0, 1.0);
        let plan = r.job();
        let CommPayload::Words(words) = &plan.payload else { panic!("plan words") };
        words[0]
    };
    assert_ne!(with_buddies, digest(true), "a rank keeping buddy copies meets one that does not at the plan");
}
