//! [`GradSync`]: one rank's gradient synchronizer, and the threads behind it.
//!
//! Starting a GradSync spawns two OS threads for the rank:
//!
//! * `gradsync-actors-rN` runs a single-threaded tokio runtime hosting the
//!   parameter-shard tasks and the bucket-scheduler task;
//! * `gradsync-comm-rN` drives the transport, one collective at a time, fed by
//!   a crossbeam channel (NCCL communicators are `!Send`, so they live on one
//!   thread; a blocked collective never stalls a tokio worker).
//!
//! Ending a step sends a request and waits for its result; the request and
//! the wait are separate, so a cancelled wait (an async future dropped by a
//! `timeout`) leaves the result to be collected by the next call for that step.
//!
//! Dropping the GradSync stops the scheduler, interrupts a collective in
//! progress and joins both threads: nothing is leaked and nothing hangs.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradsync_actors::messages::{
    FinishRequest, GatherOf, Gathered, Place, Reply, Resumption, SchedMsg, Setting, ShardMsg, StepEnd,
};
use gradsync_actors::wiring::{self, ActorConfig};
use gradsync_actors::{
    AbortReason, BuildError, Divisor, GradStore, HostStore, Interrupt, Outcome, ParamId, Plan, Progress, Step,
    StepResult, SyncError, Transport, Wire,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::hook::GradHook;

/// The answer to a request to end a step.
type Answer<S> = oneshot::Receiver<Result<StepResult<S>, SyncError>>;

/// A step whose end was requested and whose result is not collected yet.
#[derive(Debug)]
struct Pending<S: GradStore> {
    step: Step,
    /// How this rank asked to end it.
    end: StepEnd,
    answer: Answer<S>,
}

/// What [`GradSync::join`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinReport {
    /// The first step this rank shadowed.
    pub first_step: Step,
    /// Steps shadowed with zeros, the last one included (when every rank had joined).
    pub steps: u64,
}

/// What [`GradSync::reset_membership`] did.
#[derive(Debug)]
pub struct MembershipReset<S: GradStore = HostStore> {
    /// The step every member opens next.
    pub step: Step,
    /// The failed step, reduced again among the new members (partial
    /// policy, when every member could); apply it like any finished step.
    pub redone: Option<StepResult<S>>,
}

/// One rank's gradient synchronizer.
///
/// Give [`GradSync::hook`] clones to autograd hooks; call
/// [`GradSync::finish_step`] when backward is over on this rank (or
/// [`GradSync::abort_step`] when this rank cannot finish it, or
/// [`GradSync::join`] when it has run out of data).
///
/// **Failures.** A step is consumed by the call that ends it, successful or
/// not, so [`GradSync::current_step`] moves on either way. After a failed step
/// (a timeout, a desync, a peer gone: [`SyncError::needs_reset`]) every later
/// call is refused with [`SyncError::Poisoned`], consuming no step, until
/// [`GradSync::reset`] has been called on every rank; `reset` returns the step
/// all ranks continue at. The failed step's gradients are lost: run its batch
/// again under the new step number.
///
/// `S` is where gradients live: host memory by default (the local backend),
/// device memory with the CUDA backend.
#[derive(Debug)]
pub struct GradSync<S: GradStore = HostStore> {
    rank: usize,
    world: usize,
    plan: Arc<Plan>,
    hook: GradHook<S>,
    /// Parameter-shard inboxes (also inside `hook`), for flush and settle markers.
    shards: Vec<UnboundedSender<ShardMsg<S>>>,
    sched: UnboundedSender<SchedMsg<S>>,
    /// A step whose end was requested but whose result was not collected.
    pending: Option<Pending<S>>,
    /// The step that failed and why, once this rank learned it: calls are
    /// refused (consuming no step) until a reset.
    failed: Option<(Step, String)>,
    /// Resets so far: the parameter actors' message generation.
    epoch: u32,
    /// Id of the next progress request.
    next_request: u64,
    /// The back-pressure request [`GradSync::await_in_flight`] left
    /// unanswered (its bound, its answer to come), asked again by the next
    /// call with the same bound instead of a new one (in a mutex only so
    /// that the handle is `Sync`: one caller, never contended).
    in_flight_wait: Option<(usize, std::sync::Mutex<std::sync::mpsc::Receiver<Progress>>)>,
    /// Longest wait for an answer from the local actors.
    answer_timeout: Duration,
    interrupt: Option<Interrupter>,
    /// Consumed payloads coming back for reuse (with `recycle_payloads`).
    spent: Option<crossbeam_channel::Receiver<(ParamId, S::Values)>>,
    /// Bytes of bucket buffers the scheduler has allocated.
    allocated: Arc<AtomicUsize>,
    /// The wire types the transport carries.
    wires: &'static [Wire],
    threads: Vec<JoinHandle<()>>,
}

impl<S: GradStore> GradSync<S> {
    /// Start the actors (configured by `cfg`, over `plan`) and the
    /// communicator thread on `transport`; every collective may wait up to
    /// `collective_timeout`. Called by `GradSyncBuilder::build`, which
    /// checked the settings.
    pub(crate) fn start<T: Transport<Store = S>>(
        plan: Plan,
        cfg: ActorConfig,
        collective_timeout: Duration,
        transport: T,
    ) -> Result<Self, BuildError> {
        let (rank, world) = (transport.rank(), transport.world());
        let plan = Arc::new(plan);
        let interrupt = transport.interrupter().map(Interrupter);
        let wires = transport.wires();
        let store = transport.store();
        let (comm_tx, comm_rx) = crossbeam_channel::unbounded();
        let actors = wiring::wire(&cfg, store.clone(), Arc::clone(&plan), comm_tx)?;
        let spawn_err = |which: &'static str| move |e: std::io::Error| BuildError::Spawn { which, why: e.to_string() };
        let runtime = tokio::runtime::Builder::new_current_thread().build().map_err(spawn_err("actor runtime"))?;
        let (shard_actors, (scheduler, sched_rx)) = (actors.shards, actors.scheduler);
        let actor_thread = std::thread::Builder::new()
            .name(format!("gradsync-actors-r{rank}"))
            .spawn(move || {
                runtime.block_on(async move {
                    for (shard, rx) in shard_actors {
                        tokio::spawn(shard.run(rx));
                    }
                    scheduler.run(sched_rx).await;
                });
            })
            .map_err(spawn_err("actor"))?;
        let completed = wiring::completions(actors.scheduler_inbox.clone());
        let comm_thread = std::thread::Builder::new()
            .name(format!("gradsync-comm-r{rank}"))
            .spawn(move || gradsync_actors::comm::run_communicator(transport, comm_rx, completed))
            .map_err(spawn_err("communicator"))?;
        let numel = plan.param_ids().iter().map(|&p| plan.param_numel(p)).collect();
        let buckets = plan.num_buckets() as u32;
        let bucket_ends = actors.bucket_ends.clone();
        let (shards, sched) = (actors.shard_inboxes.clone(), actors.scheduler_inbox.clone());
        let hook = GradHook::new(shards, sched, numel, bucket_ends, store);
        Ok(GradSync {
            rank,
            world,
            hook,
            plan,
            shards: actors.shard_inboxes,
            sched: actors.scheduler_inbox,
            pending: None,
            failed: None,
            epoch: 0,
            next_request: 0,
            in_flight_wait: None,
            // Every collective of a step may use its full timeout before failing.
            answer_timeout: collective_timeout * (buckets + 4) + Duration::from_secs(10),
            interrupt,
            spent: actors.spent,
            allocated: actors.allocated,
            wires,
            threads: vec![actor_thread, comm_thread],
        })
    }

    /// A handle for autograd hooks (cheap to clone, usable from any thread).
    pub fn hook(&self) -> GradHook<S> {
        self.hook.clone()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The bucket plan the parameters were registered with (reverse
    /// registration order). The scheduler may rebuild it in the order
    /// gradients arrive ([`GradSyncBuilder::reorder_buckets`](crate::GradSyncBuilder::reorder_buckets)); bucket
    /// count and order may then differ, total bytes never do.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Every registered parameter's id, in registration order.
    pub fn param_ids(&self) -> &[ParamId] {
        self.plan.param_ids()
    }

    /// The id of a registered parameter name.
    pub fn param_id(&self, name: &str) -> Option<ParamId> {
        self.plan.id(name)
    }

    /// The open step: the one hooks deliver to and the next one to end.
    /// gradsync keeps it in one place, the hooks' handle, which moves it on
    /// when a step ends (and to the agreed step at a reset); callers read it
    /// here rather than counting steps themselves.
    pub fn current_step(&self) -> Step {
        self.hook.open_step()
    }

    /// Memory gradsync holds beyond the caller's gradients: the bucket buffers
    /// plus per-parameter metadata. There is one set of buffers per step
    /// whose [`Gradients`](crate::Gradients) are alive, plus the set the open step packs into:
    /// holding a step's gradients never stalls or refuses a later step, and
    /// a set comes back for reuse when its `Gradients` is dropped, so a caller
    /// that drops each step's gradients before the next step ends needs two.
    /// Payloads handed over are the caller's gradients and are kept at most
    /// until their step finishes; they are not counted here.
    pub fn memory_bytes(&self) -> usize {
        let per_param = 4 * std::mem::size_of::<usize>() + 96;
        self.allocated.load(Ordering::Relaxed) + self.plan.num_params() * per_param
    }

    /// Backward of `step` is over on this rank: launch what is left, run the
    /// control collective (and a correction if any parameter arrived late), and
    /// return the report and the averaged gradients. Blocks; use
    /// [`GradSync::finish_step_async`] inside an async runtime.
    pub fn finish_step(&mut self, step: Step) -> Result<StepResult<S>, SyncError> {
        self.end_step(step, StepEnd::Finish)
    }

    /// This rank cannot finish `step` (out of memory, bad batch): its remaining
    /// collectives carry zeros. Under the default policy every rank's result
    /// is `Outcome::Skipped` naming this rank; under `AbortPolicy::Partial` the
    /// other ranks' average applies on every rank (`Outcome::Partial`). Nobody
    /// hangs; the next step proceeds normally.
    pub fn abort_step(&mut self, step: Step, reason: AbortReason) -> Result<StepResult<S>, SyncError> {
        self.end_step(step, StepEnd::Abort(reason))
    }

    /// The first half of [`GradSync::finish_step`]: what is left of `step`
    /// launched and its control collective under way, without waiting for
    /// the result, which the next `finish_step(step)` collects. For a rank
    /// that must do something else before the others can finish the step
    /// (serve their parameter gathers): their reductions then never wait
    /// for it meanwhile.
    pub fn begin_finish_step(&mut self, step: Step) -> Result<(), SyncError> {
        self.request_end(step, StepEnd::Finish)
    }

    /// The first half of [`GradSync::abort_step`], as
    /// [`GradSync::begin_finish_step`] is of `finish_step`; the next
    /// `abort_step(step, ..)` collects the result.
    pub fn begin_abort_step(&mut self, step: Step, reason: AbortReason) -> Result<(), SyncError> {
        self.request_end(step, StepEnd::Abort(reason))
    }

    /// Async form of [`GradSync::finish_step`]. Cancel-safe: if the future is
    /// dropped before it completes, the step still completes in the
    /// background, and the next `finish_step(step)` (blocking or async)
    /// returns its result without sending a new request. Until then, ending
    /// any other step is refused with [`SyncError::FinishPending`].
    pub async fn finish_step_async(&mut self, step: Step) -> Result<StepResult<S>, SyncError> {
        self.end_step_async(step, StepEnd::Finish).await
    }

    /// Async form of [`GradSync::abort_step`] (cancel-safe, like [`GradSync::finish_step_async`]).
    pub async fn abort_step_async(&mut self, step: Step, reason: AbortReason) -> Result<StepResult<S>, SyncError> {
        self.end_step_async(step, StepEnd::Abort(reason)).await
    }

    /// This rank has run out of data (uneven inputs, DDP's `join`): from the
    /// open step on it contributes zeros to every step of the ranks still
    /// training, until every rank has joined, then returns. Each of those
    /// steps is averaged over the ranks that contributed, and every rank's
    /// report names the joined ranks. Call it when the data loader is
    /// exhausted; the gradients of the shadowed steps are not lent to this rank.
    pub fn join(&mut self) -> Result<JoinReport, SyncError> {
        let first_step = self.hook.open_step();
        let mut steps = 0;
        loop {
            let report = self.shadow_step()?.report;
            steps += 1;
            if report.outcome == Outcome::AllJoined {
                return Ok(JoinReport { first_step, steps });
            }
        }
    }

    /// One step of [`GradSync::join`]: this rank is out of data and
    /// contributes zeros to the open step of the ranks still training, then
    /// returns that step's report (`Outcome::AllJoined` once every rank
    /// shadowed the same step). For callers that count the ranks still
    /// training themselves, as torch's `Join` context manager does: call it
    /// once per step the others run, on every joined rank. The result lends
    /// that step's averages, as the others got them (a sharded rank steps
    /// its partition with them: it still owns it).
    pub fn shadow_step(&mut self) -> Result<StepResult<S>, SyncError> {
        let step = match &self.pending {
            Some(p) if p.end == StepEnd::Join => p.step,
            _ => self.hook.open_step(),
        };
        self.end_step(step, StepEnd::Join)
    }

    /// The first half of [`GradSync::shadow_step`]: this rank's zeros for
    /// the others' open step go out now, without waiting for the step's
    /// result, which the next `shadow_step` collects. For a joined rank
    /// that must do something else before the others can finish that step
    /// (serve their parameter gathers): their reductions then never wait
    /// for it. Does nothing when a shadow step is already under way.
    pub fn begin_shadow_step(&mut self) -> Result<(), SyncError> {
        if matches!(&self.pending, Some(p) if p.end == StepEnd::Join) {
            return Ok(());
        }
        let step = self.hook.open_step();
        self.request_end(step, StepEnd::Join)
    }

    fn end_step(&mut self, step: Step, end: StepEnd) -> Result<StepResult<S>, SyncError> {
        self.request_end(step, end)?;
        let pending = self.pending.as_mut().expect("a request is pending");
        match block_on_timeout(&mut pending.answer, self.answer_timeout) {
            Some(answer) => self.collect(answer),
            None => Err(SyncError::Unresponsive { step, waited: self.answer_timeout }),
        }
    }

    async fn end_step_async(&mut self, step: Step, end: StepEnd) -> Result<StepResult<S>, SyncError> {
        self.request_end(step, end)?;
        let pending = self.pending.as_mut().expect("a request is pending");
        // Dropping this future here leaves `pending` in place: cancel-safe.
        let answer = (&mut pending.answer).await;
        self.collect(answer)
    }

    /// Ask the actors to end `step`, unless its end was already asked for and
    /// is waiting to be collected.
    fn request_end(&mut self, step: Step, end: StepEnd) -> Result<(), SyncError> {
        if let Some(p) = &self.pending {
            return if p.step == step { Ok(()) } else { Err(SyncError::FinishPending { pending: p.step, got: step }) };
        }
        if let Some((failed, cause)) = &self.failed {
            return Err(SyncError::Poisoned { step: *failed, cause: cause.clone() });
        }
        if step != self.hook.open_step() {
            return Err(SyncError::NotCurrentStep { expected: self.hook.open_step(), got: step });
        }
        let held = self.hook.held();
        if held > 0 {
            return Err(SyncError::Undelivered { step, held });
        }
        let at = Instant::now();
        // Arrivals for `step` are refused from now on; the shards move on at the flush.
        self.hook.open(step + 1);
        for shard in &self.shards {
            shard.send(ShardMsg::Flush { step }).map_err(|_| SyncError::Closed)?;
        }
        let (tx, answer) = oneshot::channel();
        let req = FinishRequest { step, end, at, reply: Reply::Async(tx) };
        self.sched.send(SchedMsg::Finish(req)).map_err(|_| SyncError::Closed)?;
        self.pending = Some(Pending { step, end, answer });
        Ok(())
    }

    /// The pending step's answer arrived: clear it (and remember a failure).
    fn collect(
        &mut self,
        answer: Result<Result<StepResult<S>, SyncError>, oneshot::error::RecvError>,
    ) -> Result<StepResult<S>, SyncError> {
        let step = self.pending.take().map_or(self.hook.open_step(), |p| p.step);
        let answer = answer.unwrap_or(Err(SyncError::Closed));
        match &answer {
            Ok(_) => {}
            Err(SyncError::Poisoned { step, cause }) => self.failed = Some((*step, cause.clone())),
            Err(e) if e.needs_reset() => self.failed = Some((step, e.to_string())),
            Err(_) => {}
        }
        answer
    }

    /// Recover from a failed step (a timeout, a desync): every rank whose
    /// GradSync failed calls `reset`; the ranks agree in one collective on the
    /// step to restart at (the largest step any of them had reached), which is
    /// returned. Gradients of the abandoned step, a result not collected yet,
    /// and arrivals sent between the failure and `reset` are discarded: run
    /// that batch again.
    ///
    /// A rank that is gone (crashed) cannot agree: `reset` then fails naming it,
    /// and the survivors must drop their GradSync and build a new world.
    pub fn reset(&mut self) -> Result<Step, SyncError> {
        self.reset_with(None).map(|r| r.step)
    }

    /// Reset into a new membership (an elastic job, after its members
    /// changed): this rank is `place.rank` of `place.world` from now on
    /// (keeping buddy copies `place.buddy_stride` ranks on), the transport
    /// already on the new members' group (its [`Transport::reset`](crate::backend::Transport::reset)
    /// moved it). The new members agree on the step to continue at (the
    /// largest any of them had reached; a process that just joined proposes
    /// its first) and then on the plan again. Every member calls it with its
    /// own place, at the same point.
    ///
    /// Under [`AbortPolicy::Partial`](crate::AbortPolicy::Partial), when the
    /// step in flight failed on every new member and each kept its whole
    /// contribution, the members reduce that step again among themselves:
    /// [`MembershipReset::redone`] holds its result (the average over the
    /// members present), identical on every member. Otherwise the step is
    /// skipped on every member (`redone` is `None`): never a mix.
    pub fn reset_membership(&mut self, place: Place) -> Result<MembershipReset<S>, SyncError> {
        let Place { rank, world, .. } = place;
        if rank >= world {
            return Err(SyncError::Setting { setting: "membership", why: format!("rank {rank} of {world} ranks") });
        }
        let resumed = self.reset_with(Some(place))?;
        (self.rank, self.world) = (rank, world);
        let redone = match resumed.redo {
            Some(step) => Some(self.redo(step)?),
            None => None,
        };
        Ok(MembershipReset { step: resumed.step, redone })
    }

    /// Finish the failed `step` again among the new members: the scheduler
    /// holds this rank's contribution; no arrival is taken.
    fn redo(&mut self, step: Step) -> Result<StepResult<S>, SyncError> {
        let (tx, answer) = oneshot::channel();
        let req = FinishRequest { step, end: StepEnd::Finish, at: Instant::now(), reply: Reply::Async(tx) };
        self.sched.send(SchedMsg::Finish(req)).map_err(|_| SyncError::Closed)?;
        self.pending = Some(Pending { step, end: StepEnd::Finish, answer });
        let pending = self.pending.as_mut().expect("just set");
        match block_on_timeout(&mut pending.answer, self.answer_timeout) {
            Some(answer) => self.collect(answer),
            None => Err(SyncError::Unresponsive { step, waited: self.answer_timeout }),
        }
    }

    fn reset_with(&mut self, membership: Option<Place>) -> Result<Resumption, SyncError> {
        let proposed = self.hook.open_step();
        self.pending = None;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let msg = SchedMsg::Reset { proposed, membership, reply: Reply::Blocking(tx) };
        self.sched.send(msg).map_err(|_| SyncError::Closed)?;
        let resumed = self.await_answer(&rx, proposed)??;
        self.epoch += 1;
        for shard in &self.shards {
            shard.send(ShardMsg::Reset { step: resumed.step, epoch: self.epoch }).map_err(|_| SyncError::Closed)?;
        }
        self.hook.reopen(resumed.step);
        self.failed = None;
        Ok(resumed)
    }

    /// Divide the sum of every step that has not begun by `divisor` (the
    /// step open now too, unless a gradient of it was already packed). Every
    /// rank must change it at the same point (between the same two steps):
    /// the divisor joins each step's control vote, so ranks that divide
    /// differently fail that step with a desync instead of diverging.
    pub fn set_divisor(&mut self, divisor: Divisor) -> Result<(), SyncError> {
        if divisor == Divisor::Fixed(0) {
            return Err(SyncError::Setting { setting: "divisor", why: "division by zero".into() });
        }
        self.configure(Setting::Divisor(divisor))
    }

    /// Send data buckets as `wire` (see [`GradSyncBuilder::wire_dtype`](crate::GradSyncBuilder::wire_dtype))
    /// when it could not be chosen at build time (a comm hook registered
    /// before the first step). Only before the first bucket is launched, on
    /// every rank: the plan agreement runs again with the new type, so
    /// ranks that disagree fail together with a desync.
    pub fn set_wire_dtype(&mut self, wire: Wire) -> Result<(), SyncError> {
        if !self.wires.contains(&wire) {
            let carried: Vec<&str> = self.wires.iter().map(|w| w.label()).collect();
            let why = format!("this transport carries data buckets as {carried:?}, not {}", wire.label());
            return Err(SyncError::Setting { setting: "wire dtype", why });
        }
        self.configure(Setting::Wire(wire))
    }

    /// Gather what a sharded model's update needs from every rank: each
    /// `(what, buffer)` of `buffers` holds `world` equal chunks back to
    /// back, this rank's (at `rank * chunk`) filled (its updated partition
    /// of a bucket after its optimizer stepped, or its partial gradient
    /// norm for a clip); on return every rank's chunk is in place. The buffers
    /// come back into `buffers` in the same order whether the gather
    /// succeeded or not (it is left empty only when the runtime is gone or
    /// does not answer). A collective on the communicator thread like the
    /// buckets' (the collective deadline, failures classified, metrics and
    /// timeline); every rank calls it with the same buckets at the same
    /// point, between steps. A failure leaves the session failed until a
    /// reset, as a failed step does. [`GradSync::start_gather`] and
    /// [`GradSync::finish_gather`] are its two halves, for a caller with
    /// work to do while it runs.
    pub fn gather(&mut self, buffers: &mut Vec<(GatherOf, S::Bucket)>) -> Result<(), SyncError> {
        let pending = match self.start_gather(std::mem::take(buffers)) {
            Ok(pending) => pending,
            Err((back, error)) => {
                *buffers = back;
                return Err(error);
            }
        };
        let (back, outcome) = self.finish_gather(pending);
        *buffers = back;
        outcome
    }

    /// Hand `buffers` to the communicator (see [`GradSync::gather`]) and
    /// return at once: the gather runs behind any collective already
    /// queued, and several may be in flight (none of the same bucket), each
    /// answered as its own buffers come back, in the order they were
    /// started. Refused, with the buffers, when the session is failed or
    /// the actors are gone.
    pub fn start_gather(
        &mut self,
        buffers: Vec<(GatherOf, S::Bucket)>,
    ) -> Result<PendingGather<S::Bucket>, RefusedGather<S::Bucket>> {
        if let Some((failed, cause)) = &self.failed {
            return Err((buffers, SyncError::Poisoned { step: *failed, cause: cause.clone() }));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let asked = SchedMsg::Gather { buffers, reply: Reply::Blocking(tx) };
        if let Err(tokio::sync::mpsc::error::SendError(SchedMsg::Gather { buffers: unsent, .. })) =
            self.sched.send(asked)
        {
            return Err((unsent, SyncError::Closed));
        }
        Ok(PendingGather { answer: rx, step: self.hook.open_step() })
    }

    /// Wait for a gather [`GradSync::start_gather`] began: its buffers
    /// (empty only when the runtime is gone or does not answer within the
    /// answer timeout) and its outcome. A failure leaves the session failed
    /// until a reset.
    pub fn finish_gather(&mut self, pending: PendingGather<S::Bucket>) -> Gathered<S::Bucket> {
        let (back, outcome) = match self.await_answer(&pending.answer, pending.step) {
            Ok(answer) => answer,
            Err(error) => return (Vec::new(), Err(error)),
        };
        if let Err(e) = &outcome {
            if e.needs_reset() && self.failed.is_none() {
                self.failed = Some((pending.step, e.to_string()));
            }
        }
        (back, outcome)
    }

    fn configure(&mut self, setting: Setting) -> Result<(), SyncError> {
        if let Some((failed, cause)) = &self.failed {
            return Err(SyncError::Poisoned { step: *failed, cause: cause.clone() });
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.sched.send(SchedMsg::Configure { setting, reply: Reply::Blocking(tx) }).map_err(|_| SyncError::Closed)?;
        self.await_answer(&rx, self.hook.open_step())?
    }

    /// Payload vectors gradsync has finished with, for reuse as the next
    /// payloads of the same parameters (only with `recycle_payloads(true)`;
    /// otherwise always empty). Contents are stale: overwrite before sending.
    pub fn take_spent(&self) -> Vec<(ParamId, S::Values)> {
        self.spent.as_ref().map(|rx| rx.try_iter().collect()).unwrap_or_default()
    }

    /// The current step's progress, after every arrival sent so far was
    /// processed: buckets launched and completed, parameters ready. Blocks briefly.
    pub fn progress(&mut self) -> Result<Progress, SyncError> {
        let rx = self.request_progress(None)?;
        self.await_answer(&rx, self.hook.open_step())
    }

    /// Back-pressure on a producer of gradients: wait until at most
    /// `in_flight_at_most` of the current step's buckets are still in their
    /// collective (every arrival sent so far processed first), or the step
    /// failed or ended, for at most `within`. The progress then, or `None`
    /// when `within` passed first: ask again (a caller that polls, doing
    /// something else between its asks, asks the same request each time).
    pub fn await_in_flight(
        &mut self,
        in_flight_at_most: usize,
        within: Duration,
    ) -> Result<Option<Progress>, SyncError> {
        let rx = match self.in_flight_wait.take() {
            Some((most, rx)) if most == in_flight_at_most => rx.into_inner().unwrap_or_else(|e| e.into_inner()),
            _ => self.request_progress(Some(in_flight_at_most))?,
        };
        match rx.recv_timeout(within) {
            // (An answer about an earlier step, left by a wait that gave up: ask again.)
            Ok(progress) if progress.step < self.hook.open_step() => self.await_in_flight(in_flight_at_most, within),
            Ok(progress) => Ok(Some(progress)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                self.in_flight_wait = Some((in_flight_at_most, std::sync::Mutex::new(rx)));
                Ok(None)
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(SyncError::Closed),
        }
    }

    /// Ask every shard to settle a new request, and the scheduler to answer it.
    fn request_progress(
        &mut self,
        in_flight_at_most: Option<usize>,
    ) -> Result<std::sync::mpsc::Receiver<Progress>, SyncError> {
        let id = self.next_request;
        self.next_request += 1;
        for shard in &self.shards {
            shard.send(ShardMsg::Settle { id }).map_err(|_| SyncError::Closed)?;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let msg = SchedMsg::Progress { id, in_flight_at_most, reply: Reply::Blocking(tx) };
        self.sched.send(msg).map_err(|_| SyncError::Closed)?;
        Ok(rx)
    }

    /// Wait for the actors' answer about `step`, at most `answer_timeout`.
    fn await_answer<T>(&self, rx: &std::sync::mpsc::Receiver<T>, step: Step) -> Result<T, SyncError> {
        rx.recv_timeout(self.answer_timeout).map_err(|e| match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => SyncError::Unresponsive { step, waited: self.answer_timeout },
            std::sync::mpsc::RecvTimeoutError::Disconnected => SyncError::Closed,
        })
    }
}

/// A gather [`GradSync::start_gather`] refused: its buffers, and why.
pub type RefusedGather<B> = (Vec<(GatherOf, B)>, SyncError);

/// A gather handed to the communicator by [`GradSync::start_gather`] and
/// not yet waited for: where its answer comes, and the step it ran after
/// (for a timeout's error).
#[derive(Debug)]
pub struct PendingGather<B> {
    answer: std::sync::mpsc::Receiver<Gathered<B>>,
    step: Step,
}

/// Poll `future` on this thread until it completes or `timeout` passes,
/// parking between polls. Works inside and outside an async runtime (it
/// blocks the calling thread, as a blocking call does).
fn block_on_timeout<F: Future + Unpin>(future: &mut F, timeout: Duration) -> Option<F::Output> {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let deadline = Instant::now() + timeout;
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = Pin::new(&mut *future).poll(&mut cx) {
            return Some(out);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        std::thread::park_timeout(left);
    }
}

/// The transport's shutdown callback (opaque, so printed as a marker).
struct Interrupter(Interrupt);

impl std::fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interrupter")
    }
}

impl<S: GradStore> Drop for GradSync<S> {
    fn drop(&mut self) {
        let _ = self.sched.send(SchedMsg::Shutdown);
        for shard in &self.shards {
            let _ = shard.send(ShardMsg::Shutdown);
        }
        if let Some(Interrupter(interrupt)) = &self.interrupt {
            interrupt();
        }
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::error!(rank = self.rank, "a gradsync thread panicked");
            }
        }
    }
}
