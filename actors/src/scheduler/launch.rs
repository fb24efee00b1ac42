//! The data path of a step: step start, packing values into bucket slots,
//! launching buckets in plan order, and their completion.

use std::time::Instant;

use super::step::{BucketState, Lifecycle};
use super::Scheduler;
use crate::arrival::{ParamId, PayloadKind, Token};
use crate::bucket_buf::WriteMode;
use crate::comm::{CommDone, CommPayload};
use crate::error::{CollectiveKind, CollectiveTag, CommError};
use crate::messages::Readiness;
use crate::policy::AbortPolicy;
use crate::store::GradStore;
use crate::timeline::{Lane, TimelineEvent};

impl<S: GradStore> Scheduler<S> {
    /// Step-start work, once per step at its first message: take a set of
    /// buffers, count each bucket's pending members (parameters expected to
    /// stay unused are ready as zeros), launch what is complete. `false` if
    /// the step failed (no buffers).
    pub(super) fn begin(&mut self) -> bool {
        if self.step.began.is_some() {
            return true;
        }
        self.step.began = Some(Instant::now());
        if !self.plan_proposed {
            self.propose_plan();
        }
        if let Err(e) = self.ensure_buffers() {
            self.fail(e.into());
            return false;
        }
        for b in 0..self.plan.num_buckets() {
            let pending = self.plan.bucket_params(b).iter().filter(|p| !self.expect_none[p.index()]).count();
            self.step.buckets[b] = BucketState::Filling { pending, since: None };
        }
        for (p, &none) in self.expect_none.iter().enumerate() {
            self.step.params[p].ready = none;
        }
        self.launch_ready_buckets();
        true
    }

    /// A parameter's value from its actor.
    pub(super) fn on_ready(
        &mut self,
        param: ParamId,
        token: Token,
        kind: PayloadKind,
        values: S::Values,
        readiness: Readiness,
        at: Instant,
    ) {
        let slot = self.plan.slot(param);
        let launched = self.step.launched(slot.bucket);
        let partial = self.cfg.policy == AbortPolicy::Partial;
        let factor = self.launch_factor();
        self.step.seq += 1;
        let seq = self.step.seq;
        if !launched && self.partitions.is_some() {
            // A partitioned step's bucket gets its whole buffer at its first gradient.
            if let Err(e) = self.ensure_full(slot.bucket) {
                self.recycle(param, values);
                return self.fail(e.into());
            }
        }
        let ps = &mut self.step.params[param.index()];
        ps.seen = seq;
        ps.seen_at = Some(at);
        if kind == PayloadKind::Accumulated && ps.token.is_some_and(|t| token <= t) {
            // Superseded by a higher token already accepted (hooks racing on
            // several threads): the result depends on the set, not the order.
            return self.recycle(param, values);
        }
        if self.cfg.record_timeline {
            let what = match (readiness, launched) {
                (_, true) => "late",
                (Readiness::Complete, false) => "ready",
                (Readiness::Extra, false) => "merge",
            };
            self.step.timeline.push(TimelineEvent::instant(format!("{what} p{}", param.index()), Lane::Backward, at));
        }
        if kind == PayloadKind::Accumulated {
            ps.token = Some(token);
        }
        ps.kind = Some(kind);
        if self.cfg.check_finite && !self.store.all_finite(&values) {
            self.step.nonfinite = true;
        }
        if launched {
            // The bucket is already in (or through) its all-reduce: late.
            self.step.late_arrivals += 1;
            let spent = match (&mut ps.late, kind) {
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
        let Some(Some(buf)) = self.buffers.current.get_mut(slot.bucket) else {
            unreachable!("an unlaunched bucket's buffer is home")
        };
        if let BucketState::Filling { since, .. } = &mut self.step.buckets[slot.bucket] {
            since.get_or_insert(at);
        }
        let mode = if kind == PayloadKind::Increment && ps.written { WriteMode::Add } else { WriteMode::Set };
        if self.cfg.scale_when_packing {
            self.store.pack_scaled(buf, slot.offset, &values, mode, factor);
        } else {
            self.store.pack(buf, slot.offset, &values, mode);
        }
        ps.written = true;
        // Keep what was sent where a later step of the protocol needs it.
        let spent = match (kind, &mut ps.sent) {
            (PayloadKind::Accumulated, sent) => sent.replace(values),
            (PayloadKind::Increment, sent @ None) if partial => sent.replace(values),
            (PayloadKind::Increment, Some(sum)) if partial => {
                self.store.add_assign(sum, &values);
                Some(values)
            }
            (PayloadKind::Increment, _) => Some(values),
        };
        if readiness == Readiness::Complete && !ps.ready {
            ps.ready = true;
            if let BucketState::Filling { pending, .. } = &mut self.step.buckets[slot.bucket] {
                *pending -= 1;
            }
            self.launch_ready_buckets();
        }
        if let Some(v) = spent {
            self.recycle(param, v);
        }
    }

    /// The factor data buckets and corrections are multiplied by: one over
    /// the step's divisor, counting the ranks not known to have joined as its
    /// contributors (corrected at completion by [`Self::rescale`]).
    pub(super) fn launch_factor(&self) -> f64 {
        self.step.divisor.factor(self.cfg.world, self.step.launch_contributors, 0)
    }

    /// Launch every bucket that is complete and whose predecessors are
    /// launched, once the ranks agreed on the plan.
    pub(super) fn launch_ready_buckets(&mut self) {
        if !self.plan_agreed || self.step.began.is_none() {
            return;
        }
        while let Some(&BucketState::Filling { pending: 0, since }) = self.step.buckets.get(self.step.next_launch) {
            self.launch_bucket(self.step.next_launch, since);
        }
    }

    /// Zero the slots nobody wrote, and hand the bucket to the communicator.
    fn launch_bucket(&mut self, b: usize, since: Option<Instant>) {
        if self.partitions.is_some() {
            if let Err(e) = self.ensure_full(b) {
                return self.fail(e.into());
            }
        }
        let mut buf = self.buffers.current[b].take().expect("bucket buffer is home at launch");
        for &p in self.plan.bucket_params(b) {
            if !self.step.params[p.index()].written {
                self.store.zero(&mut buf, self.plan.slot(p).offset, self.plan.param_numel(p));
            }
        }
        let tag = CollectiveTag {
            step: self.step.step,
            kind: CollectiveKind::Bucket { index: b, numel: self.plan.bucket_numel(b) },
        };
        if self.cfg.record_timeline {
            let now = Instant::now();
            let from = since.or(self.step.began).unwrap_or(now);
            self.step.timeline.push(TimelineEvent::span(format!("fill bucket {b}"), Lane::Scheduler, from, now));
        }
        self.step.buckets[b] = BucketState::InFlight;
        self.step.next_launch = b + 1;
        if self.step.finish_at.is_none() {
            self.step.launched_before_finish += 1;
        }
        // Scaled while packing, or by the transport after the sum.
        let factor = if self.cfg.scale_when_packing { 1.0 } else { self.launch_factor() };
        self.submit(tag, CommPayload::Grads(buf), factor, self.cfg.collective_timeout);
    }

    /// A collective returned: account for it, then route it by kind.
    pub(super) fn on_done(&mut self, done: CommDone<S>) {
        let CommDone { tag, payload, result, started, finished } = done;
        let bytes = payload.bytes(&self.store);
        let payload = match (tag.kind, payload) {
            // (Answered whatever the step's state: the caller waits for it.)
            (CollectiveKind::Gather { .. } | CollectiveKind::Norm { .. }, CommPayload::Grads(buffer)) => {
                self.account(tag, bytes, (started, finished), &result);
                return self.on_gathered(tag, buffer, result);
            }
            (_, payload) => payload,
        };
        if let Lifecycle::Resetting(_) = self.lifecycle {
            // Collectives queued before the reset return first (failed at
            // once); only the agreement matters now.
            if let (CollectiveKind::Reset { .. }, CommPayload::Words(words)) = (tag.kind, payload) {
                self.on_reset_agreed(result.map(|()| words));
            }
            return;
        }
        self.step.comm_busy += finished.saturating_duration_since(started);
        self.account(tag, bytes, (started, finished), &result);
        if let Lifecycle::Failed(_) = self.lifecycle {
            // A failed step's collectives: their buffers may be missing pieces,
            // so the reset allocates fresh ones instead.
            return;
        }
        if let Err(e) = result {
            self.fail(e.into());
            return self.answer_waiting_progress();
        }
        match (tag.kind, payload) {
            (CollectiveKind::Plan { .. }, CommPayload::Words(words)) => self.on_plan_agreed(&words),
            (CollectiveKind::Bucket { index, .. }, CommPayload::Grads(buf)) => {
                self.on_bucket_reduced(index, buf, finished)
            }
            (CollectiveKind::Control { .. }, CommPayload::Words(words)) => self.on_control(&words),
            (CollectiveKind::Correction { .. }, CommPayload::Grads(buf)) => self.on_correction(&buf),
            (CollectiveKind::Order { .. }, CommPayload::Words(words)) => self.on_order(&words),
            (kind, _) => unreachable!("payload does not match collective {kind:?}"),
        }
    }

    /// A returned collective into the metrics and, when recording, the
    /// step's timeline (on the communicator's lane).
    fn account(
        &mut self,
        tag: CollectiveTag,
        bytes: usize,
        (started, finished): (Instant, Instant),
        result: &Result<(), CommError>,
    ) {
        let took = finished.saturating_duration_since(started);
        crate::telemetry::collective(&self.rank_label, &tag.kind, bytes, took, result);
        if self.cfg.record_timeline {
            let name = match tag.kind {
                CollectiveKind::Bucket { index, .. } => format!("all-reduce bucket {index}"),
                CollectiveKind::Gather { index, .. } => format!("all-gather bucket {index}"),
                CollectiveKind::Norm { .. } => "gradient norm".to_string(),
                kind => kind.label().to_string(),
            };
            self.step.timeline.push(TimelineEvent::span(name, Lane::Communicator, started, finished));
        }
    }

    fn on_bucket_reduced(&mut self, b: usize, buf: S::Bucket, finished: Instant) {
        if self.partitions.is_some() {
            if let Err(e) = self.keep_partition(b, buf) {
                return self.fail(e.into());
            }
        } else {
            self.buffers.current[b] = Some(buf);
        }
        self.step.buckets[b] = BucketState::Reduced;
        self.step.reduced += 1;
        if self.step.finish_at.is_none_or(|at| finished < at) {
            self.step.reduced_before_finish += 1;
        }
    }
}
