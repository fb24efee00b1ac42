//! The public API of gradsync (re-exported by the `gradsync` crate).
//!
//! A training loop builds one [`GradSync`] per rank (the same registrations on
//! every rank), hands [`GradHook`] clones to its autograd hooks, and ends each
//! step with [`GradSync::finish_step`] (or [`abort_step`](GradSync::abort_step),
//! or [`join`](GradSync::join) when out of data). What flows through:
//!
//! ```text
//! GradSyncBuilder::param(...) ─▶ Plan (buckets, reverse registration order)
//! GradHook::accumulated / increment ──Arrival──▶ actors (dedup, pack, launch in plan order)
//! finish_step ─▶ remaining buckets ─▶ control collective ─▶ correction? ─▶ StepResult
//!                                                  { StepReport, Option<Gradients> }
//! ```
//!
//! Worlds: [`LocalWorld`] runs N ranks as threads of one process (tests,
//! examples, CPU training); `cuda` (feature `cuda`) keeps gradients in device
//! memory and all-reduces them with NCCL; the PyTorch package plugs in
//! `torch.distributed`. Writing a world of your own is [`backend`]'s subject.
#![deny(missing_docs)]

mod builder;
#[cfg(feature = "cuda")]
pub mod cuda;
mod grad_sync;
mod hook;
mod lane;
pub mod local;
pub mod membership;
pub mod metrics;
pub mod pieces;
pub mod rendezvous;
pub mod trace;

pub use builder::GradSyncBuilder;
pub use grad_sync::{GradSync, JoinReport, MembershipReset, PendingGather};
pub use gradsync_actors::messages::{GatherOf, Place};
pub use gradsync_actors::residency;
pub use gradsync_actors::{
    AbortPolicy, AbortReason, BuildError, DType, Divisor, GradView, Gradients, Outcome, ParamId, Payload, PayloadKind,
    Plan, Progress, Rejection, Step, StepReport, StepResult, SyncError, Token, Wire,
};
pub use hook::{ArrivalBatch, GradHook};
pub use lane::GatherLane;
pub use local::{LocalEndpoint, LocalMover, LocalWorld};
pub use trace::ChromeTrace;

/// For backend authors: what a world (a [`Transport`](backend::Transport))
/// and a gradient storage (a [`GradStore`](backend::GradStore)) implement.
///
/// A transport is one rank's endpoint of a communicator. The GradSync moves it
/// onto a dedicated communicator thread and calls it one collective at a
/// time, in the same order on every rank: the plan agreement, then per step
/// every bucket in plan order, the control vector and at most one correction.
/// Each call names its position with a [`CollectiveTag`](backend::CollectiveTag)
/// (compare it where the wire can carry it) and has a deadline; a transport
/// reports failures as [`CommError`](backend::CommError)s naming the ranks it
/// can. Buckets come from the transport's [`GradStore`](backend::GradStore):
/// [`HostStore`](backend::HostStore) keeps them in host memory as
/// [`BucketBuf`](backend::BucketBuf)s split into [`Transport::pieces`](backend::Transport::pieces)
/// pieces. A transport that reduce-scatters data buckets instead
/// ([`Transport::partitioned`](backend::Transport::partitioned), sharded
/// training) leaves each rank the sum of its [`partition`](backend::partition).
pub mod backend {
    pub use gradsync_actors::bucket_buf::{BucketBuf, PieceLengthError, WriteMode};
    pub use gradsync_actors::comm::{Interrupt, Transport};
    pub use gradsync_actors::error::{AllocError, CollectiveKind, CollectiveTag, CommError};
    pub use gradsync_actors::failure::Failure;
    pub use gradsync_actors::plan::{held, partition};
    pub use gradsync_actors::sources::{sources, Place};
    pub use gradsync_actors::store::{GradStore, HostStore};
}
