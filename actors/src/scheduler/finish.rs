//! The end of a step: close, drain, control collective, correction, result.
//!
//! A step closes once the caller asked to finish (or abort) *and* every
//! parameter shard has flushed, so every arrival sent before `finish_step` has
//! been packed. Closing marks the remaining parameters as unused (their slots
//! are zeroed at launch) and launches every remaining bucket in plan order.
//! When all data buckets are back, the control collective tells every rank the
//! same verdict: aborts (step skipped everywhere), fingerprints (desync is an
//! error), late parameters (one correction all-reduce, exact by linearity) and
//! parameters unused on every rank (reported as `None`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Phase, Scheduler, StepState};
use crate::arrival::{ParamId, PayloadKind};
use crate::bucket_buf::WriteMode;
use crate::comm::{CommDone, CommPayload};
use crate::error::{CollectiveKind, CollectiveTag, SyncError};
use crate::gradients::{Gradients, StepResult};
use crate::messages::{FinishRequest, ShardSummary};
use crate::plan::Fnv;
use crate::report::{AbortReason, Outcome, StepReport};
use crate::store::GradStore;
use crate::telemetry::{Lane, TimelineEvent};

impl<S: GradStore> Scheduler<S> {
    pub(super) fn on_finish(&mut self, req: FinishRequest<S>) {
        if let Some(f) = &self.failure {
            let err = if f.step == req.step {
                f.error.clone()
            } else {
                SyncError::Poisoned { step: f.step, cause: f.error.to_string() }
            };
            return req.reply.send(Err(err));
        }
        if let Some(loaned) = self.loaned {
            // The shards have flushed already; keep their messages for a retry.
            return req.reply.send(Err(SyncError::GradientsStillBorrowed { step: req.step, loaned }));
        }
        if req.step != self.state.step || self.state.finish.is_some() {
            let expected = self.state.step;
            return req.reply.send(Err(SyncError::NotCurrentStep { expected, got: req.step }));
        }
        self.begin();
        if self.cfg.record_timeline {
            let ev = TimelineEvent::instant("finish_step".into(), Lane::Backward, req.at);
            self.state.timeline.push(ev);
        }
        self.state.finish = Some(req);
        self.close_if_complete();
    }

    pub(super) fn on_flushed(&mut self, s: ShardSummary) {
        let st = &mut self.state;
        st.flushed += 1;
        st.arrivals += s.arrivals;
        st.duplicates += s.duplicates;
        st.rejected += s.rejected;
        let room = crate::report::REJECTION_SAMPLES.saturating_sub(st.rejections.len());
        st.rejections.extend(s.rejections.into_iter().take(room));
        for p in s.used {
            st.used[p.index()] = true;
        }
        for p in s.expect_none_next {
            st.expect_none_next[p.index()] = true;
        }
        self.close_if_complete();
    }

    fn close_if_complete(&mut self) {
        let st = &mut self.state;
        if st.phase != Phase::Open || st.flushed < self.cfg.shards || st.finish.is_none() {
            return;
        }
        st.phase = Phase::Draining;
        if let Some(f) = st.finish.as_mut() {
            if st.nonfinite && f.abort.is_none() {
                f.abort = Some(AbortReason::NonFinite);
            }
        }
        let aborting = st.finish.as_ref().is_some_and(|f| f.abort.is_some());
        for (b, bucket) in self.plan.buckets.iter().enumerate().skip(st.next_launch) {
            for p in &bucket.params {
                let p = p.index();
                if aborting {
                    // An aborting rank still issues every collective, with zeros.
                    st.written[p] = false;
                }
                if !st.ready[p] {
                    st.ready[p] = true;
                    st.pending[b] -= 1;
                }
            }
        }
        self.launch_ready_buckets();
        self.start_control_if_drained();
    }

    pub(super) fn on_done(&mut self, done: CommDone<S>) {
        let CommDone { tag, payload, result, started, finished } = done;
        if self.resetting.is_some() {
            // Collectives queued before the reset return first; only the
            // agreement matters now.
            if let (CollectiveKind::Reset { .. }, CommPayload::Words(words)) = (tag.kind, payload) {
                self.on_reset_agreed(result.map(|()| words));
            }
            return;
        }
        self.state.comm_busy += finished.saturating_duration_since(started);
        let took = finished.saturating_duration_since(started);
        crate::telemetry::collective(&self.rank_label, &tag.kind, payload.bytes(&self.store), took, &result);
        if self.cfg.record_timeline {
            let name = match tag.kind {
                CollectiveKind::Bucket { index, .. } => format!("all-reduce bucket {index}"),
                CollectiveKind::Control { .. } => "control".to_string(),
                CollectiveKind::Correction { .. } => "correction".to_string(),
                CollectiveKind::Reset { .. } => "reset".to_string(),
            };
            self.state.timeline.push(TimelineEvent::span(name, Lane::Communicator, started, finished));
        }
        if let Err(e) = result {
            return self.fail(e.into());
        }
        match (tag.kind, payload) {
            (CollectiveKind::Bucket { index, .. }, CommPayload::Grads(buf)) => {
                self.buffers[index] = Some(buf);
                self.state.done += 1;
                if self.before_finish(finished) {
                    self.state.done_before_finish += 1;
                }
                self.start_control_if_drained();
            }
            (CollectiveKind::Control { .. }, CommPayload::Words(words)) => self.on_control(&words),
            (CollectiveKind::Correction { .. }, CommPayload::Grads(buf)) => self.on_correction(&buf),
            (kind, _) => unreachable!("payload does not match collective {kind:?}"),
        }
    }

    fn start_control_if_drained(&mut self) {
        let st = &self.state;
        if st.phase != Phase::Draining || st.done < self.plan.buckets.len() {
            return;
        }
        let abort = st.finish.as_ref().and_then(|f| f.abort);
        let mut late = vec![false; self.plan.num_params()];
        for (p, l) in st.late.iter().enumerate() {
            late[p] = l.is_some();
        }
        let vote = super::ControlVote {
            rank: self.cfg.rank,
            world: self.cfg.world,
            abort,
            fingerprint: self.sequence_fingerprint(),
            late: &late,
            used: &st.used,
        };
        let words = vote.encode();
        let tag = CollectiveTag { step: st.step, kind: CollectiveKind::Control { len: words.len() } };
        self.state.phase = Phase::Control;
        self.submit(tag, CommPayload::Words(words));
    }

    /// Digest of the collective sequence this rank issued this step.
    fn sequence_fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        h.write(self.plan.fingerprint());
        h.write(self.state.step);
        h.write(self.state.next_launch as u64);
        h.0
    }

    fn on_control(&mut self, words: &[u64]) {
        let verdict = super::ControlVerdict::decode(words, self.cfg.world, self.plan.num_params());
        let differ = verdict.disagreeing_ranks();
        if !differ.is_empty() {
            let step = self.state.step;
            return self.fail(SyncError::Desync { step, ranks: differ, fingerprints: verdict.fingerprints });
        }
        self.state.unused_everywhere = verdict.unused_everywhere;
        if !verdict.aborted.is_empty() {
            return self.complete(Outcome::Skipped { aborted: verdict.aborted });
        }
        if verdict.late.is_empty() {
            return self.complete(Outcome::Applied);
        }
        self.start_correction(verdict.late);
    }

    /// Pack every late parameter's correction (zeros where this rank has none)
    /// and all-reduce it. All-reduce is linear, so adding the reduced
    /// corrections to the early result gives the reduction of the final values.
    fn start_correction(&mut self, late: Vec<ParamId>) {
        let numel: usize = late.iter().map(|p| self.plan.params[p.index()].numel).sum();
        let mut buf = match self.store.alloc_bucket(numel, self.cfg.pieces) {
            Ok(buf) => buf,
            Err(e) => return self.fail(e.into()),
        };
        let st = &mut self.state;
        let mut offset = 0;
        for &p in &late {
            let i = p.index();
            let n = self.plan.params[i].numel;
            if let Some(values) = st.late[i].take() {
                match (st.kind[i], st.packed[i].as_ref()) {
                    // Superseded after launch: contribute (final - what was sent).
                    (Some(PayloadKind::Accumulated), Some(sent)) => {
                        self.store.write_difference(&mut buf, offset, &values, sent)
                    }
                    // Late increments, or a first value after a zero launch.
                    _ => self.store.write(&mut buf, offset, &values, WriteMode::Set),
                }
            }
            st.correcting.push((p, offset));
            offset += n;
        }
        let tag = CollectiveTag { step: st.step, kind: CollectiveKind::Correction { numel } };
        st.phase = Phase::Correcting;
        self.submit(tag, CommPayload::Grads(buf));
    }

    fn on_correction(&mut self, buf: &S::Bucket) {
        for &(p, offset) in &self.state.correcting {
            let slot = self.plan.slots[p.index()];
            let n = self.plan.params[p.index()].numel;
            let dst = self.buffers[slot.bucket].as_mut().expect("data buckets are home after draining");
            self.store.add_from(dst, slot.offset, buf, offset, n);
        }
        self.complete(Outcome::Applied);
    }

    /// Abandon the open (failed) step and propose `proposed` as the restart step.
    /// Every rank writes its proposal into its own slot of the agreement vector,
    /// so the sum tells everyone every proposal; the maximum wins.
    pub(super) fn on_reset(
        &mut self,
        proposed: crate::arrival::Step,
        reply: crate::messages::Reply<Result<crate::arrival::Step, SyncError>>,
    ) {
        if let Some(req) = self.state.finish.take() {
            req.reply.send(Err(SyncError::Poisoned { step: self.state.step, cause: "reset requested".into() }));
        }
        self.deferred.clear();
        self.loaned = None;
        for (b, buf) in self.buffers.iter_mut().enumerate() {
            if buf.is_none() {
                // Lost in the failed collective (pieces held by peers): allocate anew.
                match self.store.alloc_bucket(self.plan.buckets[b].numel, self.cfg.pieces) {
                    Ok(fresh) => *buf = Some(fresh),
                    Err(e) => return reply.send(Err(e.into())),
                }
            }
        }
        let mut words = vec![0u64; self.cfg.world];
        words[self.cfg.rank] = proposed + 1;
        // Identical on every rank whatever it proposes, so proposals never look like a desync.
        let tag = CollectiveTag { step: 0, kind: CollectiveKind::Reset { len: words.len() } };
        self.resetting = Some(reply);
        // Peers reach their reset only after their own failing collective gives up
        // (at most one deadline after ours), so the agreement waits longer.
        let timeout = self.cfg.collective_timeout * 3;
        let job = crate::comm::CommJob::<S> { tag, payload: CommPayload::Words(words), factor: 1.0, timeout };
        if self.comm.send(job).is_err() {
            self.on_reset_agreed(Err(crate::error::CommError::Cancelled { rank: self.cfg.rank, tag }));
        }
    }

    fn on_reset_agreed(&mut self, result: Result<Vec<u64>, crate::error::CommError>) {
        let reply = self.resetting.take().expect("a reset is in progress");
        match result {
            Ok(words) => {
                let agreed = words.iter().copied().max().unwrap_or(1).saturating_sub(1);
                self.failure = None;
                self.state = StepState::new(agreed, self.plan.num_params(), self.plan.buckets.len());
                reply.send(Ok(agreed));
            }
            Err(e) => {
                let error = SyncError::from(e);
                self.failure = Some(super::Failure { step: self.state.step, error: error.clone() });
                reply.send(Err(error));
            }
        }
    }

    /// Answer the caller, lend the buffers if the step applies, start the next step.
    fn complete(&mut self, outcome: Outcome) {
        let next = StepState::new(self.state.step + 1, self.plan.num_params(), self.plan.buckets.len());
        let st = std::mem::replace(&mut self.state, next);
        let req = st.finish.expect("a completing step has a finish request");
        let report = StepReport {
            step: st.step,
            rank: self.cfg.rank,
            outcome: outcome.clone(),
            arrivals: st.arrivals,
            duplicates: st.duplicates,
            rejected: st.rejected,
            rejections: st.rejections,
            late_arrivals: st.late_arrivals,
            corrected: st.correcting.iter().map(|(p, _)| *p).collect(),
            corrections: u32::from(!st.correcting.is_empty()),
            unused_local: st.used.iter().filter(|u| !**u).count() as u32,
            unused_everywhere: (0..st.unused_everywhere.len())
                .filter(|&p| st.unused_everywhere[p])
                .map(|p| ParamId(p as u32))
                .collect(),
            buckets_launched: st.next_launch as u32,
            buckets_done_before_finish: st.done_before_finish,
            bytes_launched: st.bytes,
            exposed_comm: Instant::now().saturating_duration_since(req.at),
            comm_busy: st.comm_busy,
            timeline: st.timeline,
        };
        let step_time = st.began_at.map_or(Duration::ZERO, |t| t.elapsed());
        crate::telemetry::step(&self.rank_label, &report, step_time);
        self.expect_none = st.expect_none_next;
        for (p, v) in st.packed.into_iter().enumerate().filter_map(|(p, v)| v.map(|v| (p, v))) {
            self.recycle(ParamId(p as u32), v);
        }
        let gradients = outcome.is_applied().then(|| {
            let buffers = self.buffers.iter_mut().map(|b| b.take().expect("buffers are home")).collect();
            self.loaned = Some(st.step);
            Gradients::new(st.step, Arc::clone(&self.plan), buffers, st.unused_everywhere, self.home.clone())
        });
        req.reply.send(Ok(StepResult { report, gradients }));
        if self.loaned.is_none() {
            self.replay_deferred();
        }
    }
}
