//! The hook-side handle: what autograd hooks call, from any thread.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use gradsync_actors::messages::{SchedMsg, ShardMsg};
use gradsync_actors::plan::BucketEnds;
use gradsync_actors::{Arrival, GradStore, HostStore, ParamId, Payload, Rejection, Step, Token};
use tokio::sync::mpsc::UnboundedSender;

/// Hands gradients to gradsync. `Clone + Send + Sync`; every call is a few
/// bounds and atomic checks and one non-blocking channel send (no lock, no
/// await, no round trip).
///
/// The payload is moved, not copied. Every refusal the hook can decide on its
/// own is returned at once: an unknown parameter, a wrong length, a step that
/// is not the open one (finished, or not begun: finish the open step first),
/// and a payload kind different from the parameter's earlier arrivals in the
/// step. Refusals never touch a sum and are counted in the report of the step
/// they name.
///
/// `S` is where payloads live: host vectors by default, device buffers with
/// the CUDA backend.
#[derive(Debug)]
pub struct GradHook<S: GradStore = HostStore> {
    shared: Arc<HookShared<S>>,
}

impl<S: GradStore> Clone for GradHook<S> {
    fn clone(&self) -> Self {
        GradHook { shared: Arc::clone(&self.shared) }
    }
}

#[derive(Debug)]
struct HookShared<S: GradStore> {
    /// Inboxes of the parameter shards (parameter `p` → shard `p % len`).
    shards: Vec<UnboundedSender<ShardMsg<S>>>,
    /// The scheduler's inbox, where refusals are counted.
    scheduler: UnboundedSender<SchedMsg<S>>,
    /// Registered element count by parameter.
    numel: Vec<usize>,
    /// Measures payload lengths.
    store: S,
    /// The step arrivals are accepted for; the GradSync moves it on when the
    /// caller ends a step (and to the agreed step after a reset).
    open_step: AtomicU64,
    /// Per parameter: `step << 2 | kind code` of the latest step that had an
    /// arrival, so mixing kinds is refused without a lock.
    kinds: Vec<AtomicU64>,
    /// Per parameter: whether it is the last member of its bucket in the
    /// plan in force, where an [`ArrivalBatch`] delivers at once.
    bucket_ends: BucketEnds,
    /// Arrivals accepted by batches and not delivered yet; a step cannot end
    /// while any are held.
    held: AtomicUsize,
    /// Bumped by every reset: a batch drops arrivals held from before it.
    generation: AtomicU64,
}

impl<S: GradStore> GradHook<S> {
    pub(crate) fn new(
        shards: Vec<UnboundedSender<ShardMsg<S>>>,
        scheduler: UnboundedSender<SchedMsg<S>>,
        numel: Vec<usize>,
        bucket_ends: BucketEnds,
        store: S,
    ) -> Self {
        let kinds = numel.iter().map(|_| AtomicU64::new(0)).collect();
        let shared = HookShared {
            shards,
            scheduler,
            numel,
            store,
            open_step: AtomicU64::new(0),
            kinds,
            bucket_ends,
            held: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
        };
        GradHook { shared: Arc::new(shared) }
    }

    /// A batch for one caller thread: arrivals checked now, delivered in
    /// groups (see [`ArrivalBatch`]).
    pub fn batch(&self) -> ArrivalBatch<S> {
        ArrivalBatch::new(self.clone())
    }

    /// The store payloads are measured and packed with.
    #[cfg(feature = "cuda")]
    pub(crate) fn store(&self) -> &S {
        &self.shared.store
    }

    /// The open step: the one arrivals are accepted for. The runtime's one
    /// record of it (the [`crate::GradSync`] reads it here too).
    pub fn open_step(&self) -> Step {
        self.shared.open_step.load(Ordering::Acquire)
    }

    /// Accept arrivals for `step` from now on (the previous step has ended).
    pub(crate) fn open(&self, step: Step) {
        self.shared.open_step.store(step, Ordering::Release);
    }

    /// After a reset: accept `step`, and forget the abandoned steps' kinds.
    pub(crate) fn reopen(&self, step: Step) {
        for k in &self.shared.kinds {
            k.store(0, Ordering::Relaxed);
        }
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
        self.shared.held.store(0, Ordering::Release);
        self.open(step);
    }

    /// Arrivals held by batches, not yet delivered.
    pub(crate) fn held(&self) -> usize {
        self.shared.held.load(Ordering::Acquire)
    }

    /// Deliver one hook firing of `param` in `step`, identified by `token`.
    pub fn arrive(
        &self,
        step: Step,
        param: ParamId,
        token: Token,
        payload: Payload<S::Values>,
    ) -> Result<(), Rejection> {
        let shard = self.admit(step, param, &payload)?;
        let arrival = Arrival { step, param, token, payload };
        self.shared.shards[shard].send(ShardMsg::Arrival(arrival)).map_err(|_| Rejection::Closed)
    }

    /// Every check the call site can make; the shard `param` belongs to.
    fn admit(&self, step: Step, param: ParamId, payload: &Payload<S::Values>) -> Result<usize, Rejection> {
        let s = &*self.shared;
        let Some(&expected) = s.numel.get(param.index()) else {
            return self.refuse(step, Rejection::UnknownParam { param });
        };
        let got = s.store.values_len(payload.values());
        if got != expected {
            return self.refuse(step, Rejection::WrongLength { param, expected, got });
        }
        let open = s.open_step.load(Ordering::Acquire);
        if step < open {
            return self.refuse(step, Rejection::StepFinished { param, step });
        }
        if step > open {
            return self.refuse(step, Rejection::FutureStep { param, step, current: open });
        }
        if !self.claim_kind(step, param, payload.kind().code()) {
            return self.refuse(step, Rejection::MixedKinds { param });
        }
        Ok(param.index() % s.shards.len())
    }

    /// [`GradHook::arrive`] with the parameter's whole local gradient so far:
    /// among the step's `Accumulated` arrivals the highest token wins.
    pub fn accumulated(&self, step: Step, param: ParamId, token: Token, grad: S::Values) -> Result<(), Rejection> {
        self.arrive(step, param, token, Payload::Accumulated(grad))
    }

    /// [`GradHook::arrive`] with one additive contribution (summed with the
    /// step's other tokens).
    pub fn increment(&self, step: Step, param: ParamId, token: Token, grad: S::Values) -> Result<(), Rejection> {
        self.arrive(step, param, token, Payload::Increment(grad))
    }

    /// Record `kind` as `param`'s kind in `step` unless another kind got
    /// there first; `false` if it did. One load on the common path; a
    /// compare-and-swap for the first arrival of a step.
    fn claim_kind(&self, step: Step, param: ParamId, kind: u64) -> bool {
        let slot = &self.shared.kinds[param.index()];
        let want = (step << 2) | kind;
        let mut current = slot.load(Ordering::Acquire);
        loop {
            if current == want {
                return true;
            }
            if current >> 2 == step && current & 3 != 0 {
                return false; // this step already has the other kind
            }
            match slot.compare_exchange_weak(current, want, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// Count the refusal in the step it names (the scheduler owns the counts) and return it.
    fn refuse<T>(&self, step: Step, why: Rejection) -> Result<T, Rejection> {
        let _ = self.shared.scheduler.send(SchedMsg::Rejected { step, why: why.clone() });
        Err(why)
    }
}

/// A batch delivers once it holds this many arrivals.
const DELIVER_AT_ARRIVALS: usize = 64;
/// A batch delivers once its payloads reach this many bytes.
const DELIVER_AT_BYTES: usize = 256 << 10;

/// Arrivals checked at once and delivered to the parameter actors in groups,
/// for callers that hand over many small gradients.
///
/// Every [`GradHook::arrive`] is one channel send, and when the actors are
/// asleep (as they are between gradients of a backward pass that computes on
/// every core) one OS wake-up of their thread: tens of microseconds, which
/// dominates for gradients of a few kilobytes. A batch holds accepted
/// arrivals and sends them as one message when
///
/// * the arrival is the last member of its bucket in plan order (the bucket
///   can launch now, so nothing waits for the batch in the usual order),
/// * it holds 64 arrivals or 256 KiB of
///   payload (a large gradient goes at once), or
/// * [`ArrivalBatch::deliver`] is called, or the batch is dropped.
///
/// Refusals are decided and counted when the arrival is offered, exactly as
/// with [`GradHook::arrive`]. A step cannot end while a batch holds arrivals
/// of it: `finish_step` refuses with [`gradsync_actors::SyncError::Undelivered`]
/// (deliver first). After a `reset`, arrivals held from the failed step are
/// dropped, never delivered into the step that replaces it.
///
/// A batch belongs to one thread (`Send`, not `Clone`); use one per thread
/// that runs hooks.
#[derive(Debug)]
pub struct ArrivalBatch<S: GradStore = HostStore> {
    hook: GradHook<S>,
    /// Accepted arrivals, in the order offered, with each one's shard.
    held: Vec<(usize, Arrival<S::Values>)>,
    /// Bytes of the held payloads.
    held_bytes: usize,
    /// The hook's reset generation when the oldest held arrival was accepted.
    generation: u64,
}

impl<S: GradStore> ArrivalBatch<S> {
    fn new(hook: GradHook<S>) -> Self {
        ArrivalBatch { hook, held: Vec::with_capacity(DELIVER_AT_ARRIVALS), held_bytes: 0, generation: 0 }
    }

    /// Offer one hook firing (see [`GradHook::arrive`]); it is delivered with
    /// the batch.
    pub fn arrive(
        &mut self,
        step: Step,
        param: ParamId,
        token: Token,
        payload: Payload<S::Values>,
    ) -> Result<(), Rejection> {
        let shard = self.hook.admit(step, param, &payload)?;
        let generation = self.hook.shared.generation.load(Ordering::Acquire);
        if generation != self.generation {
            self.drop_stale(generation);
        }
        let shared = &*self.hook.shared;
        self.held_bytes += shared.numel[param.index()] * std::mem::size_of::<f32>();
        self.held.push((shard, Arrival { step, param, token, payload }));
        shared.held.fetch_add(1, Ordering::AcqRel);
        if shared.bucket_ends.is_end(param)
            || self.held.len() >= DELIVER_AT_ARRIVALS
            || self.held_bytes >= DELIVER_AT_BYTES
        {
            self.deliver()?;
        }
        Ok(())
    }

    /// [`ArrivalBatch::arrive`] with one additive contribution.
    pub fn increment(&mut self, step: Step, param: ParamId, token: Token, grad: S::Values) -> Result<(), Rejection> {
        self.arrive(step, param, token, Payload::Increment(grad))
    }

    /// [`ArrivalBatch::arrive`] with the parameter's whole local gradient so far.
    pub fn accumulated(&mut self, step: Step, param: ParamId, token: Token, grad: S::Values) -> Result<(), Rejection> {
        self.arrive(step, param, token, Payload::Accumulated(grad))
    }

    /// Send every held arrival to its parameter actor now (one message per
    /// shard). `Err(Rejection::Closed)` if the actors have stopped.
    pub fn deliver(&mut self) -> Result<(), Rejection> {
        if self.held.is_empty() {
            return Ok(());
        }
        let shared = &*self.hook.shared;
        let generation = shared.generation.load(Ordering::Acquire);
        if generation != self.generation {
            self.drop_stale(generation);
            return Ok(());
        }
        let count = self.held.len();
        self.held_bytes = 0;
        let mut per_shard: Vec<Vec<Arrival<S::Values>>> = shared.shards.iter().map(|_| Vec::new()).collect();
        for (shard, arrival) in self.held.drain(..) {
            per_shard[shard].push(arrival);
        }
        let mut result = Ok(());
        for (inbox, batch) in shared.shards.iter().zip(per_shard) {
            if !batch.is_empty() && inbox.send(ShardMsg::Arrivals(batch)).is_err() {
                result = Err(Rejection::Closed);
            }
        }
        shared.held.fetch_sub(count, Ordering::AcqRel);
        result
    }

    /// The open step (see [`GradHook::open_step`]): arrivals offered for it
    /// are accepted.
    pub fn open_step(&self) -> Step {
        self.hook.open_step()
    }

    /// Arrivals held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// A reset happened since the held arrivals were accepted: they belong to
    /// an abandoned step (the reset already cleared the shared count).
    fn drop_stale(&mut self, generation: u64) {
        self.held.clear();
        self.held_bytes = 0;
        self.generation = generation;
    }
}

impl<S: GradStore> Drop for ArrivalBatch<S> {
    fn drop(&mut self) {
        // Nothing is lost: a closed runtime is the only way this can fail.
        let _ = self.deliver();
    }
}
