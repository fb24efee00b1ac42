//! [`GatherLane`]: parameter sharding's second communicator, for the gathers
//! that run inside forward and backward.
//!
//! A unit's gather needed by the next layer's backward must not wait behind
//! the reduce-scatters already queued on the step's communicator (one
//! thread runs its collectives in order), and it cannot join that queue at
//! all: where a rank issues it among the step's buckets depends on its own
//! backward, so two ranks would pair a gather with a reduction. The lane is
//! a communicator of its own (its thread, its transport over a group of its
//! own and, on the device plane, its own stream and NCCL communicator), so
//! the two sequences never meet and cannot deadlock against each other.
//!
//! What flows through it, one *round* at a time:
//!
//! ```text
//! needs(words)   ─▶ Needs collective: every rank's words, summed (which units any rank needs)
//!                   (or post_needs(words), then sum_within(tick) until the sum comes)
//! start(b, buf)… ─▶ one Gather collective per bucket of those units, in the agreed order
//! wait()…        ◀── each buffer back, oldest first, with its outcome
//! ```
//!
//! Every rank runs the same rounds in the same order (the caller's protocol,
//! `gradsync.torch.sharding.units`, makes sure of it: a round gathers the
//! union of what the ranks asked, so no rank's forward decides alone). A
//! failed collective breaks the lane: what is queued behind it fails at
//! once with the same error, until [`GatherLane::reset`] starts a new
//! epoch on every rank.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use gradsync_actors::comm::{run_communicator, CommDone, CommJob, CommPayload, Interrupt, Transport};
use gradsync_actors::error::{BuildError, CollectiveKind, CollectiveTag, SyncError};
use gradsync_actors::policy::Wire;
use gradsync_actors::store::GradStore;

/// One rank's gather lane (see the module docs).
pub struct GatherLane<S: GradStore> {
    /// Jobs to the lane's communicator thread; `None` once closed.
    jobs: Option<Sender<CommJob<S>>>,
    /// What the thread hands back, in submission order.
    done: Receiver<CommDone<S>>,
    /// The communicator thread (joined on drop).
    thread: Option<JoinHandle<()>>,
    /// Cuts a wait in progress short at drop, where the transport can.
    interrupt: Option<Interrupt>,
    /// Where the lane's buffers must live (the transport's store).
    store: S,
    /// The current round: the step of every tag the lane submits, so a
    /// transport that compares tags sees two ranks in different rounds.
    round: u64,
    /// Collectives submitted and not yet waited for.
    out: usize,
    /// How long each collective may wait for the other ranks.
    timeout: Duration,
    rank: usize,
}

impl<S: GradStore> std::fmt::Debug for GatherLane<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatherLane")
            .field("rank", &self.rank)
            .field("round", &self.round)
            .field("out", &self.out)
            .finish()
    }
}

impl<S: GradStore> GatherLane<S> {
    /// Start the lane's communicator thread on `transport`; each collective
    /// may wait `timeout` for the other ranks.
    pub fn start<T: Transport<Store = S>>(transport: T, timeout: Duration) -> Result<Self, BuildError> {
        let rank = transport.rank();
        let store = transport.store();
        let interrupt = transport.interrupter();
        let (jobs, jobs_rx) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name(format!("gradsync-lane-r{rank}"))
            .spawn(move || run_communicator(transport, jobs_rx, move |d| done_tx.send(d).is_ok()))
            .map_err(|e| BuildError::Spawn { which: "gather lane", why: e.to_string() })?;
        Ok(GatherLane {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            interrupt,
            store,
            round: 0,
            out: 0,
            timeout,
            rank,
        })
    }

    /// The store the lane's buffers must come from.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Collectives submitted and not yet waited for.
    pub fn in_flight(&self) -> usize {
        self.out
    }

    /// Open the next round: sum `words` over every rank and return the sum.
    /// Refused while a gather of the round before is still out.
    pub fn needs(&mut self, words: Vec<u64>) -> Result<Vec<u64>, SyncError> {
        self.post_needs(words)?;
        match self.wait_payload()? {
            (CommPayload::Words(sum), Ok(())) => Ok(sum),
            (_, Err(e)) => Err(e),
            (CommPayload::Grads(_), Ok(())) => unreachable!("a Needs collective carries words"),
        }
    }

    /// Open the next round without waiting for it: `words` go out, and
    /// [`sum_within`](Self::sum_within) takes the sum when it comes (a rank
    /// that waits for something else meanwhile: its reductions). Refused
    /// while a gather of the round before, or a sum, is still out.
    pub fn post_needs(&mut self, words: Vec<u64>) -> Result<(), SyncError> {
        if self.out > 0 {
            let why = format!("{} collectives of round {} are still out: wait for them first", self.out, self.round);
            return Err(SyncError::Setting { setting: "gather lane", why });
        }
        self.round += 1;
        let tag = CollectiveTag { step: self.round, kind: CollectiveKind::Needs { len: words.len() } };
        self.submit(tag, CommPayload::Words(words)).map_err(|(_, e)| e)
    }

    /// The sum of the round [`post_needs`](Self::post_needs) opened, if it
    /// comes within `within`; `None` if not yet (ask again). A failed
    /// collective is its error, as with [`needs`](Self::needs).
    pub fn sum_within(&mut self, within: Duration) -> Result<Option<Vec<u64>>, SyncError> {
        if self.out != 1 {
            let why = format!("{} collectives are out: a sum is taken after post_needs alone", self.out);
            return Err(SyncError::Setting { setting: "gather lane", why });
        }
        match self.done.recv_timeout(within) {
            Ok(done) => {
                self.out -= 1;
                match (done.payload, done.result.map_err(SyncError::from)) {
                    (CommPayload::Words(sum), Ok(())) => Ok(Some(sum)),
                    (_, Err(e)) => Err(e),
                    (CommPayload::Grads(_), Ok(())) => unreachable!("a Needs collective carries words"),
                }
            }
            // (The transport honours the collective's deadline and answers with its error.)
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                self.out = 0;
                self.jobs = None;
                Err(SyncError::Closed)
            }
        }
    }

    /// Start gathering `buffer` (bucket `index`: every rank's chunk back to
    /// back, this rank's written) in the current round. On refusal the
    /// buffer comes back with the error.
    pub fn start_gather(&mut self, index: usize, buffer: S::Bucket) -> Result<(), (S::Bucket, SyncError)> {
        let numel = self.store.bucket_numel(&buffer);
        let tag = CollectiveTag { step: self.round, kind: CollectiveKind::Gather { index, numel } };
        match self.submit(tag, CommPayload::Grads(buffer)) {
            Ok(()) => Ok(()),
            Err((CommPayload::Grads(buffer), e)) => Err((buffer, e)),
            Err((CommPayload::Words(_), _)) => unreachable!("a gather carries its buffer"),
        }
    }

    /// Wait for the oldest gather [`start_gather`](Self::start_gather)
    /// began: its buffer (every chunk in place on success) and outcome, or
    /// `None` for the buffer if the lane stopped answering.
    pub fn wait_gather(&mut self) -> (Option<S::Bucket>, Result<(), SyncError>) {
        match self.wait_payload() {
            Ok((CommPayload::Grads(buffer), outcome)) => (Some(buffer), outcome),
            Ok((CommPayload::Words(_), _)) => unreachable!("only gathers are out after the round's needs"),
            Err(e) => (None, Err(e)),
        }
    }

    /// After a failure, on every rank: settle what is still out, then agree
    /// on a new epoch of the lane's group (a collective).
    pub fn reset(&mut self) -> Result<(), SyncError> {
        while self.out > 0 {
            let _ = self.wait_payload();
        }
        let tag = CollectiveTag { step: 0, kind: CollectiveKind::Reset { len: 1 } };
        self.submit(tag, CommPayload::Words(vec![1])).map_err(|(_, e)| e)?;
        self.round = 0;
        self.wait_payload()?.1
    }

    /// Hand `payload` to the thread (tagged `tag`); it comes back if the
    /// thread is gone.
    fn submit(&mut self, tag: CollectiveTag, payload: CommPayload<S>) -> Result<(), (CommPayload<S>, SyncError)> {
        let Some(jobs) = &self.jobs else {
            return Err((payload, SyncError::Closed));
        };
        let job = CommJob { tag, payload, factor: 1.0, wire: Wire::F32, timeout: self.timeout };
        match jobs.send(job) {
            Ok(()) => {
                self.out += 1;
                Ok(())
            }
            Err(back) => Err((back.0.payload, SyncError::Closed)),
        }
    }

    /// The oldest collective out, back from the thread.
    fn wait_payload(&mut self) -> Result<(CommPayload<S>, Result<(), SyncError>), SyncError> {
        if self.out == 0 {
            let why = "nothing is in flight on the gather lane".to_string();
            return Err(SyncError::Setting { setting: "gather lane", why });
        }
        // The transport honours the deadline; the margin covers a thread
        // that stopped answering altogether.
        let answer = self.done.recv_deadline(Instant::now() + self.timeout * 2 + Duration::from_secs(10));
        self.out -= 1;
        match answer {
            Ok(done) => Ok((done.payload, done.result.map_err(SyncError::from))),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                self.out = 0;
                self.jobs = None;
                Err(SyncError::Closed)
            }
        }
    }
}

impl<S: GradStore> Drop for GatherLane<S> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(interrupt) = &self.interrupt {
            interrupt();
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!(rank = self.rank, "the gather lane's thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::LocalWorld;
    use gradsync_actors::bucket_buf::{BucketBuf, WriteMode};
    use gradsync_actors::store::HostStore;

    /// Rank `rank`'s gather buffer of `world` chunks of `chunk` values: its
    /// own chunk holds `100 * rank + i`, the others zero.
    fn buffer(rank: usize, world: usize, chunk: usize) -> BucketBuf {
        let mut buf = BucketBuf::zeroed(world * chunk, 1);
        let mine: Vec<f32> = (0..chunk).map(|i| (100 * rank + i) as f32).collect();
        buf.write(rank * chunk, &mine, WriteMode::Set);
        buf
    }

    #[test]
    fn a_posted_round_is_taken_when_every_rank_posted_it() {
        let endpoints = LocalWorld::connect(2).unwrap();
        let (release, late) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let mut endpoints = endpoints.into_iter();
            let (first, second) = (endpoints.next().unwrap(), endpoints.next().unwrap());
            s.spawn(move || {
                let mut lane: GatherLane<HostStore> = GatherLane::start(first, Duration::from_secs(5)).unwrap();
                lane.post_needs(vec![1, 0]).unwrap();
                assert!(lane.needs(vec![0]).is_err(), "no round opens while a sum is out");
                assert_eq!(lane.sum_within(Duration::from_millis(1)).unwrap(), None, "rank 1 has not posted");
                release.send(()).unwrap();
                let sum = loop {
                    if let Some(sum) = lane.sum_within(Duration::from_millis(50)).unwrap() {
                        break sum;
                    }
                };
                assert_eq!(sum, vec![1, 1]);
                assert!(lane.sum_within(Duration::ZERO).is_err(), "nothing is posted");
            });
            s.spawn(move || {
                let mut lane: GatherLane<HostStore> = GatherLane::start(second, Duration::from_secs(5)).unwrap();
                late.recv().unwrap();
                assert_eq!(lane.needs(vec![0, 1]).unwrap(), vec![1, 1]);
            });
        });
    }

    #[test]
    fn a_round_sums_the_needs_then_gathers_every_chunk_in_order() {
        let world = 3;
        let endpoints = LocalWorld::connect(world).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = endpoints
                .into_iter()
                .map(|ep| {
                    s.spawn(move || {
                        let rank = ep.rank();
                        let mut lane: GatherLane<HostStore> = GatherLane::start(ep, Duration::from_secs(5)).unwrap();
                        // Rank r needs unit r; the sum says which units any rank needs.
                        let mut words = vec![0u64; world];
                        words[rank] = 1;
                        let needs = lane.needs(words).unwrap();
                        assert!(lane.needs(vec![0]).is_ok(), "a round with nothing out may follow at once");
                        for b in 0..2 {
                            lane.start_gather(b, buffer(rank, world, 4 + b)).map_err(|(_, e)| e).unwrap();
                        }
                        assert!(lane.needs(vec![0]).is_err(), "no round opens while gathers are out");
                        let gathered: Vec<Vec<f32>> = (0..2)
                            .map(|_| {
                                let (buf, outcome) = lane.wait_gather();
                                outcome.unwrap();
                                buf.unwrap().piece(0).to_vec()
                            })
                            .collect();
                        (needs, gathered)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (needs, gathered) in results {
            assert_eq!(needs, vec![1, 1, 1]);
            for (b, values) in gathered.iter().enumerate() {
                let chunk = 4 + b;
                let want: Vec<f32> = (0..world).flat_map(|r| (0..chunk).map(move |i| (100 * r + i) as f32)).collect();
                assert_eq!(values, &want, "bucket {b}: every rank's chunk in place");
            }
        }
    }

    #[test]
    fn a_missing_rank_fails_the_round_within_the_deadline_and_a_reset_recovers() {
        let deadline = Duration::from_secs(2);
        let endpoints = LocalWorld::connect(2).unwrap();
        let mut endpoints = endpoints.into_iter();
        let (first, second) = (endpoints.next().unwrap(), endpoints.next().unwrap());
        let (failed_tx, failed_rx) = crossbeam_channel::bounded(1);
        std::thread::scope(|s| {
            let late = s.spawn(move || {
                let mut lane: GatherLane<HostStore> = GatherLane::start(second, deadline).unwrap();
                // Rank 1 skips the first round; once rank 0's failed, both reset.
                failed_rx.recv().unwrap();
                lane.reset().unwrap();
                lane.needs(vec![2]).unwrap()
            });
            let mut lane: GatherLane<HostStore> = GatherLane::start(first, deadline).unwrap();
            let began = Instant::now();
            let error = lane.needs(vec![1]).unwrap_err();
            let waited = began.elapsed();
            failed_tx.send(()).unwrap();
            assert!(waited >= deadline && waited < deadline * 3, "the deadline was honoured: {waited:?}");
            assert!(matches!(error, SyncError::Comm(_)), "{error}");
            assert!(error.to_string().contains("gather round 1"), "the error names the round: {error}");
            lane.reset().unwrap();
            assert_eq!(lane.needs(vec![1]).unwrap(), vec![3]);
            assert_eq!(late.join().unwrap(), vec![3]);
        });
    }
}
