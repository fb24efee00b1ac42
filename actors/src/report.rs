//! What a finished step tells the caller.

use std::time::Duration;

use crate::arrival::{ParamId, Step};
use crate::error::Rejection;

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
    /// An application-defined reason (code ≥ 16 is free for applications).
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
}

/// How a step ended, identically on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Gradients are reduced and may be applied.
    Applied,
    /// At least one rank aborted: no rank may apply this step's gradients.
    Skipped {
        /// The aborting ranks and their reasons, by rank.
        aborted: Vec<(usize, AbortReason)>,
    },
}

impl Outcome {
    /// Whether the gradients may be applied.
    pub fn is_applied(&self) -> bool {
        matches!(self, Outcome::Applied)
    }
}

/// Everything one rank learned about one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// The step.
    pub step: Step,
    /// This rank.
    pub rank: usize,
    /// Applied or skipped (identical on every rank).
    pub outcome: Outcome,
    /// Distinct arrivals accepted on this rank.
    pub arrivals: u64,
    /// Re-deliveries of an already seen `(step, param, token)`, ignored.
    pub duplicates: u64,
    /// Arrivals refused on the hook path (see [`crate::Rejection`]).
    pub rejected: u64,
    /// The first refusals of the step (at most [`REJECTION_SAMPLES`]), for diagnosis.
    pub rejections: Vec<Rejection>,
    /// Arrivals on this rank that came after their bucket was launched.
    pub late_arrivals: u64,
    /// Parameters corrected after the data buckets (late on at least one rank).
    pub corrected: Vec<ParamId>,
    /// Correction collectives issued (0 or 1).
    pub corrections: u32,
    /// Parameters with no arrival on this rank (they contributed zeros).
    pub unused_local: u32,
    /// Parameters with no arrival on any rank: their gradient is `None`.
    pub unused_everywhere: Vec<ParamId>,
    /// Data buckets all-reduced.
    pub buckets_launched: u32,
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
    pub timeline: Vec<crate::telemetry::TimelineEvent>,
}

/// A snapshot of the current step, taken after every arrival sent so far was processed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The open step (the next one to finish).
    pub step: Step,
    /// Data buckets handed to the communicator this step.
    pub buckets_launched: usize,
    /// Data buckets whose all-reduce completed this step.
    pub buckets_done: usize,
    /// Parameters ready (their expected arrivals seen).
    pub params_ready: usize,
}
