//! Tests of the local transport: exact sums for many shapes, deadlines,
//! dropped peers, desync, reset.
use super::*;
use gradsync_actors::CollectiveKind;
use std::time::Duration;

fn tag(step: u64, index: usize, numel: usize) -> CollectiveTag {
    CollectiveTag { step, kind: CollectiveKind::Bucket { index, numel } }
}

/// Rank `rank`'s pieces of a bucket of `numel` values: value `i * (rank + 1)` at flat index `i`.
fn pieces(rank: usize, numel: usize, world: usize) -> gradsync_actors::BucketBuf {
    let mut buf = gradsync_actors::BucketBuf::zeroed(numel, world);
    let values: Vec<f32> = (0..numel).map(|i| (i * (rank + 1)) as f32).collect();
    buf.write(0, &values, gradsync_actors::bucket_buf::WriteMode::Set);
    buf
}

/// Run `rank_body` for every endpoint on its own thread while `meanwhile` runs
/// on the calling thread; results by rank.
fn on_endpoints<R: Send>(
    eps: Vec<LocalEndpoint>,
    meanwhile: impl FnOnce(),
    rank_body: impl Fn(LocalEndpoint) -> R + Sync,
) -> Vec<R> {
    std::thread::scope(|s| {
        let body = &rank_body;
        let handles: Vec<_> = eps.into_iter().map(|ep| s.spawn(move || body(ep))).collect();
        meanwhile();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn deadline(after: Duration) -> Instant {
    Instant::now() + after
}

#[test]
fn every_rank_gets_the_exact_sum_for_many_shapes() {
    for world in 1..=5 {
        for numel in [0, 1, 3, 7, 64, 1001] {
            let eps = LocalWorld::connect(world).unwrap();
            let results = on_endpoints(
                eps,
                || {},
                |mut ep| {
                    let mut p = pieces(ep.rank, numel, world);
                    // Rounds two and three reduce the previous sums again.
                    for step in 0..3 {
                        ep.all_reduce_grads(tag(step, 0, numel), &mut p, 1.0, deadline(Duration::from_secs(10)))
                            .unwrap();
                    }
                    p.chunks(0, p.numel()).flatten().copied().collect::<Vec<f32>>()
                },
            );
            let ranks_sum: f32 = (1..=world).map(|r| r as f32).sum();
            let factor = (world as f32).powi(2) * ranks_sum;
            let want: Vec<f32> = (0..numel).map(|i| i as f32 * factor).collect();
            for r in &results {
                assert_eq!(r, &want, "world {world} numel {numel}");
            }
        }
    }
}

#[test]
fn a_missing_rank_is_named_after_the_deadline() {
    let mut eps = LocalWorld::connect(3).unwrap();
    let _silent = eps.pop().unwrap(); // rank 2 never joins
    let t0 = Instant::now();
    let errs = on_endpoints(
        eps,
        || {},
        |mut ep| {
            let mut p = pieces(ep.rank, 9, 3);
            ep.all_reduce_grads(tag(0, 0, 9), &mut p, 1.0, deadline(Duration::from_millis(200))).unwrap_err()
        },
    );
    assert!(t0.elapsed() < Duration::from_secs(2), "deadline not honoured: {:?}", t0.elapsed());
    for e in errs {
        let CommError::Timeout { missing, .. } = e else { panic!("expected timeout, got {e}") };
        assert_eq!(missing, vec![2]);
    }
}

#[test]
fn a_dropped_peer_is_named_at_once_not_after_the_deadline() {
    let mut eps = LocalWorld::connect(3).unwrap();
    let dead = eps.pop().unwrap();
    let t0 = Instant::now();
    let drop_rank_2 = || {
        std::thread::sleep(Duration::from_millis(50));
        drop(dead);
    };
    let errs = on_endpoints(eps, drop_rank_2, |mut ep| {
        let mut p = pieces(ep.rank, 9, 3);
        ep.all_reduce_grads(tag(0, 0, 9), &mut p, 1.0, deadline(Duration::from_secs(30))).unwrap_err()
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "waited for the deadline: {:?}", t0.elapsed());
    for e in errs {
        assert!(matches!(e, CommError::PeerGone { peer: 2, .. }), "got {e}");
    }
}

#[test]
fn after_reset_stale_pieces_are_ignored_and_sums_are_exact() {
    let eps = LocalWorld::connect(2).unwrap();
    let out = on_endpoints(
        eps,
        || {},
        |mut ep| {
            let mut p = pieces(ep.rank, 6, 2);
            if ep.rank == 0 {
                // Rank 0 starts a collective rank 1 never joins.
                ep.all_reduce_grads(tag(0, 0, 6), &mut p, 1.0, deadline(Duration::from_millis(100))).unwrap_err();
                p = pieces(0, 6, 2);
            }
            ep.reset();
            ep.all_reduce_grads(tag(1, 0, 6), &mut p, 1.0, deadline(Duration::from_secs(10))).unwrap();
            p.chunks(0, p.numel()).flatten().copied().collect::<Vec<f32>>()
        },
    );
    let want: Vec<f32> = (0..6).map(|i| (i * 3) as f32).collect();
    assert_eq!(out, vec![want.clone(), want]);
}

#[test]
fn different_collectives_at_the_same_position_are_a_desync() {
    let eps = LocalWorld::connect(2).unwrap();
    let errs = on_endpoints(
        eps,
        || {},
        |mut ep| {
            let numel = 4 + ep.rank; // rank 1 thinks the bucket is larger
            let mut p = pieces(ep.rank, numel, 2);
            ep.all_reduce_grads(tag(0, 0, numel), &mut p, 1.0, deadline(Duration::from_secs(5))).unwrap_err()
        },
    );
    for (rank, e) in errs.into_iter().enumerate() {
        let CommError::Desync { peer, .. } = e else { panic!("expected desync, got {e}") };
        assert_eq!(peer, 1 - rank);
    }
}

#[test]
fn control_words_sum_with_wrapping() {
    let eps = LocalWorld::connect(3).unwrap();
    let out = on_endpoints(
        eps,
        || {},
        |mut ep| {
            let mut w = vec![ep.rank as u64 + 1, u64::MAX, 5, 0, 1];
            let t = CollectiveTag { step: 0, kind: CollectiveKind::Control { len: 5 } };
            ep.all_reduce_u64(t, &mut w, deadline(Duration::from_secs(5))).unwrap();
            w
        },
    );
    for w in out {
        assert_eq!(w, vec![6, u64::MAX - 2, 15, 0, 3]);
    }
}

/// Invariant: a rank that detects a desync tells every peer before it
/// leaves. Rank 2 issues a different collective and rank 0 leaves the
/// moment it notices; rank 1 still learns the desync (naming rank 2), not
/// just that rank 0 left.
#[test]
fn a_rank_that_notices_a_desync_tells_the_others_before_it_leaves() {
    let eps = LocalWorld::connect(3).unwrap();
    let errs = on_endpoints(
        eps,
        || {},
        |mut ep| {
            let numel = if ep.rank == 2 { 6 } else { 4 };
            if ep.rank == 1 {
                // Let rank 0 notice and leave first.
                std::thread::sleep(Duration::from_millis(100));
            }
            let mut p = pieces(ep.rank, numel, 3);
            let e = ep.all_reduce_grads(tag(0, 0, numel), &mut p, 1.0, deadline(Duration::from_secs(5))).unwrap_err();
            drop(ep); // a program that exits on error
            e
        },
    );
    for (rank, e) in errs.into_iter().enumerate() {
        let CommError::Desync { peer, .. } = e else { panic!("rank {rank}: expected a desync, got {e}") };
        if rank != 2 {
            assert_eq!(peer, 2, "rank {rank} names the odd rank");
        }
    }
}

#[test]
fn a_moved_endpoint_reduces_in_its_new_world_and_its_old_peers_see_it_leave() {
    let mut old = LocalWorld::connect(3).unwrap();
    let movers: Vec<LocalMover> = old.iter().map(LocalEndpoint::mover).collect();
    let fresh = LocalWorld::connect(2).unwrap();
    // Ranks 0 and 2 move (to ranks 0 and 1); rank 1 stays behind.
    for (mover, next) in [&movers[0], &movers[2]].into_iter().zip(fresh) {
        assert!(mover.move_to(next).is_ok());
    }
    let mut stays = old.remove(1);
    let results = on_endpoints(
        old,
        || {},
        |mut ep| {
            ep.reset();
            assert_eq!((ep.world(), ep.rank() < 2), (2, true));
            // A bucket allocated for the old world (3 pieces) is cut for the new one.
            let mut p = pieces(ep.rank(), 7, 3);
            ep.all_reduce_grads(tag(0, 0, 7), &mut p, 0.5, deadline(Duration::from_secs(10))).unwrap();
            p.chunks(0, p.numel()).flatten().copied().collect::<Vec<f32>>()
        },
    );
    let want: Vec<f32> = (0..7).map(|i| (i + 2 * i) as f32 * 0.5).collect();
    assert_eq!(results, vec![want.clone(), want]);
    let mut p = pieces(1, 3, 3);
    let err = stays.all_reduce_grads(tag(0, 0, 3), &mut p, 1.0, deadline(Duration::from_secs(10))).unwrap_err();
    assert!(matches!(err, CommError::PeerGone { .. }), "the old world sees its ranks leave: {err}");
}

#[test]
fn the_interrupter_still_wakes_an_endpoint_after_a_move() {
    let mut eps = LocalWorld::connect(2).unwrap();
    let mut ep = eps.remove(0);
    let interrupt = ep.interrupter().unwrap();
    let mut fresh = LocalWorld::connect(2).unwrap();
    assert!(ep.mover().move_to(fresh.remove(0)).is_ok());
    ep.reset();
    let waiting = std::thread::spawn(move || {
        let mut p = pieces(0, 2, 2);
        ep.all_reduce_grads(tag(0, 0, 2), &mut p, 1.0, deadline(Duration::from_secs(30)))
    });
    std::thread::sleep(Duration::from_millis(50));
    interrupt();
    let began = Instant::now();
    let err = waiting.join().unwrap().unwrap_err();
    assert!(matches!(err, CommError::Cancelled { .. }), "{err}");
    assert!(began.elapsed() < Duration::from_secs(5), "woken, not timed out");
    drop((eps, fresh));
}
