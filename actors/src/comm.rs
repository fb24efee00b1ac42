//! The communicator side: a [`Transport`] driven by one dedicated OS thread.
//!
//! The scheduler sends [`CommJob`]s over a crossbeam channel; the thread runs
//! them strictly in the order received (plan agreement once, then per step:
//! buckets in plan order, control, correction) and hands each back as a
//! [`CommDone`] to a *completion sink* (a closure; the wiring makes it post to
//! the scheduler's inbox). The thread's transport is moved in, never shared,
//! so backends whose handles are `!Send` once created (NCCL) live here.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use crate::error::{CollectiveKind, CollectiveTag, CommError};
use crate::policy::Wire;
use crate::store::{GradStore, HostStore};

/// One rank's endpoint of a communicator: sums buffers across all ranks.
///
/// Implementations must give every rank bit-identical results, honour the
/// deadline (returning [`CommError::Timeout`] naming the missing ranks where
/// they can), and detect a peer that issued a different collective where they
/// can. The `tag` of every call is the same on every rank for the same
/// position in the sequence; a transport that can carry it should compare it.
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
    /// Sum `bucket` element-wise over all ranks, then multiply by `factor`
    /// (given in f64, rounded to the bucket's element type).
    fn all_reduce_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut <Self::Store as GradStore>::Bucket,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError>;
    /// Sum `words` (wrapping) over all ranks.
    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError>;
    /// Forget the collective sequence in progress (after a failure) and start a
    /// new epoch: messages of earlier epochs are dropped. Local only; the reset
    /// agreement collective that follows synchronizes the ranks.
    fn reset(&mut self);
    /// Whether data buckets should reach this transport already multiplied by
    /// their factor, the multiply fused into packing, so that the collective
    /// only sums and gets factor `1.0` (corrections keep their factor).
    /// Worth it where scaling after the sum costs a separate pass over the
    /// bucket (the torch binding); default `false`, for transports that scale
    /// inside the reduction for free (the local world, NCCL).
    fn scale_when_packing(&self) -> bool {
        false
    }
    /// Whether data buckets ([`CollectiveKind::Bucket`]) are reduce-scattered
    /// instead of all-reduced (sharded training): after a bucket's collective
    /// only this rank's [`partition`](crate::plan::partition) of it holds the
    /// sum (the rest holds whatever the transport left there). Corrections
    /// still all-reduce, so every semantic that adds to or replaces part of
    /// a bucket stays exact on the partition. Default `false`. It joins the
    /// plan agreement, and a partitioned plan is never rebuilt.
    fn partitioned(&self) -> bool {
        false
    }
    /// Whether a partitioned rank also keeps the next rank's partition of
    /// each bucket (its *buddy* copy, for an elastic sharded job: a lost
    /// rank's partition lives on at the rank before it). The buckets must
    /// then be all-reduced (both partitions hold the sum). Default `false`;
    /// part of the plan agreement.
    fn buddies(&self) -> bool {
        false
    }
    /// How many collectives may be in flight at once. With more than one, the
    /// communicator calls the `start_*` methods for every queued collective up
    /// to this many, then [`Transport::wait_oldest`] for each in turn, so
    /// consecutive collectives overlap (the buckets left when backward ends,
    /// and the control vote behind them). Default 1: the `start_*` methods run
    /// the whole collective.
    fn max_in_flight(&self) -> usize {
        1
    }
    /// Start summing `bucket` (see [`Transport::all_reduce_grads`]); the result
    /// is due at the matching [`Transport::wait_oldest`]. `bucket` stays put
    /// and untouched until then. Default: the whole collective, now.
    fn start_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut <Self::Store as GradStore>::Bucket,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.all_reduce_grads(tag, bucket, factor, deadline)
    }
    /// Start summing `words` (see [`Transport::all_reduce_u64`]), due at the
    /// matching [`Transport::wait_oldest`]. Default: the whole collective, now.
    fn start_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.all_reduce_u64(tag, words, deadline)
    }
    /// Start gathering `bucket` (a sharded model's parameters): it holds
    /// `world` chunks of equal length back to back, this rank's at `rank *
    /// chunk` filled; every rank's chunk lands in its place, bit for bit.
    /// Due at the matching [`Transport::wait_oldest`]. Default: refused
    /// with [`CommError::Backend`] (a transport without an all-gather;
    /// the sharded wrappers that gather use one that has it).
    fn start_gather(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut <Self::Store as GradStore>::Bucket,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let _ = (bucket, deadline);
        Err(CommError::Backend { rank: self.rank(), tag, why: "this transport has no all-gather".into() })
    }
    /// Finish the oldest started collective (a no-op when `start_*` finished it).
    fn wait_oldest(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    /// Forget every started collective without waiting (they failed with an
    /// earlier one; a reset follows).
    fn discard_in_flight(&mut self) {}
    /// The types data buckets may travel in on this transport (default:
    /// float32 only). The builder refuses a wire type not listed.
    fn wires(&self) -> &'static [Wire] {
        &[Wire::F32]
    }

    /// Send data buckets ([`CollectiveKind::Bucket`]) as `wire` from now on,
    /// converting from and back to the bucket's type around the sum; other collectives
    /// stay exact. Called by the communicator thread before the first bucket
    /// of another wire type, never with a type [`Transport::wires`] leaves out.
    fn set_wire(&mut self, wire: Wire) {
        debug_assert_eq!(wire, Wire::F32, "a transport that lists only float32 was asked for {wire:?}");
    }

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
    pub factor: f64,
    /// The type a data bucket travels in (see [`Transport::set_wire`]);
    /// `F32` for every other collective.
    pub wire: Wire,
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

/// A collective the transport has started.
struct InFlight<S: GradStore> {
    tag: CollectiveTag,
    payload: CommPayload<S>,
    started: Instant,
    /// `Err` if starting it failed (it is then not in the transport's queue).
    start: Result<(), CommError>,
}

/// Body of the communicator thread: run jobs in order until the job channel
/// closes or `completed` returns `false` (nobody listens any more).
///
/// Up to [`Transport::max_in_flight`] collectives are started before the
/// oldest is waited for; results are reported strictly in submission order.
/// After a failed collective the communicator's sequence is broken (peers may
/// hold half of it), so every later job fails at once with the same error
/// instead of waiting out another deadline, until a reset job starts a new
/// epoch. A panicking transport fails the collective instead of leaving the
/// scheduler waiting for an answer that never comes.
pub fn run_communicator<T: Transport>(
    mut transport: T,
    jobs: Receiver<CommJob<T::Store>>,
    mut completed: impl FnMut(CommDone<T::Store>) -> bool,
) {
    let window = transport.max_in_flight().max(1);
    let mut rank = transport.rank();
    let mut broken: Option<CommError> = None;
    let mut flight: VecDeque<InFlight<T::Store>> = VecDeque::with_capacity(window);
    let mut open = true;
    let mut wire = Wire::F32;
    while open || !flight.is_empty() {
        // Start what is queued, up to the window; block only when idle.
        while open && flight.len() < window {
            let next = if flight.is_empty() { jobs.recv().ok() } else { jobs.try_recv().ok() };
            let Some(job) = next else {
                // Idle and the channel closed: nothing more will come.
                open = !flight.is_empty();
                break;
            };
            if matches!(job.tag.kind, CollectiveKind::Reset { .. }) {
                // A reset follows a failure: settle what is in flight first.
                while let Some(f) = flight.pop_front() {
                    let failed = broken.clone().unwrap_or(CommError::Cancelled { rank, tag: f.tag });
                    let done = CommDone {
                        tag: f.tag,
                        payload: f.payload,
                        result: f.start.and(Err(failed)),
                        started: f.started,
                        finished: Instant::now(),
                    };
                    if !completed(done) {
                        return;
                    }
                }
                transport.discard_in_flight();
                transport.reset();
                // An elastic job's reset may give this rank a new place.
                rank = transport.rank();
                broken = None;
            }
            if matches!(job.tag.kind, CollectiveKind::Bucket { .. }) && job.wire != wire {
                wire = job.wire;
                transport.set_wire(wire);
            }
            let started = Instant::now();
            let deadline = started + job.timeout;
            let mut payload = job.payload;
            let start = match &broken {
                Some(e) => Err(e.clone()),
                None => guarded(rank, job.tag, || match &mut payload {
                    CommPayload::Grads(buf)
                        if matches!(job.tag.kind, CollectiveKind::Gather { .. } | CollectiveKind::Norm { .. }) =>
                    {
                        transport.start_gather(job.tag, buf, deadline)
                    }
                    CommPayload::Grads(buf) => transport.start_grads(job.tag, buf, job.factor, deadline),
                    CommPayload::Words(words) => transport.start_u64(job.tag, words, deadline),
                }),
            };
            if let Err(e) = &start {
                if broken.is_none() {
                    broken = Some(e.clone());
                    transport.discard_in_flight();
                }
            }
            flight.push_back(InFlight { tag: job.tag, payload, started, start });
        }
        // Complete the oldest.
        let Some(f) = flight.pop_front() else { continue };
        let result = match (f.start, &broken) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(e)) => Err(e.clone()),
            (Ok(()), None) => guarded(rank, f.tag, || transport.wait_oldest()),
        };
        if let Err(e) = &result {
            if broken.is_none() {
                broken = Some(e.clone());
                transport.discard_in_flight();
            }
        }
        if !completed(CommDone { tag: f.tag, payload: f.payload, result, started: f.started, finished: Instant::now() })
        {
            return;
        }
    }
}

/// Run one transport call, turning a panic into [`CommError::Panicked`].
fn guarded(rank: usize, tag: CollectiveTag, call: impl FnOnce() -> Result<(), CommError>) -> Result<(), CommError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-text panic payload".to_string());
        Err(CommError::Panicked { rank, tag, why })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket_buf::BucketBuf;
    use std::sync::{Arc, Mutex};

    /// Records every call; collective `fail_at` (by start order) fails at its wait.
    struct Recording {
        log: Arc<Mutex<Vec<String>>>,
        window: usize,
        fail_at: Option<usize>,
        started: usize,
        waiting: VecDeque<usize>,
    }

    impl Transport for Recording {
        type Store = HostStore;
        fn store(&self) -> HostStore {
            HostStore
        }
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            1
        }
        fn all_reduce_grads(
            &mut self,
            _: CollectiveTag,
            _: &mut BucketBuf,
            _: f64,
            _: Instant,
        ) -> Result<(), CommError> {
            unreachable!("the windowed path calls start_grads")
        }
        fn all_reduce_u64(&mut self, _: CollectiveTag, _: &mut Vec<u64>, _: Instant) -> Result<(), CommError> {
            unreachable!("the windowed path calls start_u64")
        }
        fn reset(&mut self) {
            self.log.lock().unwrap().push("reset".into());
        }
        fn max_in_flight(&self) -> usize {
            self.window
        }
        fn start_grads(&mut self, tag: CollectiveTag, _: &mut BucketBuf, _: f64, _: Instant) -> Result<(), CommError> {
            self.log.lock().unwrap().push(format!("start {}", tag.step));
            self.waiting.push_back(self.started);
            self.started += 1;
            Ok(())
        }
        fn start_u64(&mut self, tag: CollectiveTag, _: &mut Vec<u64>, _: Instant) -> Result<(), CommError> {
            self.log.lock().unwrap().push(format!("start words {}", tag.step));
            self.waiting.push_back(self.started);
            self.started += 1;
            Ok(())
        }
        fn wait_oldest(&mut self) -> Result<(), CommError> {
            let n = self.waiting.pop_front().expect("a started collective");
            self.log.lock().unwrap().push(format!("wait {n}"));
            if self.fail_at == Some(n) {
                let tag = CollectiveTag { step: n as u64, kind: CollectiveKind::Bucket { index: 0, numel: 1 } };
                return Err(CommError::Timeout { rank: 0, tag, missing: vec![1], waited: Duration::ZERO });
            }
            Ok(())
        }
        fn discard_in_flight(&mut self) {
            self.log.lock().unwrap().push("discard".into());
            self.waiting.clear();
        }
    }

    fn job(step: u64) -> CommJob {
        let tag = CollectiveTag { step, kind: CollectiveKind::Bucket { index: 0, numel: 1 } };
        CommJob {
            tag,
            payload: CommPayload::Grads(BucketBuf::zeroed(1, 1)),
            factor: 1.0,
            timeout: Duration::from_secs(1),
            wire: Wire::F32,
        }
    }

    /// Run `jobs` (all queued before the thread starts) and return the log and the results' steps and outcomes.
    fn run(window: usize, fail_at: Option<usize>, jobs: Vec<CommJob>) -> (Vec<String>, Vec<(u64, bool)>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let transport = Recording { log: Arc::clone(&log), window, fail_at, started: 0, waiting: VecDeque::new() };
        let (tx, rx) = crossbeam_channel::unbounded();
        for j in jobs {
            tx.send(j).unwrap();
        }
        drop(tx);
        let mut results = Vec::new();
        run_communicator(transport, rx, |done| {
            results.push((done.tag.step, done.result.is_ok()));
            true
        });
        let log = log.lock().unwrap().clone();
        (log, results)
    }

    #[test]
    fn queued_collectives_overlap_up_to_the_window_and_complete_in_order() {
        let (log, results) = run(2, None, (0..4).map(job).collect());
        assert_eq!(log, ["start 0", "start 1", "wait 0", "start 2", "wait 1", "start 3", "wait 2", "wait 3"]);
        assert_eq!(results, vec![(0, true), (1, true), (2, true), (3, true)]);
    }

    #[test]
    fn a_failure_breaks_every_later_collective_until_a_reset() {
        let mut jobs: Vec<CommJob> = (0..3).map(job).collect();
        let mut reset = job(9);
        reset.tag.kind = CollectiveKind::Reset { len: 1 };
        reset.payload = CommPayload::Words(vec![0]);
        jobs.push(reset);
        jobs.push(job(4));
        let (log, results) = run(2, Some(0), jobs);
        // Collective 0 fails at its wait; 1 was started and is discarded, 2 fails at once.
        assert_eq!(&log[..4], ["start 0", "start 1", "wait 0", "discard"]);
        assert_eq!(results[..3], [(0, false), (1, false), (2, false)]);
        assert!(log.contains(&"reset".to_string()));
        assert_eq!(results.last(), Some(&(4, true)), "after the reset the communicator works again");
    }
}
