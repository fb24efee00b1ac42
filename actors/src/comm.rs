//! The communicator side: a [`Transport`] driven by one dedicated OS thread.
//!
//! The scheduler sends [`CommJob`]s over a crossbeam channel; the thread runs
//! them strictly in the order received (which is plan order, then control, then
//! correction) and answers each with a [`CommDone`] on the scheduler's inbox.
//! Backends whose handles are `!Send` (NCCL) build their transport on this thread.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::{CollectiveTag, CommError};
use crate::messages::SchedMsg;
use crate::store::{GradStore, HostStore};

/// One rank's endpoint of a communicator: sums buffers across all ranks.
///
/// Implementations must give every rank bit-identical results, honour the
/// deadline (returning [`CommError::Timeout`] naming the missing ranks), and
/// detect a peer that issued a different collective where they can.
pub trait Transport: Send + 'static {
    /// Where this transport's buckets live (host memory, a device).
    type Store: GradStore;
    /// The store the actors must use to pack buckets for this transport (for a
    /// device: one bound to the communicator's stream).
    fn store(&self) -> Self::Store;
    /// This rank's index in `0..world()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// In how many pieces bucket buffers should be allocated (the local
    /// backend moves one piece to each rank).
    fn pieces(&self) -> usize {
        self.world()
    }
    /// Sum `bucket` element-wise over all ranks, then multiply by `factor`.
    fn all_reduce_f32(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut <Self::Store as GradStore>::Bucket,
        factor: f32,
        deadline: Instant,
    ) -> Result<(), CommError>;
    /// Sum `words` (wrapping) over all ranks.
    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError>;
    /// Forget the collective sequence in progress (after a failure) and start a
    /// new epoch: messages of earlier epochs are dropped. Local only; the reset
    /// agreement collective that follows synchronizes the ranks.
    fn reset(&mut self);
    /// A callback that makes a wait in progress fail promptly with
    /// [`CommError::Cancelled`], used at shutdown. `None` if waits cannot be cut short
    /// (shutdown then waits for the collective deadline).
    fn interrupter(&self) -> Option<Interrupt> {
        None
    }
}

/// Cuts a transport's wait short (see [`Transport::interrupter`]).
pub type Interrupt = Box<dyn Fn() + Send + Sync>;

/// What travels through a collective.
#[derive(Debug)]
pub enum CommPayload<S: GradStore = HostStore> {
    /// Gradient values (a data bucket or a correction).
    Grads(S::Bucket),
    /// Control words.
    Words(Vec<u64>),
}

impl<S: GradStore> CommPayload<S> {
    /// Bytes this rank contributes.
    pub fn bytes(&self, store: &S) -> usize {
        match self {
            CommPayload::Grads(b) => store.bucket_numel(b) * std::mem::size_of::<f32>(),
            CommPayload::Words(w) => w.len() * 8,
        }
    }
}

/// A collective to run.
#[derive(Debug)]
pub struct CommJob<S: GradStore = HostStore> {
    /// Which collective.
    pub tag: CollectiveTag,
    /// Its buffer (moved to the communicator thread and back).
    pub payload: CommPayload<S>,
    /// Scale applied after summing gradients (`1 / divisor`).
    pub factor: f32,
    /// How long the collective may wait for peers once started.
    pub timeout: Duration,
}

/// A finished collective, successful or not.
#[derive(Debug)]
pub struct CommDone<S: GradStore = HostStore> {
    /// Which collective.
    pub tag: CollectiveTag,
    /// The buffer, reduced on success. On failure its content is unspecified and
    /// pieces may be missing.
    pub payload: CommPayload<S>,
    /// Outcome.
    pub result: Result<(), CommError>,
    /// When the communicator started it.
    pub started: Instant,
    /// When it returned.
    pub finished: Instant,
}

/// Body of the communicator thread: run jobs in order until the scheduler hangs up.
///
/// After a failed collective the communicator's sequence is broken (peers may
/// hold half of it), so every later job fails at once with the same error
/// instead of waiting out another deadline.
pub fn run_communicator<T: Transport>(
    mut transport: T,
    jobs: Receiver<CommJob<T::Store>>,
    done: UnboundedSender<SchedMsg<T::Store>>,
) {
    let mut broken: Option<CommError> = None;
    while let Ok(job) = jobs.recv() {
        if matches!(job.tag.kind, crate::error::CollectiveKind::Reset { .. }) {
            transport.reset();
            broken = None;
        }
        let started = Instant::now();
        let deadline = started + job.timeout;
        let mut payload = job.payload;
        let rank = transport.rank();
        // A panicking transport must fail the step, not leave the scheduler
        // waiting for an answer that never comes.
        let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match (&broken, &mut payload) {
            (Some(e), _) => Err(e.clone()),
            (None, CommPayload::Grads(buf)) => transport.all_reduce_f32(job.tag, buf, job.factor, deadline),
            (None, CommPayload::Words(words)) => transport.all_reduce_u64(job.tag, words, deadline),
        }));
        let result = attempt.unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-text panic payload".to_string());
            Err(CommError::Panicked { rank, tag: job.tag, why })
        });
        if let Err(e) = &result {
            broken.get_or_insert_with(|| e.clone());
        }
        let msg = CommDone { tag: job.tag, payload, result, started, finished: Instant::now() };
        if done.send(SchedMsg::Done(msg)).is_err() {
            break;
        }
    }
}
