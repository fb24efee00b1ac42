//! Criterion suites for the data path: the pack/unpack loops on a bucket and
//! the local all-reduce against a plain memcpy of the same bytes.
//!
//! * `pack/...`: copying one gradient into its bucket slot (across pieces), adding a
//!   second contribution, and reading it back (unpack);
//! * `reduce/...`: the reduce step of the reduce-scatter (4 sources, scaled);
//! * `allreduce_vs_memcpy/...`: a 64 MiB bucket all-reduced by 4 local ranks,
//!   and a memcpy of 64 MiB. Both report bytes/s; their ratio is the figure of
//!   merit (`gradsync-bench allreduce` prints it from one interleaved run).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gradsync::backend::{BucketBuf, CollectiveKind, CollectiveTag, Transport, WriteMode};
use gradsync::LocalWorld;

fn pack(c: &mut Criterion) {
    let mut g = c.benchmark_group("pack");
    for numel in [1usize << 10, 1 << 16, 1 << 22] {
        let src: Vec<f32> = (0..numel).map(|i| i as f32).collect();
        let mut buf = BucketBuf::zeroed(numel + 13, 4);
        g.throughput(Throughput::Bytes((numel * 4) as u64));
        g.bench_with_input(BenchmarkId::new("set", numel), &numel, |b, _| {
            b.iter(|| buf.write(7, &src, WriteMode::Set))
        });
        g.bench_with_input(BenchmarkId::new("add", numel), &numel, |b, _| {
            b.iter(|| buf.write(7, &src, WriteMode::Add))
        });
        let mut out = vec![0.0; numel];
        g.bench_with_input(BenchmarkId::new("unpack", numel), &numel, |b, _| b.iter(|| buf.read(7, &mut out)));
    }
    g.finish();
}

fn reduce(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce");
    let numel = 1 << 20;
    let srcs: Vec<Vec<f32>> = (0..3).map(|k| vec![k as f32; numel]).collect();
    let refs: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
    let mut dst = vec![1.0f32; numel];
    g.throughput(Throughput::Bytes((4 * numel * 4) as u64));
    g.bench_function("4_sources_scaled", |b| b.iter(|| gradsync_kernels_reduce(&mut dst, &refs)));
    g.finish();
}

fn gradsync_kernels_reduce(dst: &mut [f32], srcs: &[&[f32]]) {
    gradsync_kernels::reduce_scaled(dst, srcs, 0.25);
}

/// Slowest rank's time for `iters` all-reduces of `numel` values on `world` threads.
fn allreduce_time(numel: usize, world: usize, iters: u64) -> Duration {
    let eps = LocalWorld::connect(world).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .into_iter()
            .map(|mut ep| {
                s.spawn(move || {
                    let mut buf = BucketBuf::zeroed(numel, world);
                    let t = Instant::now();
                    for step in 0..iters {
                        let tag = CollectiveTag { step, kind: CollectiveKind::Bucket { index: 0, numel } };
                        ep.all_reduce_grads(tag, &mut buf, 0.25, Instant::now() + Duration::from_secs(60)).unwrap();
                    }
                    t.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

fn allreduce_vs_memcpy(c: &mut Criterion) {
    let mut g = c.benchmark_group("allreduce_vs_memcpy");
    g.sample_size(10);
    let numel = (64 << 20) / 4;
    g.throughput(Throughput::Bytes((numel * 4) as u64));
    g.bench_function("local_allreduce_64MiB_world4", |b| b.iter_custom(|iters| allreduce_time(numel, 4, iters)));
    let src = vec![1.0f32; numel];
    let mut dst = vec![0.0f32; numel];
    g.bench_function("memcpy_64MiB", |b| b.iter(|| dst.copy_from_slice(&src)));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = pack, reduce, allreduce_vs_memcpy
}
criterion_main!(benches);
