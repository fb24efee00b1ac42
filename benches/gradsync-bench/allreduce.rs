//! `allreduce`: the local backend's all-reduce of one bucket against a plain
//! memcpy of the same bytes, interleaved in one run. Bandwidths are bucket bytes
//! over time (the all-reduce's "algorithm bandwidth"); the ratio is the target.
//! A world-parallel memcpy (every rank thread copying its own bucket at once)
//! is printed too: it is the machine's ceiling for work spread over all ranks.

use std::time::{Duration, Instant};

use gradsync::backend::{BucketBuf, CollectiveKind, CollectiveTag, Transport};
use gradsync::LocalWorld;

/// Settings of `allreduce`.
#[derive(Debug, clap::Args)]
pub struct AllreduceArgs {
    /// Bucket size in MiB.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    world: u64,
    /// Timed rounds of each measurement (at least 3).
    #[arg(long, default_value_t = 15)]
    rounds: usize,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Time `rounds` all-reduces of `numel` values on `world` rank threads (the slowest rank per round).
fn allreduce_times(numel: usize, world: usize, rounds: usize) -> Vec<Duration> {
    let endpoints = LocalWorld::connect(world).expect("world ≥ 1");
    let per_rank: Vec<Vec<Duration>> = std::thread::scope(|s| {
        let handles: Vec<_> = endpoints
            .into_iter()
            .map(|mut ep| {
                s.spawn(move || {
                    let mut buf = BucketBuf::zeroed(numel, world);
                    for j in 0..buf.num_pieces() {
                        buf.piece_mut(j).fill((ep.rank() + j) as f32);
                    }
                    let mut times = Vec::new();
                    for step in 0..rounds as u64 {
                        let tag = CollectiveTag { step, kind: CollectiveKind::Bucket { index: 0, numel } };
                        let t = Instant::now();
                        let deadline = t + Duration::from_secs(60);
                        ep.all_reduce_grads(tag, &mut buf, 1.0 / world as f64, deadline).expect("all-reduce");
                        times.push(t.elapsed());
                    }
                    times
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    (0..rounds).map(|i| per_rank.iter().map(|t| t[i]).max().unwrap_or_default()).collect()
}

fn memcpy_times(numel: usize, threads: usize, rounds: usize) -> Vec<Duration> {
    let mut pairs: Vec<(Vec<f32>, Vec<f32>)> =
        (0..threads).map(|t| (vec![t as f32 + 1.0; numel], vec![0.0; numel])).collect();
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|s| {
                for (src, dst) in pairs.iter_mut() {
                    s.spawn(move || dst.copy_from_slice(src));
                }
            });
            t.elapsed()
        })
        .collect()
}

pub fn command(a: &AllreduceArgs) -> Result<(), String> {
    let (mib, world, rounds) = (a.mib, a.world as usize, a.rounds.max(3));
    let numel = (mib << 20) / 4;
    let bytes = (numel * 4) as f64;
    let (mut ar, mut mc, mut mcw) = (Vec::new(), Vec::new(), Vec::new());
    // Interleave: a few rounds of each, repeatedly, so drift hits all alike.
    for _ in 0..rounds.div_ceil(3) {
        ar.extend(allreduce_times(numel, world, 3));
        mc.extend(memcpy_times(numel, 1, 3));
        mcw.extend(memcpy_times(numel, world, 3));
    }
    let (ar, mc, mcw) = (median(ar), median(mc), median(mcw));
    let gbs = |d: Duration| bytes / d.as_secs_f64() / 1e9;
    println!(
        "bucket {mib} MiB, world {world} (rank threads on {} cores):",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("  local all-reduce        {:>8.2} ms  {:>6.2} GB/s", ar.as_secs_f64() * 1e3, gbs(ar));
    println!("  memcpy, 1 thread        {:>8.2} ms  {:>6.2} GB/s", mc.as_secs_f64() * 1e3, gbs(mc));
    println!("  memcpy, {world} threads at once {:>6.2} ms  {:>6.2} GB/s per copy", mcw.as_secs_f64() * 1e3, gbs(mcw));
    println!("  all-reduce / memcpy bandwidth = {:.2} (target ≥ 0.70)", gbs(ar) / gbs(mc));
    println!("  all-reduce / world-parallel memcpy = {:.2}", gbs(ar) / gbs(mcw));
    Ok(())
}
