//! The end of a step: close, drain, control collective, correction, result.
//!
//! A step closes once the caller asked to end it *and* every parameter shard
//! has flushed, so every arrival sent before `finish_step` has been packed.
//! Closing marks the remaining parameters as unused (their slots are zeroed at
//! launch), launches every remaining bucket in plan order and, right behind
//! them, the control collective. Its answer (which arrives after every data
//! bucket's) tells every rank the same verdict:
//! desync (an error naming the odd ranks), aborts (skip, or under the partial
//! policy exclude the aborting ranks), joins, late parameters (one correction
//! all-reduce, exact by linearity) and parameters unused on every rank.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::control::{disagreement, ControlVerdict, ControlVote, RankStatus};
use super::step::{Correction, Lifecycle, StepState};
use super::Scheduler;
use crate::arrival::{DType, ParamId, PayloadKind};
use crate::bucket_buf::WriteMode;
use crate::comm::CommPayload;
use crate::error::{CollectiveKind, CollectiveTag, SyncError};
use crate::gradients::{Gradients, LoanHome, StepResult};
use crate::messages::{FinishRequest, SchedMsg, ShardSummary, StepEnd};
use crate::plan::Fnv;
use crate::policy::AbortPolicy;
use crate::report::{AbortReason, Outcome, StepReport};
use crate::store::GradStore;
use crate::timeline::{Lane, TimelineEvent};

impl<S: GradStore> Scheduler<S> {
    /// The caller ends the current step (finish, abort or join).
    pub(super) fn on_finish(&mut self, req: FinishRequest<S>) {
        if matches!(self.lifecycle, Lifecycle::Failed(_)) {
            self.salvage_end(req.step, req.end);
        }
        if let Lifecycle::Failed(f) = &self.lifecycle {
            let err = if f.step == req.step {
                f.error.clone()
            } else {
                SyncError::Poisoned { step: f.step, cause: f.error.to_string() }
            };
            return req.reply.send(Err(err));
        }
        if req.step != self.step.step || !matches!(self.lifecycle, Lifecycle::Open) {
            // The runtime checks the step before asking, so this is a caller
            // racing itself (or a reset in progress).
            let expected = self.step.step;
            return req.reply.send(Err(SyncError::NotCurrentStep { expected, got: req.step }));
        }
        if !self.begin() {
            return req.reply.send(Err(SyncError::Poisoned { step: self.step.step, cause: "no bucket memory".into() }));
        }
        // A step reduced again after a change of members starts with everything packed.
        self.feed_redo();
        if self.cfg.record_timeline {
            self.step.timeline.push(TimelineEvent::instant("finish_step".into(), Lane::Backward, req.at));
        }
        self.step.end = Some(req.end);
        self.step.finish_at = Some(req.at);
        self.lifecycle = Lifecycle::Flushing(req);
        self.close_if_flushed();
    }

    pub(super) fn on_flushed(&mut self, s: ShardSummary) {
        let st = &mut self.step;
        st.flushed += 1;
        st.arrivals += s.arrivals;
        st.duplicates += s.duplicates;
        for p in s.used {
            st.params[p.index()].used = true;
        }
        for p in s.expect_none_next {
            st.params[p.index()].expect_none_next = true;
        }
        self.close_if_flushed();
    }

    /// Flushing → Draining once every shard has flushed: every parameter not
    /// ready is unused (zeros); an aborting or joined rank sends zeros from
    /// here on; every remaining bucket launches.
    fn close_if_flushed(&mut self) {
        if !matches!(self.lifecycle, Lifecycle::Flushing(_)) || self.step.flushed < self.cfg.shards {
            return;
        }
        if self.step.nonfinite && self.step.end == Some(StepEnd::Finish) {
            self.step.end = Some(StepEnd::Abort(AbortReason::NonFinite));
        }
        let silent = self.step.end != Some(StepEnd::Finish);
        for b in self.step.next_launch..self.plan.num_buckets() {
            for &p in self.plan.bucket_params(b) {
                let ps = &mut self.step.params[p.index()];
                // Nothing of a silent rank goes into buckets not launched yet.
                let unsent = if silent {
                    ps.written = false;
                    ps.sent.take()
                } else {
                    None
                };
                let was_pending = !std::mem::replace(&mut ps.ready, true);
                if was_pending {
                    if let super::step::BucketState::Filling { pending, .. } = &mut self.step.buckets[b] {
                        *pending -= 1;
                    }
                }
                if let Some(v) = unsent {
                    self.recycle(p, v);
                }
            }
        }
        let Lifecycle::Flushing(req) = std::mem::replace(&mut self.lifecycle, Lifecycle::Open) else {
            unreachable!("checked above")
        };
        self.lifecycle = Lifecycle::Draining(req);
        self.launch_ready_buckets();
        self.start_control_once_launched();
    }

    /// Draining → Control once every data bucket is launched. The vote
    /// depends only on what this rank knows at close (late, used and
    /// retracted parameters, the collectives issued), not on reduced data, so
    /// it goes out right behind the last bucket; the communicator completes
    /// collectives in order, so its answer arrives after every bucket's.
    pub(super) fn start_control_once_launched(&mut self) {
        if !matches!(self.lifecycle, Lifecycle::Draining(_)) || self.step.next_launch < self.plan.num_buckets() {
            return;
        }
        let end = self.step.end.expect("a draining step has an end");
        let status = match end {
            StepEnd::Finish => RankStatus::Finished,
            StepEnd::Abort(r) => RankStatus::Aborted(r),
            StepEnd::Join => RankStatus::Joined,
        };
        let finished = end == StepEnd::Finish;
        let late: Vec<bool> = self.step.params.iter().map(|p| finished && p.late.is_some()).collect();
        // Only a rank whose gradients count says what it used: a parameter that
        // only aborting or joined ranks touched has no gradient.
        let used: Vec<bool> = self.step.params.iter().map(|p| finished && p.used).collect();
        let partial = self.cfg.policy == AbortPolicy::Partial;
        let aborting = matches!(end, StepEnd::Abort(_));
        // What an aborting rank wrote is in the launched buckets: it is retracted.
        let retract: Vec<bool> = self.step.params.iter().map(|p| aborting && p.written).collect();
        let vote = ControlVote {
            rank: self.cfg.rank,
            world: self.cfg.world,
            status,
            fingerprint: self.sequence_fingerprint(),
            late: &late,
            used: &used,
            retract: partial.then_some(retract.as_slice()),
            reorder: finished && self.wants_reorder(),
            admit: self.cfg.joiner_waiting.as_ref().is_some_and(|w| w.load(std::sync::atomic::Ordering::Relaxed)),
        };
        let words = vote.encode();
        let tag = CollectiveTag { step: self.step.step, kind: CollectiveKind::Control { len: words.len() } };
        let Lifecycle::Draining(req) = std::mem::replace(&mut self.lifecycle, Lifecycle::Open) else {
            unreachable!("checked above")
        };
        self.lifecycle = Lifecycle::Control(req);
        self.submit(tag, CommPayload::Words(words), 1.0, self.cfg.collective_timeout);
    }

    /// Digest of the collective sequence this rank issued this step.
    fn sequence_fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        h.write(self.plan.fingerprint());
        h.write(self.step.step);
        h.write(self.step.next_launch as u64);
        h.write(self.step.divisor.code());
        h.0
    }

    /// Control → complete, Correcting or Failed, from the summed votes.
    pub(super) fn on_control(&mut self, words: &[u64]) {
        debug_assert_eq!(self.step.reduced, self.plan.num_buckets(), "collectives complete in order");
        let (world, params) = (self.cfg.world, self.plan.num_params());
        let partial = self.cfg.policy == AbortPolicy::Partial;
        let verdict = ControlVerdict::decode(words, world, params, partial);
        if let Some(d) = disagreement(&verdict.fingerprints) {
            let step = self.step.step;
            let error = SyncError::Desync {
                step,
                ranks: d.ranks,
                groups: d.groups,
                majority: d.majority,
                fingerprints: verdict.fingerprints,
            };
            return self.fail(error);
        }
        let ControlVerdict { aborted, joined, late, unused_everywhere, retract, reorder, admit, .. } = verdict;
        self.step.reorder = reorder;
        self.step.admit = admit;
        self.step.unused_everywhere = unused_everywhere;
        self.step.joined = joined.clone();
        self.joined = joined.len();
        if joined.len() == world {
            return self.complete(Outcome::AllJoined, 0);
        }
        let excluded = if partial { aborted.len() } else { 0 };
        let contributors = world - joined.len() - excluded;
        // A NaN or Inf already summed cannot be subtracted out again.
        let unretractable = aborted.iter().any(|&(_, why)| why == AbortReason::NonFinite);
        if !aborted.is_empty() && (!partial || contributors == 0 || unretractable) {
            return self.complete(Outcome::Skipped { aborted }, 0);
        }
        let outcome = if aborted.is_empty() { Outcome::Applied } else { Outcome::Partial { excluded: aborted } };
        let mut targets = late;
        targets.extend(retract);
        targets.sort_unstable();
        targets.dedup();
        if targets.is_empty() {
            return self.complete(outcome, contributors);
        }
        self.start_correction(targets, outcome, contributors);
    }

    /// Pack this rank's correction of every target parameter and all-reduce it.
    /// All-reduce is linear, so adding the reduced corrections to the early
    /// result gives the reduction of the final values:
    ///
    /// * a rank that finished contributes its late increments, or for a late
    ///   `Accumulated` value `final - sent`, and zeros elsewhere;
    /// * a rank that aborted (partial policy) contributes `-sent` where it had
    ///   written a value into a launched bucket, and zeros elsewhere;
    /// * a joined rank contributes zeros.
    ///
    /// A correction buffer holds one element type, as a bucket does: targets
    /// of two types are corrected by two collectives in turn (float32 first),
    /// the same sequence on every rank (the targets come from the control verdict).
    fn start_correction(&mut self, targets: Vec<ParamId>, outcome: Outcome, contributors: usize) {
        self.step.corrected = targets.clone();
        self.correct(targets, outcome, contributors);
    }

    /// Pack and all-reduce the correction of the `targets` of one element
    /// type (the first one's); the others are left for the next round.
    fn correct(&mut self, targets: Vec<ParamId>, outcome: Outcome, contributors: usize) {
        let dtype = targets.iter().map(|&p| self.plan.param_dtype(p)).min_by_key(|d| d.size()).expect("targets");
        let (targets, rest): (Vec<ParamId>, Vec<ParamId>) =
            targets.into_iter().partition(|&p| self.plan.param_dtype(p) == dtype);
        let numel: usize = targets.iter().map(|&p| self.plan.param_numel(p)).sum();
        let mut buf = match self.store.alloc_bucket(numel, self.cfg.pieces, dtype) {
            Ok(buf) => buf,
            Err(e) => return self.fail(e.into()),
        };
        let end = self.step.end.expect("a step in control has an end");
        let mut offsets = Vec::with_capacity(targets.len());
        let mut offset = 0;
        for &p in &targets {
            let n = self.plan.param_numel(p);
            let ps = &mut self.step.params[p.index()];
            match end {
                StepEnd::Finish => {
                    if let Some(values) = ps.late.take() {
                        match (ps.kind, ps.sent.as_ref()) {
                            // Superseded after launch: contribute (final - what was sent).
                            (Some(PayloadKind::Accumulated), Some(sent)) => {
                                self.store.pack_difference(&mut buf, offset, &values, sent)
                            }
                            // Late increments, or a first value after a zero launch.
                            _ => self.store.pack(&mut buf, offset, &values, WriteMode::Set),
                        }
                        self.recycle(p, values);
                    }
                }
                StepEnd::Abort(_) => {
                    if let (true, Some(sent)) = (ps.written, ps.sent.as_ref()) {
                        self.store.pack(&mut buf, offset, sent, WriteMode::Set);
                        self.store.scale(&mut buf, offset, n, -1.0);
                    }
                }
                StepEnd::Join => {}
            }
            offsets.push((p, offset));
            offset += n;
        }
        let tag = CollectiveTag { step: self.step.step, kind: CollectiveKind::Correction { numel } };
        let Lifecycle::Control(req) = std::mem::replace(&mut self.lifecycle, Lifecycle::Open) else {
            unreachable!("a correction follows the control collective")
        };
        self.lifecycle = Lifecycle::Correcting(req, Correction { targets: offsets, rest, outcome, contributors });
        let factor = self.launch_factor();
        self.submit(tag, CommPayload::Grads(buf), factor, self.cfg.collective_timeout);
    }

    /// Correcting → complete: add the reduced corrections into the buckets.
    pub(super) fn on_correction(&mut self, buf: &S::Bucket) {
        let Lifecycle::Correcting(_, correction) = &self.lifecycle else {
            unreachable!("a correction result arrives while correcting")
        };
        for &(p, offset) in &correction.targets {
            let slot = self.plan.slot(p);
            let n = self.plan.param_numel(p);
            if let Some(parts) = self.partitions.as_mut() {
                // Only the parts of the parameter inside what this rank keeps.
                for (at, skip, len) in parts.in_partition(slot.bucket, slot.offset, n) {
                    let dst = parts.parts[slot.bucket].as_mut().expect("every bucket is reduced before corrections");
                    self.store.add_from(dst, at, buf, offset + skip, len);
                }
                continue;
            }
            let dst = self.buffers.current[slot.bucket].as_mut().expect("data buckets are home after draining");
            self.store.add_from(dst, slot.offset, buf, offset, n);
        }
        let (outcome, contributors) = (correction.outcome.clone(), correction.contributors);
        if !correction.rest.is_empty() {
            let Lifecycle::Correcting(req, correction) = std::mem::replace(&mut self.lifecycle, Lifecycle::Open) else {
                unreachable!("checked above")
            };
            self.lifecycle = Lifecycle::Control(req);
            return self.correct(correction.rest, outcome, contributors);
        }
        self.complete(outcome, contributors);
    }

    /// Answer the caller, lend the buffers if the step applies, open the next step.
    fn complete(&mut self, outcome: Outcome, contributors: usize) {
        let req = self.lifecycle.take_finish().expect("a completing step has a finish request");
        if outcome.is_applied() {
            self.rescale(&outcome, contributors);
        }
        let next_contributors = self.cfg.world - self.joined;
        let (params, buckets) = (self.plan.num_params(), self.plan.num_buckets());
        let next = StepState::new(self.step.step + 1, params, buckets, next_contributors, self.cfg.divisor);
        let mut st = std::mem::replace(&mut self.step, next);
        if let Some(early) = self.early_refusals.remove(&self.step.step) {
            self.step.refusals.absorb(early);
        }
        let unused_everywhere: Vec<bool> = st.unused_everywhere.clone();
        // One correction collective per element type corrected.
        let corrections = [DType::F32, DType::F64]
            .iter()
            .filter(|&&d| st.corrected.iter().any(|&p| self.plan.param_dtype(p) == d))
            .count() as u32;
        let excluded = match &outcome {
            Outcome::Partial { excluded } => excluded.len(),
            _ => 0,
        };
        let divisor = if outcome.is_applied() { st.divisor.count(self.cfg.world, contributors, excluded) } else { 1 };
        let report = StepReport {
            divisor: divisor as u32,
            step: st.step,
            rank: self.cfg.rank,
            outcome: outcome.clone(),
            contributors: contributors as u32,
            joined: std::mem::take(&mut st.joined),
            arrivals: st.arrivals,
            duplicates: st.duplicates,
            rejected: st.refusals.count,
            rejections: std::mem::take(&mut st.refusals.samples),
            late_arrivals: st.late_arrivals,
            corrected: std::mem::take(&mut st.corrected),
            corrections,
            unused_local: st.params.iter().filter(|p| !p.used).count() as u32,
            unused_everywhere: self.plan.param_ids().iter().copied().filter(|p| unused_everywhere[p.index()]).collect(),
            buckets_launched: st.next_launch as u32,
            buckets_launched_before_finish: st.launched_before_finish,
            buckets_done_before_finish: st.reduced_before_finish,
            bytes_launched: st.bytes,
            exposed_comm: Instant::now().saturating_duration_since(req.at),
            comm_busy: st.comm_busy,
            timeline: std::mem::take(&mut st.timeline),
            admit: st.admit,
        };
        let step_time = st.began.map_or(Duration::ZERO, |t| t.elapsed());
        crate::telemetry::step(&self.rank_label, &report, step_time);
        crate::telemetry::memory(&self.rank_label, self.allocated.load(std::sync::atomic::Ordering::Relaxed));
        self.expect_none = st.params.iter().map(|p| p.expect_none_next).collect();
        let order = st.reorder.then(|| super::reorder::positions(&st));
        for (p, ps) in st.params.into_iter().enumerate() {
            let id = self.plan.param_ids()[p];
            for v in [ps.sent, ps.late].into_iter().flatten() {
                self.recycle(id, v);
            }
        }
        let starts = self.partitions.as_ref().map(|p| (0..p.held.len()).map(|b| p.start(b)).collect());
        if !outcome.is_applied() {
            self.free_partitions();
        }
        let gradients = outcome.is_applied().then(|| {
            let buffers = match self.partitions.as_mut() {
                Some(parts) => parts.take(),
                None => std::mem::take(&mut self.buffers.current)
                    .into_iter()
                    .map(|b| b.expect("buffers are home at completion"))
                    .collect(),
            };
            let home = self.home.clone();
            let give_back = LoanHome::new(move |buffers| {
                let _ = home.send(SchedMsg::LoanReturned { buffers });
            });
            Gradients::new(st.step, Arc::clone(&self.plan), buffers, unused_everywhere, give_back).starting_at(starts)
        });
        req.reply.send(Ok(StepResult { report, gradients }));
        match order {
            Some(words) => self.start_reorder(st.step, words),
            None => self.replay_next(),
        }
    }

    /// The step's divisor counts otherwise than the launch factor assumed (a
    /// rank joined, or was excluded under the partial policy, during the
    /// step): re-divide, so the result is the sum over the step's divisor.
    /// With [`launch_factor`](Self::launch_factor), the one place gradsync
    /// divides.
    fn rescale(&mut self, outcome: &Outcome, contributors: usize) {
        let excluded = match outcome {
            Outcome::Partial { excluded } => excluded.len(),
            _ => 0,
        };
        let (world, divisor) = (self.cfg.world, self.step.divisor);
        let assumed = divisor.count(world, self.step.launch_contributors, 0);
        let actual = divisor.count(world, contributors, excluded);
        if contributors == 0 || assumed == actual {
            return;
        }
        let factor = assumed as f64 / actual as f64;
        if let Some(parts) = self.partitions.as_mut() {
            for (part, held) in parts.parts.iter_mut().zip(&parts.held) {
                let part = part.as_mut().expect("every bucket is reduced at completion");
                self.store.scale(part, 0, held.iter().map(|r| r.len()).sum(), factor);
            }
            return;
        }
        for b in 0..self.plan.num_buckets() {
            let buf = self.buffers.current[b].as_mut().expect("buffers are home at completion");
            self.store.scale(buf, 0, self.plan.bucket_numel(b), factor);
        }
    }

    /// Re-apply messages held for the step that is now current.
    pub(super) fn replay_next(&mut self) {
        let held = std::mem::take(&mut self.next);
        for msg in held {
            self.handle(msg);
        }
    }
}
