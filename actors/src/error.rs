//! Typed errors of registration, of the step protocol and of transports.
//!
//! Every message says what happened *and what to do next*; every variant that
//! involves other ranks names them.
//!
//! **What comes after a failed step** (one rule, repeated in each message that
//! ends a step): a step is consumed by the call that ends it, successful or
//! not, so `current_step()` moves on. After a failure every later call on that
//! `GradSync` is refused with [`SyncError::Poisoned`] (consuming no step) until
//! `reset()` has been called on every rank; `reset()` returns the step all
//! ranks continue at. The failed step's gradients are lost: run its batch
//! again under the new step number.

use std::fmt;
use std::time::Duration;

use crate::arrival::{DType, ParamId, Step};

/// The recovery rule, appended to every error that ends a step.
const RECOVER: &str = "this step is lost: call reset() on every rank (or drop the GradSync) before the next step";

/// Which collective of a step a message or an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CollectiveTag {
    /// The step.
    pub step: Step,
    /// Position in the step's collective sequence.
    pub kind: CollectiveKind,
}

/// The kinds of collective gradsync issues, in the order a step issues them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    /// Once, before the first bucket: every rank's plan digest, so ranks that
    /// registered different models fail together instead of summing
    /// unrelated tensors.
    Plan {
        /// Length of the agreement vector.
        len: usize,
    },
    /// Data bucket `index` of the plan, `numel` values.
    Bucket {
        /// Bucket index in plan order.
        index: usize,
        /// Values in the bucket.
        numel: usize,
    },
    /// The small integer control vector (aborts, joins, late and used parameters, fingerprints).
    Control {
        /// Length of the control vector.
        len: usize,
    },
    /// The correction all-reduce of late (or retracted) parameters.
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
    /// After a step whose control vote asked for it: every rank's position
    /// of each gradient, summed, to rebuild the bucket plan in that order.
    Order {
        /// One word per parameter.
        len: usize,
    },
    /// A sharded model's parameters, after its optimizer stepped each
    /// rank's partition: bucket `index` of the plan, every rank's chunk of
    /// it gathered into every rank's buffer of `numel` values (the chunks
    /// back to back, in rank order).
    Gather {
        /// Bucket index in plan order.
        index: usize,
        /// Values in the gathered buffer (every rank's chunk).
        numel: usize,
    },
    /// The clip by a sharded model's global gradient norm: every rank's
    /// partial norm (its partition's), gathered, so that every rank
    /// combines the same values in rank order.
    Norm {
        /// Values gathered (one per rank).
        numel: usize,
    },
    /// A round of parameter sharding's gather lane: every rank's count of
    /// ranks needing each gather unit, summed, so that every rank gathers
    /// the union of what any rank needs (its tag's step: the lane's round).
    Needs {
        /// One word per unit, and one for the ranks at their step's end.
        len: usize,
    },
}

impl CollectiveKind {
    /// Short lowercase name (`"bucket"`, `"control"`, …), as used in metric labels.
    pub fn label(self) -> &'static str {
        match self {
            CollectiveKind::Plan { .. } => "plan",
            CollectiveKind::Bucket { .. } => "bucket",
            CollectiveKind::Control { .. } => "control",
            CollectiveKind::Correction { .. } => "correction",
            CollectiveKind::Reset { .. } => "reset",
            CollectiveKind::Order { .. } => "order",
            CollectiveKind::Gather { .. } => "gather",
            CollectiveKind::Norm { .. } => "norm",
            CollectiveKind::Needs { .. } => "needs",
        }
    }
}

impl fmt::Display for CollectiveTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CollectiveKind::Plan { len } => write!(f, "plan agreement ({len} words)"),
            CollectiveKind::Bucket { index, numel } => {
                write!(f, "step {} bucket {} ({} values)", self.step, index, numel)
            }
            CollectiveKind::Control { len } => write!(f, "step {} control ({} words)", self.step, len),
            CollectiveKind::Correction { numel } => {
                write!(f, "step {} correction ({} values)", self.step, numel)
            }
            CollectiveKind::Reset { len } => write!(f, "reset agreement ({len} words)"),
            CollectiveKind::Order { len } => write!(f, "step {} gradient order ({len} words)", self.step),
            CollectiveKind::Gather { index, numel } => {
                write!(f, "step {} parameter gather of bucket {} ({} values)", self.step, index, numel)
            }
            CollectiveKind::Norm { numel } => write!(f, "step {} gradient norm ({numel} values)", self.step),
            CollectiveKind::Needs { len } => write!(f, "gather round {} ({len} words)", self.step),
        }
    }
}

/// A collective failed on this rank.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not join the collective before the deadline.
    #[error(
        "rank {rank}: {tag} timed out after {waited:?}; {}. \
         Look at those ranks (out of memory, crashed, stuck in forward); {RECOVER}",
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
         Every rank must register the same parameters with the same bucket cap and run the same steps; {RECOVER}"
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
    /// A peer sent data this rank cannot use although it named the same collective.
    #[error(
        "rank {rank}: during {tag} rank {peer} sent unusable data ({why}); this is a transport bug, \
         please report it; {RECOVER}"
    )]
    Protocol {
        /// This rank.
        rank: usize,
        /// The collective.
        tag: CollectiveTag,
        /// The rank that sent it.
        peer: usize,
        /// What was wrong.
        why: String,
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
    /// The collective library reported an error (a backend outside this
    /// crate: `torch.distributed`, for example).
    #[error("rank {rank}: {tag} failed in the collective library: {why}; {RECOVER}")]
    Backend {
        /// This rank.
        rank: usize,
        /// The collective.
        tag: CollectiveTag,
        /// The library's message.
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

impl CommError {
    /// Short lowercase name of the variant, as used in metric labels.
    pub fn label(&self) -> &'static str {
        match self {
            CommError::Timeout { .. } => "timeout",
            CommError::PeerGone { .. } => "peer_gone",
            CommError::Desync { .. } => "desync",
            CommError::Protocol { .. } => "protocol",
            CommError::Device { .. } => "device",
            CommError::Backend { .. } => "backend",
            CommError::Panicked { .. } => "panicked",
            CommError::Cancelled { .. } => "cancelled",
        }
    }
}

fn missing_text(missing: &[usize]) -> String {
    if missing.is_empty() {
        "the transport cannot tell which ranks did not join: check every rank's log".to_string()
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

/// A registration or configuration the runtime refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// Two parameters were registered under one name.
    #[error("parameter {name:?} is registered twice: give every parameter a unique name")]
    DuplicateParam {
        /// The name.
        name: String,
    },
    /// A parameter with no element.
    #[error("parameter {name:?} has 0 elements: leave it out, it has no gradient to synchronize")]
    ZeroSizedParam {
        /// The name.
        name: String,
    },
    /// The backend's store holds no bucket of this element type.
    #[error(
        "parameter {name:?}: this backend holds no {dtype:?} buckets; register it as F32 (its gradient converted \
         to float32 and back) or use a backend that holds {dtype:?} (the torch binding's)"
    )]
    UnsupportedDType {
        /// The name.
        name: String,
        /// The type asked for.
        dtype: DType,
    },
    /// More parameters than ids can name.
    #[error("more than {max} parameters registered; group small tensors into flat buffers")]
    TooManyParams {
        /// The limit.
        max: usize,
    },
    /// Nothing was registered.
    #[error("no parameter registered: register every parameter whose gradient must be synchronized")]
    NoParams,
    /// A setting that cannot work.
    #[error("invalid setting {setting}: {why}")]
    InvalidSetting {
        /// The setting.
        setting: &'static str,
        /// Why it is refused.
        why: String,
    },
    /// A world of zero ranks, or a transport whose rank is outside its world.
    #[error("invalid world: rank {rank} of {world} ranks; a world needs at least one rank and rank < world")]
    InvalidWorld {
        /// The rank reported by the transport.
        rank: usize,
        /// The world size reported by the transport.
        world: usize,
    },
    /// An OS thread could not be started.
    #[error("could not start the {which} thread: {why}; the process may be out of threads or memory")]
    Spawn {
        /// Which thread.
        which: &'static str,
        /// The OS error.
        why: String,
    },
    /// The bucket buffers could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

/// Why a step could not complete, or why a call was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SyncError {
    /// A collective failed (timeout, a peer gone, a desync seen by the transport).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A correction buffer (or a bucket lost in a failed collective) could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// Ranks issued (or were about to issue) different collective sequences:
    /// different models, bucket caps or abort policies.
    #[error("{}; {RECOVER}", desync_text(*step, ranks, groups, *majority))]
    Desync {
        /// The step.
        step: Step,
        /// The odd ranks: those outside the largest group of ranks that agree.
        /// On a tie (no majority), the ranks outside the tied group holding the
        /// lowest rank.
        ranks: Vec<usize>,
        /// Every group of ranks that agree with each other, largest first.
        groups: Vec<Vec<usize>>,
        /// Whether one group is larger than every other (if not, `ranks` is a
        /// tie-break and the message names every side).
        majority: bool,
        /// Every rank's fingerprint, by rank.
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
    /// An earlier wait for a step's result was cancelled and the result is
    /// still to be collected.
    #[error(
        "step {pending} is still finishing in the background (an earlier wait for it was cancelled): \
         call finish_step({pending}) to collect its result before step {got}"
    )]
    FinishPending {
        /// The step whose result is waiting to be collected.
        pending: Step,
        /// The step that was named.
        got: Step,
    },
    /// Arrivals of the step are still held in an `ArrivalBatch`.
    #[error(
        "step {step} cannot finish while {held} of its arrivals are held in an ArrivalBatch: \
         call deliver() on every batch (or drop it) before ending the step"
    )]
    Undelivered {
        /// The step being ended.
        step: Step,
        /// Arrivals held, over every batch.
        held: usize,
    },
    /// An earlier step failed and left this instance unusable until a reset.
    #[error("this GradSync failed at step {step} ({cause}); call reset() on every rank, or drop it")]
    Poisoned {
        /// Step of the original failure.
        step: Step,
        /// The original failure, rendered.
        cause: String,
    },
    /// The actor threads have stopped (the GradSync was dropped or crashed).
    #[error("the gradsync actors have stopped; build a new GradSync")]
    Closed,
    /// A setting changed at a point where it cannot take effect alike on
    /// every rank (nothing changed).
    #[error("{setting}: {why}")]
    Setting {
        /// The setting.
        setting: &'static str,
        /// Why it was refused, and when it can be changed.
        why: String,
    },
    /// No answer from the local actors within the step deadline.
    #[error("step {step}: no answer from the local actors after {waited:?}; this is a gradsync bug, please report it")]
    Unresponsive {
        /// The step.
        step: Step,
        /// How long the caller waited.
        waited: Duration,
    },
}

impl SyncError {
    /// Whether this error ended a step and leaves the GradSync failed until
    /// `reset()` on every rank (as opposed to a refused call, such as a wrong
    /// step number or gradients still held, after which nothing changed).
    pub fn needs_reset(&self) -> bool {
        matches!(self, SyncError::Comm(_) | SyncError::Alloc(_) | SyncError::Desync { .. } | SyncError::Poisoned { .. })
    }
}

fn desync_text(step: Step, ranks: &[usize], groups: &[Vec<usize>], majority: bool) -> String {
    let what = "ranks disagree on the collective sequence (the model's parameters, their order and sizes, \
                the bucket cap, the abort policy, the wire type or the divisor)";
    if majority {
        format!("step {step}: {what}: ranks {ranks:?} differ from the majority {:?}", groups.first())
    } else {
        format!("step {step}: {what}, and no group of ranks is a majority: {groups:?}")
    }
}

/// Why an arrival was refused. Refusals never block and never touch a sum;
/// the hook returns them at once when it can decide, and every refusal is
/// counted in the [`crate::StepReport`] of the step it names (when that
/// report is still to come) and in the metrics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The parameter id belongs to another GradSync.
    #[error("unknown parameter {param}: only ids from this GradSync's builder are valid")]
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

impl Rejection {
    /// Short lowercase name of the variant (`"unknown_param"`, `"future_step"`, …).
    pub fn label(&self) -> &'static str {
        match self {
            Rejection::UnknownParam { .. } => "unknown_param",
            Rejection::WrongLength { .. } => "wrong_length",
            Rejection::StepFinished { .. } => "step_finished",
            Rejection::FutureStep { .. } => "future_step",
            Rejection::MixedKinds { .. } => "mixed_kinds",
            Rejection::Closed => "closed",
        }
    }
}
