//! `overlap`: a training step emulated on the local world with real parameter
//! shapes. Backward time per layer comes from its FLOPs at a device rate and is
//! *slept*, so the communicator threads own the CPUs as they would own a NIC
//! or NVLink while a GPU computes. Policies run interleaved, step by step, in
//! one process, so a noisy machine affects them alike:
//!
//! * `gradsync`: arrivals as gradients appear, dedup, learned counts (a late
//!   tied weight is corrected in the first step);
//! * `no_sync`: backward with no communication, then every gradient in one
//!   fused bucket (the usual workaround for recompute);
//! * `ddp_static`: DDP's `static_graph`: the first step without overlap (it
//!   counts hook firings), later steps with the counts known;
//! * `ideal`: the bound `max(compute, communication)`, from the measured
//!   compute time and the fused all-reduce time of `no_sync`.

use std::time::{Duration, Instant};

use gradsync::{DType, Divisor, GradSync, GradSyncBuilder, LocalWorld, Token};
use indicatif::{ProgressBar, ProgressStyle};

use crate::models::ModelSpec;

/// Settings of one `overlap` run.
#[derive(Debug, Clone)]
pub struct OverlapCfg {
    pub model: ModelSpec,
    pub world: usize,
    /// Device rate in TFLOP/s; `None` = chosen so compute ≈ communication.
    pub tflops: Option<f64>,
    pub steps: usize,
    pub recompute: bool,
    /// Layers per recompute segment.
    pub segment_layers: usize,
    pub bucket_cap_bytes: usize,
}

/// The policies compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Gradsync,
    NoSync,
    DdpStatic,
}

impl Policy {
    pub const ALL: [Policy; 3] = [Policy::Gradsync, Policy::NoSync, Policy::DdpStatic];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Gradsync => "gradsync",
            Policy::NoSync => "no_sync",
            Policy::DdpStatic => "ddp_static",
        }
    }
}

/// One emulated gradient: which parameter, which segment (token), when.
#[derive(Debug, Clone)]
struct Emission {
    /// Backward time elapsed before it exists.
    at: Duration,
    param: usize,
    token: u64,
}

/// The backward schedule of one step (see [`ModelSpec::backward_schedule`]).
fn backward_schedule(cfg: &OverlapCfg, tflops: f64) -> (Vec<Emission>, Duration) {
    let (times, total) = cfg.model.backward_schedule(tflops, cfg.recompute, cfg.segment_layers);
    let emissions = times
        .into_iter()
        .map(|(at, param, token)| Emission { at: Duration::from_secs_f64(at), param, token })
        .collect();
    (emissions, Duration::from_secs_f64(total))
}

/// Arrivals per parameter per step under `schedule` (declared by `ddp_static`).
fn counts(schedule: &[Emission], params: usize) -> Vec<u32> {
    let mut c = vec![0; params];
    for e in schedule {
        c[e.param] += 1;
    }
    c
}

fn builder(cfg: &OverlapCfg, policy: Policy, declared: &[u32]) -> GradSyncBuilder {
    let mut b = GradSync::builder();
    let ids: Vec<_> =
        cfg.model.params.iter().map(|p| b.param(p.name.clone(), p.numel, DType::F32).expect("valid model")).collect();
    let cap = if policy == Policy::NoSync { usize::MAX } else { cfg.bucket_cap_bytes };
    b.bucket_cap_bytes(cap)
        .divisor(Divisor::Contributors)
        .collective_timeout(Duration::from_secs(600))
        .recycle_payloads(true);
    if policy == Policy::DdpStatic {
        for (p, &c) in declared.iter().enumerate() {
            b.expect_arrivals(ids[p], c).expect("registered");
        }
    }
    b
}

/// Payload vectors per parameter, recycled from earlier steps: on a GPU the
/// gradient already exists on the device, so the emulation should not pay a
/// host allocation (and its page faults) per gradient per step.
/// At most [`POOL_BYTES`] per rank are kept (BERT-large's 1.3 GB per rank per
/// policy of buckets already fills most of a 24 GB machine at world 4).
type Pool = Vec<Vec<Vec<f32>>>;

/// Bytes of recycled payloads one rank keeps.
const POOL_BYTES: usize = 256 << 20;

/// One rank's step under `policy`: emulate backward, hand gradients over, finish.
/// Returns (step time, exposed communication).
fn rank_step(
    sync: &mut GradSync,
    model: &ModelSpec,
    schedule: &[Emission],
    step: u64,
    defer_all: bool,
    pool: &mut Pool,
) -> (Duration, Duration) {
    let hook = sync.hook();
    let ids = sync.param_ids().to_vec();
    let start = Instant::now();
    let mut deferred = Vec::new();
    for e in schedule {
        // Make the payload while the "device" computes, then wait for the layer's end.
        let payload = pool[e.param].pop().unwrap_or_else(|| vec![1.0f32; model.params[e.param].numel]);
        let due = start + e.at;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        if defer_all {
            deferred.push((e.param, e.token, payload));
        } else {
            hook.increment(step, ids[e.param], Token(e.token), payload).expect("valid arrival");
        }
    }
    for (p, token, payload) in deferred {
        hook.increment(step, ids[p], Token(token), payload).expect("valid arrival");
    }
    let result = sync.finish_step(step).expect("step succeeds");
    assert!(result.report.outcome.is_applied());
    let timing = (start.elapsed(), result.report.exposed_comm);
    drop(result);
    let mut pooled: usize = pool.iter().flatten().map(|v| v.len() * 4).sum();
    for (p, v) in sync.take_spent() {
        if pooled + v.len() * 4 <= POOL_BYTES {
            pooled += v.len() * 4;
            pool[p.index()].push(v);
        }
    }
    timing
}

/// Medians of one policy.
#[derive(Debug, Clone, Default)]
pub struct PolicyResult {
    pub step_s: Vec<f64>,
    pub exposed_s: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

impl PolicyResult {
    pub fn step_median(&self) -> f64 {
        median(&self.step_s)
    }
    pub fn exposed_median(&self) -> f64 {
        median(&self.exposed_s)
    }
}

/// Everything `overlap` measured.
#[derive(Debug, Clone)]
pub struct OverlapReport {
    pub tflops: f64,
    pub compute_s: f64,
    pub results: Vec<(Policy, PolicyResult)>,
    pub ideal_s: f64,
}

/// Run `steps` steps of every policy on all ranks. `tflops = f64::INFINITY` runs
/// with no compute (used to measure communication alone).
fn run_policies(cfg: &OverlapCfg, tflops: f64, policies: &[Policy], progress: bool) -> Vec<(Policy, PolicyResult)> {
    let (schedule, _) = backward_schedule(cfg, tflops);
    let declared = counts(&schedule, cfg.model.params.len());
    // Every policy gets its own communicator; rank r of each lives on thread r.
    let mut per_rank: Vec<Vec<GradSync>> = (0..cfg.world).map(|_| Vec::new()).collect();
    for &policy in policies {
        let b = builder(cfg, policy, &declared);
        for (r, ep) in LocalWorld::connect(cfg.world).expect("world ≥ 1").into_iter().enumerate() {
            per_rank[r].push(b.build(ep).expect("valid settings"));
        }
    }
    // A progress bar on a terminal; nothing when stderr is not one.
    let bar = if progress { ProgressBar::new(cfg.steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("  {bar:30} step {pos}/{len}, {elapsed}").expect("a valid template"));
    let timings: Vec<Vec<Vec<(Duration, Duration)>>> = std::thread::scope(|s| {
        let handles: Vec<_> = per_rank
            .into_iter()
            .enumerate()
            .map(|(rank, mut syncs)| {
                let (schedule, bar) = (&schedule, &bar);
                s.spawn(move || {
                    let mut t = vec![Vec::new(); policies.len()];
                    let mut pool: Pool = vec![Vec::new(); cfg.model.params.len()];
                    for step in 0..cfg.steps as u64 {
                        for (i, &policy) in policies.iter().enumerate() {
                            let defer = policy == Policy::NoSync || (policy == Policy::DdpStatic && step == 0);
                            t[i].push(rank_step(&mut syncs[i], &cfg.model, schedule, step, defer, &mut pool));
                        }
                        if rank == 0 {
                            bar.inc(1);
                        }
                    }
                    t
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    bar.finish_and_clear();
    policies
        .iter()
        .enumerate()
        .map(|(i, &policy)| {
            // A step lasts until its slowest rank is done.
            let mut r = PolicyResult::default();
            for step in 0..cfg.steps {
                let worst = timings.iter().map(|t| t[i][step]).max().unwrap_or_default();
                r.step_s.push(worst.0.as_secs_f64());
                r.exposed_s.push(worst.1.as_secs_f64());
            }
            (policy, r)
        })
        .collect()
}

/// The `overlap` benchmark.
pub fn run(cfg: &OverlapCfg) -> OverlapReport {
    let unit = backward_schedule(cfg, 1.0).1.as_secs_f64(); // seconds of compute at 1 TFLOP/s
    let tflops = cfg.tflops.unwrap_or_else(|| {
        // Calibrate: the fused all-reduce alone, then a rate where compute ≈ comm.
        eprintln!("calibrating: fused all-reduce of {} MB at world {}", (cfg.model.numel() * 4) >> 20, cfg.world);
        let probe = OverlapCfg { steps: 3, ..cfg.clone() };
        let comm = run_policies(&probe, f64::INFINITY, &[Policy::NoSync], false)[0].1.exposed_median();
        unit / comm.max(1e-6)
    });
    let compute_s = unit / tflops;
    let results = run_policies(cfg, tflops, &Policy::ALL, true);
    let comm_s = results.iter().find(|(p, _)| *p == Policy::NoSync).map_or(0.0, |(_, r)| r.exposed_median());
    OverlapReport { tflops, compute_s, results, ideal_s: compute_s.max(comm_s) }
}
