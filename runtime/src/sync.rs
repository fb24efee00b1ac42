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
//! Dropping the GradSync stops the scheduler, interrupts a collective in
//! progress and joins both threads: nothing is leaked and nothing hangs.

use std::sync::Weak;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gradsync_actors::messages::{FinishRequest, Reply, SchedMsg, ShardMsg};
use gradsync_actors::param::ParamShard;
use gradsync_actors::scheduler::{Scheduler, SchedulerConfig};
use gradsync_actors::{
    AbortReason, GradStore, HostStore, Interrupt, ParamId, Plan, Progress, Step, StepResult, SyncError, Transport,
};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use crate::builder::{BuildError, Divisor, GradSyncBuilder};
use crate::hook::GradHook;

/// One rank's gradient synchronizer.
///
/// Give [`GradSync::hook`] clones to autograd hooks; call
/// [`GradSync::finish_step`] when backward is over on this rank (or
/// [`GradSync::abort_step`] when this rank cannot finish it).
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
    /// The step `finish_step` accepts next.
    next_step: Step,
    /// The last applied step's gradients: alive while the caller holds them.
    loan: Option<(Step, Weak<()>)>,
    /// Id of the next progress request.
    next_request: u64,
    /// Longest wait for an answer from the local actors.
    answer_timeout: Duration,
    interrupt: Option<Interrupter>,
    /// Consumed payloads coming back for reuse (with `recycle_payloads`).
    spent: Option<crossbeam_channel::Receiver<(ParamId, S::Values)>>,
    threads: Vec<JoinHandle<()>>,
}

impl GradSync {
    /// A builder: register parameters, choose settings, then `build`.
    pub fn builder() -> GradSyncBuilder {
        GradSyncBuilder::default()
    }
}

impl<S: GradStore> GradSync<S> {
    pub(crate) fn start<T: Transport<Store = S>>(b: &GradSyncBuilder, transport: T) -> Result<Self, BuildError> {
        let (rank, world) = (transport.rank(), transport.world());
        let plan = Arc::new(Plan::build(b.params.clone(), b.bucket_cap_bytes));
        let factor = match b.divisor {
            Divisor::WorldSize => 1.0 / world as f32,
            Divisor::Sum => 1.0,
            Divisor::Fixed(n) => 1.0 / n as f32,
        };
        let cfg = SchedulerConfig {
            rank,
            world,
            shards: b.param_shards,
            pieces: transport.pieces(),
            factor,
            collective_timeout: b.collective_timeout,
            check_finite: b.check_finite,
            record_timeline: b.record_timeline,
        };
        let interrupt = transport.interrupter().map(Interrupter);
        let store = transport.store();
        let (sched_tx, sched_rx) = unbounded_channel();
        let (comm_tx, comm_rx) = crossbeam_channel::unbounded();
        let mut scheduler = Scheduler::new(cfg, store.clone(), Arc::clone(&plan), comm_tx, sched_tx.clone())?;
        let spent = if b.recycle_payloads {
            let (tx, rx) = crossbeam_channel::bounded(2 * plan.num_params());
            scheduler = scheduler.with_spent_payloads(tx);
            Some(rx)
        } else {
            None
        };
        let mut shard_txs = Vec::with_capacity(b.param_shards);
        let mut shard_actors = Vec::with_capacity(b.param_shards);
        for i in 0..b.param_shards {
            let (tx, rx) = unbounded_channel();
            shard_txs.push(tx);
            let shard = ParamShard::new(store.clone(), i, b.param_shards, &plan, b.learning_window, sched_tx.clone());
            shard_actors.push((shard.with_idle_spin(b.idle_spin).with_timestamps(b.record_timeline), rx));
        }
        let spawn_err = |which: &'static str| move |e: std::io::Error| BuildError::Spawn { which, why: e.to_string() };
        let runtime = tokio::runtime::Builder::new_current_thread().build().map_err(spawn_err("actor runtime"))?;
        let actors = std::thread::Builder::new()
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
        let done_tx = sched_tx.clone();
        let comm = std::thread::Builder::new()
            .name(format!("gradsync-comm-r{rank}"))
            .spawn(move || gradsync_actors::comm::run_communicator(transport, comm_rx, done_tx))
            .map_err(spawn_err("communicator"))?;
        let numel = plan.params.iter().map(|p| p.numel).collect();
        let buckets = plan.buckets.len() as u32;
        Ok(GradSync {
            rank,
            world,
            hook: GradHook::new(shard_txs.clone(), numel, store),
            plan,
            shards: shard_txs,
            sched: sched_tx,
            next_step: 0,
            loan: None,
            next_request: 0,
            // Every collective of a step may use its full timeout before failing.
            answer_timeout: b.collective_timeout * (buckets + 3) + Duration::from_secs(10),
            interrupt,
            spent,
            threads: vec![actors, comm],
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

    /// The bucket plan in force.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The id of a registered parameter name.
    pub fn param_id(&self, name: &str) -> Option<ParamId> {
        self.plan.params.iter().position(|p| p.name == name).map(|i| ParamId(i as u32))
    }

    /// The step `finish_step` accepts next (the open step).
    pub fn current_step(&self) -> Step {
        self.next_step
    }

    /// Memory gradsync holds beyond the caller's gradients: the bucket buffers
    /// (one copy of every gradient, allocated once per plan) plus per-parameter
    /// metadata. `Accumulated` payloads handed over are the caller's gradients
    /// and are kept until the step finishes; they are not counted here.
    pub fn memory_bytes(&self) -> usize {
        let per_param = 4 * std::mem::size_of::<usize>() + 64;
        self.plan.bucket_bytes() + self.plan.num_params() * per_param
    }

    /// Backward of `step` is over on this rank: launch what is left, run the
    /// control collective (and a correction if any parameter arrived late), and
    /// return the report and the averaged gradients. Blocks; use
    /// [`GradSync::finish_step_async`] inside an async runtime.
    pub fn finish_step(&mut self, step: Step) -> Result<StepResult<S>, SyncError> {
        self.end_step(step, None)
    }

    /// This rank cannot finish `step` (out of memory, bad batch): its remaining
    /// collectives carry zeros and every rank's result is `Outcome::Skipped`
    /// naming this rank. Nobody hangs; the next step proceeds normally.
    pub fn abort_step(&mut self, step: Step, reason: AbortReason) -> Result<StepResult<S>, SyncError> {
        self.end_step(step, Some(reason))
    }

    fn end_step(&mut self, step: Step, abort: Option<AbortReason>) -> Result<StepResult<S>, SyncError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.request_end(step, abort, Reply::Blocking(tx))?;
        let answer = self.await_answer(&rx, step).and_then(|answer| answer);
        self.record_loan(answer)
    }

    /// Async form of [`GradSync::finish_step`].
    pub async fn finish_step_async(&mut self, step: Step) -> Result<StepResult<S>, SyncError> {
        self.end_step_async(step, None).await
    }

    /// Async form of [`GradSync::abort_step`].
    pub async fn abort_step_async(&mut self, step: Step, reason: AbortReason) -> Result<StepResult<S>, SyncError> {
        self.end_step_async(step, Some(reason)).await
    }

    async fn end_step_async(&mut self, step: Step, abort: Option<AbortReason>) -> Result<StepResult<S>, SyncError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.request_end(step, abort, Reply::Async(tx))?;
        let answer = rx.await.unwrap_or(Err(SyncError::Closed));
        self.record_loan(answer)
    }

    /// Validate on the caller's side, then flush the shards and ask the scheduler.
    fn request_end(
        &mut self,
        step: Step,
        abort: Option<AbortReason>,
        reply: Reply<Result<StepResult<S>, SyncError>>,
    ) -> Result<(), SyncError> {
        if step != self.next_step {
            return Err(SyncError::NotCurrentStep { expected: self.next_step, got: step });
        }
        self.ensure_not_borrowed(step)?;
        let at = Instant::now();
        for shard in &self.shards {
            shard.send(ShardMsg::Flush { step }).map_err(|_| SyncError::Closed)?;
        }
        // The shards have moved on to step + 1, whatever the answer.
        self.next_step += 1;
        let req = FinishRequest { step, abort, at, reply };
        self.sched.send(SchedMsg::Finish(req)).map_err(|_| SyncError::Closed)
    }

    fn record_loan(&mut self, answer: Result<StepResult<S>, SyncError>) -> Result<StepResult<S>, SyncError> {
        if let Ok(result) = &answer {
            self.loan = result.gradients.as_ref().map(|g| (result.report.step, g.liveness()));
        }
        answer
    }

    /// Recover from a failed step (a timeout, a desync): every rank whose
    /// GradSync failed calls `reset`; the ranks agree in one collective on the
    /// step to restart at (the largest step any of them had reached), which is
    /// returned. Gradients of the abandoned step, and arrivals sent between the
    /// failure and `reset`, are discarded: run that step's backward again.
    ///
    /// A rank that is gone (crashed) cannot agree: `reset` then fails naming it,
    /// and the survivors must drop their GradSync and build a new world.
    pub fn reset(&mut self) -> Result<Step, SyncError> {
        let proposed = self.next_step;
        self.ensure_not_borrowed(proposed)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.sched.send(SchedMsg::Reset { proposed, reply: Reply::Blocking(tx) }).map_err(|_| SyncError::Closed)?;
        let agreed = self.await_answer(&rx, proposed)??;
        for shard in &self.shards {
            shard.send(ShardMsg::Reset { step: agreed }).map_err(|_| SyncError::Closed)?;
        }
        self.next_step = agreed;
        self.loan = None;
        Ok(agreed)
    }

    /// Payload vectors gradsync has finished with, for reuse as the next
    /// payloads of the same parameters (only with `recycle_payloads(true)`;
    /// otherwise always empty). Contents are stale: overwrite before sending.
    pub fn take_spent(&self) -> Vec<(ParamId, S::Values)> {
        self.spent.as_ref().map(|rx| rx.try_iter().collect()).unwrap_or_default()
    }

    /// The open step's progress, after every arrival sent so far was processed:
    /// buckets launched and completed, parameters ready. Blocks briefly.
    pub fn progress(&mut self) -> Result<Progress, SyncError> {
        let id = self.next_request;
        self.next_request += 1;
        for shard in &self.shards {
            shard.send(ShardMsg::Settle { id }).map_err(|_| SyncError::Closed)?;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.sched.send(SchedMsg::Progress { id, reply: Reply::Blocking(tx) }).map_err(|_| SyncError::Closed)?;
        self.await_answer(&rx, self.next_step)
    }

    /// Wait for the actors' answer about `step`, at most `answer_timeout`.
    fn await_answer<T>(&self, rx: &std::sync::mpsc::Receiver<T>, step: Step) -> Result<T, SyncError> {
        rx.recv_timeout(self.answer_timeout).map_err(|e| match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => SyncError::Unresponsive { step, waited: self.answer_timeout },
            std::sync::mpsc::RecvTimeoutError::Disconnected => SyncError::Closed,
        })
    }

    /// Refuse to start ending `step` while the last applied step's gradients are held.
    fn ensure_not_borrowed(&self, step: Step) -> Result<(), SyncError> {
        match &self.loan {
            Some((loaned, alive)) if alive.strong_count() > 0 => {
                Err(SyncError::GradientsStillBorrowed { step, loaned: *loaned })
            }
            _ => Ok(()),
        }
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
