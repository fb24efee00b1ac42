//! A data-parallel training session on the local thread world, and the
//! single-process reference it must match.
//!
//! Each rank thread owns an identical replica and a slice of every global
//! batch; its backward hands gradients to gradsync as `Accumulated` payloads
//! (the rank's running `.grad`, like a post-accumulate-grad hook), one arrival
//! per segment that touched the parameter, token = the parameter's firing
//! index in the step (0, 1, …: the highest token is the most complete). After
//! `finish_step` every rank applies the averaged gradient with the same SGD
//! update as the reference, so all replicas and the reference stay equal up
//! to floating-point summation order.

use std::collections::HashSet;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradsync::{Divisor, GradSync, LocalWorld, StepReport, Token};

use crate::data::{Batch, MarkovTask};
use crate::model::{ActivationBytes, Model, ModelCfg};

/// How gradients reach the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// gradsync: every segment's gradients go out as soon as they exist.
    Overlap,
    /// The usual workaround: backward with no sync, then one fused all-reduce.
    NoSync,
    /// DDP's rule: a second arrival for a parameter in one step is an error.
    Strict,
}

/// Everything a session needs.
#[derive(Debug, Clone)]
pub struct TrainCfg {
    pub ranks: usize,
    pub steps: u64,
    pub mode: Mode,
    pub recompute: bool,
    pub seed: u64,
    pub batch_per_rank: usize,
    pub model: ModelCfg,
    pub lr: f32,
    pub momentum: f32,
    pub bucket_cap_bytes: usize,
    /// Record each step's timeline into the reports (for `--trace`).
    pub record_timeline: bool,
}

/// One rank's line for one step, sent to the printing thread.
#[derive(Debug, Clone)]
pub struct StepLine {
    pub step: u64,
    pub loss: f32,
    pub step_time: Duration,
    pub report: StepReport,
}

/// What a session produced.
#[derive(Debug, Clone)]
pub struct TrainOutput {
    /// Final parameters of every rank.
    pub params: Vec<Vec<Vec<f32>>>,
    /// Activation memory measured on rank 0 in the last step.
    pub activations: ActivationBytes,
}

/// What one rank returns: its final parameters and its activation measurements.
type RankOutput = Result<(Vec<Vec<f32>>, ActivationBytes), TrainError>;

/// Why a session failed.
#[derive(Debug)]
pub enum TrainError {
    /// A second arrival in strict mode (what DDP raises under recompute).
    ArrivedTwice {
        rank: usize,
        step: u64,
        param: String,
    },
    Sync(gradsync::SyncError),
    Candle(candle_core::Error),
}

impl std::fmt::Display for TrainError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrainError::ArrivedTwice { rank, step, param } => write!(
                f,
                "rank {rank}, step {step}: parameter '{param}' was marked ready twice. Strict mode rejects a \
                 second arrival, as DDP does (\"Expected to mark a variable ready only once\"); under reentrant \
                 recompute a shared weight fires once per use. Run with --mode overlap to accept it exactly."
            ),
            TrainError::Sync(e) => write!(f, "gradient sync failed: {e}"),
            TrainError::Candle(e) => write!(f, "model error: {e}"),
        }
    }
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        TrainError::Candle(e)
    }
}

impl From<gradsync::SyncError> for TrainError {
    fn from(e: gradsync::SyncError) -> Self {
        TrainError::Sync(e)
    }
}

/// Momentum SGD on flat vectors, shared by the ranks and the reference.
pub fn sgd(w: &mut [f32], v: &mut [f32], g: &[f32], lr: f32, momentum: f32) {
    for ((w, v), g) in w.iter_mut().zip(v.iter_mut()).zip(g) {
        *v = momentum * *v + g;
        *w -= lr * *v;
    }
}

fn task(cfg: &TrainCfg) -> MarkovTask {
    MarkovTask::new(cfg.model.vocab, 3, cfg.seed)
}

/// Run the data-parallel session; `lines` receives one [`StepLine`] per rank and step.
pub fn train(cfg: &TrainCfg, lines: mpsc::Sender<StepLine>) -> Result<TrainOutput, TrainError> {
    let probe = Model::new(cfg.model, cfg.seed)?;
    let mut builder = GradSync::builder();
    for i in 0..probe.len() {
        builder.param(probe.names[i].clone(), probe.numel(i), gradsync::DType::F32).expect("valid registration");
    }
    let cap = if cfg.mode == Mode::NoSync { usize::MAX } else { cfg.bucket_cap_bytes };
    builder
        .bucket_cap_bytes(cap)
        .divisor(Divisor::Contributors)
        .collective_timeout(Duration::from_secs(60))
        .record_timeline(cfg.record_timeline);
    let endpoints = LocalWorld::connect(cfg.ranks).expect("at least one rank");
    let syncs: Vec<GradSync> = endpoints.into_iter().map(|ep| builder.build(ep).expect("valid settings")).collect();
    let task = task(cfg);
    let results: Vec<RankOutput> = std::thread::scope(|s| {
        let handles: Vec<_> = syncs
            .into_iter()
            .enumerate()
            .map(|(rank, sync)| {
                let (task, lines) = (&task, lines.clone());
                s.spawn(move || run_rank(cfg, rank, sync, task, lines))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    });
    let mut params = Vec::new();
    let mut activations = ActivationBytes::default();
    for (rank, r) in results.into_iter().enumerate() {
        let (p, a) = r?;
        if rank == 0 {
            activations = a;
        }
        params.push(p);
    }
    Ok(TrainOutput { params, activations })
}

fn run_rank(
    cfg: &TrainCfg,
    rank: usize,
    mut sync: GradSync,
    task: &MarkovTask,
    lines: mpsc::Sender<StepLine>,
) -> RankOutput {
    let model = Model::new(cfg.model, cfg.seed)?;
    let hook = sync.hook();
    let ids = sync.param_ids().to_vec();
    let n = model.len();
    let mut velocity: Vec<Vec<f32>> = (0..n).map(|i| vec![0.0; model.numel(i)]).collect();
    // The averaged gradients are copied here every step: allocated once.
    let mut averaged: Vec<Vec<f32>> = (0..n).map(|i| vec![0.0; model.numel(i)]).collect();
    let mut activations = ActivationBytes::default();
    let global = cfg.batch_per_rank * cfg.ranks;
    for step in 0..cfg.steps {
        let t0 = Instant::now();
        let batch =
            task.batch(step, global, cfg.seed).slice(rank * cfg.batch_per_rank..(rank + 1) * cfg.batch_per_rank);
        // The rank's running `.grad` per parameter.
        let mut local: Vec<Option<Vec<f32>>> = vec![None; n];
        // Each parameter's firings so far this step: its next token.
        let mut fired = vec![0u64; n];
        let mut seen = HashSet::new();
        let mut failure: Option<TrainError> = None;
        let mut deliver = |p: usize, grad: Vec<f32>| {
            if failure.is_some() {
                return;
            }
            if cfg.mode == Mode::Strict && !seen.insert(p) {
                failure = Some(TrainError::ArrivedTwice { rank, step, param: model.names[p].clone() });
                return;
            }
            let acc = match &mut local[p] {
                Some(acc) => {
                    add_into(acc, &grad);
                    acc
                }
                slot @ None => slot.insert(grad),
            };
            if cfg.mode != Mode::NoSync {
                // Hook refusals are counted in the step report; none are expected here.
                let _ = hook.accumulated(step, ids[p], Token(fired[p]), acc.clone());
            }
            fired[p] += 1;
        };
        let loss = if cfg.recompute {
            let (loss, mem) = model.recompute_backward(&batch, |_segment, grads| {
                for (p, g) in grads {
                    deliver(p, g);
                }
            })?;
            activations = mem;
            loss
        } else {
            let (loss, grads, kept) = model.full_backward(&batch)?;
            activations.full = kept;
            for (p, g) in grads.into_iter().enumerate().rev() {
                deliver(p, g);
            }
            loss
        };
        if let Some(e) = failure {
            return Err(e);
        }
        if cfg.mode == Mode::NoSync {
            // One fused all-reduce after backward: every gradient now, one bucket.
            for (p, g) in local.into_iter().enumerate().rev() {
                let g = g.unwrap_or_else(|| vec![0.0; model.numel(p)]);
                let _ = hook.accumulated(step, ids[p], Token(0), g);
            }
        }
        let result = sync.finish_step(step)?;
        let grads = result.gradients.as_ref().expect("no rank aborts in this example");
        let mut values = model.values()?;
        for (p, w) in values.iter_mut().enumerate() {
            if grads.copy_into(ids[p], &mut averaged[p]) {
                sgd(w, &mut velocity[p], &averaged[p], cfg.lr, cfg.momentum);
            }
        }
        for (p, w) in values.into_iter().enumerate() {
            model.set(p, w)?;
        }
        let report = result.report.clone();
        let _ = lines.send(StepLine { step, loss, step_time: t0.elapsed(), report });
    }
    Ok((model.values()?, activations))
}

fn add_into(acc: &mut [f32], g: &[f32]) {
    for (a, x) in acc.iter_mut().zip(g) {
        *a += x;
    }
}

/// The same model trained in one process on the whole batch with a plain full
/// backward. Returns the final parameters and the loss of every step.
pub fn reference(cfg: &TrainCfg) -> Result<(Vec<Vec<f32>>, Vec<f32>), TrainError> {
    let model = Model::new(cfg.model, cfg.seed)?;
    let task = task(cfg);
    let mut velocity: Vec<Vec<f32>> = (0..model.len()).map(|i| vec![0.0; model.numel(i)]).collect();
    let mut losses = Vec::new();
    for step in 0..cfg.steps {
        let batch: Batch = task.batch(step, cfg.batch_per_rank * cfg.ranks, cfg.seed);
        let (loss, grads, _) = model.full_backward(&batch)?;
        losses.push(loss);
        let mut values = model.values()?;
        for (p, w) in values.iter_mut().enumerate() {
            sgd(w, &mut velocity[p], &grads[p], cfg.lr, cfg.momentum);
        }
        for (p, w) in values.into_iter().enumerate() {
            model.set(p, w)?;
        }
    }
    Ok((model.values()?, losses))
}

/// Largest element-wise difference between two parameter sets.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}
