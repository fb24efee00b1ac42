//! The parameter gather of a sharded model (`GradSync::gather`), end to end
//! on the local world's rank threads: every rank's chunk lands in every
//! rank's buffer bit for bit (negative zero and NaN payloads included), it
//! runs between steps without disturbing them, and a rank that never
//! gathers fails the others at the collective deadline with the collective
//! and the missing rank named, after which the session needs a reset.

use crate::common;

use std::time::Duration;

use common::{build_world, on_ranks, Sent};
use gradsync::backend::BucketBuf;
use gradsync::{GatherOf, GradSync, SyncError};

/// Rank `rank`'s chunk of `chunk` values for bucket `b`: distinct bit
/// patterns, a negative zero and a NaN with a payload among them.
fn chunk_of(rank: usize, b: usize, chunk: usize) -> Vec<f32> {
    (0..chunk)
        .map(|i| match i {
            0 => -0.0,
            1 => f32::from_bits(0x7fc0_0000 | (rank as u32 + 1)),
            _ => (rank * 1000 + b * 100 + i) as f32 * 0.1,
        })
        .collect()
}

/// This rank's buffers for buckets `chunks.len()` buckets, its own chunk filled.
fn buffers(rank: usize, world: usize, chunks: &[usize]) -> Vec<(GatherOf, BucketBuf)> {
    chunks
        .iter()
        .enumerate()
        .map(|(b, &chunk)| {
            let mut buf = BucketBuf::zeroed(chunk * world, 1);
            buf.write(rank * chunk, &chunk_of(rank, b, chunk), gradsync::backend::WriteMode::Set);
            (GatherOf::Bucket(b), buf)
        })
        .collect()
}

fn bits(buf: &BucketBuf) -> Vec<u32> {
    buf.chunks(0, buf.numel()).flatten().map(|v| v.to_bits()).collect()
}

#[test]
fn every_rank_receives_every_chunk_bit_for_bit_between_steps() {
    let world = 3;
    let chunks = [4, 2];
    // Two buckets (one parameter each), as the gather's.
    let syncs = build_world(world, &[4, 4], |b| {
        b.bucket_cap_bytes(16);
    });
    let out = on_ranks(syncs, |rank, mut sync: GradSync| {
        Sent::inc(0, 0, vec![rank as f32; 4]).deliver(&sync, 0);
        Sent::inc(1, 0, vec![0.0; 4]).deliver(&sync, 0);
        let first = sync.finish_step(0).unwrap().gradients.unwrap().to_vec(common::pid(0)).unwrap();
        let mut gathered = buffers(rank, world, &chunks);
        sync.gather(&mut gathered).expect("the gather");
        // The next step goes on as usual after it.
        Sent::inc(0, 0, vec![2.0; 4]).deliver(&sync, 1);
        Sent::inc(1, 0, vec![0.0; 4]).deliver(&sync, 1);
        let second = sync.finish_step(1).unwrap().gradients.unwrap().to_vec(common::pid(0)).unwrap();
        let gathered: Vec<_> = gathered.iter().map(|(of, buf)| (*of, bits(buf))).collect();
        (first, gathered, second)
    });
    for (rank, (first, gathered, second)) in out.into_iter().enumerate() {
        assert_eq!((first, second), (vec![1.0; 4], vec![2.0; 4]), "rank {rank}: the steps around the gather");
        for (of, got) in gathered {
            let GatherOf::Bucket(b) = of else { panic!("rank {rank}: {of:?}") };
            let want: Vec<u32> = (0..world).flat_map(|r| chunk_of(r, b, chunks[b])).map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "rank {rank} bucket {b}");
        }
    }
}

/// Started one bucket at a time and waited for in order (how the torch
/// wrapper pipelines its packing and unpacking with the gathers in flight),
/// every chunk lands as with one gather of every bucket.
#[test]
fn gathers_started_one_by_one_and_waited_in_order_land_bit_for_bit() {
    let world = 3;
    let chunks = [4, 2, 3];
    let syncs = build_world(world, &[4, 4, 4], |b| {
        b.bucket_cap_bytes(16);
    });
    let out = on_ranks(syncs, |rank, mut sync: GradSync| {
        let mut pending = Vec::new();
        for buffer in buffers(rank, world, &chunks) {
            pending.push(sync.start_gather(vec![buffer]).expect("started"));
        }
        pending
            .into_iter()
            .map(|p| {
                let (mut back, outcome) = sync.finish_gather(p);
                outcome.expect("the gather");
                let (of, buf) = back.pop().expect("the buffer back");
                (of, bits(&buf))
            })
            .collect::<Vec<_>>()
    });
    for (rank, gathered) in out.into_iter().enumerate() {
        assert_eq!(gathered.len(), chunks.len());
        for (b, (of, got)) in gathered.into_iter().enumerate() {
            assert_eq!(of, GatherOf::Bucket(b), "rank {rank}: answered in the order started");
            let want: Vec<u32> = (0..world).flat_map(|r| chunk_of(r, b, chunks[b])).map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "rank {rank} bucket {b}");
        }
    }
}

#[test]
fn a_rank_that_never_gathers_fails_the_others_at_the_deadline_naming_it() {
    let syncs = build_world(3, &[4], |b| {
        b.collective_timeout(Duration::from_millis(300));
    });
    let out = on_ranks(syncs, |rank, mut sync: GradSync| {
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(900));
            return None;
        }
        let mut mine = buffers(rank, 3, &[2]);
        let error = sync.gather(&mut mine).unwrap_err();
        assert_eq!(mine.len(), 1, "rank {rank}: the buffers come back after a failure too");
        let again = sync.finish_step(0).unwrap_err();
        Some((error, again))
    });
    for (rank, result) in out.into_iter().enumerate().take(2) {
        let (error, again) = result.unwrap();
        let text = error.to_string();
        assert!(text.contains("parameter gather of bucket 0") && text.contains("[2]"), "rank {rank}: {text}");
        assert!(matches!(again, SyncError::Poisoned { .. }), "rank {rank}: needs a reset after it: {again}");
    }
}
