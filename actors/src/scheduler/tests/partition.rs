//! Partitioned (reduce-scattered) buckets: whole buffers only while a bucket
//! fills or is in flight, the step keeps and lends this rank's partition,
//! and corrections land in it.

use super::*;

/// Rank 1 of 2, two parameters of two values in one bucket `[p1, p0]`:
/// rank 1's partition is `[2, 4)`, p0's values.
fn partitioned_rank() -> Rank {
    rank_configured(2, 1, &[2, 2], 1 << 20, AbortPolicy::Skip, Divisor::Contributors, |c| c.partitioned = true)
}

#[test]
fn no_whole_buffer_exists_before_a_bucket_fills() {
    let r = partitioned_rank();
    assert!(r.sched.buffers.current.iter().all(Option::is_none), "nothing allocated up front");
    assert_eq!(r.sched.allocated.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn a_partitioned_step_lends_its_partition_with_the_late_correction_added() {
    let mut r = partitioned_rank();
    r.agree_plan();
    r.inc(0, 0, 1.0);
    r.inc(0, 1, 2.0);
    let bucket = r.job();
    assert_eq!(kind(&bucket), CollectiveKind::Bucket { index: 0, numel: 4 });
    r.ready(0, 0, 1, PayloadKind::Increment, 4.0, Readiness::Extra); // after launch: late
    r.done(bucket); // the peer sent zeros: the sum is this rank's own
    let (answer, control) = r.finish_to_control(0, &[0, 1]);
    r.control(control, &[peer(0, RankStatus::Finished, &[false, false], &[true, true])]);
    let correction = r.job();
    assert_eq!(kind(&correction), CollectiveKind::Correction { numel: 2 });
    r.done(correction);
    let result = answer.try_recv().unwrap().unwrap();
    let gradients = result.gradients.as_ref().expect("applied");
    let buckets: Vec<_> = gradients.buckets().collect();
    assert_eq!(buckets.len(), 1);
    let (part, members, start) = buckets[0];
    assert_eq!((members, start), (&[r.p(1), r.p(0)][..], 2), "the partition starts at p0");
    let mut got = [0.0; 2];
    part.read(0, &mut got);
    assert_eq!(got, [5.0, 5.0], "p0's sum (1) plus its late increment (4); p1 is not this rank's");
    assert_eq!(part.numel(), 2, "only the partition is kept");
    assert!(gradients.locate(r.p(0)).is_none(), "a partition is read through buckets()");
    // The whole buffer went idle; the lent partition and it are all that was allocated.
    assert_eq!(r.sched.allocated.load(std::sync::atomic::Ordering::Relaxed), (4 + 2) * 4);
}

/// The whole buffer stays idle for the next bucket; a partition lives while
/// its step's result is lent (as a gradient until `zero_grad`) and is freed
/// when the loan ends, so a step's backward holds only the partitions it
/// reduced so far.
#[test]
fn the_next_step_reuses_the_idle_buffer_and_a_returned_partition_is_freed() {
    let mut r = partitioned_rank();
    r.agree_plan();
    for step in 0..3 {
        r.inc(step, 0, 1.0);
        r.inc(step, 1, 2.0);
        let bucket = r.job();
        r.done(bucket);
        let (answer, control) = r.finish_to_control(step, &[0, 1]);
        r.control(control, &[peer(0, RankStatus::Finished, &[false, false], &[true, true])]);
        let result = answer.try_recv().unwrap().unwrap();
        let (part, ..) = result.gradients.as_ref().unwrap().buckets().next().unwrap();
        let mut got = [0.0; 2];
        part.read(0, &mut got);
        assert_eq!(got, [1.0, 1.0], "step {step}: a reused buffer holds this step's values only");
        let allocated = |r: &Rank| r.sched.allocated.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(allocated(&r), (4 + 2) * 4, "step {step}: the idle whole buffer and the lent partition");
        drop(result); // the loan comes home
        while let Ok(msg) = r.home.try_recv() {
            r.send(msg);
        }
        assert_eq!(allocated(&r), 4 * 4, "step {step}: freed");
    }
}

/// Rank 1 of 2 with a buddy copy: it keeps its partition `[2, 4)` (p0) and
/// then rank 0's `[0, 2)` (p1), in one buffer; a late increment of p1 lands
/// in the buddy part.
#[test]
fn a_buddy_rank_keeps_the_next_ranks_partition_after_its_own() {
    let mut r = rank_configured(2, 1, &[2, 2], 1 << 20, AbortPolicy::Skip, Divisor::Contributors, |c| {
        c.partitioned = true;
        c.buddy_stride = 1;
    });
    r.agree_plan();
    r.inc(0, 0, 1.0);
    r.inc(0, 1, 2.0);
    let bucket = r.job();
    r.ready(0, 1, 1, PayloadKind::Increment, 4.0, Readiness::Extra); // p1, late
    r.done(bucket);
    let (answer, control) = r.finish_to_control(0, &[0, 1]);
    r.control(control, &[peer(0, RankStatus::Finished, &[false, false], &[true, true])]);
    let correction = r.job();
    r.done(correction);
    let result = answer.try_recv().unwrap().unwrap();
    let (part, _, start) = result.gradients.as_ref().expect("applied").buckets().next().unwrap();
    assert_eq!(start, 2, "its own partition first");
    let mut got = [0.0; 4];
    part.read(0, &mut got);
    assert_eq!(got, [1.0, 1.0, 6.0, 6.0], "p0 (its own), then p1 (its buddy's) with the late increment");
}

/// World 1 keeps one partition, its own: no rank is its own buddy.
#[test]
fn a_single_rank_keeps_one_partition_with_buddies_on() {
    let r = rank_configured(1, 0, &[2, 2], 1 << 20, AbortPolicy::Skip, Divisor::Contributors, |c| {
        c.partitioned = true;
        c.buddy_stride = 1;
    });
    let parts = r.sched.partitions.as_ref().unwrap();
    assert_eq!(parts.held[0], vec![0..4]);
    let moved =
        crate::scheduler::partition::Partitions::<()>::new(&r.sched.plan, 0, 1, 1).moved(&r.sched.plan, 1, 3, 1);
    assert_eq!(moved.held[0], vec![2..4, 4..4], "rank 1 of 3: its own chunk, then rank 2's (empty)");
}

/// A failed partitioned step and a plain reset (no change of members): the
/// next step still keeps and lends this rank's partition. (The reset took
/// the partitions away, and the step after it lent whole buckets.)
#[test]
fn a_plain_reset_keeps_the_partitions() {
    let mut r = partitioned_rank();
    r.agree_plan();
    r.inc(0, 0, 1.0);
    r.inc(0, 1, 2.0);
    let bucket = r.job();
    let timeout = CommError::Timeout { rank: 1, tag: bucket.tag, missing: vec![0], waited: Duration::from_secs(5) };
    r.fail(bucket, timeout);
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset { proposed: 1, membership: None, reply: Reply::Blocking(tx) });
    let agreement = r.job();
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 1, redo: None }));
    r.epoch = 1;
    r.inc(1, 0, 1.0);
    r.inc(1, 1, 2.0);
    let bucket = r.job();
    r.done(bucket);
    let (answer, control) = r.finish_to_control(1, &[0, 1]);
    r.control(control, &[peer(0, RankStatus::Finished, &[false, false], &[true, true])]);
    let result = answer.try_recv().unwrap().unwrap();
    let (part, members, start) = result.gradients.as_ref().expect("applied").buckets().next().unwrap();
    assert_eq!((members, start, part.numel()), (&[r.p(1), r.p(0)][..], 2, 2), "this rank's partition, p0's");
}
