//! The bucket scheduler: the only place that decides what is launched and when.
//!
//! It owns the bucket buffers and the current step's state (`step.rs`). Inputs
//! arrive on one inbox ([`SchedMsg`]): `Ready` values and `Flushed` summaries
//! from the parameter actors, refusals, the caller's `Finish`, `Done` from the
//! communicator thread, resets, and buffers coming home from a loan.
//!
//! ```text
//!  Ready(complete) ─▶ pack into slot ─▶ bucket pending -= 1 ─▶ launch buckets in plan order (launch.rs)
//!  Ready(extra)    ─▶ bucket not launched? merge into slot : keep as a late contribution
//!  Finish + every shard Flushed ─▶ close: unused → zeros, launch the rest, then the control vote
//!  control Done (after every bucket's) ─▶ correction collective? ─▶ StepResult     (finish.rs)
//!  Reset ─▶ agreement collective ─▶ open the agreed step                            (reset.rs)
//! ```
//!
//! Ordering invariant: every rank hands the communicator the same sequence (the
//! plan agreement once, when the first step begins, then per step data buckets strictly in plan order,
//! control, and a correction decided by the *summed* control words), whatever
//! order its gradients arrived in. That is what makes dedup, late arrivals and
//! aborts safe on transports that match collectives by order (NCCL).
//!
//! The state machine is synchronous ([`Scheduler::handle`]); its unit tests
//! drive it message by message. [`Scheduler::run`] drives it from a tokio task.

pub mod control;
mod finish;
mod gather;
mod launch;
mod partition;
mod reorder;
mod reset;
mod salvage;
mod step;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::arrival::{ParamId, Step};
use crate::comm::{CommJob, CommPayload};
use crate::error::{AllocError, CollectiveKind, CollectiveTag, Rejection, SyncError};
use crate::messages::Setting;
use crate::messages::{Place, Reply, Resumption, SchedMsg};
use crate::plan::{BucketEnds, Plan};
use crate::policy::{AbortPolicy, Divisor, Wire};
use crate::report::Progress;
use crate::store::{GradStore, HostStore};
use partition::Partitions;
use reorder::OrderWatch;
pub use reorder::{REORDER_AFTER, REORDER_MIN_GAIN, REORDER_MIN_SHARE};
use salvage::Salvage;
use step::{BufferPool, Failure, Lifecycle, Refusals, StepState};

/// How many future steps' refusals are kept for their reports (beyond that,
/// refusals naming a far-off step are counted in the metrics only).
const EARLY_REFUSAL_STEPS: usize = 64;

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
    /// What the reduced sum is divided by.
    pub divisor: Divisor,
    /// What a step some rank aborted means.
    pub policy: AbortPolicy,
    /// How long one collective may wait for its peers.
    pub collective_timeout: Duration,
    /// Skip the step on every rank when any rank's gradient holds NaN or Inf.
    pub check_finite: bool,
    /// Record a per-step timeline into each report.
    pub record_timeline: bool,
    /// Multiply data buckets by their factor while packing; the transport
    /// only sums them ([`crate::Transport::scale_when_packing`]).
    pub scale_when_packing: bool,
    /// Rebuild the plan in the order gradients arrive (`reorder.rs`).
    pub reorder: bool,
    /// The type data buckets travel in (part of the plan agreement).
    pub wire: Wire,
    /// Data buckets are reduce-scattered ([`crate::Transport::partitioned`];
    /// part of the plan agreement).
    pub partitioned: bool,
    /// ...and each rank also keeps the partition of rank `(rank +
    /// buddy_stride) % world` (0: no buddy copies;
    /// [`crate::Transport::buddies`]; part of the plan agreement).
    pub buddy_stride: usize,
    /// Raised by an elastic job's liveness monitor while a process waits
    /// to join: this rank's control votes say so (`None`: not elastic).
    pub joiner_waiting: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// A progress request ([`SchedMsg::Progress`]) until it is answered.
#[derive(Debug, Default)]
struct ProgressRequest {
    /// Shards that settled it (every arrival they were sent before it forwarded).
    settled: usize,
    /// Where to answer (`None` while a shard's `Settled` came first).
    reply: Option<Reply<Progress>>,
    /// Answer only once at most this many data buckets are in flight.
    in_flight_at_most: Option<usize>,
}

/// The bucket-scheduler actor of one rank.
#[derive(Debug)]
pub struct Scheduler<S: GradStore = HostStore> {
    cfg: SchedulerConfig,
    /// Packs, zeroes and combines gradient values (host loops or device kernels).
    store: S,
    plan: Arc<Plan>,
    /// Jobs for the communicator thread.
    comm: Sender<CommJob<S>>,
    /// This actor's own inbox, for loans to come home through.
    home: UnboundedSender<SchedMsg<S>>,
    /// Where the current step is.
    lifecycle: Lifecycle<S>,
    /// The current step's bookkeeping.
    step: StepState<S::Values>,
    /// Bucket buffers: the current set and spare sets.
    buffers: BufferPool<S::Bucket>,
    /// Every rank's plan matched ours (launches wait until it did).
    plan_agreed: bool,
    /// The plan agreement was submitted: at the first step's start, so that
    /// settings chosen before the first step (the wire type) join it.
    plan_proposed: bool,
    /// Messages of a later step, held until the current one completes.
    next: VecDeque<SchedMsg<S>>,
    /// Per parameter: treat as ready (zeros) at step start.
    expect_none: Vec<bool>,
    /// Ranks known to have joined (from the last control verdict).
    joined: usize,
    /// Generation of the parameter actors' messages: bumped by every reset so
    /// that values sent before it are dropped.
    epoch: u32,
    /// Progress requests, by id.
    settles: HashMap<u64, ProgressRequest>,
    /// Refusals naming a step that has not begun, for its report.
    early_refusals: BTreeMap<Step, Refusals>,
    /// This rank as a metric label.
    rank_label: String,
    /// Where consumed payload vectors go for reuse by the caller (opt-in).
    spent: Option<Sender<(ParamId, S::Values)>>,
    /// Bytes of bucket buffers allocated, for the caller's memory figure.
    allocated: Arc<AtomicUsize>,
    /// Gradient order against the plan, and a rebuild in progress.
    order: OrderWatch,
    /// Where the plan's buckets end, shared with the hooks that batch arrivals.
    bucket_ends: BucketEnds,
    /// This rank's contribution to the failed step, under the partial
    /// policy, for the members to reduce it again (`salvage.rs`).
    salvage: Option<Salvage<S::Values>>,
    /// The salvage the new members agreed to reduce again: fed into the
    /// reopened step at the caller's `Finish`.
    redo: Option<Salvage<S::Values>>,
    /// A membership reset waiting for the failed step's last flush.
    deferred_reset: Option<DeferredReset>,
    /// Partitioned (reduce-scattered) buckets: the partitions a step keeps
    /// and the whole buffers between uses (`partition.rs`); `None` otherwise.
    partitions: Option<Partitions<S::Bucket>>,
    /// A sharded model's parameter gathers in flight, in the order they were asked for (`gather.rs`).
    gathering: Vec<gather::Gathering<S::Bucket>>,
}

/// A reset held back: its proposal, membership and reply.
type DeferredReset = (Step, Option<Place>, Reply<Result<Resumption, SyncError>>);

impl<S: GradStore> Scheduler<S> {
    /// A scheduler for `plan` packing with `store`. Allocates one set of bucket
    /// buffers (partitioned: none, they are allocated as buckets fill); the plan agreement, the first collective of every rank, is
    /// submitted when the first step begins (its first gradient or its end),
    /// after every setting chosen before it.
    pub fn new(
        cfg: SchedulerConfig,
        store: S,
        plan: Arc<Plan>,
        comm: Sender<CommJob<S>>,
        home: UnboundedSender<SchedMsg<S>>,
    ) -> Result<Self, AllocError> {
        let allocated = Arc::new(AtomicUsize::new(0));
        let expect_none = plan.param_ids().iter().map(|&p| plan.expected_arrivals(p) == Some(0)).collect();
        let step = StepState::new(0, plan.num_params(), plan.num_buckets(), cfg.world, cfg.divisor);
        let rank_label = cfg.rank.to_string();
        let bucket_ends = BucketEnds::of(&plan);
        crate::telemetry::plan(&rank_label, plan.num_buckets(), plan.bucket_bytes());
        crate::timeline::trace_epoch();
        let mut sched = Scheduler {
            rank_label,
            cfg,
            store,
            plan,
            comm,
            home,
            lifecycle: Lifecycle::Open,
            step,
            buffers: BufferPool { current: Vec::new(), spare: Vec::new(), sets: 0 },
            plan_agreed: false,
            plan_proposed: false,
            next: VecDeque::new(),
            expect_none,
            joined: 0,
            epoch: 0,
            settles: HashMap::new(),
            early_refusals: BTreeMap::new(),
            spent: None,
            allocated,
            order: OrderWatch::default(),
            salvage: None,
            redo: None,
            deferred_reset: None,
            bucket_ends,
            partitions: None,
            gathering: Vec::new(),
        };
        if sched.cfg.partitioned {
            // Whole buffers are allocated as buckets fill (partition.rs).
            let (rank, world, stride) = (sched.cfg.rank, sched.cfg.world, sched.cfg.buddy_stride);
            sched.partitions = Some(Partitions::new(&sched.plan, rank, world, stride));
            sched.buffers.current = (0..sched.plan.num_buckets()).map(|_| None).collect();
            return Ok(sched);
        }
        let set = sched.allocate_set()?;
        sched.buffers.current = set.into_iter().map(Some).collect();
        Ok(sched)
    }

    /// Send payload vectors the scheduler no longer needs to `spent` instead of
    /// freeing them, so a caller can reuse them (a bounded channel: when it is
    /// full, vectors are freed as usual).
    pub fn with_spent_payloads(mut self, spent: Sender<(ParamId, S::Values)>) -> Self {
        self.spent = Some(spent);
        self
    }

    /// Where the buckets of the plan in force end (updated when it is rebuilt).
    pub fn bucket_ends(&self) -> BucketEnds {
        self.bucket_ends.clone()
    }

    /// Bytes of bucket buffers allocated so far, updated as sets are added.
    pub fn allocated_bytes(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.allocated)
    }

    /// Where the current step is in its lifecycle (`"open"`, `"flushing"`,
    /// `"draining"`, `"control"`, `"correcting"`, `"failed"`, `"resetting"`).
    pub fn phase(&self) -> &'static str {
        self.lifecycle.name()
    }

    /// The step the scheduler is working on.
    pub fn current_step(&self) -> Step {
        self.step.step
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
        // A returned collective or a finished step may let a request that
        // waits for buckets in flight be answered.
        let drains = matches!(msg, SchedMsg::Done(_) | SchedMsg::Finish(_)) && !self.settles.is_empty();
        match msg {
            SchedMsg::Shutdown => return false,
            SchedMsg::Settled { id } => self.on_settled(id),
            SchedMsg::Progress { id, in_flight_at_most, reply } => {
                let request = self.settles.entry(id).or_default();
                request.reply = Some(reply);
                request.in_flight_at_most = in_flight_at_most;
                self.answer_progress(id);
            }
            SchedMsg::LoanReturned { buffers } => self.take_home(buffers),
            SchedMsg::Rejected { step, why } => self.on_rejected(step, why),
            SchedMsg::Done(done) => self.on_done(done),
            // The plan is being rebuilt: the next step waits for it.
            SchedMsg::Finish(req) if self.order.pending => self.next.push_back(SchedMsg::Finish(req)),
            SchedMsg::Finish(req) => self.on_finish(req),
            SchedMsg::Reset { proposed, membership, reply } => self.on_reset(proposed, membership, reply),
            SchedMsg::Configure { setting, reply } => reply.send(self.configure(setting)),
            SchedMsg::Gather { buffers, reply } => self.on_gather(buffers, reply),
            SchedMsg::Ready { step, epoch, .. }
            | SchedMsg::Flushed(crate::messages::ShardSummary { step, epoch, .. })
                if epoch != self.epoch || step < self.step.step =>
            {
                // Sent before a reset, or left over from an abandoned step.
                if let SchedMsg::Ready { param, values, .. } = msg {
                    self.recycle(param, values);
                }
            }
            msg @ (SchedMsg::Ready { .. } | SchedMsg::Flushed(_)) => self.on_step_message(msg),
        }
        if drains {
            self.answer_waiting_progress();
        }
        true
    }

    /// A `Ready` or `Flushed` of the current step or a later one.
    fn on_step_message(&mut self, msg: SchedMsg<S>) {
        let step = match &msg {
            SchedMsg::Ready { step, .. } => *step,
            SchedMsg::Flushed(s) => s.step,
            _ => unreachable!("only Ready and Flushed are step messages"),
        };
        if self.failed() {
            // The step is abandoned (its salvage keeps what it needs); a reset will open a new one.
            let Some(msg) = self.fold_into_salvage(msg) else { return };
            if let SchedMsg::Ready { param, values, .. } = msg {
                self.recycle(param, values);
            }
            return;
        }
        if step > self.step.step || self.order.pending {
            // A later step's message: the current step must complete first
            // (and a plan being rebuilt must be in place).
            return self.next.push_back(msg);
        }
        if !self.begin() {
            return;
        }
        match msg {
            SchedMsg::Ready { param, token, kind, values, readiness, at, .. } => {
                self.on_ready(param, token, kind, values, readiness, at)
            }
            SchedMsg::Flushed(summary) => self.on_flushed(summary),
            _ => unreachable!("only Ready and Flushed are step messages"),
        }
    }

    /// Apply a [`Setting`] (see [`SchedMsg::Configure`]).
    fn configure(&mut self, setting: Setting) -> Result<(), SyncError> {
        match setting {
            Setting::Divisor(divisor) => {
                self.cfg.divisor = divisor;
                if self.step.began.is_none() {
                    self.step.divisor = divisor;
                }
            }
            Setting::Wire(wire) if wire == self.cfg.wire => {}
            Setting::Wire(wire) => {
                if self.plan_proposed {
                    return Err(SyncError::Setting {
                        setting: "wire dtype",
                        why: format!(
                            "cannot change to {} once the first step began (the ranks agreed on the plan then); \
                             choose it when building, or before the first step on every rank",
                            wire.label()
                        ),
                    });
                }
                self.cfg.wire = wire;
            }
        }
        Ok(())
    }

    /// Whether the scheduler is failed or resetting (step messages are dropped).
    fn failed(&self) -> bool {
        matches!(self.lifecycle, Lifecycle::Failed(_) | Lifecycle::Resetting(_))
    }

    /// Answer every progress request that was waiting for the plan
    /// agreement or for buckets in flight.
    fn answer_waiting_progress(&mut self) {
        let ids: Vec<u64> = self.settles.keys().copied().collect();
        for id in ids {
            self.answer_progress(id);
        }
    }

    fn on_settled(&mut self, id: u64) {
        self.settles.entry(id).or_default().settled += 1;
        self.answer_progress(id);
    }

    /// Answer progress request `id` once every shard has settled it and the
    /// plan agreement (and a plan rebuild) is over: before, launches wait
    /// and arrivals are held, so a snapshot would not show what they caused.
    fn answer_progress(&mut self, id: u64) {
        let Some(request) = self.settles.get(&id) else { return };
        let settled = request.reply.is_some() && request.settled >= self.cfg.shards;
        let agreed = self.plan_agreed || !self.plan_proposed;
        let s = &self.step;
        let drained = request.in_flight_at_most.is_none_or(|most| s.next_launch - s.reduced <= most);
        if settled && ((agreed && !self.order.pending && drained) || self.failed()) {
            let request = self.settles.remove(&id).expect("entry present");
            request.reply.expect("reply present").send(Progress {
                step: s.step,
                buckets_launched: s.next_launch,
                buckets_done: s.reduced,
                params_ready: s.params.iter().filter(|p| p.ready).count(),
            });
        }
    }

    /// Count a refused arrival in the report of the step it names, if that
    /// report is still to come; always in the metrics.
    fn on_rejected(&mut self, step: Step, why: Rejection) {
        crate::telemetry::rejected(&self.rank_label);
        let current = self.step.step;
        if step == current && !self.failed() {
            self.step.refusals.add(why);
        } else if step > current
            && (self.early_refusals.len() < EARLY_REFUSAL_STEPS || self.early_refusals.contains_key(&step))
        {
            self.early_refusals.entry(step).or_default().add(why);
        } else {
            tracing::debug!(rank = self.cfg.rank, step, current, %why, "refusal for a step whose report is out");
        }
    }

    /// Hand a consumed payload back to the caller, or free it.
    fn recycle(&self, param: ParamId, values: S::Values) {
        if let Some(tx) = &self.spent {
            let _ = tx.try_send((param, values));
        }
    }

    /// Allocate one set of bucket buffers.
    fn allocate_set(&mut self) -> Result<Vec<S::Bucket>, AllocError> {
        let mut set = Vec::with_capacity(self.plan.num_buckets());
        for b in 0..self.plan.num_buckets() {
            set.push(self.store.alloc_bucket(self.plan.bucket_numel(b), self.cfg.pieces, self.plan.bucket_dtype(b))?);
        }
        self.buffers.sets += 1;
        self.allocated.fetch_add(self.plan.bucket_bytes(), Ordering::Relaxed);
        Ok(set)
    }

    /// Make sure the current step has a set of buffers: a spare one, or a new one.
    fn ensure_buffers(&mut self) -> Result<(), AllocError> {
        if !self.buffers.current.is_empty() || self.plan.num_buckets() == 0 {
            return Ok(());
        }
        let set = match self.buffers.spare.pop() {
            Some(set) => set,
            None => self.allocate_set()?,
        };
        self.buffers.current = set.into_iter().map(Some).collect();
        Ok(())
    }

    /// Hand a collective to the communicator thread.
    fn submit(&mut self, tag: CollectiveTag, payload: CommPayload<S>, factor: f64, timeout: Duration) {
        self.step.bytes += payload.bytes(&self.store) as u64;
        let wire = if matches!(tag.kind, CollectiveKind::Bucket { .. }) { self.cfg.wire } else { Wire::F32 };
        let job = CommJob { tag, payload, factor, timeout, wire };
        if self.comm.send(job).is_err() {
            // The communicator thread is gone (it only exits when we drop the
            // sender, so this is a crash); fail the step instead of waiting forever.
            self.fail(SyncError::Closed);
        }
    }

    /// End the current step with an error: answer whoever waits (a finish or
    /// a reset), and stay failed until a reset. The first failure is kept.
    fn fail(&mut self, error: SyncError) {
        tracing::error!(rank = self.cfg.rank, step = self.step.step, %error, "gradsync step failed");
        self.next.clear();
        let correcting = matches!(self.lifecycle, Lifecycle::Correcting(..));
        match std::mem::replace(&mut self.lifecycle, Lifecycle::Open) {
            Lifecycle::Flushing(f) | Lifecycle::Draining(f) | Lifecycle::Control(f) | Lifecycle::Correcting(f, _) => {
                f.reply.send(Err(error.clone()));
                self.salvage_failed_step(correcting);
            }
            // The failed step's salvage (if any) is still there.
            Lifecycle::Resetting(reply) => reply.send(Err(error.clone())),
            Lifecycle::Failed(first) => {
                self.lifecycle = Lifecycle::Failed(first);
                return;
            }
            Lifecycle::Open => self.salvage_failed_step(false),
        }
        self.lifecycle = Lifecycle::Failed(Failure { step: self.step.step, error });
    }
}
