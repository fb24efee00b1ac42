//! The bucket scheduler: the only place that decides what is launched and when.
//!
//! It owns the bucket buffers and the per-step bucket state. Inputs arrive on
//! one inbox ([`SchedMsg`]): `Ready` values from the parameter actors, `Flushed`
//! summaries, the caller's `Finish`, `Done` from the communicator thread, and the
//! buffers coming home when the caller drops its [`crate::Gradients`].
//!
//! ```text
//!  Ready(first) ─▶ pack into slot ─▶ bucket pending -= 1 ─▶ launch buckets in plan order
//!  Ready(extra) ─▶ bucket not launched? merge into slot : keep as late contribution
//!  Flushed × shards + Finish ─▶ close: unused → zeros, launch the rest   (finish.rs)
//!  all data Done ─▶ control collective ─▶ correction collective? ─▶ StepResult
//! ```
//!
//! Ordering invariant: every rank hands the communicator the same sequence
//! (data buckets strictly in plan order, then control, then an optional
//! correction decided by the *summed* control words), whatever order its
//! gradients arrived in. That is what makes dedup, late arrivals and aborts
//! safe on transports that match collectives by order (NCCL).
//!
//! The state machine is synchronous ([`Scheduler::handle`]); [`Scheduler::run`]
//! drives it from a tokio task.

mod control;
mod finish;

pub use control::{ControlVerdict, ControlVote};

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::arrival::{ParamId, PayloadKind, Step};
use crate::bucket_buf::WriteMode;
use crate::comm::{CommJob, CommPayload};
use crate::error::{AllocError, CollectiveKind, CollectiveTag, SyncError};
use crate::messages::{FinishRequest, Reply, SchedMsg, ShardSummary};
use crate::report::Progress;
use crate::store::{GradStore, HostStore};
use crate::telemetry::{Lane, TimelineEvent};

/// Fixed settings of one scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Number of parameter-shard actors feeding this scheduler.
    pub shards: usize,
    /// Pieces per bucket buffer (the transport's preference).
    pub pieces: usize,
    /// Scale applied to reduced sums: `1 / divisor`.
    pub factor: f32,
    /// How long one collective may wait for its peers.
    pub collective_timeout: Duration,
    /// Skip the step on every rank when any rank's gradient holds NaN or Inf.
    pub check_finite: bool,
    /// Record a per-step timeline into each report.
    pub record_timeline: bool,
}

/// Where a step is in its finish protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Backward running: buckets launch as they fill.
    Open,
    /// Finish requested and every shard flushed: remaining buckets launched, waiting for them.
    Draining,
    /// The control collective is in flight.
    Control,
    /// The correction collective is in flight.
    Correcting,
}

/// A failure that ended a step; later steps report it as [`SyncError::Poisoned`].
#[derive(Debug, Clone)]
struct Failure {
    step: Step,
    error: SyncError,
}

/// Bucket and parameter state of the open step.
#[derive(Debug)]
struct StepState<S: GradStore> {
    step: Step,
    /// Whether step-start work (pre-ready parameters) is done.
    begun: bool,
    phase: Phase,
    /// Per parameter: its ready value has been packed (or none is expected).
    ready: Vec<bool>,
    /// Per parameter: its slot holds this step's data (otherwise zeroed at launch).
    written: Vec<bool>,
    /// Per parameter: payload kind seen this step.
    kind: Vec<Option<PayloadKind>>,
    /// Per parameter: the `Accumulated` value packed into the slot, kept so a
    /// late supersede can be turned into a difference.
    packed: Vec<Option<S::Values>>,
    /// Per parameter: late contribution (sum of late increments, or the latest
    /// late `Accumulated` value).
    late: Vec<Option<S::Values>>,
    /// Per bucket: members not ready yet.
    pending: Vec<usize>,
    /// Buckets `0..next_launch` have been handed to the communicator.
    next_launch: usize,
    /// Data buckets whose all-reduce returned.
    done: usize,
    done_before_finish: u32,
    late_arrivals: u64,
    /// Shards that flushed this step, and what they reported.
    flushed: usize,
    arrivals: u64,
    duplicates: u64,
    rejected: u64,
    rejections: Vec<crate::error::Rejection>,
    /// A NaN or Inf was packed this step (only checked with `check_finite`).
    nonfinite: bool,
    used: Vec<bool>,
    expect_none_next: Vec<bool>,
    finish: Option<FinishRequest<S>>,
    bytes: u64,
    comm_busy: Duration,
    /// Late parameters being corrected, with their offset in the correction buffer.
    correcting: Vec<(ParamId, usize)>,
    unused_everywhere: Vec<bool>,
    /// When the step's first message arrived.
    began_at: Option<Instant>,
    /// Per bucket: when its first value was packed.
    fill_started: Vec<Option<Instant>>,
    /// Events of this step (only with `record_timeline`).
    timeline: Vec<TimelineEvent>,
}

impl<S: GradStore> StepState<S> {
    fn new(step: Step, num_params: usize, num_buckets: usize) -> Self {
        StepState {
            step,
            begun: false,
            phase: Phase::Open,
            ready: vec![false; num_params],
            written: vec![false; num_params],
            kind: vec![None; num_params],
            packed: std::iter::repeat_with(|| None).take(num_params).collect(),
            late: std::iter::repeat_with(|| None).take(num_params).collect(),
            pending: vec![0; num_buckets],
            next_launch: 0,
            done: 0,
            done_before_finish: 0,
            late_arrivals: 0,
            flushed: 0,
            arrivals: 0,
            duplicates: 0,
            rejected: 0,
            rejections: Vec::new(),
            nonfinite: false,
            used: vec![false; num_params],
            expect_none_next: vec![false; num_params],
            finish: None,
            bytes: 0,
            comm_busy: Duration::ZERO,
            correcting: Vec::new(),
            unused_everywhere: vec![false; num_params],
            began_at: None,
            fill_started: vec![None; num_buckets],
            timeline: Vec::new(),
        }
    }
}

/// The bucket-scheduler actor of one rank.
#[derive(Debug)]
pub struct Scheduler<S: GradStore = HostStore> {
    cfg: SchedulerConfig,
    /// Packs, zeroes and combines gradient values (host loops or device kernels).
    store: S,
    plan: Arc<crate::plan::Plan>,
    /// Jobs for the communicator thread.
    comm: Sender<CommJob<S>>,
    /// This actor's own inbox, handed to [`crate::Gradients`] so buffers come home.
    home: UnboundedSender<SchedMsg<S>>,
    /// Bucket buffers by bucket index; `None` while in a collective or on loan.
    buffers: Vec<Option<S::Bucket>>,
    /// The step whose gradients the caller still holds.
    loaned: Option<Step>,
    /// Messages of a later step, held until the current one completes and its
    /// loan is returned.
    deferred: VecDeque<SchedMsg<S>>,
    /// Per parameter: treat as ready (zeros) at step start.
    expect_none: Vec<bool>,
    /// Progress requests: settled shard count and the waiting reply.
    settles: HashMap<u64, (usize, Option<Reply<Progress>>)>,
    failure: Option<Failure>,
    /// This rank as a metric label.
    rank_label: String,
    /// Where consumed payload vectors go for reuse by the caller (opt-in).
    spent: Option<Sender<(ParamId, S::Values)>>,
    /// A reset in progress: its agreement collective is in flight.
    resetting: Option<Reply<Result<Step, SyncError>>>,
    state: StepState<S>,
}

impl<S: GradStore> Scheduler<S> {
    /// A scheduler for `plan` packing with `store`; allocates the bucket buffers once.
    pub fn new(
        cfg: SchedulerConfig,
        store: S,
        plan: Arc<crate::plan::Plan>,
        comm: Sender<CommJob<S>>,
        home: UnboundedSender<SchedMsg<S>>,
    ) -> Result<Self, AllocError> {
        let mut buffers = Vec::with_capacity(plan.buckets.len());
        for b in &plan.buckets {
            buffers.push(Some(store.alloc_bucket(b.numel, cfg.pieces)?));
        }
        let expect_none = plan.params.iter().map(|p| p.expected_arrivals == Some(0)).collect();
        let state = StepState::new(0, plan.num_params(), plan.buckets.len());
        let rank_label = cfg.rank.to_string();
        crate::telemetry::plan(&rank_label, plan.buckets.len(), plan.bucket_bytes());
        crate::telemetry::trace_epoch();
        Ok(Scheduler {
            rank_label,
            cfg,
            store,
            plan,
            comm,
            home,
            buffers,
            loaned: None,
            deferred: VecDeque::new(),
            expect_none,
            settles: HashMap::new(),
            failure: None,
            resetting: None,
            spent: None,
            state,
        })
    }

    /// Send payload vectors the scheduler no longer needs to `spent` instead of
    /// freeing them, so a caller can reuse them (a bounded channel: when it is
    /// full, vectors are freed as usual).
    pub fn with_spent_payloads(mut self, spent: Sender<(ParamId, S::Values)>) -> Self {
        self.spent = Some(spent);
        self
    }

    /// Hand a consumed payload back to the caller, or free it.
    pub(crate) fn recycle(&self, param: ParamId, values: S::Values) {
        if let Some(tx) = &self.spent {
            let _ = tx.try_send((param, values));
        }
    }

    /// Drain the inbox until `Shutdown` or until every sender is gone.
    pub async fn run(mut self, mut inbox: UnboundedReceiver<SchedMsg<S>>) {
        let mut batch = Vec::with_capacity(256);
        while inbox.recv_many(&mut batch, 256).await > 0 {
            for msg in batch.drain(..) {
                if !self.handle(msg) {
                    return;
                }
            }
        }
    }

    /// Apply one message; `false` means stop.
    pub fn handle(&mut self, msg: SchedMsg<S>) -> bool {
        match msg {
            SchedMsg::Shutdown => return false,
            SchedMsg::Settled { id } => self.on_settled(id),
            SchedMsg::Progress { id, reply } => {
                self.settles.entry(id).or_insert((0, None)).1 = Some(reply);
                self.answer_progress(id);
            }
            SchedMsg::LoanReturned { buffers } => self.on_loan_returned(buffers),
            SchedMsg::Done(done) => self.on_done(done),
            SchedMsg::Finish(req) => self.on_finish(req),
            SchedMsg::Reset { proposed, reply } => self.on_reset(proposed, reply),
            msg @ (SchedMsg::Ready { step, .. } | SchedMsg::Flushed(ShardSummary { step, .. })) => {
                if step < self.state.step {
                    // Left over from a step abandoned by a reset.
                } else if self.loaned.is_some() || step != self.state.step || self.resetting.is_some() {
                    self.deferred.push_back(msg);
                } else if self.failure.is_none() {
                    self.begin();
                    match msg {
                        SchedMsg::Ready { param, kind, values, first, at, .. } => {
                            self.on_ready(param, kind, values, first, at)
                        }
                        SchedMsg::Flushed(s) => self.on_flushed(s),
                        _ => unreachable!("matched as Ready or Flushed above"),
                    }
                }
            }
        }
        true
    }

    fn on_settled(&mut self, id: u64) {
        self.settles.entry(id).or_insert((0, None)).0 += 1;
        self.answer_progress(id);
    }

    fn answer_progress(&mut self, id: u64) {
        let complete = matches!(self.settles.get(&id), Some((n, Some(_))) if *n >= self.cfg.shards);
        if complete {
            let (_, reply) = self.settles.remove(&id).expect("entry present");
            let s = &self.state;
            reply.expect("reply present").send(Progress {
                step: s.step,
                buckets_launched: s.next_launch,
                buckets_done: s.done,
                params_ready: s.ready.iter().filter(|r| **r).count(),
            });
        }
    }

    fn on_loan_returned(&mut self, buffers: Vec<S::Bucket>) {
        for (slot, buf) in self.buffers.iter_mut().zip(buffers) {
            *slot = Some(buf);
        }
        self.loaned = None;
        self.replay_deferred();
    }

    /// Re-apply messages held for the step that is now current.
    fn replay_deferred(&mut self) {
        let held = std::mem::take(&mut self.deferred);
        for msg in held {
            self.handle(msg);
        }
    }

    /// Step-start work: parameters expected to stay unused are ready (zeros).
    fn begin(&mut self) {
        if self.state.begun {
            return;
        }
        self.state.begun = true;
        self.state.began_at = Some(Instant::now());
        for (b, bucket) in self.plan.buckets.iter().enumerate() {
            self.state.pending[b] = bucket.params.iter().filter(|p| !self.expect_none[p.index()]).count();
        }
        for (p, &none) in self.expect_none.iter().enumerate() {
            self.state.ready[p] = none;
        }
        self.launch_ready_buckets();
    }

    fn on_ready(&mut self, param: ParamId, kind: PayloadKind, values: S::Values, first: bool, at: Instant) {
        let p = param.index();
        let slot = self.plan.slots[p];
        let st = &mut self.state;
        if self.cfg.record_timeline {
            let what = match (first, slot.bucket < st.next_launch) {
                (_, true) => "late",
                (true, false) => "ready",
                (false, false) => "merge",
            };
            st.timeline.push(TimelineEvent::instant(format!("{what} p{}", param.0), Lane::Backward, at));
        }
        st.kind[p] = Some(kind);
        if self.cfg.check_finite && !self.store.all_finite(&values) {
            st.nonfinite = true;
        }
        if slot.bucket < st.next_launch {
            // The bucket is already in (or through) its all-reduce: late.
            st.late_arrivals += 1;
            let spent = match (&mut st.late[p], kind) {
                (Some(acc), PayloadKind::Increment) => {
                    self.store.add_assign(acc, &values);
                    Some(values)
                }
                (late, _) => late.replace(values),
            };
            if let Some(v) = spent {
                self.recycle(param, v);
            }
            return;
        }
        if self.cfg.record_timeline {
            st.fill_started[slot.bucket].get_or_insert_with(Instant::now);
        }
        let buf = self.buffers[slot.bucket].as_mut().expect("unlaunched bucket buffer is home");
        let mode = if kind == PayloadKind::Increment && st.written[p] { WriteMode::Add } else { WriteMode::Set };
        self.store.write(buf, slot.offset, &values, mode);
        st.written[p] = true;
        let spent = if kind == PayloadKind::Accumulated { st.packed[p].replace(values) } else { Some(values) };
        if first && !st.ready[p] {
            st.ready[p] = true;
            st.pending[slot.bucket] -= 1;
            self.launch_ready_buckets();
        }
        if let Some(v) = spent {
            self.recycle(param, v);
        }
    }

    /// Launch every bucket that is full and whose predecessors are launched.
    fn launch_ready_buckets(&mut self) {
        while self.state.next_launch < self.plan.buckets.len() && self.state.pending[self.state.next_launch] == 0 {
            self.launch_bucket(self.state.next_launch);
            self.state.next_launch += 1;
        }
    }

    fn launch_bucket(&mut self, b: usize) {
        let mut buf = self.buffers[b].take().expect("bucket buffer is home at launch");
        let spec = &self.plan.buckets[b];
        for p in &spec.params {
            if !self.state.written[p.index()] {
                self.store.zero(&mut buf, self.plan.slots[p.index()].offset, self.plan.params[p.index()].numel);
            }
        }
        let tag = CollectiveTag { step: self.state.step, kind: CollectiveKind::Bucket { index: b, numel: spec.numel } };
        if self.cfg.record_timeline {
            let now = Instant::now();
            let from = self.state.fill_started[b].or(self.state.began_at).unwrap_or(now);
            self.state.timeline.push(TimelineEvent::span(format!("fill bucket {b}"), Lane::Scheduler, from, now));
        }
        self.submit(tag, CommPayload::Grads(buf));
    }

    /// Hand a collective to the communicator thread.
    fn submit(&mut self, tag: CollectiveTag, payload: CommPayload<S>) {
        self.state.bytes += payload.bytes(&self.store) as u64;
        let job = CommJob { tag, payload, factor: self.cfg.factor, timeout: self.cfg.collective_timeout };
        if self.comm.send(job).is_err() {
            // The communicator thread is gone (it only exits when we drop the
            // sender, so this is a crash); fail the step instead of waiting forever.
            self.fail(SyncError::Closed);
        }
    }

    /// End the step with an error; the instance stays failed.
    fn fail(&mut self, error: SyncError) {
        tracing::error!(rank = self.cfg.rank, step = self.state.step, %error, "gradsync step failed");
        if let Some(req) = self.state.finish.take() {
            req.reply.send(Err(error.clone()));
        }
        if self.failure.is_none() {
            self.failure = Some(Failure { step: self.state.step, error });
        }
    }

    /// Whether `Instant` `at` is before the caller asked to finish.
    fn before_finish(&self, at: Instant) -> bool {
        self.state.finish.as_ref().is_none_or(|f| at < f.at)
    }
}
