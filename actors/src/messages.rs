//! Messages between the hook side, the parameter actors, the scheduler and the
//! communicator. Every actor owns its state and is reached only through these.

use std::time::Instant;

use crate::arrival::{Arrival, ParamId, PayloadKind, Step, Token};
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
    /// Several hook firings delivered together (an `ArrivalBatch`), in order.
    Arrivals(Vec<Arrival<S::Values>>),
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
        /// The scheduler's new message generation: later messages carry it.
        epoch: u32,
    },
    /// Stop the actor.
    Shutdown,
}

/// What a [`SchedMsg::Ready`] value means for its parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// The value that makes the parameter ready (its expected arrivals are
    /// in, or backward is over): its bucket stops waiting for it.
    Complete,
    /// An arrival after that: merged if the bucket is not launched yet,
    /// otherwise a late contribution that the correction collective adds.
    Extra,
}

/// A setting changed while the runtime runs (see [`SchedMsg::Configure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// The divisor of every step that has not begun.
    Divisor(crate::policy::Divisor),
    /// The type data buckets travel in: only before the first bucket is
    /// launched (the plan agreement is run again, so ranks that disagree fail
    /// together with a desync).
    Wire(crate::policy::Wire),
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
        /// The token of the arrival that carried `values` (for `Accumulated`,
        /// the highest token combined into them).
        token: Token,
        /// How `values` combines with what is stored.
        kind: PayloadKind,
        /// The values.
        values: S::Values,
        /// Whether this value completes the parameter or comes after.
        readiness: Readiness,
        /// When the arrival that completed this message reached its actor.
        at: Instant,
        /// The shard's generation (see [`ShardMsg::Reset`]).
        epoch: u32,
    },
    /// An arrival was refused (by the hook or by a parameter actor).
    Rejected {
        /// The step the refused arrival named.
        step: Step,
        /// Why it was refused.
        why: Rejection,
    },
    /// A shard has forwarded everything of `step`.
    Flushed(ShardSummary),
    /// A shard has forwarded everything sent before the [`ShardMsg::Settle`] `id`.
    Settled {
        /// Request id.
        id: u64,
    },
    /// Finish, abort or join the current step.
    Finish(FinishRequest<S>),
    /// Report progress once every shard has settled request `id`.
    Progress {
        /// Request id (matches the shards' `Settled`).
        id: u64,
        /// With a number: answer only once at most that many of the step's
        /// data buckets are in their collective (launched, not reduced), or
        /// the step failed or ended (back-pressure on a producer of
        /// gradients that would otherwise fill more buckets meanwhile).
        in_flight_at_most: Option<usize>,
        /// Where to answer.
        reply: Reply<Progress>,
    },
    /// A collective returned.
    Done(CommDone<S>),
    /// Abandon the failed step and agree with every rank on the step to restart at.
    Reset {
        /// This rank's proposal (its next step); the agreed step is the maximum.
        proposed: Step,
        /// This rank's new place, when the reset follows a change of
        /// members (an elastic job): the agreement runs among the new
        /// members, and the plan is agreed again among them.
        membership: Option<Place>,
        /// Where to answer with the agreed step (and the step to reduce again).
        reply: Reply<Result<Resumption, SyncError>>,
    },
    /// Change a setting that every rank changes at the same point.
    Configure {
        /// The new value.
        setting: Setting,
        /// Where to answer: refused if it can no longer apply alike everywhere.
        reply: Reply<Result<(), SyncError>>,
    },
    /// Gather what a sharded model's update needs from every rank (its
    /// parameters after its optimizer stepped, its partial gradient norms
    /// for a clip): per [`GatherOf`], a buffer of every rank's chunk, this
    /// rank's filled ([`crate::Transport::start_gather`]). Every rank sends
    /// the same in the same order, between steps.
    Gather {
        /// What each buffer gathers, in the order the collectives run.
        buffers: Vec<(GatherOf, S::Bucket)>,
        /// Where the buffers come back, in the same order, gathered or with
        /// the failure (their content then unspecified).
        reply: Reply<Gathered<S::Bucket>>,
    },
    /// The caller dropped a [`crate::Gradients`]: the bucket buffers come home.
    LoanReturned {
        /// The buffers, in bucket order.
        buffers: Vec<S::Bucket>,
    },
    /// Stop the actor.
    Shutdown,
}

/// A rank's place in an elastic job's membership after a change of members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// This rank.
    pub rank: usize,
    /// Ranks in the new membership.
    pub world: usize,
    /// Where a sharded job's buddy copies live: this rank keeps the
    /// partition of rank `(rank + buddy_stride) % world` too (0: none).
    /// Identical on every member (the roster decides it).
    pub buddy_stride: usize,
}

/// Where the members continue after a reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumption {
    /// The step every member opens next (the largest any proposed).
    pub step: Step,
    /// A step that failed on every new member and that they reduce again
    /// among themselves (partial policy, after a change of members): the
    /// caller finishes it (without new arrivals) before `step` begins.
    pub redo: Option<Step>,
}

/// What a shard saw in one step, sent with [`SchedMsg::Flushed`].
#[derive(Debug, Clone, Default)]
pub struct ShardSummary {
    /// The step.
    pub step: Step,
    /// The shard's generation (see [`ShardMsg::Reset`]).
    pub epoch: u32,
    /// Distinct arrivals accepted.
    pub arrivals: u64,
    /// Duplicate deliveries ignored.
    pub duplicates: u64,
    /// Parameters that had at least one arrival.
    pub used: Vec<ParamId>,
    /// Parameters expected to have no arrival next step (learned or declared):
    /// the scheduler treats them as ready (zero) from the step's start.
    pub expect_none_next: Vec<ParamId>,
}

/// How this rank ends a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepEnd {
    /// Backward is over: contribute what arrived.
    Finish,
    /// This rank cannot finish the step: contribute zeros (and, under the
    /// partial policy, retract what was already sent).
    Abort(AbortReason),
    /// This rank has run out of data: contribute zeros, every step, until
    /// every rank has joined.
    Join,
}

/// A request to end the current step.
#[derive(Debug)]
pub struct FinishRequest<S: GradStore = HostStore> {
    /// The step.
    pub step: Step,
    /// How this rank ends it.
    pub end: StepEnd,
    /// When the caller asked.
    pub at: Instant,
    /// Where to answer.
    pub reply: Reply<Result<StepResult<S>, SyncError>>,
}

/// What a gather buffer of [`SchedMsg::Gather`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherOf {
    /// Every rank's partition of this bucket of the plan (the parameters).
    Bucket(usize),
    /// Every rank's partial gradient norm (a clip by the global norm).
    Norm,
}

/// What a [`SchedMsg::Gather`] answers: the buffers, always (they are the
/// caller's memory), and the outcome.
pub type Gathered<B> = (Vec<(GatherOf, B)>, Result<(), SyncError>);

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
