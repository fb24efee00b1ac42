//! `hooks`: arrival throughput through the actor pipeline, and hook-to-launch
//! latency percentiles (from the hook call that completes a one-parameter
//! bucket to the moment the scheduler hands that bucket to the communicator,
//! read off the step timeline).

use std::time::{Duration, Instant};

use gradsync::trace::{trace_epoch, Lane};
use gradsync::{DType, GradSync, LocalWorld, Token};

fn world_of_one(params: usize, timeline: bool, cap: usize, spin: Duration) -> GradSync {
    let mut b = GradSync::builder();
    for i in 0..params {
        b.param(format!("p{i}"), 1, DType::F32).unwrap();
    }
    b.bucket_cap_bytes(cap).record_timeline(timeline).idle_spin(spin);
    b.build(LocalWorld::connect(1).unwrap().pop().unwrap()).unwrap()
}

/// Arrivals per second for `params` parameters, one arrival each per step,
/// from the first hook call to `finish_step` returning (median of `steps`).
pub fn throughput(params: usize, steps: usize) -> f64 {
    let mut sync = world_of_one(params, false, 64 << 10, Duration::ZERO);
    let hook = sync.hook();
    let ids = sync.param_ids().to_vec();
    let mut rates = Vec::new();
    for step in 0..steps as u64 {
        let mut payloads: Vec<Vec<f32>> = (0..params).map(|_| vec![1.0]).collect();
        let t = Instant::now();
        for p in (0..params).rev() {
            hook.increment(step, ids[p], Token(0), payloads.pop().unwrap()).unwrap();
        }
        drop(sync.finish_step(step).unwrap());
        rates.push(params as f64 / t.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// Hook-to-launch latencies: `samples` steps of 64 one-parameter buckets, each
/// completed by a hook call after the previous bucket was handled.
pub fn hook_to_launch(samples: usize, spin: Duration) -> Vec<Duration> {
    const PARAMS: usize = 64;
    let mut sync = world_of_one(PARAMS, true, 4, spin);
    let hook = sync.hook();
    let ids = sync.param_ids().to_vec();
    let epoch = trace_epoch();
    let mut latencies = Vec::new();
    for step in 0..samples as u64 {
        let mut called = Vec::with_capacity(PARAMS);
        for p in (0..PARAMS).rev() {
            // Space the calls so each latency is measured on an idle pipeline.
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(20) {
                std::hint::spin_loop();
            }
            called.push(Instant::now().saturating_duration_since(epoch));
            hook.increment(step, ids[p], Token(0), vec![1.0]).unwrap();
        }
        let r = sync.finish_step(step).unwrap();
        let launches: Vec<Duration> = r
            .report
            .timeline
            .iter()
            .filter(|e| e.lane == Lane::Scheduler && e.name.starts_with("fill bucket"))
            .map(|e| e.start + e.duration.unwrap_or_default())
            .collect();
        // Bucket i holds parameter PARAMS-1-i, the i-th hook call.
        for (c, l) in called.iter().zip(&launches) {
            latencies.push(l.saturating_sub(*c));
        }
    }
    latencies.sort();
    latencies
}
