//! Micro-benchmarks of the hook path and the actor pipeline.
//!
//! * `hook_call`: one `GradHook::increment` (a bounds check and a channel send),
//!   payload allocation excluded; steps are finished outside the timed region.
//! * `pipeline/P`: P arrivals (one per parameter) from the first hook call to
//!   `finish_step` returning on a 1-rank world: dedup, pack, launch, control.
//!   Reported as arrivals per second.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gradsync::{DType, GradSync, LocalWorld, ParamId, Token};

fn world_of_one(params: usize) -> GradSync {
    let mut b = GradSync::builder();
    for i in 0..params {
        b.param(format!("p{i}"), 1, DType::F32).unwrap();
    }
    b.bucket_cap_bytes(64 << 10);
    b.build(LocalWorld::connect(1).unwrap().pop().unwrap()).unwrap()
}

fn hook_call(c: &mut Criterion) {
    const PARAMS: usize = 4096;
    let mut sync = world_of_one(PARAMS);
    let hook = sync.hook();
    let mut step = 0;
    c.bench_function("hook_call", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(PARAMS);
                let mut payloads: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0]).collect();
                let t = Instant::now();
                for p in 0..n {
                    let payload = payloads.pop().expect("one payload per call");
                    hook.increment(step, ParamId(p as u32), Token(0), payload).unwrap();
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
        let mut sync = world_of_one(params);
        let hook = sync.hook();
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
                        hook.increment(step, ParamId(p as u32), Token(0), payload).unwrap();
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

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = hook_call, pipeline
}
criterion_main!(benches);
