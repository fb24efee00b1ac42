//! Data-parallel training with candle on the local thread world, with
//! reentrant recompute and a tied embedding: the case that makes DDP raise
//! "Expected to mark a variable ready only once".
//!
//! ```text
//! cargo run --release --example train -- [--ranks 4] [--steps 300] [--mode overlap|no-sync|strict]
//!                                        [--recompute on|off] [--seed 7] [--batch 128]
//!                                        [--metrics-addr 127.0.0.1:9464] [--linger SECS] [--trace FILE]
//! ```
//!
//! `--metrics-addr` serves Prometheus metrics while training (loopback only);
//! `--linger` keeps the process, and so the endpoint, up after training;
//! `--trace` writes every rank's step timeline as Chrome trace JSON (Perfetto).
//!
//! Prints a line per step (mean loss over ranks, step time, what gradsync saw),
//! a summary, the activation memory kept with and without recompute, and last
//! `equivalence: max |param - reference| = … OK` against the same model trained
//! in one process on the whole batch (exit status 1 if it is not within tolerance).

mod data;
mod model;
mod session;

use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use model::ModelCfg;
use session::{max_abs_diff, Mode, StepLine, TrainCfg};

/// Tolerance of the equivalence check: the replicas sum gradients in a
/// different order than the reference (per-rank means, then the mean of
/// means), so they differ by float rounding, amplified a little by training.
const TOLERANCE: f32 = 1e-4;

fn usage() -> &'static str {
    "usage: train [--ranks N] [--steps N] [--mode overlap|no-sync|strict] [--recompute on|off] [--seed N] \
     [--batch N] [--metrics-addr ADDR] [--linger SECS] [--trace FILE]"
}

/// Settings of the run around the training itself.
struct RunOpts {
    metrics_addr: Option<std::net::SocketAddr>,
    linger: Duration,
    trace: Option<std::path::PathBuf>,
}

fn parse_args() -> Result<(TrainCfg, RunOpts), String> {
    let mut cfg = TrainCfg {
        ranks: 4,
        steps: 300,
        mode: Mode::Overlap,
        recompute: true,
        seed: 7,
        batch_per_rank: 128,
        model: ModelCfg { vocab: 48, dim: 64, hidden: 256, blocks: 4 },
        lr: 0.1,
        momentum: 0.9,
        bucket_cap_bytes: 256 << 10,
        record_timeline: false,
    };
    let mut opts = RunOpts { metrics_addr: None, linger: Duration::ZERO, trace: None };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value\n{}", usage()));
        let number = |v: String| v.parse::<u64>().map_err(|_| format!("{flag}: {v:?} is not a number"));
        match flag.as_str() {
            "--ranks" => cfg.ranks = number(value()?)?.max(1) as usize,
            "--steps" => cfg.steps = number(value()?)?,
            "--seed" => cfg.seed = number(value()?)?,
            "--batch" => cfg.batch_per_rank = number(value()?)?.max(1) as usize,
            "--mode" => {
                cfg.mode = match value()?.as_str() {
                    "overlap" => Mode::Overlap,
                    "no-sync" => Mode::NoSync,
                    "strict" => Mode::Strict,
                    other => return Err(format!("--mode: unknown mode {other:?}\n{}", usage())),
                }
            }
            "--recompute" => {
                cfg.recompute = match value()?.as_str() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--recompute: expected on or off, got {other:?}")),
                }
            }
            "--metrics-addr" => {
                let v = value()?;
                opts.metrics_addr = Some(v.parse().map_err(|_| format!("--metrics-addr: {v:?} is not HOST:PORT"))?);
            }
            "--linger" => opts.linger = Duration::from_secs(number(value()?)?),
            "--trace" => {
                opts.trace = Some(value()?.into());
                cfg.record_timeline = true;
            }
            "-h" | "--help" => return Err(usage().to_string()),
            other => return Err(format!("unknown flag {other:?}\n{}", usage())),
        }
    }
    Ok((cfg, opts))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> ExitCode {
    let (cfg, opts) = match parse_args() {
        Ok(parsed) => parsed,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
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
    if let Some(addr) = opts.metrics_addr {
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
        let (ranks, steps) = (cfg.ranks, cfg.steps);
        move || print_steps(rx, ranks, steps)
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
    if let Some(path) = &opts.trace {
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
    if !opts.linger.is_zero() {
        if let Some(addr) = opts.metrics_addr {
            println!("lingering {} s so http://{addr}/metrics can be scraped", opts.linger.as_secs());
        }
        std::thread::sleep(opts.linger);
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Print one line per step once every rank reported it; return the summary.
fn print_steps(rx: mpsc::Receiver<StepLine>, ranks: usize, steps: u64) -> (String, gradsync::ChromeTrace) {
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
        println!(
            "step {:>4}/{steps}  loss {loss:.4}  step {:>6.1} ms  exposed comm {:>5.2} ms  buckets overlapped {}/{}  \
             late {}  corrected {:?}",
            step + 1,
            ms(time),
            ms(r0.exposed_comm),
            r0.buckets_done_before_finish,
            r0.buckets_launched,
            r0.late_arrivals,
            r0.corrected.iter().map(|p| p.0).collect::<Vec<_>>()
        );
    }
    exposed.sort_by(f64::total_cmp);
    let median = exposed.get(exposed.len() / 2).copied().unwrap_or_default();
    let summary = format!(
        "summary: duplicates {dups}, late arrivals {late} (all ranks), steps with a correction {corrected_steps}, \
         buckets done before finish_step {overlapped}/{launched} (rank 0), exposed comm median {median:.2} ms"
    );
    (summary, trace)
}
