//! The state the scheduler keeps for one step: where the step is in its
//! lifecycle, and per parameter and per bucket what has happened so far.

use std::time::{Duration, Instant};

use crate::arrival::{PayloadKind, Step, Token};
use crate::error::{Rejection, SyncError};
use crate::messages::{FinishRequest, Reply, StepEnd};
use crate::policy::Divisor;
use crate::report::REJECTION_SAMPLES;
use crate::store::GradStore;
use crate::timeline::TimelineEvent;

/// Where the scheduler is with the current step.
///
/// ```text
///            Finish                last Flushed            last bucket launched
///  Open ───────────────▶ Flushing ──────────────▶ Draining ────────────────────▶ Control
///   ▲   (all flushed: straight to Draining)                                   │
///   │                                                   late/retract? ──▶ Correcting
///   │                            complete (result sent, next step opens)      │
///   └─────────────────────────────────────────────────────────────────────────┘
///  any collective fails ──▶ Failed ──Reset──▶ Resetting ──agreed──▶ Open (agreed step,
///                                                     or the failed step again: salvage.rs)
/// ```
///
/// "Done" is not a resting state: completing a step sends its result and
/// opens the next step at once.
#[derive(Debug)]
pub(crate) enum Lifecycle<S: GradStore> {
    /// Backward running on this rank: arrivals are packed and buckets launch as they fill.
    Open,
    /// The caller ended the step; waiting for every parameter shard to flush.
    Flushing(FinishRequest<S>),
    /// Every arrival is packed; the remaining buckets launch (once the ranks
    /// agreed on the plan), then the control vote.
    Draining(FinishRequest<S>),
    /// The control collective is in flight behind the last bucket; its answer
    /// arrives after every data bucket's.
    Control(FinishRequest<S>),
    /// The correction collective is in flight.
    Correcting(FinishRequest<S>, Correction),
    /// A collective failed: every request is answered with the failure until a reset.
    Failed(Failure),
    /// A reset's agreement collective is in flight.
    Resetting(Reply<Result<crate::messages::Resumption, SyncError>>),
}

impl<S: GradStore> Lifecycle<S> {
    /// Short name, for logs and test messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Lifecycle::Open => "open",
            Lifecycle::Flushing(_) => "flushing",
            Lifecycle::Draining(_) => "draining",
            Lifecycle::Control(_) => "control",
            Lifecycle::Correcting(..) => "correcting",
            Lifecycle::Failed(_) => "failed",
            Lifecycle::Resetting(_) => "resetting",
        }
    }

    /// Take the pending finish request out, leaving `Open` behind.
    pub(crate) fn take_finish(&mut self) -> Option<FinishRequest<S>> {
        match std::mem::replace(self, Lifecycle::Open) {
            Lifecycle::Flushing(f) | Lifecycle::Draining(f) | Lifecycle::Control(f) | Lifecycle::Correcting(f, _) => {
                Some(f)
            }
            other => {
                *self = other;
                None
            }
        }
    }
}

/// A failure that ended a step; later requests get [`SyncError::Poisoned`].
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) step: Step,
    pub(crate) error: SyncError,
}

/// What a correction collective carries, and how the step ends after it.
#[derive(Debug)]
pub(crate) struct Correction {
    /// Each corrected parameter's offset in the correction buffer.
    pub(crate) targets: Vec<(crate::arrival::ParamId, usize)>,
    /// Targets of another element type, corrected by the next collective.
    pub(crate) rest: Vec<crate::arrival::ParamId>,
    /// The step's outcome once the correction is applied.
    pub(crate) outcome: crate::report::Outcome,
    /// Ranks whose gradients are in the result.
    pub(crate) contributors: usize,
}

/// One parameter in the current step, as the scheduler sees it.
#[derive(Debug)]
pub(crate) struct ParamStep<V> {
    /// Counted out of its bucket's pending members (ready, or expected to stay unused).
    pub(crate) ready: bool,
    /// Its slot holds this step's data (otherwise it is zeroed at launch).
    pub(crate) written: bool,
    /// Payload kind seen this step.
    pub(crate) kind: Option<PayloadKind>,
    /// Highest `Accumulated` token accepted (packed or late): lower ones are stale.
    pub(crate) token: Option<Token>,
    /// What this rank put into the slot, kept while the step may need it: the
    /// packed `Accumulated` value (a late supersede becomes a difference), and
    /// under the partial policy the packed increments' sum (to retract).
    pub(crate) sent: Option<V>,
    /// Late contribution: the sum of late increments, or the latest late
    /// `Accumulated` value.
    pub(crate) late: Option<V>,
    /// Some arrival of this step reached it (shards report it at flush).
    pub(crate) used: bool,
    /// Its shard expects it to have no arrival next step.
    pub(crate) expect_none_next: bool,
    /// Position of its last arrival this step (1 = first of the step), 0 if none.
    pub(crate) seen: u32,
    /// When its last arrival of this step was handled.
    pub(crate) seen_at: Option<Instant>,
}

impl<V> Default for ParamStep<V> {
    fn default() -> Self {
        ParamStep {
            ready: false,
            written: false,
            kind: None,
            token: None,
            sent: None,
            late: None,
            used: false,
            expect_none_next: false,
            seen: 0,
            seen_at: None,
        }
    }
}

/// One data bucket in the current step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BucketState {
    /// Waiting for `pending` members; `since` is when its first value was packed.
    Filling { pending: usize, since: Option<Instant> },
    /// Handed to the communicator.
    InFlight,
    /// Its all-reduce returned.
    Reduced,
}

/// Counters of refused arrivals that name one step.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Refusals {
    pub(crate) count: u64,
    pub(crate) samples: Vec<Rejection>,
}

impl Refusals {
    pub(crate) fn add(&mut self, why: Rejection) {
        self.count += 1;
        if self.samples.len() < REJECTION_SAMPLES {
            self.samples.push(why);
        }
    }

    pub(crate) fn absorb(&mut self, other: Refusals) {
        self.count += other.count;
        let room = REJECTION_SAMPLES.saturating_sub(self.samples.len());
        self.samples.extend(other.samples.into_iter().take(room));
    }
}

/// Everything the scheduler tracks about the current step.
#[derive(Debug)]
pub(crate) struct StepState<V> {
    pub(crate) step: Step,
    /// When step-start work ran (first message of the step); `None` before.
    pub(crate) began: Option<Instant>,
    /// How this rank ends the step, once the caller said.
    pub(crate) end: Option<StepEnd>,
    /// When the caller asked to end the step.
    pub(crate) finish_at: Option<Instant>,
    pub(crate) params: Vec<ParamStep<V>>,
    pub(crate) buckets: Vec<BucketState>,
    /// Buckets `0..next_launch` have been handed to the communicator.
    pub(crate) next_launch: usize,
    /// Data buckets whose all-reduce returned.
    pub(crate) reduced: usize,
    pub(crate) reduced_before_finish: u32,
    /// Shards that flushed this step.
    pub(crate) flushed: usize,
    pub(crate) arrivals: u64,
    pub(crate) duplicates: u64,
    pub(crate) late_arrivals: u64,
    pub(crate) refusals: Refusals,
    /// A NaN or Inf was packed this step (only checked with `check_finite`).
    pub(crate) nonfinite: bool,
    /// Contributor count the launch factor assumed (`world` minus known joined ranks).
    pub(crate) launch_contributors: usize,
    /// What this step's sum is divided by (the setting in force when it began).
    pub(crate) divisor: Divisor,
    pub(crate) bytes: u64,
    pub(crate) comm_busy: Duration,
    /// Per parameter: no rank used it (known after the control collective).
    pub(crate) unused_everywhere: Vec<bool>,
    /// Ranks that had joined (known after the control collective).
    pub(crate) joined: Vec<usize>,
    /// Parameters corrected (known after the control collective).
    pub(crate) corrected: Vec<crate::arrival::ParamId>,
    /// Events of this step (only with `record_timeline`).
    pub(crate) timeline: Vec<TimelineEvent>,
    /// Arrivals packed or kept so far: the last one's position.
    pub(crate) seq: u32,
    /// Buckets launched before the caller ended the step.
    pub(crate) launched_before_finish: u32,
    /// The control verdict asked to rebuild the plan after this step.
    pub(crate) reorder: bool,
    /// The control vote said a process waits to join (elastic jobs).
    pub(crate) admit: bool,
}

impl<V> StepState<V> {
    pub(crate) fn new(step: Step, params: usize, buckets: usize, launch_contributors: usize, divisor: Divisor) -> Self {
        StepState {
            step,
            began: None,
            end: None,
            finish_at: None,
            params: std::iter::repeat_with(ParamStep::default).take(params).collect(),
            buckets: vec![BucketState::Filling { pending: 0, since: None }; buckets],
            next_launch: 0,
            reduced: 0,
            reduced_before_finish: 0,
            flushed: 0,
            arrivals: 0,
            duplicates: 0,
            late_arrivals: 0,
            refusals: Refusals::default(),
            nonfinite: false,
            launch_contributors,
            divisor,
            bytes: 0,
            comm_busy: Duration::ZERO,
            unused_everywhere: vec![false; params],
            joined: Vec::new(),
            corrected: Vec::new(),
            timeline: Vec::new(),
            seq: 0,
            launched_before_finish: 0,
            reorder: false,
            admit: false,
        }
    }

    /// Follow a new plan of `buckets` buckets (between steps: nothing of
    /// this step is packed yet).
    pub(crate) fn resize_buckets(&mut self, buckets: usize) {
        debug_assert!(self.began.is_none(), "a plan changes only between steps");
        self.buckets = vec![BucketState::Filling { pending: 0, since: None }; buckets];
    }

    /// Whether bucket `b` has been handed to the communicator.
    pub(crate) fn launched(&self, b: usize) -> bool {
        b < self.next_launch
    }
}

/// The bucket buffers: the set the current step packs into, and spare sets.
///
/// A finished step lends its whole set to the caller; the next step packs
/// into a spare set (allocated the first time one is needed), so holding
/// gradients never stalls the next step's overlap. Sets come back when the
/// loan ends.
#[derive(Debug)]
pub(crate) struct BufferPool<B> {
    /// The current step's buffers by bucket; `None` while in a collective.
    /// Empty when lent and no spare was taken yet.
    pub(crate) current: Vec<Option<B>>,
    /// Whole sets back from loans.
    pub(crate) spare: Vec<Vec<B>>,
    /// Sets allocated so far (for the memory figure).
    pub(crate) sets: usize,
}
