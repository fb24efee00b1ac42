//! gradsync: exact, overlapped gradient all-reduce for data-parallel training
//! that stays correct when recompute, shared weights, unused parameters or
//! repeated forwards make gradient hooks fire twice, late, or never.
//!
//! One [`GradSync`] per rank; hooks send gradients through a [`GradHook`];
//! after backward, [`GradSync::finish_step`] returns a [`StepReport`] and the
//! averaged [`Gradients`]. Backend authors: see [`backend`].
//!
//! ```
//! use gradsync::{DType, GradSync, LocalWorld, Token};
//!
//! let mut b = GradSync::builder();
//! let w = b.param("shared.weight", 4, DType::F32).unwrap(); // register in forward order
//!
//! // Two ranks as threads of this process; each rank owns one GradSync.
//! let results: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let ranks: Vec<_> = LocalWorld::connect(2).unwrap().into_iter().map(|endpoint| {
//!         let b = &b;
//!         s.spawn(move || {
//!             let mut sync = b.build(endpoint).unwrap();
//!             let rank = sync.rank() as f32;
//!             let hook = sync.hook(); // Clone + Send: give it to autograd hooks
//!             // Reentrant recompute fires the shared weight's hook twice; the
//!             // first firing carries a partial gradient, the second the total.
//!             hook.accumulated(0, w, Token(0), vec![rank; 4]).unwrap();
//!             hook.accumulated(0, w, Token(1), vec![rank + 1.0; 4]).unwrap();
//!             let result = sync.finish_step(0).unwrap();
//!             let grads = result.gradients.as_ref().expect("no rank aborted");
//!             let mut out = vec![0.0; 4];
//!             grads.copy_into(w, &mut out); // into your own buffer
//!             out
//!         })
//!     }).collect();
//!     ranks.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! // Average of the final local gradients: ((0 + 1) + (1 + 1)) / 2 = 1.5 on every rank.
//! assert_eq!(results, vec![vec![1.5; 4], vec![1.5; 4]]);
//! ```
#![deny(missing_docs)]

pub use gradsync_runtime::*;

/// The simulator's door into the actors (feature `sim`).
///
/// `gradsync-bench sim` drives one rank's real parameter actor and scheduler
/// on a virtual clock, playing the communicator and the other ranks itself.
/// This module gives it the wiring and the messages it needs; it is not part
/// of the stable API and may change with the actors.
#[cfg(feature = "sim")]
pub mod sim {
    pub use gradsync_actors::comm::{CommDone, CommJob, CommPayload};
    pub use gradsync_actors::messages::{FinishRequest, Reply, SchedMsg, ShardMsg, StepEnd};
    pub use gradsync_actors::plan::{ParamSpec, Registry};
    pub use gradsync_actors::scheduler::control::mirror_vote;
    pub use gradsync_actors::scheduler::SchedulerConfig;
    pub use gradsync_actors::wiring::{wire, ActorConfig, Actors};
    pub use gradsync_actors::{Arrival, HostStore};
}
