//! The device-agnostic concurrency core of gradsync.
//!
//! What flows through this crate, per rank and per step:
//!
//! ```text
//! hook ──Arrival──▶ ParamShard ──Ready──▶ Scheduler ──CommJob──▶ communicator thread
//!  (any thread,      (dedup, count,        (pack, plan-order      (one OS thread, runs a
//!   non-blocking      token order,          launch, control,        Transport: local threads,
//!   send)             learn, extras)        correction)             NCCL, torch, simulation)
//!                                               ▲                       │
//! finish_step ──Flush──▶ shards ──Flushed───────┤◀──────CommDone────────┘
//!             ──Finish─────────────────────────▶│──▶ StepResult { StepReport, Gradients }
//! ```
//!
//! * [`param`]: parameter actors, grouped in shards, one owner per parameter.
//! * [`scheduler`]: the bucket scheduler, an explicit step state machine and
//!   the only place that decides launches.
//! * [`comm`]: the [`Transport`] trait and the communicator thread body.
//! * [`wiring`]: the one function that connects a rank's actors.
//! * [`plan`] / [`bucket_buf`]: registration, the bucket layout, host storage.
//! * [`store`]: where gradient values live ([`GradStore`]: host memory here,
//!   device memory in the runtime's CUDA backend).
//! * [`gradients`]: the reduced gradients, lent to the caller until dropped.
//!
//! This is gradsync's implementation crate: its modules are public for the
//! runtime crate and the simulator. The supported API is the `gradsync`
//! crate, which re-exports what training loops and backend authors need.
//! Nothing here knows a device or a backend beyond [`Transport`] and
//! [`GradStore`].
#![deny(missing_docs)]

pub mod arrival;
pub mod bucket_buf;
pub mod comm;
pub mod error;
pub mod failure;
pub mod gradients;
pub mod messages;
pub mod param;
pub mod plan;
pub mod policy;
pub mod report;
pub mod residency;
pub mod scheduler;
pub mod sources;
pub mod store;
pub mod telemetry;
pub mod timeline;
pub mod wiring;

pub use arrival::{Arrival, DType, ParamId, Payload, PayloadKind, Step, Token};
pub use bucket_buf::{BucketBuf, PieceLengthError, WriteMode};
pub use comm::{CommDone, CommJob, CommPayload, Interrupt, Transport};
pub use error::{AllocError, BuildError, CollectiveKind, CollectiveTag, CommError, Rejection, SyncError};
pub use failure::Failure;
pub use gradients::{GradView, Gradients, StepResult};
pub use plan::Plan;
pub use policy::{AbortPolicy, Divisor, Wire};
pub use report::{AbortReason, Outcome, Progress, StepReport};
pub use store::{GradStore, HostStore};
pub use timeline::{Lane, TimelineEvent};
