//! Micro-benchmarks of the hook path and the actor pipeline.
//!
//! * `hook_call`: one `GradHook::increment` (a bounds check and a channel send),
//!   payload allocation excluded; steps are finished outside the timed region.
//! * `pipeline/P`: P arrivals (one per parameter) from the first hook call to
//!   `finish_step` returning on a 1-rank world: dedup, pack, launch, control.
//!   Reported as arrivals per second.
//! * `hook_to_launch`: from the hook call that completes a one-parameter bucket
//!   to the scheduler handing that bucket to the communicator (read off the
//!   step timeline); calls are spaced by 20 µs so each sees an idle pipeline.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gradsync::{DType, GradSync, LocalWorld, Token};

/// A 1-rank world of `params` one-value parameters in buckets of `cap_bytes`.
fn world_of_one(params: usize, cap_bytes: usize, timeline: bool) -> GradSync {
    let mut b = GradSync::builder();
    for i in 0..params {
        b.param(format!("p{i}"), 1, DType::F32).unwrap();
    }
    b.bucket_cap_bytes(cap_bytes).record_timeline(timeline);
    b.build(LocalWorld::connect(1).unwrap().pop().unwrap()).unwrap()
}

fn hook_call(c: &mut Criterion) {
    const PARAMS: usize = 4096;
    let mut sync = world_of_one(PARAMS, 64 << 10, false);
    let hook = sync.hook();
    let ids = sync.param_ids().to_vec();
    let mut step = 0;
    c.bench_function("hook_call", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(PARAMS);
                let mut payloads: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0]).collect();
                let t = Instant::now();
                for &id in &ids[..n] {
                    let payload = payloads.pop().expect("one payload per call");
                    hook.increment(step, id, Token(0), payload).unwrap();
                }
                timed += t.elapsed();
                drop(sync.finish_step(step).unwrap());
                step += 1;
                left -= n;
            }
            timed
        })
    });
}

fn pipeline(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline");
    for params in [100usize, 1_000, 10_000] {
        let mut sync = world_of_one(params, 64 << 10, false);
        let hook = sync.hook();
        let ids = sync.param_ids().to_vec();
        let mut step = 0;
        group.throughput(Throughput::Elements(params as u64));
        group.bench_with_input(BenchmarkId::from_parameter(params), &params, |b, &params| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let mut payloads: Vec<Vec<f32>> = (0..params).map(|_| vec![1.0]).collect();
                    let t = Instant::now();
                    for p in (0..params).rev() {
                        let payload = payloads.pop().expect("one payload per parameter");
                        hook.increment(step, ids[p], Token(0), payload).unwrap();
                    }
                    let r = sync.finish_step(step).unwrap();
                    timed += t.elapsed();
                    drop(r);
                    step += 1;
                }
                timed
            })
        });
    }
    group.finish();
}

fn hook_to_launch(c: &mut Criterion) {
    const PARAMS: usize = 64;
    // One parameter per bucket, so every hook call completes a bucket.
    let mut sync = world_of_one(PARAMS, 4, true);
    let hook = sync.hook();
    let ids = sync.param_ids().to_vec();
    let epoch = gradsync::trace::trace_epoch();
    let mut step = 0;
    c.bench_function("hook_to_launch", |bench| {
        bench.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(PARAMS);
                let mut called = Vec::with_capacity(n);
                // Bucket i holds parameter PARAMS-1-i: call them in bucket order.
                for p in (PARAMS - n..PARAMS).rev() {
                    let spaced = Instant::now();
                    while spaced.elapsed() < Duration::from_micros(20) {
                        std::hint::spin_loop();
                    }
                    called.push(Instant::now().saturating_duration_since(epoch));
                    hook.increment(step, ids[p], Token(0), vec![1.0]).unwrap();
                }
                let r = sync.finish_step(step).unwrap();
                let launches = r
                    .report
                    .timeline
                    .iter()
                    .filter(|e| e.name.starts_with("fill bucket"))
                    .map(|e| e.start + e.duration.unwrap_or_default());
                total += called.iter().zip(launches).map(|(c, l)| l.saturating_sub(*c)).sum::<Duration>();
                step += 1;
                left -= n;
            }
            total
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hook_call, pipeline, hook_to_launch
}
criterion_main!(benches);
