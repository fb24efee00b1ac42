//! Messages between the hook side, the parameter actors, the scheduler and the
//! communicator. Every actor owns its state and is reached only through these.

use std::time::Instant;

use crate::arrival::{Arrival, ParamId, PayloadKind, Step};
use crate::comm::CommDone;
use crate::error::{Rejection, SyncError};
use crate::gradients::StepResult;
use crate::report::{AbortReason, Progress};
use crate::store::{GradStore, HostStore};

/// Inbox of a parameter-shard actor.
#[derive(Debug)]
pub enum ShardMsg<S: GradStore = HostStore> {
    /// A hook firing for a parameter owned by this shard.
    Arrival(Arrival<S::Values>),
    /// A refusal decided on the hook side, to be counted in the step's report.
    Rejected {
        /// The step the refused arrival named.
        step: Step,
        /// Why it was refused.
        why: Rejection,
    },
    /// Backward of `step` is over on this rank: forward what is held and report.
    Flush {
        /// The step being finished.
        step: Step,
    },
    /// Answer [`SchedMsg::Settled`] once everything sent before is forwarded.
    Settle {
        /// Request id, echoed back.
        id: u64,
    },
    /// Forget the open step's state and continue at `step` (after a reset).
    Reset {
        /// The step every rank agreed to restart at.
        step: Step,
    },
    /// Stop the actor.
    Shutdown,
}

/// Inbox of the bucket scheduler.
#[derive(Debug)]
pub enum SchedMsg<S: GradStore = HostStore> {
    /// A parameter's gradient (or a later contribution to it) from its actor.
    Ready {
        /// The step.
        step: Step,
        /// The parameter.
        param: ParamId,
        /// How `values` combines with what is stored.
        kind: PayloadKind,
        /// The values.
        values: S::Values,
        /// `true` for the value that makes the parameter ready; `false` for an
        /// arrival after that (merged if the bucket is not launched, late otherwise).
        first: bool,
        /// When the arrival that completed this message reached its actor.
        at: Instant,
    },
    /// A shard has forwarded everything of `step`.
    Flushed(ShardSummary),
    /// A shard has forwarded everything sent before the [`ShardMsg::Settle`] `id`.
    Settled {
        /// Request id.
        id: u64,
    },
    /// Finish (or abort) the current step.
    Finish(FinishRequest<S>),
    /// Report progress once every shard has settled request `id`.
    Progress {
        /// Request id (matches the shards' `Settled`).
        id: u64,
        /// Where to answer.
        reply: Reply<Progress>,
    },
    /// A collective returned.
    Done(CommDone<S>),
    /// Abandon the failed step and agree with every rank on the step to restart at.
    Reset {
        /// This rank's proposal (its next step); the agreed step is the maximum.
        proposed: Step,
        /// Where to answer with the agreed step.
        reply: Reply<Result<Step, SyncError>>,
    },
    /// The caller dropped a [`crate::Gradients`]: the bucket buffers come home.
    LoanReturned {
        /// The buffers, in bucket order.
        buffers: Vec<S::Bucket>,
    },
    /// Stop the actor.
    Shutdown,
}

/// What a shard saw in one step, sent with [`SchedMsg::Flushed`].
#[derive(Debug, Clone, Default)]
pub struct ShardSummary {
    /// The step.
    pub step: Step,
    /// Distinct arrivals accepted.
    pub arrivals: u64,
    /// Duplicate deliveries ignored.
    pub duplicates: u64,
    /// Arrivals refused.
    pub rejected: u64,
    /// The first few refusals, for diagnosis.
    pub rejections: Vec<Rejection>,
    /// Parameters that had at least one arrival.
    pub used: Vec<ParamId>,
    /// Parameters expected to have no arrival next step (learned or declared):
    /// the scheduler treats them as ready (zero) from the step's start.
    pub expect_none_next: Vec<ParamId>,
}

/// A request to end the current step.
#[derive(Debug)]
pub struct FinishRequest<S: GradStore = HostStore> {
    /// The step.
    pub step: Step,
    /// `Some` when this rank gives up on the step.
    pub abort: Option<AbortReason>,
    /// When the caller asked.
    pub at: Instant,
    /// Where to answer.
    pub reply: Reply<Result<StepResult<S>, SyncError>>,
}

/// A one-shot answer channel usable from blocking and from async callers.
#[derive(Debug)]
pub enum Reply<T> {
    /// A caller blocked on a std channel (works outside and inside runtimes).
    Blocking(std::sync::mpsc::SyncSender<T>),
    /// An async caller.
    Async(tokio::sync::oneshot::Sender<T>),
}

impl<T> Reply<T> {
    /// Deliver the answer; a caller that gave up is ignored.
    pub fn send(self, value: T) {
        match self {
            Reply::Blocking(tx) => {
                let _ = tx.try_send(value);
            }
            Reply::Async(tx) => {
                let _ = tx.send(value);
            }
        }
    }
}
