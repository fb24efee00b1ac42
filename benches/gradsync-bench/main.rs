//! gradsync's benchmark binary.
//!
//! ```text
//! cargo run --release --bin gradsync-bench -- overlap [--model bert-large|gpt2|resnet50] [--world 4]
//!     [--tflops auto|X] [--steps 6] [--recompute] [--segment-layers 2] [--bucket-mb 25] [--json]
//! cargo run --release --bin gradsync-bench -- sim [--model ...] [--preset h100-nvlink|ib-multinode]
//!     [--ranks 8,16,...,1024] [--bucket-mb 25] [--recompute] [--json] [--svg FILE]
//! cargo run --release --bin gradsync-bench -- hooks
//! cargo run --release --bin gradsync-bench -- allreduce [--mib 64] [--world 4]
//! ```
//!
//! Every comparison is measured in one run, interleaved, and printed as a ratio.

mod allreduce;
mod hooks;
mod models;
mod overlap;
mod sim;

use std::process::ExitCode;

use models::ModelSpec;

const USAGE: &str = "usage: gradsync-bench <overlap|sim|hooks|allreduce> [options]  (see --help of each)";

/// Flags as `--name value` pairs or bare `--switch`es.
struct Flags(Vec<String>);

impl Flags {
    fn value(&self, name: &str) -> Option<&str> {
        self.0.iter().position(|a| a == name).and_then(|i| self.0.get(i + 1)).map(String::as_str)
    }
    fn has(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }
    fn parse<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.value(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("{name}: cannot parse {v:?}")),
        }
    }
    fn model(&self) -> Result<ModelSpec, String> {
        let name = self.value("--model").unwrap_or("bert-large");
        ModelSpec::by_name(name).ok_or(format!("--model: unknown model {name:?} (bert-large, gpt2, resnet50)"))
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().cloned() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let flags = Flags(args[1..].to_vec());
    let result = match cmd.as_str() {
        "overlap" => cmd_overlap(&flags),
        "sim" => sim::command(&flags),
        "hooks" => cmd_hooks(),
        "allreduce" => allreduce::command(&flags),
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn cmd_overlap(f: &Flags) -> Result<(), String> {
    let tflops = match f.value("--tflops") {
        None | Some("auto") => None,
        Some(v) => Some(v.parse::<f64>().map_err(|_| format!("--tflops: {v:?} is not a number"))?),
    };
    let cfg = overlap::OverlapCfg {
        model: f.model()?,
        world: f.parse("--world", 4usize)?.max(1),
        tflops,
        steps: f.parse("--steps", 6usize)?.max(1),
        recompute: f.has("--recompute"),
        segment_layers: f.parse("--segment-layers", 2usize)?,
        bucket_cap_bytes: f.parse("--bucket-mb", 25usize)? << 20,
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
    if f.has("--json") {
        let mut policies: Vec<String> = rep
            .results
            .iter()
            .map(|(p, r)| {
                format!(
                    "\"{}\": {{\"step_s_median\": {:.6}, \"exposed_comm_s_median\": {:.6}, \"step_s\": {:?}}}",
                    p.name(),
                    r.step_median(),
                    r.exposed_median(),
                    r.step_s
                )
            })
            .collect();
        policies.push(format!("\"ideal\": {{\"step_s_median\": {:.6}}}", rep.ideal_s));
        println!(
            "{{\"model\": \"{}\", \"world\": {}, \"recompute\": {}, \"tflops\": {:.4}, \"compute_s\": {:.6}, \"policies\": {{{}}}}}",
            cfg.model.name,
            cfg.world,
            cfg.recompute,
            rep.tflops,
            rep.compute_s,
            policies.join(", ")
        );
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
