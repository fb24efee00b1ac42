//! gradsync's benchmark binary (feature `sim`, for the simulator's door).
//!
//! ```text
//! cargo run --release --features sim --bin gradsync-bench -- overlap [--model bert-large|gpt2|resnet50]
//!     [--world 4] [--tflops X] [--steps 6] [--recompute] [--segment-layers 2] [--bucket-mb 25] [--json]
//! cargo run --release --features sim --bin gradsync-bench -- sim [--model ...] [--preset h100-nvlink|ib-multinode]
//!     [--ranks 8,16,...,1024] [--bucket-mb 25] [--recompute] [--json] [--svg FILE]
//! cargo run --release --features sim --bin gradsync-bench -- hooks
//! cargo run --release --features sim --bin gradsync-bench -- allreduce [--mib 64] [--world 4]
//! cargo run --release --features sim --bin gradsync-bench -- membership [--members 8,64,512,4096]
//!     [--latency-ms 0.2,2] [--healthy-s 3] [--json]
//! ```
//!
//! Every comparison is measured in one run, interleaved, and printed as a ratio.

mod allreduce;
mod hooks;
mod membership;
mod models;
mod overlap;
mod sim;

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use models::ModelSpec;
use serde_json::json;

/// Benchmarks of gradsync: overlap against its peers' policies, the
/// simulator, the hook path, the local all-reduce and the membership protocol.
#[derive(Debug, Parser)]
#[command(name = "gradsync-bench")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// A training step emulated on the local world (compute slept), per policy.
    Overlap(OverlapArgs),
    /// SIMULATED scaling: the real scheduler on a virtual clock and a cost model.
    Sim(sim::SimArgs),
    /// Hook path: arrival throughput and hook-to-launch latency.
    Hooks,
    /// The local all-reduce against memcpy of the same bytes.
    Allreduce(allreduce::AllreduceArgs),
    /// The membership protocol at a job's size: real monitors and agreements on one store.
    Membership(membership::MembershipArgs),
}

/// A model with real parameter shapes.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelName {
    /// BERT-large with its pre-training heads (tied MLM decoder).
    BertLarge,
    /// GPT-2 124M with the LM head tied to the token embedding.
    Gpt2,
    /// ResNet-50.
    Resnet50,
}

impl ModelName {
    fn spec(self) -> ModelSpec {
        match self {
            ModelName::BertLarge => models::bert_large(),
            ModelName::Gpt2 => models::gpt2(),
            ModelName::Resnet50 => models::resnet50(),
        }
    }
}

/// What `overlap` and `sim` share: how backward runs, how it is bucketed,
/// and how the result is printed.
#[derive(Debug, clap::Args)]
pub struct Workload {
    /// Reentrant recompute: segment by segment, a tied weight arrives twice.
    #[arg(long)]
    pub recompute: bool,
    /// Layers per recompute segment.
    #[arg(long, default_value_t = 2)]
    pub segment_layers: usize,
    /// Bucket cap in MiB.
    #[arg(long, default_value_t = 25)]
    pub bucket_mb: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Settings of `overlap`.
#[derive(Debug, clap::Args)]
struct OverlapArgs {
    /// The model whose parameter shapes and FLOPs are emulated.
    #[arg(long, value_enum, default_value = "bert-large")]
    model: ModelName,
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    world: u64,
    /// Emulated device rate in TFLOP/s (default: calibrated so compute ≈ communication).
    #[arg(long)]
    tflops: Option<f64>,
    /// Steps per policy.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    #[command(flatten)]
    workload: Workload,
}

fn main() -> ExitCode {
    let result = match Cli::parse().cmd {
        Cmd::Overlap(args) => cmd_overlap(&args),
        Cmd::Sim(args) => sim::command(&args),
        Cmd::Hooks => cmd_hooks(),
        Cmd::Allreduce(args) => allreduce::command(&args),
        Cmd::Membership(args) => membership::command(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn cmd_overlap(a: &OverlapArgs) -> Result<(), String> {
    let cfg = overlap::OverlapCfg {
        model: a.model.spec(),
        world: a.world as usize,
        tflops: a.tflops,
        steps: a.steps as usize,
        recompute: a.workload.recompute,
        segment_layers: a.workload.segment_layers,
        bucket_cap_bytes: a.workload.bucket_mb << 20,
    };
    eprintln!(
        "overlap: {} ({} params, {} MB of f32 gradients), world {}, recompute {}, {} steps per policy",
        cfg.model.name,
        cfg.model.numel(),
        (cfg.model.numel() * 4) >> 20,
        cfg.world,
        if cfg.recompute { "on" } else { "off" },
        cfg.steps
    );
    let rep = overlap::run(&cfg);
    let no_sync = rep.results.iter().find(|(p, _)| *p == overlap::Policy::NoSync).map(|(_, r)| r.step_median());
    if a.workload.json {
        let mut policies = serde_json::Map::new();
        for (p, r) in &rep.results {
            policies.insert(
                p.name().into(),
                json!({"step_s_median": r.step_median(), "exposed_comm_s_median": r.exposed_median(), "step_s": r.step_s}),
            );
        }
        policies.insert("ideal".into(), json!({"step_s_median": rep.ideal_s}));
        let out = json!({
            "model": cfg.model.name, "world": cfg.world, "recompute": cfg.recompute,
            "tflops": rep.tflops, "compute_s": rep.compute_s, "policies": policies,
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "{} on {} local ranks, recompute {}, emulated device {:.3} TFLOP/s: backward compute {:.3} s per step",
        cfg.model.name,
        cfg.world,
        if cfg.recompute { "on" } else { "off" },
        rep.tflops,
        rep.compute_s
    );
    println!(
        "{:<12} {:>14} {:>12} {:>20} {:>14}",
        "policy", "step median", "vs no_sync", "exposed comm median", "first step"
    );
    for (p, r) in &rep.results {
        let ratio = no_sync.map_or(f64::NAN, |n| r.step_median() / n);
        println!(
            "{:<12} {:>12.3} s {:>11.2}x {:>18.3} s {:>12.3} s",
            p.name(),
            r.step_median(),
            ratio,
            r.exposed_median(),
            r.step_s[0]
        );
    }
    let ratio = no_sync.map_or(f64::NAN, |n| rep.ideal_s / n);
    println!("{:<12} {:>12.3} s {:>11.2}x   (bound: max(compute, fused all-reduce))", "ideal", rep.ideal_s, ratio);
    Ok(())
}

fn cmd_hooks() -> Result<(), String> {
    // Latency is measured without and with the actors' idle spin (GradSyncBuilder::idle_spin).
    println!("arrival throughput (1-rank world, one arrival per parameter, hook call to finish_step):");
    for params in [100, 1_000, 10_000] {
        let rate = hooks::throughput(params, 31);
        println!("  {params:>6} parameters: {:>6.2} M arrivals/s (median of 31 steps)", rate / 1e6);
    }
    for spin_us in [0u64, 100] {
        let lat = hooks::hook_to_launch(40, std::time::Duration::from_micros(spin_us));
        let pct = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize];
        println!(
            "hook-to-launch latency, idle_spin {spin_us} µs ({} samples): p50 {:?}  p90 {:?}  p99 {:?}  max {:?}",
            lat.len(),
            pct(0.5),
            pct(0.9),
            pct(0.99),
            lat.last().copied().unwrap_or_default()
        );
    }
    Ok(())
}
