//! A sharded model's parameter gather: submitted between steps in the order
//! given, answered once every buffer is back, failures kept until a reset.

use super::*;
use crate::messages::GatherOf;

fn gather(r: &mut Rank, indices: &[usize]) -> mpsc::Receiver<crate::messages::Gathered<BucketBuf>> {
    let (tx, rx) = mpsc::sync_channel(1);
    let buffers = indices.iter().map(|&b| (GatherOf::Bucket(b), BucketBuf::zeroed(4, 1))).collect();
    r.send(SchedMsg::Gather { buffers, reply: Reply::Blocking(tx) });
    rx
}

/// Invariant: one gather collective per buffer, in the order given, tagged
/// with the open step; the answer waits for the last and returns every
/// buffer; the next step's buckets come after.
#[test]
fn a_gather_runs_one_collective_per_bucket_in_order_and_answers_once_all_are_back() {
    let mut r = rank_with(1, 0, &[2, 2], 8, AbortPolicy::Skip, Divisor::Contributors);
    r.agree_plan();
    r.step_alone(0, &[(0, 1.0), (1, 1.0)]);
    let answer = gather(&mut r, &[1, 0]);
    let (first, second) = (r.job(), r.job());
    assert_eq!((first.tag.step, kind(&first)), (1, CollectiveKind::Gather { index: 1, numel: 4 }));
    assert_eq!(kind(&second), CollectiveKind::Gather { index: 0, numel: 4 });
    r.done(first);
    assert!(answer.try_recv().is_err(), "not before the last buffer is back");
    r.done(second);
    let (back, outcome) = answer.try_recv().unwrap();
    assert_eq!(outcome, Ok(()));
    assert_eq!(back.iter().map(|(of, _)| *of).collect::<Vec<_>>(), vec![GatherOf::Bucket(1), GatherOf::Bucket(0)]);
    r.inc(1, 1, 1.0); // (the plan's first bucket holds the last parameter registered)
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 }, "the next step goes on");
}

/// Invariant: a failed gather returns the buffers with the failure and
/// poisons the scheduler until a reset; a gather asked while failed makes
/// no collective; a bucket the plan lacks is refused at once.
#[test]
fn a_failed_gather_gives_the_buffers_back_and_poisons_until_a_reset() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    let refused = gather(&mut r, &[3]);
    let (back, outcome) = refused.try_recv().unwrap();
    assert!(matches!(outcome, Err(SyncError::Setting { setting: "gather", .. })) && back.len() == 1);
    r.no_job();
    let answer = gather(&mut r, &[0]);
    let job = r.job();
    let gone = CommError::PeerGone { rank: 0, peer: 1, tag: job.tag };
    r.fail(job, gone.clone());
    let (back, outcome) = answer.try_recv().unwrap();
    assert_eq!((back.len(), outcome), (1, Err(SyncError::Comm(gone.clone()))));
    assert_eq!(r.sched.phase(), "failed");
    let again = gather(&mut r, &[0]);
    let (back, outcome) = again.try_recv().unwrap();
    assert_eq!((back.len(), outcome), (1, Err(SyncError::Comm(gone))));
    r.no_job();
}

/// Invariant: gathers started one after another (one per bucket, as a
/// caller that unpacks each as it lands starts them) are all in flight at
/// once, each answered as soon as its own buffer is back, whatever order
/// the others finish in; a second gather of a bucket still in flight is
/// refused at once, without a collective.
#[test]
fn gathers_in_flight_together_are_each_answered_when_their_own_buffers_are_back() {
    let mut r = rank_with(1, 0, &[2, 2, 2], 12, AbortPolicy::Skip, Divisor::Contributors);
    r.agree_plan();
    let first = gather(&mut r, &[2]);
    let second = gather(&mut r, &[1, 0]);
    let twice = gather(&mut r, &[1]);
    let (back, outcome) = twice.try_recv().unwrap();
    assert!(matches!(outcome, Err(SyncError::Setting { setting: "gather", .. })) && back.len() == 1);
    let (a, b, c) = (r.job(), r.job(), r.job());
    r.no_job();
    assert_eq!(kind(&a), CollectiveKind::Gather { index: 2, numel: 4 });
    r.done(b);
    assert!(first.try_recv().is_err() && second.try_recv().is_err());
    r.done(a);
    let (back, outcome) = first.try_recv().unwrap();
    assert_eq!((back.len(), outcome), (1, Ok(())));
    assert!(second.try_recv().is_err(), "bucket 0 is still out");
    r.done(c);
    let (back, outcome) = second.try_recv().unwrap();
    assert_eq!((back.len(), outcome), (2, Ok(())));
}
