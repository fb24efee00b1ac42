//! `sim` (SIMULATED): gradsync's own parameter actor and bucket scheduler,
//! driven by a virtual clock and a latency/bandwidth model of the collectives,
//! for rank counts no test machine has. One representative rank is simulated
//! (all ranks are symmetric in this model: same backward, same start); the
//! control collective's sum is formed as if every rank voted the same.
//!
//! Collective cost: `T(bytes, N) = 2·log2(N)·α + 2·(N−1)/N · bytes / B`, a
//! tree-latency, ring-bandwidth model (NCCL picks trees for small messages and
//! rings for large ones). Presets, with their sources (approximate, from
//! vendor data sheets and published nccl-tests results; leads, not measurements):
//!
//! * `h100-nvlink`: one node of 8 H100 SXM with NVLink 4 / NVSwitch. NVLink 4
//!   gives 900 GB/s per GPU (both directions); nccl-tests all-reduce bus
//!   bandwidth on such nodes is reported around 360 GB/s for large messages.
//!   α = 8 µs. Up to 8 ranks.
//! * `ib-multinode`: nodes of 8 such GPUs with one 400 Gb/s NDR InfiniBand NIC
//!   per GPU (50 GB/s line rate); across nodes the bus bandwidth per GPU is
//!   taken as 45 GB/s (90% of line rate), inside one node as `h100-nvlink`.
//!   α = 12 µs per tree level.
//!
//! Compute: per-layer backward = 2 × forward FLOPs at `--tflops` (default 400:
//! about 40% of an H100's 989 dense bf16 TFLOP/s).

use std::collections::BinaryHeap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use gradsync::backend::CollectiveKind;
use gradsync::sim::{
    mirror_vote, wire, ActorConfig, Arrival, CommDone, CommJob, CommPayload, FinishRequest, HostStore, ParamSpec,
    Registry, Reply, SchedMsg, SchedulerConfig, ShardMsg, StepEnd,
};
use gradsync::{AbortPolicy, DType, Divisor, ParamId, Payload, Plan, Token, Wire};
use serde_json::json;

use crate::models::ModelSpec;
use crate::{ModelName, Workload};

/// Settings of `sim`.
#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// The model whose parameter shapes and FLOPs are simulated.
    #[arg(long, value_enum, default_value = "bert-large")]
    model: ModelName,
    /// The cluster's cost model.
    #[arg(long, value_enum, default_value = "ib-multinode")]
    preset: PresetName,
    /// Rank counts, comma-separated (default: powers of two from 8 to the preset's limit or 1024).
    #[arg(long, value_delimiter = ',')]
    ranks: Vec<usize>,
    /// Device rate in TFLOP/s.
    #[arg(long, default_value_t = 400.0)]
    tflops: f64,
    #[command(flatten)]
    workload: Workload,
    /// Write the efficiency curves as an SVG chart.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// The presets below, by name.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum PresetName {
    /// One node of 8 H100 SXM on NVLink 4.
    H100Nvlink,
    /// Nodes of 8 H100 with one NDR InfiniBand NIC per GPU.
    IbMultinode,
}

/// A cluster's collective cost model.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    pub name: &'static str,
    /// Bus bandwidth inside a node, bytes/s.
    pub intra_bw: f64,
    /// Bus bandwidth per GPU across nodes, bytes/s.
    pub inter_bw: f64,
    /// Latency per tree level, seconds.
    pub alpha: f64,
    /// GPUs per node.
    pub node: usize,
    /// Largest rank count the preset describes.
    pub max_ranks: usize,
}

pub const PRESETS: [Preset; 2] = [
    Preset { name: "h100-nvlink", intra_bw: 360e9, inter_bw: 360e9, alpha: 8e-6, node: 8, max_ranks: 8 },
    Preset { name: "ib-multinode", intra_bw: 360e9, inter_bw: 45e9, alpha: 12e-6, node: 8, max_ranks: 1 << 20 },
];

impl Preset {
    /// Seconds for an all-reduce of `bytes` over `n` ranks.
    pub fn allreduce(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let bw = if n <= self.node { self.intra_bw } else { self.inter_bw };
        2.0 * (n as f64).log2().ceil() * self.alpha + 2.0 * (n - 1) as f64 / n as f64 * bytes / bw
    }
}

/// The real plan's bucket membership with one value per parameter, and each
/// bucket's real size in bytes.
fn virtual_plan(model: &ModelSpec, cap: usize, declared: Option<&[u32]>) -> (Plan, Vec<f64>) {
    let mut registry = Registry::default();
    for (i, p) in model.params.iter().enumerate() {
        let id = registry.add(p.name.clone(), p.numel, DType::F32).expect("a valid model");
        if let Some(d) = declared {
            registry.expect_arrivals(id, d[i]).expect("registered");
        }
    }
    let real = registry.plan(cap);
    let bytes: Vec<f64> = (0..real.num_buckets()).map(|b| real.bucket_numel(b) as f64 * 4.0).collect();
    let membership: Vec<Vec<ParamId>> = (0..real.num_buckets()).map(|b| real.bucket_params(b).to_vec()).collect();
    let specs = real
        .param_ids()
        .iter()
        .map(|&p| ParamSpec {
            name: real.param_name(p).to_string(),
            numel: 1,
            dtype: DType::F32,
            expected_arrivals: real.expected_arrivals(p),
            unit: 0,
        })
        .collect();
    (Plan::from_layout(specs, membership, cap), bytes)
}

/// A policy in the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SimPolicy {
    Gradsync,
    NoSync,
    DdpStatic,
}

/// Step times (seconds) of `steps` consecutive simulated steps.
fn simulate(model: &ModelSpec, preset: &Preset, n: usize, cfg: &SimCfg, policy: SimPolicy, steps: u64) -> Vec<f64> {
    let (sched_times, compute) = model.backward_schedule(cfg.tflops, cfg.recompute, cfg.segment_layers);
    let mut counts = vec![0u32; model.params.len()];
    for &(_, p, _) in &sched_times {
        counts[p] += 1;
    }
    let cap = if policy == SimPolicy::NoSync { usize::MAX } else { cfg.bucket_cap };
    let declared = (policy == SimPolicy::DdpStatic).then_some(counts.as_slice());
    let (plan, bucket_bytes) = virtual_plan(model, cap, declared);
    let late_bytes: f64 =
        model.params.iter().zip(model.uses()).filter(|(_, u)| *u > 1).map(|(p, _)| p.numel as f64 * 4.0).sum();
    let plan = Arc::new(plan);
    let ids = plan.param_ids().to_vec();
    let (comm_tx, comm_rx) = crossbeam_channel::unbounded::<CommJob>();
    let cfg = ActorConfig {
        scheduler: SchedulerConfig {
            rank: 0,
            world: n,
            shards: 1,
            pieces: 1,
            divisor: Divisor::Contributors,
            policy: AbortPolicy::Skip,
            collective_timeout: Duration::from_secs(3600),
            check_finite: false,
            record_timeline: false,
            scale_when_packing: false,
            // The simulated plan is the model's own layout, kept as is.
            reorder: false,
            wire: Wire::F32,
            partitioned: false,
            buddy_stride: 0,
            joiner_waiting: None,
        },
        learning_window: 4,
        idle_spin: Duration::ZERO,
        recycle_payloads: false,
    };
    let actors = wire(&cfg, HostStore, Arc::clone(&plan), comm_tx).expect("host buckets always allocate");
    let (mut sched, mut inbox) = actors.scheduler;
    let (mut shard, _) = actors.shards.into_iter().next().expect("one shard");
    let mut times = Vec::new();
    for step in 0..steps {
        // Virtual-time events: (time, order, what). Earlier time first; arrivals before finish.
        #[derive(PartialEq, Eq, PartialOrd, Ord)]
        enum Ev {
            Arrive(usize),
            Finish,
            Done(u64),
        }
        let mut heap: BinaryHeap<std::cmp::Reverse<(u64, u64, Ev)>> = BinaryHeap::new();
        let ns = |s: f64| (s * 1e9) as u64;
        let defer = policy == SimPolicy::NoSync || (policy == SimPolicy::DdpStatic && step == 0);
        for (i, &(t, _, _)) in sched_times.iter().enumerate() {
            heap.push(std::cmp::Reverse((ns(if defer { compute } else { t }), i as u64, Ev::Arrive(i))));
        }
        heap.push(std::cmp::Reverse((ns(compute), u64::MAX, Ev::Finish)));
        let mut comm_free = 0u64;
        let mut in_flight: Vec<Option<CommJob>> = Vec::new();
        let (reply_tx, reply_rx) = std::sync::mpsc::sync_channel(1);
        let mut reply = Some(Reply::Blocking(reply_tx));
        let end = loop {
            let std::cmp::Reverse((now, _, ev)) = heap.pop().expect("the step ends before events run out");
            match ev {
                Ev::Arrive(i) => {
                    let (_, param, token) = sched_times[i];
                    let a = Arrival {
                        step,
                        param: ids[param],
                        token: Token(token),
                        payload: Payload::Increment(vec![1.0]),
                    };
                    shard.handle(ShardMsg::Arrival(a));
                }
                Ev::Finish => {
                    shard.handle(ShardMsg::Flush { step });
                    while let Ok(m) = inbox.try_recv() {
                        sched.handle(m);
                    }
                    let req = FinishRequest {
                        step,
                        end: StepEnd::Finish,
                        at: Instant::now(),
                        reply: reply.take().expect("one finish"),
                    };
                    sched.handle(SchedMsg::Finish(req));
                }
                Ev::Done(id) => {
                    let job = in_flight[id as usize].take().expect("job in flight");
                    let mut payload = job.payload;
                    if let CommPayload::Words(w) = &mut payload {
                        // The plan agreement (once, when step 0 begins) or a
                        // control vote, of n identical ranks.
                        let words_per_rank = if matches!(job.tag.kind, CollectiveKind::Plan { .. }) { 1 } else { 2 };
                        mirror_vote(w, n, words_per_rank);
                    }
                    let now_i = Instant::now();
                    sched.handle(SchedMsg::Done(CommDone {
                        tag: job.tag,
                        payload,
                        result: Ok(()),
                        started: now_i,
                        finished: now_i,
                    }));
                }
            }
            while let Ok(m) = inbox.try_recv() {
                sched.handle(m);
            }
            while let Ok(job) = comm_rx.try_recv() {
                let bytes = match job.tag.kind {
                    CollectiveKind::Bucket { index, .. } | CollectiveKind::Gather { index, .. } => bucket_bytes[index],
                    CollectiveKind::Correction { .. } => late_bytes,
                    CollectiveKind::Plan { len }
                    | CollectiveKind::Control { len }
                    | CollectiveKind::Reset { len }
                    | CollectiveKind::Order { len }
                    | CollectiveKind::Needs { len } => len as f64 * 8.0,
                    CollectiveKind::Norm { numel } => numel as f64 * 8.0,
                };
                let start = comm_free.max(now);
                comm_free = start + ns(preset.allreduce(bytes, n));
                in_flight.push(Some(job));
                heap.push(std::cmp::Reverse((comm_free, 0, Ev::Done(in_flight.len() as u64 - 1))));
            }
            if let Ok(result) = reply_rx.try_recv() {
                drop(result.expect("simulated step succeeds"));
                break now;
            }
        };
        while let Ok(m) = inbox.try_recv() {
            sched.handle(m); // the loan of the gradients comes home
        }
        times.push(end as f64 / 1e9);
    }
    times
}

/// Simulated step times at one rank count.
struct Row {
    ranks: usize,
    /// gradsync, steps 0..3 (learning), seconds.
    gradsync: Vec<f64>,
    no_sync: f64,
    /// ddp_static, steps 0..3 (the first without overlap).
    ddp_static: Vec<f64>,
    ideal: f64,
}

impl Row {
    fn steady(v: &[f64]) -> f64 {
        *v.last().expect("at least one step")
    }
}

#[derive(Debug, Clone)]
struct SimCfg {
    tflops: f64,
    recompute: bool,
    segment_layers: usize,
    bucket_cap: usize,
}

pub fn command(a: &SimArgs) -> Result<(), String> {
    let model = a.model.spec();
    let preset = match a.preset {
        PresetName::H100Nvlink => &PRESETS[0],
        PresetName::IbMultinode => &PRESETS[1],
    };
    let ranks: Vec<usize> = if a.ranks.is_empty() {
        (3..=10).map(|k| 1 << k).filter(|&r| r <= preset.max_ranks).collect()
    } else {
        a.ranks.clone()
    };
    if let Some(&r) = ranks.iter().find(|&&r| r > preset.max_ranks || r == 0) {
        return Err(format!("preset {} describes 1..={} ranks, not {r}", preset.name, preset.max_ranks));
    }
    let cfg = SimCfg {
        tflops: a.tflops,
        recompute: a.workload.recompute,
        segment_layers: a.workload.segment_layers,
        bucket_cap: a.workload.bucket_mb << 20,
    };
    let compute = model.backward_schedule(cfg.tflops, cfg.recompute, cfg.segment_layers).1;
    let total_bytes = model.numel() as f64 * 4.0;
    let mut rows = Vec::new();
    for &n in &ranks {
        let g = simulate(&model, preset, n, &cfg, SimPolicy::Gradsync, 3);
        let ns = simulate(&model, preset, n, &cfg, SimPolicy::NoSync, 1);
        let ds = simulate(&model, preset, n, &cfg, SimPolicy::DdpStatic, 3);
        let ideal = compute.max(preset.allreduce(total_bytes, n));
        rows.push(Row { ranks: n, gradsync: g, no_sync: ns[0], ddp_static: ds, ideal });
    }
    let sweep_n = *ranks.last().unwrap_or(&8);
    let sweep: Vec<(usize, f64)> = [1usize, 4, 16, 25, 64, 256]
        .iter()
        .map(|&mb| {
            let c = SimCfg { bucket_cap: mb << 20, ..cfg.clone() };
            (mb, *simulate(&model, preset, sweep_n, &c, SimPolicy::Gradsync, 3).last().unwrap())
        })
        .collect();
    let eff = |t: f64| compute / t;
    if a.workload.json {
        let per = |sel: &dyn Fn(&Row) -> f64| -> Vec<serde_json::Value> {
            rows.iter().map(|r| json!({"ranks": r.ranks, "step_s": sel(r), "efficiency": eff(sel(r))})).collect()
        };
        let out = json!({
            "simulated": true, "model": model.name, "preset": preset.name, "recompute": cfg.recompute,
            "tflops": cfg.tflops, "compute_s": compute,
            "policies": {
                "gradsync": per(&|r| Row::steady(&r.gradsync)), "no_sync": per(&|r| r.no_sync),
                "ddp_static": per(&|r| Row::steady(&r.ddp_static)), "ideal": per(&|r| r.ideal),
            },
            "bucket_sweep": {
                "ranks": sweep_n,
                "points": sweep.iter().map(|(mb, t)| json!({"bucket_mb": mb, "step_s": t})).collect::<Vec<_>>(),
            },
        });
        println!("{out}");
    } else {
        println!(
            "SIMULATED ({} cost model, not a measurement): {}, recompute {}, {:.0} TFLOP/s per device, backward {:.1} ms",
            preset.name, model.name, if cfg.recompute { "on" } else { "off" }, cfg.tflops, compute * 1e3
        );
        println!("scaling efficiency = backward compute / step time (steady state; gradsync's first step in brackets)");
        println!("{:>6} {:>18} {:>10} {:>12} {:>8}", "ranks", "gradsync", "no_sync", "ddp_static", "ideal");
        for r in &rows {
            println!(
                "{:>6} {:>8.3} [{:.3}] {:>10.3} {:>12.3} {:>8.3}",
                r.ranks,
                eff(Row::steady(&r.gradsync)),
                eff(r.gradsync[0]),
                eff(r.no_sync),
                eff(Row::steady(&r.ddp_static)),
                eff(r.ideal)
            );
        }
        println!("bucket-size sweep at {sweep_n} ranks (gradsync, steady state):");
        for (mb, t) in &sweep {
            println!("  {mb:>4} MB buckets: step {:.2} ms, efficiency {:.3}", t * 1e3, eff(*t));
        }
    }
    if let Some(path) = &a.svg {
        let series: Vec<(&str, Vec<(usize, f64)>)> = vec![
            ("no_sync", rows.iter().map(|r| (r.ranks, eff(r.no_sync))).collect()),
            ("ddp_static", rows.iter().map(|r| (r.ranks, eff(Row::steady(&r.ddp_static)))).collect()),
            ("ideal", rows.iter().map(|r| (r.ranks, eff(r.ideal))).collect()),
            ("gradsync", rows.iter().map(|r| (r.ranks, eff(Row::steady(&r.gradsync)))).collect()),
        ];
        let title = format!("SIMULATED scaling efficiency: {} on {}", model.name, preset.name);
        std::fs::write(path, svg(&title, &series)).map_err(|e| format!("--svg {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// A line chart of efficiency (0..1) against ranks (log2 axis).
fn svg(title: &str, series: &[(&str, Vec<(usize, f64)>)]) -> String {
    let (w, h, l, r, t, b) = (720.0, 420.0, 70.0, 150.0, 50.0, 50.0);
    let xs: Vec<f64> = series.iter().flat_map(|s| s.1.iter().map(|p| (p.0 as f64).log2())).collect();
    let (x0, x1) = (xs.iter().copied().fold(f64::INFINITY, f64::min), xs.iter().copied().fold(0.0, f64::max).max(1.0));
    let span = (x1 - x0).max(1.0);
    let px = |x: f64| l + (x - x0) / span * (w - l - r);
    let py = |y: f64| h - b - y.clamp(0.0, 1.0) * (h - t - b);
    let colors = ["#d62728", "#2ca02c", "#7f7f7f", "#1f77b4"];
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{l}\" y=\"25\" font-size=\"15\">{title}</text>\n");
    for k in 0..=4 {
        let y = k as f64 / 4.0;
        let (x2, yy, lx, ly) = (w - r, py(y), l - 8.0, py(y) + 4.0);
        s += &format!("<line x1=\"{l}\" x2=\"{x2}\" y1=\"{yy}\" y2=\"{yy}\" stroke=\"#ddd\"/><text x=\"{lx}\" y=\"{ly}\" text-anchor=\"end\">{y:.2}</text>\n");
    }
    let mut x = x0;
    while x <= x1 + 1e-9 {
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            px(x),
            h - b + 18.0,
            2f64.powf(x).round()
        );
        x += 1.0;
    }
    s += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">ranks</text>\n", (l + w - r) / 2.0, h - 10.0);
    s += &format!(
        "<text x=\"18\" y=\"{}\" transform=\"rotate(-90 18 {0})\" text-anchor=\"middle\">efficiency</text>\n",
        (t + h - b) / 2.0
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let path: Vec<String> =
            pts.iter().map(|(n, e)| format!("{:.1},{:.1}", px((*n as f64).log2()), py(*e))).collect();
        // Dashed lines stay visible where two policies coincide.
        let dash = if *name == "gradsync" { "" } else { " stroke-dasharray=\"7 4\"" };
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
            path.join(" ")
        );
        s += &format!(
            "<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"3\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">{name}</text>\n",
            w - r + 15.0,
            t + 20.0 * i as f64 + 6.0,
            w - r + 34.0,
            t + 20.0 * i as f64 + 11.0
        );
    }
    s + "</svg>\n"
}
