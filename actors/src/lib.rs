//! The device-agnostic concurrency core of gradsync.
//!
//! What flows through this crate, per rank and per step:
//!
//! ```text
//! hook ──Arrival──▶ ParamShard ──Ready──▶ Scheduler ──CommJob──▶ communicator thread
//!  (any thread,      (dedup, count,        (pack, plan-order      (one OS thread, runs a
//!   non-blocking      learn, forward        launch, control,        Transport: local threads,
//!   send)             extras)               correction)             NCCL, simulation)
//!                                               ▲                       │
//! finish_step ──Flush──▶ shards ──Flushed───────┤◀──────CommDone────────┘
//!             ──Finish─────────────────────────▶│──▶ StepResult { StepReport, Gradients }
//! ```
//!
//! * [`param`]: parameter actors, grouped in shards, one owner per parameter.
//! * [`scheduler`]: the bucket scheduler, the only place that decides launches.
//! * [`comm`]: the [`Transport`] trait and the communicator thread body.
//! * [`plan`] / [`bucket_buf`]: the bucket layout and its sharded host storage.
//! * [`store`]: where gradient values live ([`GradStore`]: host memory here,
//!   device memory in the runtime's CUDA backend).
//! * [`gradients`]: the reduced gradients, lent to the caller until dropped.
//!
//! Nothing here knows a device or a backend beyond [`Transport`] and
//! [`GradStore`]; the runtime
//! crate wires actors to threads and offers the public API.
#![deny(missing_docs)]

pub mod arrival;
pub mod bucket_buf;
pub mod comm;
pub mod error;
pub mod gradients;
pub mod messages;
pub mod param;
pub mod plan;
pub mod report;
pub mod scheduler;
pub mod store;
pub mod telemetry;

pub use arrival::{Arrival, DType, ParamId, Payload, PayloadKind, Step, Token};
pub use bucket_buf::{BucketBuf, WriteMode};
pub use comm::{CommDone, CommJob, CommPayload, Interrupt, Transport};
pub use error::{AllocError, CollectiveKind, CollectiveTag, CommError, Rejection, SyncError};
pub use gradients::{GradView, Gradients, StepResult};
pub use plan::{BucketSpec, ParamSpec, Plan, Slot};
pub use report::{AbortReason, Outcome, Progress, StepReport};
pub use store::{GradStore, HostStore};
pub use telemetry::{Lane, TimelineEvent};
