//! A failed step reduced again among the members left after a change of
//! members (an elastic job under the partial policy).
//!
//! When a step's collective fails because a member was lost, some buckets
//! may have been summed with the lost member's values and others not: no
//! result of the old group can be used. Under the partial policy the
//! scheduler keeps what this rank put into the step anyway (to retract it),
//! so it can contribute the step again:
//!
//! ```text
//!  collective fails ─▶ Salvage::from(step): per parameter the final local value
//!                      (packed + late increments, or the last Accumulated value)
//!  Ready / Flushed / Finish of that step, while failed ─▶ folded into the salvage
//!  Reset among the new members ─▶ the agreement's second half: "I can redo step s"
//!  every member says the same s ─▶ step s is opened again and, at the caller's
//!  Finish, fed with the salvage: buckets, control vote, result, as any step
//! ```
//!
//! Any member without a complete salvage of the same step (it applied the
//! step before the loss, it joined, it aborted, its shards never flushed)
//! makes every member skip instead: never a mix.

use std::time::Instant;

use super::Scheduler;
use crate::arrival::{PayloadKind, Step, Token};
use crate::messages::{Readiness, SchedMsg, ShardSummary, StepEnd};
use crate::policy::AbortPolicy;
use crate::store::GradStore;

/// One parameter's contribution to a failed step.
#[derive(Debug)]
struct Kept<V> {
    kind: PayloadKind,
    token: Token,
    values: V,
}

/// What this rank contributed to a failed step (see the module docs).
#[derive(Debug)]
pub(crate) struct Salvage<V> {
    /// The failed step.
    pub(crate) step: Step,
    /// Per parameter (plan index): its final local value, if any arrived.
    values: Vec<Option<Kept<V>>>,
    /// Shards that flushed the step, and what they reported.
    flushed: usize,
    summary: ShardSummary,
    /// How the caller ended the step (`None`: not yet).
    end: Option<StepEnd>,
    /// A value of the step is missing (dropped by a correction in flight).
    incomplete: bool,
}

impl<V> Salvage<V> {
    /// Whether this rank can contribute the whole step again: the caller
    /// finished it and every shard forwarded everything of it.
    pub(crate) fn complete(&self, shards: usize) -> bool {
        self.end == Some(StepEnd::Finish) && self.flushed >= shards && !self.incomplete
    }

    /// Whether a reset must wait for the step's last flush (the caller
    /// finished the step; its shards are still forwarding).
    pub(crate) fn flush_pending(&self, shards: usize) -> bool {
        self.end == Some(StepEnd::Finish) && self.flushed < shards && !self.incomplete
    }
}

impl<S: GradStore> Scheduler<S> {
    /// The current step failed: keep this rank's contribution under the
    /// partial policy (the step's parameter state is consumed).
    pub(super) fn salvage_failed_step(&mut self, correcting: bool) {
        if self.cfg.policy != AbortPolicy::Partial {
            return;
        }
        if let Some(redo) = self.redo.take() {
            // A redo was agreed but not fed yet: it is still the whole step.
            self.salvage = Some(redo);
            return;
        }
        let st = &mut self.step;
        let mut values = Vec::with_capacity(st.params.len());
        let mut spent = Vec::new();
        for (i, ps) in st.params.iter_mut().enumerate() {
            let kept = match (ps.kind, ps.sent.take(), ps.late.take()) {
                (Some(PayloadKind::Increment), Some(mut sum), Some(late)) => {
                    self.store.add_assign(&mut sum, &late);
                    spent.push((i, late));
                    Some((PayloadKind::Increment, sum))
                }
                (Some(PayloadKind::Accumulated), sent, Some(last)) => {
                    spent.extend(sent.map(|v| (i, v)));
                    Some((PayloadKind::Accumulated, last))
                }
                (Some(kind), Some(v), None) | (Some(kind), None, Some(v)) => Some((kind, v)),
                (_, sent, late) => {
                    spent.extend(sent.into_iter().chain(late).map(|v| (i, v)));
                    None
                }
            };
            values.push(kept.map(|(kind, values)| Kept { kind, token: ps.token.unwrap_or(Token(0)), values }));
        }
        let ids = self.plan.param_ids();
        let summary = ShardSummary {
            step: st.step,
            epoch: self.epoch,
            arrivals: st.arrivals,
            duplicates: st.duplicates,
            used: st.params.iter().enumerate().filter(|(_, p)| p.used).map(|(i, _)| ids[i]).collect(),
            expect_none_next: st
                .params
                .iter()
                .enumerate()
                .filter(|(_, p)| p.expect_none_next)
                .map(|(i, _)| ids[i])
                .collect(),
        };
        // Incomplete: a correction in flight consumed the late values, or a
        // value went into a bucket with no copy kept.
        let incomplete = correcting || st.params.iter().zip(&values).any(|(p, v)| p.written && v.is_none());
        let salvage = Salvage { step: st.step, values, flushed: st.flushed, summary, end: st.end, incomplete };
        for (i, v) in spent {
            self.recycle(ids[i], v);
        }
        self.salvage = Some(salvage);
    }

    /// A `Ready`, `Flushed` (or the caller's end) of the failed step:
    /// folded into its salvage. Returns the message if it is not the
    /// salvaged step's.
    pub(super) fn fold_into_salvage(&mut self, msg: SchedMsg<S>) -> Option<SchedMsg<S>> {
        let Some(salvage) = self.salvage.as_mut() else { return Some(msg) };
        match msg {
            SchedMsg::Ready { step, param, token, kind, values, .. } if step == salvage.step => {
                let slot = &mut salvage.values[param.index()];
                match slot {
                    Some(kept) if kind == PayloadKind::Increment && kept.kind == kind => {
                        self.store.add_assign(&mut kept.values, &values);
                        self.recycle(param, values);
                    }
                    Some(kept) if kind == PayloadKind::Accumulated && kept.token > token => {
                        self.recycle(param, values);
                    }
                    _ => {
                        if let Some(old) = slot.replace(Kept { kind, token, values }) {
                            self.recycle(param, old.values);
                        }
                    }
                }
                None
            }
            SchedMsg::Flushed(s) if s.step == salvage.step => {
                salvage.flushed += 1;
                salvage.summary.arrivals += s.arrivals;
                salvage.summary.duplicates += s.duplicates;
                salvage.summary.used.extend(s.used);
                salvage.summary.expect_none_next.extend(s.expect_none_next);
                if salvage.complete(self.cfg.shards) {
                    if let Some((proposed, membership, reply)) = self.deferred_reset.take() {
                        self.on_reset(proposed, membership, reply);
                    }
                }
                None
            }
            other => Some(other),
        }
    }

    /// The caller ended the failed step with `end`.
    pub(super) fn salvage_end(&mut self, step: Step, end: StepEnd) {
        if let Some(salvage) = self.salvage.as_mut().filter(|s| s.step == step) {
            salvage.end.get_or_insert(end);
        }
    }

    /// Drop the salvage, handing its values back.
    pub(super) fn drop_salvage(&mut self) {
        if let Some(salvage) = self.salvage.take() {
            let ids = self.plan.param_ids().to_vec();
            for (i, kept) in salvage.values.into_iter().enumerate() {
                if let Some(kept) = kept {
                    self.recycle(ids[i], kept.values);
                }
            }
        }
    }

    /// The redo agreed at the reset: the step it opened begins with this
    /// rank's whole salvaged contribution packed and every shard flushed
    /// (called at the caller's `Finish`, after step-start work).
    pub(super) fn feed_redo(&mut self) {
        let Some(salvage) = self.redo.take() else { return };
        let at = Instant::now();
        let ids = self.plan.param_ids().to_vec();
        for (i, kept) in salvage.values.into_iter().enumerate() {
            if let Some(Kept { kind, token, values }) = kept {
                self.on_ready(ids[i], token, kind, values, Readiness::Complete, at);
            }
        }
        let mut summary = salvage.summary;
        summary.epoch = self.epoch;
        self.on_flushed(summary);
        self.step.flushed = self.cfg.shards;
    }
}
