//! Faults with real threads: an aborting rank, a NaN, a rank that stops
//! responding, a rank that panics, ranks that registered different models.
//! Nobody hangs, every rank learns the same outcome, errors name the rank.

use crate::common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{build_world, on_ranks, pid, Sent};
use gradsync::backend::{CollectiveKind, CommError};
use gradsync::{AbortReason, DType, GradSync, LocalWorld, Outcome, SyncError};

#[test]
fn an_aborting_rank_makes_every_rank_skip_and_the_next_step_is_exact() {
    let syncs = build_world(4, &[4, 4, 4], |b| {
        b.bucket_cap_bytes(16);
    });
    let out = on_ranks(syncs, |rank, mut sync| {
        // Step 0: rank 2 runs out of memory halfway through backward.
        Sent::inc(2, 0, vec![rank as f32; 4]).deliver(&sync, 0);
        let r0 = if rank == 2 {
            sync.abort_step(0, AbortReason::OutOfMemory).unwrap()
        } else {
            Sent::inc(1, 0, vec![1.0; 4]).deliver(&sync, 0);
            Sent::inc(0, 0, vec![1.0; 4]).deliver(&sync, 0);
            sync.finish_step(0).unwrap()
        };
        assert!(r0.gradients.is_none(), "a skipped step lends no gradients");
        // Step 1 proceeds normally on every rank.
        for p in (0..3).rev() {
            Sent::inc(p, 0, vec![(rank * 4) as f32; 4]).deliver(&sync, 1);
        }
        let r1 = sync.finish_step(1).unwrap();
        let g = r1.gradients.as_ref().unwrap().to_vec(pid(0)).unwrap();
        (r0.report.outcome, g)
    });
    for (outcome, g) in out {
        assert_eq!(outcome, Outcome::Skipped { aborted: vec![(2, AbortReason::OutOfMemory)] });
        assert_eq!(g, vec![6.0; 4], "mean of 0, 4, 8, 12");
    }
}

#[test]
fn a_nan_on_one_rank_skips_the_step_on_every_rank() {
    let syncs = build_world(3, &[3, 3], |b| {
        b.check_finite(true);
    });
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut g = vec![1.0f32; 3];
        if rank == 1 {
            g[2] = f32::NAN;
        }
        Sent::acc(1, 0, g).deliver(&sync, 0);
        Sent::acc(0, 0, vec![2.0; 3]).deliver(&sync, 0);
        sync.finish_step(0).unwrap().report.outcome
    });
    for outcome in out {
        assert_eq!(outcome, Outcome::Skipped { aborted: vec![(1, AbortReason::NonFinite)] });
    }
}

/// Rank 2 stops responding at step `stalled` (after `stalled` clean steps).
/// The others fail within the collective deadline + 20%, naming rank 2 and
/// the collective it missed (returned by rank); once rank 2 is back, all
/// ranks reset, agree on the step after, and train on exactly.
fn stalled_rank(stalled: u64) -> Vec<CollectiveKind> {
    let timeout = Duration::from_millis(1000);
    let syncs = build_world(3, &[8, 8], |b| {
        b.bucket_cap_bytes(32).collective_timeout(timeout);
    });
    let (failed_tx, failed_rx) = mpsc::channel::<()>();
    let failed_rx = std::sync::Mutex::new(failed_rx);
    let out = on_ranks(syncs, |rank, mut sync| {
        for step in 0..stalled {
            for p in (0..2).rev() {
                Sent::inc(p, 0, vec![1.0; 8]).deliver(&sync, step);
            }
            sync.finish_step(step).unwrap();
        }
        let (err, missed) = if rank == 2 {
            // Stuck (say, in a slow data loader) until both others have given up.
            let rx = failed_rx.lock().unwrap();
            rx.recv().unwrap();
            rx.recv().unwrap();
            Sent::inc(1, 0, vec![1.0; 8]).deliver(&sync, stalled);
            Sent::inc(0, 0, vec![1.0; 8]).deliver(&sync, stalled);
            (sync.finish_step(stalled).unwrap_err(), None)
        } else {
            let t0 = Instant::now();
            Sent::inc(1, 0, vec![1.0; 8]).deliver(&sync, stalled); // launches bucket 0 at once
            Sent::inc(0, 0, vec![1.0; 8]).deliver(&sync, stalled);
            let err = sync.finish_step(stalled).unwrap_err();
            let waited = t0.elapsed();
            failed_tx.send(()).unwrap();
            assert!(waited <= timeout.mul_f64(1.2), "rank {rank} waited {waited:?} for a {timeout:?} deadline");
            let missed = match &err {
                SyncError::Comm(CommError::Timeout { missing, tag, .. }) => {
                    assert_eq!((missing, tag.step), (&vec![2], stalled), "rank {rank}");
                    tag.kind
                }
                other => panic!("rank {rank}: expected a timeout naming rank 2, got {other}"),
            };
            (err, Some(missed))
        };
        let restart = sync.reset().unwrap();
        for p in (0..2).rev() {
            Sent::inc(p, 0, vec![(rank + 1) as f32; 8]).deliver(&sync, restart);
        }
        let r = sync.finish_step(restart).unwrap();
        (err, restart, r.gradients.as_ref().unwrap().to_vec(pid(0)).unwrap(), missed)
    });
    let mut missed_by = Vec::new();
    for (rank, (err, restart, g, missed)) in out.into_iter().enumerate() {
        assert!(matches!(err, SyncError::Comm(_)), "rank {rank}: {err}");
        assert_eq!(restart, stalled + 1, "all ranks restart at the step after the failed one");
        assert_eq!(g, vec![2.0; 8], "mean of 1, 2, 3");
        missed_by.extend(missed);
    }
    missed_by
}

/// Stalled mid-step: the waiting ranks name the first data bucket.
#[test]
fn a_stalled_rank_is_named_within_the_deadline_and_reset_recovers() {
    for missed in stalled_rank(1) {
        assert_eq!(missed, CollectiveKind::Bucket { index: 0, numel: 8 });
    }
}

/// Stalled before its first step: the plan agreement, which runs when the
/// first step begins (so settings chosen after building join it), is what the
/// others wait on, and what they name.
#[test]
fn a_rank_stalled_before_its_first_step_is_named_on_the_plan_agreement() {
    for missed in stalled_rank(0) {
        assert_eq!(missed, CollectiveKind::Plan { len: 3 });
    }
}

/// A rank thread panics mid-step; its GradSync is dropped while unwinding.
/// The survivors fail promptly naming it, cannot reset with it, and drop cleanly.
#[test]
fn a_panicking_rank_is_named_by_the_survivors() {
    let timeout = Duration::from_secs(10);
    let syncs = build_world(3, &[8, 8], |b| {
        b.bucket_cap_bytes(32).collective_timeout(timeout);
    });
    // Survivors wait for each other before dropping, so the only rank gone is rank 1.
    let survivors = std::sync::Barrier::new(2);
    let out = on_ranks(syncs, |rank, mut sync| {
        if rank == 1 {
            let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                Sent::inc(1, 0, vec![1.0; 8]).deliver(&sync, 0);
                panic!("simulated crash in backward");
            }));
            assert!(died.is_err());
            return None;
        }
        let t0 = Instant::now();
        Sent::inc(1, 0, vec![1.0; 8]).deliver(&sync, 0);
        Sent::inc(0, 0, vec![1.0; 8]).deliver(&sync, 0);
        let err = sync.finish_step(0).unwrap_err();
        let waited = t0.elapsed();
        let reset = sync.reset().unwrap_err();
        survivors.wait();
        Some((err, reset, waited))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let Some((err, reset, waited)) = r else { continue };
        assert!(waited < timeout.mul_f64(1.2), "rank {rank} waited {waited:?}");
        assert!(
            matches!(err, SyncError::Comm(CommError::PeerGone { peer: 1, .. })),
            "rank {rank}: expected rank 1 named as gone, got {err}"
        );
        assert!(
            matches!(reset, SyncError::Comm(CommError::PeerGone { peer: 1, .. })),
            "rank {rank}: reset must fail naming rank 1, got {reset}"
        );
    }
}

/// Two ranks, each registering two 4-value parameters as `register(rank, builder)`
/// says, run one step (both parameters used); each rank's error, by rank.
fn two_ranks_disagreeing(register: impl Fn(usize, &mut gradsync::GradSyncBuilder)) -> Vec<SyncError> {
    let syncs: Vec<GradSync> = LocalWorld::connect(2)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(rank, ep)| {
            let mut b = GradSync::builder();
            register(rank, &mut b);
            b.build(ep).unwrap()
        })
        .collect();
    on_ranks(syncs, |_, mut sync| {
        Sent::inc(1, 0, vec![1.0; 4]).deliver(&sync, 0);
        Sent::inc(0, 0, vec![1.0; 4]).deliver(&sync, 0);
        sync.finish_step(0).unwrap_err()
    })
}

/// Two ranks register parameters of equal sizes under different names: the data
/// collectives match in size, but the control collective's fingerprints do not.
#[test]
fn ranks_with_different_models_get_a_desync_naming_the_rank() {
    let out = two_ranks_disagreeing(|rank, b| {
        let names = if rank == 0 { ["a", "b"] } else { ["b", "a"] };
        for n in names {
            b.param(n, 4, DType::F32).unwrap();
        }
    });
    for err in out {
        match err {
            SyncError::Desync { step, ranks, .. } => assert_eq!((step, ranks), (0, vec![1])),
            other => panic!("expected a desync, got {other}"),
        }
    }
}

/// Ranks with different bucket layouts are caught by the plan agreement,
/// before the first bucket (which NCCL could not check): with two ranks there
/// is no majority, so each side is named and the error says so.
#[test]
fn ranks_with_different_bucket_caps_get_a_desync_before_any_bucket() {
    let out = two_ranks_disagreeing(|rank, b| {
        b.param("a", 4, DType::F32).unwrap();
        b.param("b", 4, DType::F32).unwrap();
        b.bucket_cap_bytes(if rank == 0 { 16 } else { 1 << 20 });
    });
    for (rank, err) in out.into_iter().enumerate() {
        match &err {
            SyncError::Desync { ranks, groups, majority, .. } => {
                assert_eq!((ranks, groups, majority), (&vec![1], &vec![vec![0], vec![1]], &false), "rank {rank}");
                assert!(err.to_string().contains("no group of ranks is a majority"), "{err}");
            }
            other => panic!("rank {rank}: expected a desync, got {other}"),
        }
    }
}
