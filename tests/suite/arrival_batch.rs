//! `ArrivalBatch`: arrivals checked at the call site and delivered in groups
//! are summed exactly like direct ones; a step cannot end while a batch holds
//! its arrivals; arrivals held across a reset never reach the next step.

use crate::common;

use std::sync::Barrier;
use std::time::Duration;

use common::{build_world, on_ranks, pid, summed_reference, Sent};
use gradsync::{Payload, Rejection, SyncError, Token};

/// Many small parameters over several buckets and shards, with duplicates, two-token
/// increments and accumulated re-deliveries, all through batches: every
/// parameter's average is the reference, exactly.
#[test]
fn batched_arrivals_sum_exactly_like_direct_ones() {
    let (world, params, numel) = (2, 300, 3);
    // 40 parameters per bucket: bucket ends fall inside the backward order;
    // three shards: a delivery splits the batch.
    let syncs = build_world(world, &vec![numel; params], |b| {
        b.bucket_cap_bytes(40 * numel * 4).param_shards(3);
    });
    let script = |rank: usize, step: u64| -> Vec<Sent> {
        let mut sent = Vec::new();
        for p in (0..params).rev() {
            let v = |k: u64| vec![(rank * 1000 + p) as f32 + k as f32 * 0.5 + step as f32; numel];
            match p % 4 {
                0 => sent.push(Sent::inc(p, 0, v(0))),
                1 => sent.extend([Sent::inc(p, 0, v(0)), Sent::inc(p, 1, v(1)), Sent::inc(p, 0, v(0))]),
                2 => sent.extend([Sent::acc(p, 0, v(0)), Sent::acc(p, 1, v(2))]),
                _ if rank == 0 => {} // unused on rank 0
                _ => sent.push(Sent::inc(p, 0, v(3))),
            }
        }
        sent
    };
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut results = Vec::new();
        for step in 0..3 {
            let mut batch = sync.hook().batch();
            for s in script(rank, step) {
                batch.arrive(step, pid(s.param), Token(s.token), s.payload.clone()).unwrap();
            }
            batch.deliver().unwrap();
            assert!(batch.is_empty());
            let result = sync.finish_step(step).unwrap();
            let grads = result.gradients.unwrap();
            results.push((0..params).map(|p| grads.to_vec(pid(p)).unwrap()).collect::<Vec<_>>());
        }
        results
    });
    for step in 0..3u64 {
        let per_rank: Vec<Vec<Sent>> = (0..world).map(|r| script(r, step)).collect();
        for p in 0..params {
            let sum = summed_reference(&per_rank, p, numel).unwrap();
            let want: Vec<f32> = sum.iter().map(|x| x / world as f32).collect();
            for (rank, got) in out.iter().enumerate() {
                assert_eq!(got[step as usize][p], want, "rank {rank} step {step} param {p}");
            }
        }
    }
}

/// A batch delivers by itself at a bucket's last member and at its size
/// limits; until then `finish_step` refuses, says how many arrivals are held
/// and what to do, and leaves the step open.
#[test]
fn a_step_cannot_end_while_a_batch_holds_its_arrivals() {
    // One bucket; its last member in backward order is parameter 0.
    let syncs = build_world(2, &[2, 2, 2], |_| {});
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut batch = sync.hook().batch();
        let v = vec![rank as f32 + 1.0; 2];
        batch.increment(0, pid(2), Token(0), v.clone()).unwrap();
        batch.increment(0, pid(1), Token(0), v.clone()).unwrap();
        assert_eq!(batch.len(), 2, "not the bucket's end: held");
        let refused = sync.finish_step(0).unwrap_err();
        assert_eq!(refused, SyncError::Undelivered { step: 0, held: 2 });
        assert!(refused.to_string().contains("call deliver()"), "{refused}");
        assert!(!refused.needs_reset());
        assert_eq!(sync.current_step(), 0, "a refused call changes nothing");
        batch.increment(0, pid(0), Token(0), v).unwrap();
        assert!(batch.is_empty(), "the bucket's last member delivers the batch");
        let grads = sync.finish_step(0).unwrap().gradients.unwrap();
        (0..3).map(|p| grads.to_vec(pid(p)).unwrap()).collect::<Vec<_>>()
    });
    for got in out {
        assert_eq!(got, vec![vec![1.5; 2]; 3]);
    }
}

/// Call-site refusals come back from the batch at once, as from the hook,
/// and are counted in the report of the step they name.
#[test]
fn a_batch_refuses_at_the_call_site() {
    let syncs = build_world(1, &[2, 2], |_| {});
    on_ranks(syncs, |_, mut sync| {
        let mut batch = sync.hook().batch();
        let wrong = batch.increment(0, pid(1), Token(0), vec![1.0; 3]).unwrap_err();
        assert_eq!(wrong, Rejection::WrongLength { param: pid(1), expected: 2, got: 3 });
        let future = batch.arrive(1, pid(1), Token(0), Payload::Increment(vec![1.0; 2])).unwrap_err();
        assert!(matches!(future, Rejection::FutureStep { step: 1, current: 0, .. }), "{future:?}");
        assert!(batch.is_empty());
        drop(batch);
        assert_eq!(sync.finish_step(0).unwrap().report.rejected, 1, "the wrong length");
        assert_eq!(sync.finish_step(1).unwrap().report.rejected, 1, "the early arrival");
    });
}

/// After a failed step and a reset, arrivals a batch held from before the
/// reset are dropped: the restarted step sums only what came after.
#[test]
fn arrivals_held_across_a_reset_never_reach_the_next_step() {
    let syncs = build_world(2, &[2, 2], |b| {
        b.collective_timeout(Duration::from_millis(300));
    });
    let gate = Barrier::new(2);
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut batch = sync.hook().batch();
        if rank == 0 {
            Sent::inc(0, 0, vec![1.0; 2]).deliver(&sync, 0);
            sync.finish_step(0).unwrap_err(); // rank 1 is not there: the step fails
                                              // Step 1 is open at the hook; this arrival is held, then abandoned.
            batch.increment(1, pid(1), Token(0), vec![100.0; 2]).unwrap();
            assert_eq!(batch.len(), 1);
        }
        gate.wait();
        if rank == 1 {
            Sent::inc(0, 0, vec![1.0; 2]).deliver(&sync, 0);
            sync.finish_step(0).unwrap_err();
        }
        let restart = sync.reset().unwrap();
        assert_eq!(restart, 1);
        batch.deliver().unwrap();
        assert!(batch.is_empty(), "the stale arrival is dropped, not delivered");
        batch.increment(restart, pid(1), Token(0), vec![rank as f32; 2]).unwrap();
        batch.increment(restart, pid(0), Token(0), vec![rank as f32; 2]).unwrap();
        let grads = sync.finish_step(restart).unwrap().gradients.unwrap();
        (grads.to_vec(pid(0)).unwrap(), grads.to_vec(pid(1)).unwrap())
    });
    for got in out {
        assert_eq!(got, (vec![0.5; 2], vec![0.5; 2]));
    }
}

/// Without a bucket end, a batch delivers at 64 arrivals, or at once for a
/// payload of 256 KiB or more.
#[test]
fn a_batch_delivers_at_its_size_limits() {
    let big = 64 << 10; // f32 values: 256 KiB
    let mut numels = vec![1; 70];
    numels.push(big);
    // One bucket whose last member in backward order is parameter 0.
    let syncs = build_world(1, &numels, |_| {});
    on_ranks(syncs, |_, mut sync| {
        let mut batch = sync.hook().batch();
        for (n, p) in (1..70).rev().take(64).enumerate() {
            batch.increment(0, pid(p), Token(0), vec![1.0]).unwrap();
            assert_eq!(batch.len(), (n + 1) % 64, "after {} arrivals", n + 1);
        }
        batch.increment(0, pid(70), Token(0), vec![1.0; big]).unwrap();
        assert!(batch.is_empty(), "a large payload goes at once");
        sync.finish_step(0).unwrap();
    });
}
