//! Data-parallel training with candle on the local thread world, with
//! reentrant recompute and a tied embedding: the case that makes DDP raise
//! "Expected to mark a variable ready only once".
//!
//! ```text
//! cargo run --release --example train -- [--ranks 4] [--steps 300] [--mode overlap|no-sync|strict]
//!                                        [--recompute on|off] [--seed 7] [--batch 128] [--log-every 25]
//!                                        [--metrics-addr 127.0.0.1:9464] [--linger SECS] [--trace FILE]
//! ```
//!
//! `--metrics-addr` serves Prometheus metrics while training (loopback only);
//! `--linger` keeps the process, and so the endpoint, up after training;
//! `--trace` writes every rank's step timeline as Chrome trace JSON (Perfetto).
//!
//! Prints a line every `--log-every` steps (mean loss over ranks, step time,
//! what gradsync saw) with a progress bar in between (on a terminal), a
//! summary, the activation memory kept with and without recompute, and last
//! `equivalence: max |param - reference| = … OK` against the same model trained
//! in one process on the whole batch (exit status 1 if it is not within tolerance).

mod data;
mod model;
mod session;

use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use model::ModelCfg;
use session::{max_abs_diff, Mode, StepLine, TrainCfg};

/// Tolerance of the equivalence check: the replicas sum gradients in a
/// different order than the reference (per-rank means, then the mean of
/// means), so they differ by float rounding, amplified a little by training.
const TOLERANCE: f32 = 1e-4;

/// How gradients reach the all-reduce.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    /// gradsync: every segment's gradients go out as soon as they exist.
    Overlap,
    /// The usual workaround: backward with no sync, then one fused all-reduce.
    NoSync,
    /// DDP's rule: a second arrival for a parameter in one step is an error.
    Strict,
}

/// Whether backward recomputes segment by segment.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum OnOff {
    On,
    Off,
}

/// Data-parallel training of a small decoder with a tied embedding on
/// threads of this process, checked against a one-process reference.
#[derive(Debug, Parser)]
#[command(name = "train")]
struct Args {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    ranks: u64,
    /// Training steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// How gradients reach the all-reduce.
    #[arg(long, value_enum, default_value = "overlap")]
    mode: ModeArg,
    /// Reentrant recompute (segment by segment) or a full backward.
    #[arg(long, value_enum, default_value = "on")]
    recompute: OnOff,
    /// Seed of the weights and the data.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Print a step line every N steps (and the first and last step).
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: u64,
    /// Serve Prometheus metrics at this loopback address while training.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Keep the process (and the metrics endpoint) up this many seconds after training.
    #[arg(long, default_value_t = 0)]
    linger: u64,
    /// Write every rank's step timeline as Chrome trace JSON to this file.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

impl Args {
    fn train_cfg(&self) -> TrainCfg {
        TrainCfg {
            ranks: self.ranks as usize,
            steps: self.steps,
            mode: match self.mode {
                ModeArg::Overlap => Mode::Overlap,
                ModeArg::NoSync => Mode::NoSync,
                ModeArg::Strict => Mode::Strict,
            },
            recompute: matches!(self.recompute, OnOff::On),
            seed: self.seed,
            batch_per_rank: self.batch as usize,
            model: ModelCfg { vocab: 48, dim: 64, hidden: 256, blocks: 4 },
            lr: 0.1,
            momentum: 0.9,
            bucket_cap_bytes: 256 << 10,
            record_timeline: self.trace.is_some(),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = args.train_cfg();
    let m = cfg.model;
    println!(
        "gradsync train: {} ranks (local thread world), mode {:?}, recompute {}, {} steps, batch {}x{}, \
         model vocab {} dim {} hidden {} blocks {} (tied embedding)",
        cfg.ranks,
        cfg.mode,
        if cfg.recompute { "on" } else { "off" },
        cfg.steps,
        cfg.ranks,
        cfg.batch_per_rank,
        m.vocab,
        m.dim,
        m.hidden,
        m.blocks
    );
    if let Some(addr) = args.metrics_addr {
        match gradsync::metrics::install_prometheus(addr, false) {
            Ok(_) => println!("metrics: http://{addr}/metrics"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let (tx, rx) = mpsc::channel::<StepLine>();
    let printer = std::thread::spawn({
        let (ranks, steps, every) = (cfg.ranks, cfg.steps, args.log_every);
        move || print_steps(rx, ranks, steps, every)
    });
    let started = std::time::Instant::now();
    let out = session::train(&cfg, tx);
    let (totals, trace) = printer.join().expect("printer thread");
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("trained in {:.1} s", started.elapsed().as_secs_f64());
    println!("{totals}");
    if let Some(path) = &args.trace {
        let written = std::fs::File::create(path).and_then(|f| trace.write_json(std::io::BufWriter::new(f)));
        match written {
            Ok(()) => println!(
                "timeline: {} events written to {} (open in https://ui.perfetto.dev)",
                trace.len(),
                path.display()
            ),
            Err(e) => eprintln!("warning: could not write the timeline to {}: {e}", path.display()),
        }
    }
    let a = out.activations;
    if cfg.recompute {
        println!(
            "activation memory kept from forward: {} B with recompute (segment inputs; peak {} B while one \
             segment is recomputed) vs {} B for a full backward",
            a.boundaries, a.segment_peak, a.full
        );
    } else {
        println!("activation memory kept from forward: {} B (full backward, no recompute)", a.full);
    }
    let spread = out.params.iter().map(|p| max_abs_diff(p, &out.params[0])).fold(0.0, f32::max);
    println!("replicas: max |param_r - param_0| = {spread:e}");
    let (reference, losses) = match session::reference(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error in the reference run: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
        println!("reference (one process, whole batch, full backward): loss {first:.4} -> {last:.4}");
    }
    let diff = max_abs_diff(&out.params[0], &reference);
    let ok = diff <= TOLERANCE && spread == 0.0;
    println!(
        "equivalence: max |param - reference| = {diff:e} (tolerance {TOLERANCE:e}) {}",
        if ok { "OK" } else { "FAILED" }
    );
    if args.linger > 0 {
        if let Some(addr) = args.metrics_addr {
            println!("lingering {} s so http://{addr}/metrics can be scraped", args.linger);
        }
        std::thread::sleep(Duration::from_secs(args.linger));
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Print a line every `every` steps once every rank reported it, with a
/// progress bar between them (drawn only on a terminal); return the summary.
fn print_steps(rx: mpsc::Receiver<StepLine>, ranks: usize, steps: u64, every: u64) -> (String, gradsync::ChromeTrace) {
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps, {elapsed} elapsed, eta {eta}")
            .expect("a valid template"),
    );
    let mut trace = gradsync::ChromeTrace::new();
    let mut pending: std::collections::BTreeMap<u64, Vec<StepLine>> = Default::default();
    let (mut dups, mut late, mut corrected_steps, mut overlapped, mut launched) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut exposed = Vec::new();
    for line in rx {
        let step = line.step;
        let group = pending.entry(step).or_default();
        group.push(line);
        if group.len() < ranks {
            continue;
        }
        let group = pending.remove(&step).expect("group present");
        for l in &group {
            trace.add(&l.report);
        }
        let loss = group.iter().map(|l| l.loss).sum::<f32>() / ranks as f32;
        let time = group.iter().map(|l| l.step_time).max().unwrap_or_default();
        let r0 = &group[0].report;
        dups += group.iter().map(|l| l.report.duplicates).sum::<u64>();
        late += group.iter().map(|l| l.report.late_arrivals).sum::<u64>();
        corrected_steps += u64::from(r0.corrections > 0);
        overlapped += u64::from(r0.buckets_done_before_finish);
        launched += u64::from(r0.buckets_launched);
        exposed.push(ms(r0.exposed_comm));
        bar.inc(1);
        if step % every != 0 && step + 1 != steps {
            continue;
        }
        // `suspend` prints whether or not the bar is drawn (it is not off a terminal).
        let line = format!(
            "step {:>4}/{steps}  loss {loss:.4}  step {:>6.1} ms  exposed comm {:>5.2} ms  buckets overlapped {}/{}  \
             late {}  corrected {:?}",
            step + 1,
            ms(time),
            ms(r0.exposed_comm),
            r0.buckets_done_before_finish,
            r0.buckets_launched,
            r0.late_arrivals,
            r0.corrected.iter().map(|p| p.index()).collect::<Vec<_>>()
        );
        bar.suspend(|| println!("{line}"));
    }
    bar.finish_and_clear();
    exposed.sort_by(f64::total_cmp);
    let median = exposed.get(exposed.len() / 2).copied().unwrap_or_default();
    let summary = format!(
        "summary: duplicates {dups}, late arrivals {late} (all ranks), steps with a correction {corrected_steps}, \
         buckets done before finish_step {overlapped}/{launched} (rank 0), exposed comm median {median:.2} ms"
    );
    (summary, trace)
}
