//! The public API of gradsync.
//!
//! A training loop builds one [`GradSync`] per rank (the same registrations on
//! every rank), hands [`GradHook`] clones to its autograd hooks, and calls
//! [`GradSync::finish_step`] once backward is over. What flows through:
//!
//! ```text
//! GradSyncBuilder::param(...) ─▶ Plan (buckets, reverse registration order)
//! GradHook::accumulated / increment ──Arrival──▶ actors (dedup, pack, launch in plan order)
//! finish_step ─▶ remaining buckets ─▶ control collective ─▶ correction? ─▶ StepResult
//!                                                  { StepReport, Option<Gradients> }
//! ```
//!
//! Backends: [`local`] runs N ranks as threads of one process (tests, examples,
//! CPU training); `cuda` (feature `cuda`) keeps gradients in device memory and
//! all-reduces them with NCCL on a dedicated stream (`GradSync<DeviceStore>`).
//! Where gradients live is a [`GradStore`]: [`HostStore`] by default. The
//! actors themselves live in `gradsync-actors`, the numeric loops in
//! `gradsync-kernels`.
#![deny(missing_docs)]

mod builder;
#[cfg(feature = "cuda")]
pub mod cuda;
mod hook;
pub mod local;
pub mod metrics;
pub mod rendezvous;
mod sync;
pub mod trace;

pub use builder::{BuildError, Divisor, GradSyncBuilder};
pub use gradsync_actors::telemetry::trace_epoch;
pub use gradsync_actors::{
    AbortReason, AllocError, BucketBuf, CollectiveKind, CollectiveTag, CommError, DType, GradStore, GradView,
    Gradients, HostStore, Lane, Outcome, ParamId, Payload, PayloadKind, Plan, Progress, Rejection, Step, StepReport,
    StepResult, SyncError, TimelineEvent, Token, Transport, WriteMode,
};
pub use hook::GradHook;
pub use local::{LocalEndpoint, LocalWorld};
pub use sync::GradSync;
pub use trace::ChromeTrace;
