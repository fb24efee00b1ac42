//! Typed errors of the step protocol and of transports.
//!
//! Every message says what happened *and what to do next*; every variant that
//! involves other ranks names them.

use std::fmt;
use std::time::Duration;

use crate::arrival::{ParamId, Step};

/// Which collective of a step a message or an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CollectiveTag {
    /// The step.
    pub step: Step,
    /// Position in the step's collective sequence.
    pub kind: CollectiveKind,
}

/// The three kinds of collective a step issues, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Data bucket `index` of the plan, `numel` values.
    Bucket {
        /// Bucket index in plan order.
        index: usize,
        /// Values in the bucket.
        numel: usize,
    },
    /// The small integer control vector (aborts, late and used parameters, fingerprints).
    Control {
        /// Length of the control vector.
        len: usize,
    },
    /// The correction all-reduce of late parameters.
    Correction {
        /// Values corrected.
        numel: usize,
    },
    /// The agreement collective of a reset (each rank proposes the step to
    /// restart at). Its tag's step is always 0: proposals may differ.
    Reset {
        /// Length of the agreement vector.
        len: usize,
    },
}

impl fmt::Display for CollectiveTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CollectiveKind::Bucket { index, numel } => {
                write!(f, "step {} bucket {} ({} values)", self.step, index, numel)
            }
            CollectiveKind::Control { len } => write!(f, "step {} control ({} words)", self.step, len),
            CollectiveKind::Correction { numel } => {
                write!(f, "step {} correction ({} values)", self.step, numel)
            }
            CollectiveKind::Reset { len } => write!(f, "reset agreement ({len} words)"),
        }
    }
}

/// A collective failed on this rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not join the collective before the deadline.
    #[error(
        "rank {rank}: {tag} timed out after {waited:?}; {}. \
         Look at those ranks (out of memory, crashed, stuck in forward); this step is lost: \
         reset or drop the GradSync",
        missing_text(missing)
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// The collective.
        tag: CollectiveTag,
        /// Ranks that never contributed, where the transport can tell (the
        /// local backend always can; NCCL cannot, and leaves this empty).
        missing: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// A peer's endpoint was dropped (its thread or process ended).
    #[error(
        "rank {rank}: rank {peer} left the communicator during {tag}; \
         restart the job or rebuild the world without it"
    )]
    PeerGone {
        /// This rank.
        rank: usize,
        /// The rank that is gone.
        peer: usize,
        /// The collective.
        tag: CollectiveTag,
    },
    /// Two ranks issued different collectives at the same position.
    #[error(
        "rank {rank}: desync at {tag}: rank {peer} issued {theirs} instead. \
         Every rank must register the same parameters with the same bucket cap and run the same steps"
    )]
    Desync {
        /// This rank.
        rank: usize,
        /// What this rank issued.
        tag: CollectiveTag,
        /// The rank that disagreed.
        peer: usize,
        /// What that rank issued.
        theirs: CollectiveTag,
    },
    /// The device or its communication library reported an error.
    #[error(
        "rank {rank}: {tag} failed on the device: {why}. The communicator was aborted and the \
         device state is unknown: drop this GradSync (and on a sticky CUDA error, restart the process)"
    )]
    Device {
        /// This rank.
        rank: usize,
        /// The collective.
        tag: CollectiveTag,
        /// The driver's or NCCL's message.
        why: String,
    },
    /// The transport panicked (a bug); the communicator is unusable.
    #[error(
        "rank {rank}: the communicator panicked during {tag}: {why}. This is a bug in the transport, \
         please report it; drop this GradSync"
    )]
    Panicked {
        /// This rank.
        rank: usize,
        /// The collective.
        tag: CollectiveTag,
        /// The panic message.
        why: String,
    },
    /// The communicator is shutting down.
    #[error("rank {rank}: {tag} cancelled because the GradSync is shutting down")]
    Cancelled {
        /// This rank.
        rank: usize,
        /// The collective.
        tag: CollectiveTag,
    },
}

fn missing_text(missing: &[usize]) -> String {
    if missing.is_empty() {
        "the transport cannot tell which ranks did not join (NCCL): check every rank's log".to_string()
    } else {
        format!("ranks {missing:?} never joined")
    }
}

/// A store could not allocate bucket memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "could not allocate {bytes} bytes of gradient bucket memory: {why}. \
     Free device memory (smaller batch, fewer cached tensors) or lower bucket_cap_bytes"
)]
pub struct AllocError {
    /// Bytes asked for.
    pub bytes: usize,
    /// The allocator's message.
    pub why: String,
}

/// Why a step could not complete.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SyncError {
    /// A collective failed (timeout, a peer gone, a desync seen by the transport).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A correction buffer (or a bucket lost in a failed collective) could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The control collective showed that ranks issued different collective sequences.
    #[error(
        "step {step}: ranks disagree on the collective sequence (fingerprints by rank: {fingerprints:?}; \
         ranks {ranks:?} differ from rank 0). Register the same parameters in the same order with the \
         same bucket cap on every rank"
    )]
    Desync {
        /// The step.
        step: Step,
        /// Ranks whose fingerprint differs from rank 0's.
        ranks: Vec<usize>,
        /// Every rank's fingerprint.
        fingerprints: Vec<u64>,
    },
    /// `finish_step` named a step other than the current one.
    #[error("finish_step({got}) but the current step is {expected}: steps must be finished once each, in order")]
    NotCurrentStep {
        /// The step that can be finished now.
        expected: Step,
        /// The step that was named.
        got: Step,
    },
    /// The gradients of the previous step are still borrowed.
    #[error(
        "step {step} cannot finish while the Gradients of step {loaned} are still alive: \
         drop them (after applying) before finishing the next step"
    )]
    GradientsStillBorrowed {
        /// The step being finished.
        step: Step,
        /// The step whose gradients are still held.
        loaned: Step,
    },
    /// An earlier step failed and left this instance unusable.
    #[error("this GradSync failed at step {step} ({cause}); call reset() on every rank or drop it")]
    Poisoned {
        /// Step of the original failure.
        step: Step,
        /// The original failure, rendered.
        cause: String,
    },
    /// The actor threads have stopped (the GradSync was dropped or crashed).
    #[error("the gradsync actors have stopped; build a new GradSync")]
    Closed,
    /// No answer from the local actors within the step deadline.
    #[error("step {step}: no answer from the local actors after {waited:?}; this is a gradsync bug, please report it")]
    Unresponsive {
        /// The step.
        step: Step,
        /// How long the caller waited.
        waited: Duration,
    },
}

/// Why an arrival was refused on the hook path. Refusals never block and never
/// touch a sum; they are counted in the [`crate::StepReport`] and logged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The parameter id was never registered.
    #[error("unknown parameter {param}: only ids returned by the builder are valid")]
    UnknownParam {
        /// The id given.
        param: ParamId,
    },
    /// The payload length is not the registered element count.
    #[error("parameter {param}: payload has {got} values, registered with {expected}")]
    WrongLength {
        /// The parameter.
        param: ParamId,
        /// Registered element count.
        expected: usize,
        /// Values in the payload.
        got: usize,
    },
    /// The step was already finished (or aborted) on this rank.
    #[error("parameter {param}: arrival for step {step}, which is already finished; it was dropped")]
    StepFinished {
        /// The parameter.
        param: ParamId,
        /// The step named by the arrival.
        step: Step,
    },
    /// The step has not begun: the current step must be finished first.
    #[error("parameter {param}: arrival for future step {step} while step {current} is open; it was dropped")]
    FutureStep {
        /// The parameter.
        param: ParamId,
        /// The step named by the arrival.
        step: Step,
        /// The open step.
        current: Step,
    },
    /// The payload kind differs from earlier arrivals of this parameter in this step.
    #[error("parameter {param}: Accumulated and Increment payloads mixed in one step; use one kind per parameter")]
    MixedKinds {
        /// The parameter.
        param: ParamId,
    },
    /// The GradSync has been dropped.
    #[error("the GradSync behind this hook has been dropped")]
    Closed,
}
