//! Data-parallel training with candle on the local thread world, with
//! reentrant recompute and a tied embedding: the case that makes DDP raise
//! "Expected to mark a variable ready only once".
//!
//! ```text
//! cargo run --release --example train -- [--ranks 4] [--steps 300] [--mode overlap|no-sync|strict]
//!                                        [--recompute on|off] [--seed 7] [--batch 128]
//! ```
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
    "usage: train [--ranks N] [--steps N] [--mode overlap|no-sync|strict] [--recompute on|off] [--seed N] [--batch N]"
}

fn parse_args() -> Result<TrainCfg, String> {
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
    };
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
            "-h" | "--help" => return Err(usage().to_string()),
            other => return Err(format!("unknown flag {other:?}\n{}", usage())),
        }
    }
    Ok(cfg)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> ExitCode {
    let cfg = match parse_args() {
        Ok(cfg) => cfg,
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
    let (tx, rx) = mpsc::channel::<StepLine>();
    let printer = std::thread::spawn({
        let (ranks, steps) = (cfg.ranks, cfg.steps);
        move || print_steps(rx, ranks, steps)
    });
    let started = std::time::Instant::now();
    let out = session::train(&cfg, tx);
    let totals = printer.join().expect("printer thread");
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("trained in {:.1} s", started.elapsed().as_secs_f64());
    println!("{totals}");
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
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Print one line per step once every rank reported it; return the summary.
fn print_steps(rx: mpsc::Receiver<StepLine>, ranks: usize, steps: u64) -> String {
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
    format!(
        "summary: duplicates {dups}, late arrivals {late} (all ranks), steps with a correction {corrected_steps}, \
         buckets done before finish_step {overlapped}/{launched} (rank 0), exposed comm median {median:.2} ms"
    )
}
