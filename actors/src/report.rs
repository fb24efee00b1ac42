//! What a finished step tells the caller.

use std::borrow::Cow;
use std::time::Duration;

use crate::arrival::{ParamId, Step};
use crate::error::Rejection;
use crate::timeline::TimelineEvent;

/// How many refusals a step report keeps verbatim (all are counted).
pub const REJECTION_SAMPLES: usize = 16;

/// Why a rank gave up on a step (carried as a small code in the control collective).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// The rank ran out of memory.
    OutOfMemory,
    /// The batch was unusable (corrupt sample, empty shard).
    BadBatch,
    /// A gradient held NaN or Inf.
    NonFinite,
    /// An application-defined reason.
    Other(u32),
}

impl AbortReason {
    /// The non-zero wire code of this reason.
    pub fn code(self) -> u64 {
        match self {
            AbortReason::OutOfMemory => 1,
            AbortReason::BadBatch => 2,
            AbortReason::NonFinite => 3,
            AbortReason::Other(c) => 16 + u64::from(c),
        }
    }

    /// Decode a non-zero wire code.
    pub fn from_code(code: u64) -> AbortReason {
        match code {
            1 => AbortReason::OutOfMemory,
            2 => AbortReason::BadBatch,
            3 => AbortReason::NonFinite,
            c => AbortReason::Other(c.saturating_sub(16).min(u64::from(u32::MAX)) as u32),
        }
    }

    /// Short lowercase name (`"out_of_memory"`, `"other_7"`), as used in metric labels.
    pub fn label(self) -> Cow<'static, str> {
        match self {
            AbortReason::OutOfMemory => "out_of_memory".into(),
            AbortReason::BadBatch => "bad_batch".into(),
            AbortReason::NonFinite => "non_finite".into(),
            AbortReason::Other(c) => format!("other_{c}").into(),
        }
    }
}

/// How a step ended, identically on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Gradients are reduced over every rank that had not joined and may be applied.
    Applied,
    /// Some ranks aborted under the partial policy: the gradients are averaged
    /// over the ranks that finished, every rank (the excluded ones too) may
    /// apply them, and the replicas stay equal.
    Partial {
        /// The ranks whose contributions were removed, and why.
        excluded: Vec<(usize, AbortReason)>,
    },
    /// At least one rank aborted (skip policy, or nobody finished): no rank may
    /// apply this step's gradients.
    Skipped {
        /// The aborting ranks and their reasons, by rank.
        aborted: Vec<(usize, AbortReason)>,
    },
    /// Every rank had joined (run out of data): there is nothing to apply, and
    /// `join()` returns.
    AllJoined,
}

impl Outcome {
    /// Whether the step's gradients may be applied.
    pub fn is_applied(&self) -> bool {
        matches!(self, Outcome::Applied | Outcome::Partial { .. })
    }

    /// Short lowercase name (`"applied"`, `"partial"`, …), as used in metric labels.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Partial { .. } => "partial",
            Outcome::Skipped { .. } => "skipped",
            Outcome::AllJoined => "all_joined",
        }
    }
}

/// Everything one rank learned about one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The step.
    pub step: Step,
    /// This rank.
    pub rank: usize,
    /// How the step ended (identical on every rank).
    pub outcome: Outcome,
    /// Ranks whose gradients are in the result (identical on every rank).
    pub contributors: u32,
    /// Ranks that had joined (run out of data) and contributed zeros.
    pub joined: Vec<usize>,
    /// Distinct arrivals accepted on this rank.
    pub arrivals: u64,
    /// Re-deliveries of an already seen `(step, param, token)`, ignored.
    pub duplicates: u64,
    /// Refused arrivals that named this step (see [`crate::Rejection`]).
    pub rejected: u64,
    /// The first refusals (at most [`REJECTION_SAMPLES`]), for diagnosis.
    pub rejections: Vec<Rejection>,
    /// Arrivals on this rank that came after their bucket was launched.
    pub late_arrivals: u64,
    /// Parameters corrected after the data buckets (late on at least one
    /// rank, or retracted from an excluded rank).
    pub corrected: Vec<ParamId>,
    /// What the step's sum was divided by (its [`crate::Divisor`]'s count;
    /// 1 for a step that does not apply). Gradients reduced outside the
    /// buckets (sparse ones) are divided by it too.
    pub divisor: u32,
    /// Correction collectives issued (0, or 1 per element type corrected).
    pub corrections: u32,
    /// Parameters with no arrival on this rank (they contributed zeros).
    pub unused_local: u32,
    /// Parameters with no arrival on any rank: their gradient is `None`.
    pub unused_everywhere: Vec<ParamId>,
    /// Data buckets all-reduced.
    pub buckets_launched: u32,
    /// Data buckets handed to the communicator before `finish_step` was
    /// called: launched while backward ran (whether they finished in time
    /// depends on the network; this depends only on the plan and the order).
    pub buckets_launched_before_finish: u32,
    /// Data buckets whose all-reduce had completed before `finish_step` was called.
    pub buckets_done_before_finish: u32,
    /// Bytes this rank put into collectives (data, control and correction).
    pub bytes_launched: u64,
    /// Time from `finish_step` to the reduced gradients: communication that
    /// backward did not hide.
    pub exposed_comm: Duration,
    /// Total time the communicator spent inside collectives this step.
    pub comm_busy: Duration,
    /// This rank's timeline of the step (arrivals, bucket fills, collectives,
    /// finish); empty unless the builder's `record_timeline` is on.
    pub timeline: Vec<TimelineEvent>,
    /// Some rank saw a process waiting to join the job (an elastic job):
    /// every rank learns it from the same step's control vote and admits
    /// the process at this step boundary (identical on every rank).
    pub admit: bool,
}

/// A snapshot of the current step, taken after every arrival sent so far was
/// processed (and, in the first step, after the ranks agreed on the plan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The step the scheduler is working on.
    pub step: Step,
    /// Data buckets handed to the communicator this step.
    pub buckets_launched: usize,
    /// Data buckets whose all-reduce completed this step.
    pub buckets_done: usize,
    /// Parameters ready (their expected arrivals seen).
    pub params_ready: usize,
}
