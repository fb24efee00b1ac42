//! Rebuilding the bucket plan in the order backward produces gradients.
//!
//! The first plan follows reverse registration. When backward does not
//! (a module registered before the ones it feeds, a weight used at both ends
//! of the model), a bucket waits for a gradient that comes last and every
//! bucket behind it waits too. So each rank watches the order in which it
//! last saw each parameter's gradient in a step (its *final* arrival, so a
//! weight whose hook fires twice counts where it is complete), and:
//!
//! ```text
//!  step closes ─▶ would a plan in this order launch buckets earlier?
//!                 yes (by REORDER_MIN_GAIN and REORDER_MIN_SHARE of backward), after the
//!                 first step, or for REORDER_AFTER steps in a row ─▶ vote "reorder"
//!  control verdict: some rank voted ─▶ result to the caller; hold the next
//!      step's messages ─▶ Order collective: each rank's positions, summed
//!  Order done ─▶ sort by summed position ─▶ same new plan on every rank ─▶
//!      fresh buffers, plan agreement (fingerprints) ─▶ replay the held messages
//! ```
//!
//! Summing positions is what makes the rebuilt plan identical everywhere
//! even when ranks saw different orders (a parameter unused on one rank);
//! the plan agreement that follows checks it. The rebuild happens between
//! two steps: the next step's values are packed into the new layout only.

use std::sync::Arc;
use std::time::Duration;

use super::step::StepState;
use super::Scheduler;
use crate::arrival::{DType, ParamId};
use crate::comm::CommPayload;
use crate::error::{CollectiveKind, CollectiveTag};
use crate::store::GradStore;

/// Steps in a row whose order the plan must not fit, after the first rebuild
/// decision, before the plan is rebuilt again: one odd step (a skipped
/// block, a rank-dependent branch) does not make every rank reallocate.
pub const REORDER_AFTER: u32 = 3;

/// The least a rebuilt plan must gain, as the mean launch time of the
/// buckets weighted by their bytes, for a step to count against the plan.
pub const REORDER_MIN_GAIN: Duration = Duration::from_micros(200);

/// The same gain as a share of the step's backward (first to last gradient).
pub const REORDER_MIN_SHARE: f64 = 0.05;

/// What the scheduler remembers between steps about gradient order.
#[derive(Debug, Default)]
pub(crate) struct OrderWatch {
    /// The first step's order was judged (it decides alone).
    pub(crate) judged_first: bool,
    /// Consecutive steps whose order the plan did not fit.
    pub(crate) misfits: u32,
    /// An order collective is in flight: the next step's messages wait.
    pub(crate) pending: bool,
    /// Plans rebuilt so far.
    pub(crate) rebuilds: u32,
}

/// This rank's order of a step: parameters by the position of their final
/// arrival, those never seen last (in reverse registration, as the first plan).
pub(crate) fn observed_order<V>(step: &StepState<V>) -> Vec<ParamId> {
    agreed_order(&positions(step))
}

/// The order collective's words that say `order` (every parameter once):
/// per parameter, its 1-based position in it.
pub(crate) fn positions_of(order: impl IntoIterator<Item = ParamId>, params: usize) -> Vec<u64> {
    let mut words = vec![0u64; params];
    for (position, p) in order.into_iter().enumerate() {
        words[p.index()] = position as u64 + 1;
    }
    words
}

/// This rank's words for the order collective: per parameter, its position.
pub(crate) fn positions<V>(step: &StepState<V>) -> Vec<u64> {
    step.params.iter().map(|p| position(p.seen, step.params.len())).collect()
}

/// The word a rank contributes for a parameter: where it was last seen
/// (1-based), or after every seen one if it was not.
fn position(seen: u32, params: usize) -> u64 {
    if seen == 0 {
        params as u64 + 1
    } else {
        u64::from(seen)
    }
}

/// The agreed order from summed positions: ascending, ties in reverse
/// registration order.
pub(crate) fn agreed_order(summed: &[u64]) -> Vec<ParamId> {
    let mut order: Vec<ParamId> = (0..summed.len()).map(ParamId::from_index).collect();
    order.sort_by_key(|p| (summed[p.index()], std::cmp::Reverse(p.index())));
    order
}

impl<S: GradStore> Scheduler<S> {
    /// At the control vote of a step this rank finished: whether to ask every
    /// rank to rebuild the plan. A step counts against the plan when a plan
    /// in its order would have launched the buckets meaningfully earlier
    /// ([`Self::rebuild_pays`]); the first step decides alone, later steps
    /// only after [`REORDER_AFTER`] such steps in a row.
    pub(super) fn wants_reorder(&mut self) -> bool {
        if !self.cfg.reorder || self.plan.num_buckets() < 2 {
            return false;
        }
        let misfit = self.rebuild_pays();
        self.order.misfits = if misfit { self.order.misfits + 1 } else { 0 };
        let first = !std::mem::replace(&mut self.order.judged_first, true);
        misfit && (first || self.order.misfits >= REORDER_AFTER)
    }

    /// Whether the plan of this step's order launches its buckets, on
    /// average over their bytes, at least [`REORDER_MIN_GAIN`] and
    /// [`REORDER_MIN_SHARE`] of the step's backward earlier than the plan in
    /// force, given when each gradient last arrived. Gradients that arrive
    /// together (hooks racing on two threads) swap places without a gain,
    /// so they never make the ranks reallocate.
    fn rebuild_pays(&self) -> bool {
        let params = &self.step.params;
        let seen = || params.iter().filter_map(|p| p.seen_at);
        let (Some(first), Some(last)) = (seen().min(), seen().max()) else { return false };
        let span = last.saturating_duration_since(first);
        // Not seen: ready when the step closed, as far as launches go.
        let ready: Vec<Duration> =
            params.iter().map(|p| p.seen_at.map_or(span, |t| t.saturating_duration_since(first))).collect();
        let order = observed_order(&self.step);
        let plan = &self.plan;
        if order.windows(2).all(|w| plan.bucket_of(w[0]) <= plan.bucket_of(w[1])) {
            // Each bucket completes no later than the next: nothing waits.
            return false;
        }
        let now = plan.mean_launch((0..plan.num_buckets()).map(|b| plan.bucket_params(b)), &ready);
        let wanted = plan.fill(&order);
        let then = plan.mean_launch(wanted.iter().map(Vec::as_slice), &ready);
        let gain = now.saturating_sub(then);
        gain >= REORDER_MIN_GAIN && gain.as_secs_f64() >= REORDER_MIN_SHARE * span.as_secs_f64()
    }

    /// After step `step`, whose verdict asked for it: all-reduce this rank's
    /// positions of that step ([`positions`]); the next step's messages wait
    /// until the new plan is in place.
    pub(super) fn start_reorder(&mut self, step: crate::arrival::Step, words: Vec<u64>) {
        let tag = CollectiveTag { step, kind: CollectiveKind::Order { len: words.len() } };
        self.order.pending = true;
        self.order.misfits = 0;
        self.submit(tag, CommPayload::Words(words), 1.0, self.cfg.collective_timeout);
    }

    /// The summed positions arrived: install the plan they give (the same on
    /// every rank), agree on it, and go on with the held messages.
    pub(super) fn on_order(&mut self, summed: &[u64]) {
        self.order.pending = false;
        let plan = self.plan.reordered(&agreed_order(summed));
        if plan != *self.plan {
            self.order.rebuilds += 1;
            tracing::info!(
                rank = self.cfg.rank,
                step = self.step.step,
                buckets = plan.num_buckets(),
                rebuilds = self.order.rebuilds,
                "gradsync rebuilt its bucket plan in the order gradients arrive"
            );
            self.install(plan);
        }
        self.replay_next();
        // With the plan unchanged nothing else will answer them.
        self.answer_waiting_progress();
    }

    /// Make `plan` the plan in force between two steps: the buffer sets at
    /// home go through [`Self::take_home`] like loans coming back (kept if
    /// the new layout fits them, freed otherwise), the current step's buckets
    /// follow the new plan, and launches wait for the ranks to agree on it.
    fn install(&mut self, plan: super::Plan) {
        self.plan = Arc::new(plan);
        let current: Vec<S::Bucket> = std::mem::take(&mut self.buffers.current).into_iter().flatten().collect();
        let spare = std::mem::take(&mut self.buffers.spare);
        for set in spare.into_iter().chain((!current.is_empty()).then_some(current)) {
            self.take_home(set);
        }
        self.bucket_ends.follow(&self.plan);
        crate::telemetry::plan(&self.rank_label, self.plan.num_buckets(), self.plan.bucket_bytes());
        self.step.resize_buckets(self.plan.num_buckets());
        self.plan_agreed = false;
        self.propose_plan();
    }

    /// A set of buffers comes home (from a loan, or set aside by a rebuild):
    /// a spare if its bucket sizes are those of the plan in force, freed
    /// otherwise (a plan rebuilt since it was allocated). A partitioned
    /// step's partitions are always freed (see `partition.rs`).
    pub(super) fn take_home(&mut self, set: Vec<S::Bucket>) {
        if self.partitions.is_some() {
            let bytes: usize = set
                .iter()
                .enumerate()
                .map(|(b, buf)| {
                    let dtype = if b < self.plan.num_buckets() { self.plan.bucket_dtype(b) } else { DType::F32 };
                    self.store.bucket_numel(buf) * dtype.size()
                })
                .sum();
            drop(set);
            self.allocated.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        let fits = set.len() == self.plan.num_buckets()
            && set.iter().enumerate().all(|(b, buf)| self.store.bucket_numel(buf) == self.plan.bucket_numel(b));
        if fits {
            return self.buffers.spare.push(set);
        }
        let bytes: usize = set.iter().map(|b| self.store.bucket_numel(b) * std::mem::size_of::<f32>()).sum();
        drop(set);
        self.buffers.sets -= 1;
        self.allocated.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::agreed_order;
    use crate::arrival::ParamId;

    #[test]
    fn summed_positions_sort_ascending_with_ties_in_reverse_registration() {
        let ids = |v: &[usize]| v.iter().map(|&i| ParamId::from_index(i)).collect::<Vec<_>>();
        assert_eq!(agreed_order(&[3, 3, 6]), ids(&[1, 0, 2]));
        assert_eq!(agreed_order(&[9, 2, 5, 2]), ids(&[3, 1, 2, 0]));
    }
}
