//! The step semantics black-box testing found missing, end to end through the
//! public API on real rank threads: a cancelled wait, desyncs that name the
//! odd rank, token order across threads, overlap while gradients are held,
//! the failure rule, the partial abort policy and join (uneven inputs).

use crate::common;

use std::sync::Barrier;
use std::time::Duration;

use common::{build_world, on_ranks, pid, wait_for, Sent};
use gradsync::{AbortPolicy, AbortReason, DType, Divisor, GradSync, LocalWorld, Outcome, SyncError, Token};

/// Invariant: a `finish_step_async` dropped by `tokio::time::timeout` leaves a
/// usable GradSync; the step completes in the background and the next call
/// for that step collects its result. The peer sees nothing unusual.
#[test]
fn a_cancelled_async_finish_is_collected_by_the_next_call() {
    let syncs = build_world(2, &[4], |_| {});
    let peer_may_finish = Barrier::new(2);
    let out = on_ranks(syncs, |rank, mut sync| {
        Sent::inc(0, 0, vec![rank as f32 + 1.0; 4]).deliver(&sync, 0);
        if rank == 1 {
            peer_may_finish.wait(); // only after rank 0's wait was cancelled
            let g = sync.finish_step(0).unwrap().gradients.unwrap().to_vec(pid(0)).unwrap();
            Sent::inc(0, 0, vec![3.0; 4]).deliver(&sync, 1);
            let again = sync.finish_step(1).unwrap().gradients.unwrap().to_vec(pid(0)).unwrap();
            return (g, again);
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let timed_out =
            rt.block_on(async { tokio::time::timeout(Duration::from_millis(50), sync.finish_step_async(0)).await });
        assert!(timed_out.is_err(), "the peer has not finished: the wait must time out");
        assert_eq!(sync.current_step(), 1, "the step was handed over");
        let refused = sync.finish_step(1).unwrap_err();
        assert_eq!(refused, SyncError::FinishPending { pending: 0, got: 1 });
        peer_may_finish.wait();
        let collected = sync.finish_step(0).expect("the background result");
        let g = collected.gradients.unwrap().to_vec(pid(0)).unwrap();
        // And the GradSync goes on as usual.
        Sent::inc(0, 0, vec![1.0; 4]).deliver(&sync, 1);
        let again = rt.block_on(sync.finish_step_async(1)).unwrap().gradients.unwrap().to_vec(pid(0)).unwrap();
        (g, again)
    });
    for (g, again) in out {
        assert_eq!((g, again), (vec![1.5; 4], vec![2.0; 4]));
    }
}

/// Findings 2 and 3: ranks that registered different models fail at the plan
/// agreement, before any bucket, each naming the minority, even when the odd
/// rank is rank 0 or when every rank drops its GradSync on the error.
#[test]
fn a_desync_names_the_minority_on_every_rank() {
    type Names = fn(usize) -> Vec<&'static str>;
    let registrations: [(&str, Names, usize); 2] = [
        (
            "rank 0 registers b before a",
            |rank| if rank == 0 { vec!["b", "a", "c", "d"] } else { vec!["a", "b", "c", "d"] },
            0,
        ),
        (
            "rank 3 registers an extra parameter",
            |rank| {
                if rank == 3 {
                    vec!["a", "b", "c", "d", "e"]
                } else {
                    vec!["a", "b", "c", "d"]
                }
            },
            3,
        ),
    ];
    for (what, names, odd) in registrations {
        let syncs: Vec<GradSync> = LocalWorld::connect(4)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(rank, ep)| {
                let mut b = GradSync::builder();
                for n in names(rank) {
                    b.param(n, 4, DType::F32).unwrap();
                }
                b.collective_timeout(Duration::from_secs(10));
                b.build(ep).unwrap()
            })
            .collect();
        let errs = on_ranks(syncs, |_, mut sync| {
            let ids = sync.param_ids().to_vec();
            for &p in ids.iter().rev() {
                sync.hook().increment(0, p, Token(0), vec![1.0; 4]).unwrap();
            }
            sync.finish_step(0).unwrap_err() // and the GradSync is dropped at once
        });
        for (rank, err) in errs.into_iter().enumerate() {
            match err {
                SyncError::Desync { ranks, majority, .. } => {
                    assert_eq!((ranks, majority), (vec![odd], true), "{what}: rank {rank}")
                }
                other => panic!("{what}: rank {rank}: expected a desync naming rank {odd}, got {other}"),
            }
        }
    }
}

/// Invariant: the highest `Accumulated` token wins, also across threads:
/// the total (token 1) delivered before the partial (token 0) still wins.
#[test]
fn the_highest_accumulated_token_wins_across_threads() {
    let syncs = build_world(2, &[3], |b| {
        b.expect_arrivals(pid(0), 2).unwrap();
    });
    let out = on_ranks(syncs, |rank, mut sync| {
        let total = vec![10.0 + rank as f32; 3];
        Sent::acc(0, 1, total).deliver(&sync, 0);
        let hook = sync.hook();
        std::thread::spawn(move || hook.accumulated(0, pid(0), Token(0), vec![-100.0; 3]).unwrap()).join().unwrap();
        sync.finish_step(0).unwrap().gradients.unwrap().to_vec(pid(0)).unwrap()
    });
    for g in out {
        assert_eq!(g, vec![10.5; 3], "mean of the totals 10 and 11");
    }
}

/// Invariant: while step 0's gradients are held, step 1's buckets are
/// reduced as their gradients arrive (a second set of buffers, counted in
/// `memory_bytes`).
#[test]
fn holding_gradients_keeps_the_next_steps_overlap() {
    let syncs = build_world(2, &[4, 4], |b| {
        b.bucket_cap_bytes(16);
    });
    on_ranks(syncs, |rank, mut sync| {
        let before = sync.memory_bytes();
        Sent::inc(1, 0, vec![1.0; 4]).deliver(&sync, 0);
        Sent::inc(0, 0, vec![1.0; 4]).deliver(&sync, 0);
        let held = sync.finish_step(0).unwrap();
        Sent::inc(1, 0, vec![rank as f32; 4]).deliver(&sync, 1);
        Sent::inc(0, 0, vec![rank as f32; 4]).deliver(&sync, 1);
        wait_for(&mut sync, "both buckets of step 1 reduced during the loan", |p| p.step == 1 && p.buckets_done == 2);
        assert!(sync.memory_bytes() >= before + sync.plan().bucket_bytes(), "the second set is counted");
        assert_eq!(held.gradients.as_ref().unwrap().to_vec(pid(0)).unwrap(), vec![1.0; 4], "the loan is untouched");
        drop(held);
        let r1 = sync.finish_step(1).unwrap();
        assert_eq!(r1.report.buckets_done_before_finish, 2);
        assert_eq!(r1.gradients.unwrap().to_vec(pid(1)).unwrap(), vec![0.5; 4]);
    });
}

/// Any number of steps' gradients may be held at once (a training loop that
/// keeps `.grad` references for logging): every later step still finishes,
/// each held result keeps exactly its own step's values, and each held set
/// of buffers comes back for reuse when dropped, so memory stops growing.
#[test]
fn steps_finish_while_earlier_gradients_are_held_and_each_keeps_its_values() {
    let syncs = build_world(2, &[4, 4], |b| {
        b.bucket_cap_bytes(16);
    });
    on_ranks(syncs, |rank, mut sync| {
        let mut held = Vec::new();
        for step in 0..4u64 {
            // Integer payloads: rank r sends (step + 1) * (r + 1), so the mean is exact.
            let value = ((step + 1) * (rank as u64 + 1)) as f32;
            Sent::inc(1, 0, vec![value; 4]).deliver(&sync, step);
            Sent::inc(0, 0, vec![value; 4]).deliver(&sync, step);
            held.push(sync.finish_step(step).expect("a held result never refuses the next step"));
        }
        let two_sets = 2 * sync.plan().bucket_bytes();
        assert!(sync.memory_bytes() >= two_sets * 2, "four held results and the open step's set are counted");
        for (step, r) in held.iter().enumerate() {
            let mean = (step as f32 + 1.0) * 1.5;
            let g = r.gradients.as_ref().unwrap();
            assert_eq!(g.to_vec(pid(0)).unwrap(), vec![mean; 4], "step {step} keeps its own values");
            assert_eq!(g.to_vec(pid(1)).unwrap(), vec![mean; 4], "step {step} keeps its own values");
        }
        drop(held);
        let settled = sync.memory_bytes();
        for step in 4..10u64 {
            Sent::inc(1, 0, vec![1.0; 4]).deliver(&sync, step);
            Sent::inc(0, 0, vec![1.0; 4]).deliver(&sync, step);
            let r = sync.finish_step(step).unwrap();
            assert_eq!(r.gradients.unwrap().to_vec(pid(0)).unwrap(), vec![1.0; 4]);
        }
        assert_eq!(sync.memory_bytes(), settled, "returned sets are reused, nothing more is allocated");
    });
}

/// Invariant: a failed step is consumed; every later call says `Poisoned`
/// and what to do; a reset on every rank recovers.
#[test]
fn after_a_failed_step_every_call_says_to_reset() {
    let timeout = Duration::from_millis(300);
    let syncs = build_world(2, &[2], |b| {
        b.collective_timeout(timeout);
    });
    let gate = Barrier::new(2);
    on_ranks(syncs, |rank, mut sync| {
        if rank == 0 {
            Sent::inc(0, 0, vec![1.0; 2]).deliver(&sync, 0);
            let err = sync.finish_step(0).unwrap_err();
            assert!(err.to_string().contains("call reset() on every rank"), "{err}");
            assert_eq!(sync.current_step(), 1, "the failed step is consumed");
            let poisoned = sync.finish_step(1).unwrap_err();
            assert!(matches!(poisoned, SyncError::Poisoned { step: 0, .. }), "{poisoned}");
            assert!(poisoned.to_string().contains("reset()"), "{poisoned}");
        }
        gate.wait(); // rank 1 joins only after rank 0 has given up
        if rank == 1 {
            Sent::inc(0, 0, vec![1.0; 2]).deliver(&sync, 0);
            sync.finish_step(0).unwrap_err();
        }
        let restart = sync.reset().unwrap();
        assert_eq!(restart, 1);
        Sent::inc(0, 0, vec![(rank * 2) as f32; 2]).deliver(&sync, restart);
        let r = sync.finish_step(restart).unwrap();
        assert_eq!(r.gradients.unwrap().to_vec(pid(0)).unwrap(), vec![1.0; 2]);
    });
}

/// Invariant: under the partial policy the ranks that finished apply the
/// step averaged over themselves, exactly, and so does the aborting rank.
#[test]
fn a_partial_step_averages_over_the_ranks_that_finished() {
    let syncs = build_world(4, &[4, 4], |b| {
        b.bucket_cap_bytes(16).abort_policy(AbortPolicy::Partial);
    });
    let out = on_ranks(syncs, |rank, mut sync| {
        // Every rank's p1 goes out first (bucket 0); rank 3 then runs out of memory.
        Sent::inc(1, 0, vec![rank as f32 * 4.0; 4]).deliver(&sync, 0);
        wait_for(&mut sync, "bucket 0 launched", |p| p.buckets_launched >= 1);
        let r = if rank == 3 {
            sync.abort_step(0, AbortReason::OutOfMemory).unwrap()
        } else {
            Sent::inc(0, 0, vec![rank as f32 * 2.0; 4]).deliver(&sync, 0);
            sync.finish_step(0).unwrap()
        };
        let g = r.gradients.as_ref().expect("every rank applies a partial step");
        (r.report.outcome.clone(), r.report.contributors, g.to_vec(pid(1)).unwrap(), g.to_vec(pid(0)).unwrap())
    });
    for (rank, (outcome, contributors, p1, p0)) in out.into_iter().enumerate() {
        assert_eq!(outcome, Outcome::Partial { excluded: vec![(3, AbortReason::OutOfMemory)] }, "rank {rank}");
        assert_eq!(contributors, 3);
        assert_eq!(p1, vec![4.0; 4], "(0 + 4 + 8) / 3: rank 3's 12 retracted");
        assert_eq!(p0, vec![2.0; 4], "(0 + 2 + 4) / 3");
    }
}

/// Invariant: a shadow step begun early (`begin_shadow_step`) sends the
/// joined rank's zeros at once: the other rank's buckets reduce before the
/// joined rank collects the step (it serves parameter gathers meanwhile),
/// beginning twice sends nothing more, and the step collected is the one
/// the others finish.
#[test]
fn a_shadow_step_begun_early_lets_the_others_reduce_before_it_is_collected() {
    let syncs = build_world(2, &[4, 4], |b| {
        b.bucket_cap_bytes(16);
        b.divisor(Divisor::Contributors);
    });
    let reduced = Barrier::new(2);
    let out = on_ranks(syncs, |rank, mut sync| {
        if rank == 1 {
            sync.begin_shadow_step().unwrap();
            sync.begin_shadow_step().unwrap();
            reduced.wait(); // rank 0 saw both buckets reduced before this rank collects
            let r = sync.shadow_step().unwrap();
            return (r.report.step, r.report.joined.clone(), None);
        }
        Sent::inc(1, 0, vec![6.0; 4]).deliver(&sync, 0);
        Sent::inc(0, 0, vec![2.0; 4]).deliver(&sync, 0);
        wait_for(&mut sync, "both buckets reduced with the joined rank's zeros", |p| p.buckets_done == 2);
        reduced.wait();
        let r = sync.finish_step(0).unwrap();
        let g = r.gradients.unwrap().to_vec(pid(1)).unwrap();
        (r.report.step, r.report.joined.clone(), Some(g))
    });
    assert_eq!(out[0], (0, vec![1], Some(vec![6.0; 4])), "rank 0: its own gradient, one contributor");
    assert_eq!(out[1], (0, vec![1], None), "rank 1 collected step 0, which it shadowed");
}

/// Invariant: a step's end begun early (`begin_finish_step`,
/// `begin_abort_step`) launches what the rank left unsent (a parameter it
/// never used) at once: the other rank's buckets reduce while this rank
/// serves their gathers, before it collects its result.
#[test]
fn a_finish_or_abort_begun_early_lets_the_others_reduce_before_it_is_collected() {
    for abort in [false, true] {
        let syncs = build_world(2, &[4, 4], |b| {
            b.bucket_cap_bytes(16);
        });
        let reduced = Barrier::new(2);
        let out = on_ranks(syncs, |rank, mut sync| {
            if rank == 1 {
                // Rank 1 never used parameter 1: it goes out at the step's end.
                Sent::inc(0, 0, vec![2.0; 4]).deliver(&sync, 0);
                if abort {
                    sync.begin_abort_step(0, AbortReason::OutOfMemory).unwrap();
                    sync.begin_abort_step(0, AbortReason::OutOfMemory).unwrap();
                } else {
                    sync.begin_finish_step(0).unwrap();
                    sync.begin_finish_step(0).unwrap();
                }
                reduced.wait(); // rank 0 saw both buckets reduced before this rank collects
                let r = if abort { sync.abort_step(0, AbortReason::OutOfMemory) } else { sync.finish_step(0) };
                return r.unwrap().report.outcome;
            }
            Sent::inc(1, 0, vec![6.0; 4]).deliver(&sync, 0);
            Sent::inc(0, 0, vec![2.0; 4]).deliver(&sync, 0);
            wait_for(&mut sync, "both buckets reduced before rank 1 collects", |p| p.buckets_done == 2);
            reduced.wait();
            sync.finish_step(0).unwrap().report.outcome
        });
        let want =
            if abort { Outcome::Skipped { aborted: vec![(1, AbortReason::OutOfMemory)] } } else { Outcome::Applied };
        assert_eq!(out, vec![want.clone(), want], "abort: {abort}");
    }
}

/// Invariant: ranks with fewer batches join; each later step is averaged over
/// the ranks still training, and `join` returns once every rank has joined.
#[test]
fn joined_ranks_shadow_with_zeros_until_everyone_has_joined() {
    let batches = [5u64, 5, 2, 3];
    let syncs = build_world(4, &[4], |b| {
        b.divisor(Divisor::Contributors);
    });
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut seen = Vec::new();
        for step in 0..batches[rank] {
            Sent::inc(0, 0, vec![(rank + 1) as f32 * 12.0; 4]).deliver(&sync, step);
            let r = sync.finish_step(step).unwrap();
            let g = r.gradients.unwrap().to_vec(pid(0)).unwrap();
            seen.push((r.report.joined.clone(), r.report.contributors, g[0]));
        }
        let joined = sync.join().unwrap();
        (seen, joined)
    });
    // Steps 0-1: all four (12+24+36+48)/4 = 30; step 2: rank 2 gone, (12+24+48)/3 = 28;
    // steps 3-4: ranks 0 and 1, (12+24)/2 = 18.
    let want = [(vec![], 4, 30.0), (vec![], 4, 30.0), (vec![2], 3, 28.0), (vec![2, 3], 2, 18.0), (vec![2, 3], 2, 18.0)];
    for (rank, (seen, joined)) in out.into_iter().enumerate() {
        for (step, got) in seen.iter().enumerate() {
            assert_eq!(got, &want[step], "rank {rank} step {step}");
        }
        assert_eq!(joined.first_step, batches[rank], "rank {rank}");
        assert_eq!(joined.first_step + joined.steps, 6, "rank {rank}: the last shadowed step is step 5, all joined");
    }
}
