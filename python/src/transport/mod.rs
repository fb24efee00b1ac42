//! The runtime's [`Transport`] for the Python bindings: a [`BucketTransport`]
//! converts data buckets to their wire type and keeps the window of
//! collectives in flight, and an [`Engine`] runs them. One engine per
//! framework, each a type of its own:
//!
//! ```text
//! comm thread ── BucketTransport (wire conversion, window) ──▶ Engine
//!     NativeEngine  torch: the C++ shim's table (c10d gloo; NCCL on the device plane), no interpreter
//!     PythonEngine  Paddle: communicator.all_reduce(...) with the interpreter attached
//! a failure ── Failure (facts: ranks behind, time waited, cancelled) ──▶ CommError   (gradsync_actors::failure, once)
//! ```
//!
//! The bucket is one contiguous piece ([`Transport::pieces`] is 1), so an
//! address covers it whole. Collectives may overlap where the engine allows
//! (torch's: `start` launches one and returns, `wait_oldest` finishes the
//! oldest, up to the window; Paddle's runs each to the end).
//!
//! **Wire types.** A host bucket that travels as bfloat16 or float16
//! ([`Transport::set_wire`]) is rounded here, and only here for host
//! buckets, into a half-width buffer before the collective starts
//! ([`collective::Staged`]); the engine sums whatever element type it is
//! handed, and the sum is widened back into the bucket when it finishes. A
//! device-plane bucket is rounded and widened by the shim on the device
//! (python/shim/plane.cpp, `start_tensor`). Control words and corrections
//! always travel as they are.

mod collective;
mod native;
mod python;

use std::collections::VecDeque;
use std::time::Instant;

use gradsync_runtime::backend::{CollectiveKind, CollectiveTag, CommError, Transport};
use gradsync_runtime::Wire;
use pyo3::prelude::*;

use crate::collectives::Words;
use crate::plane::DevicePlane;
use crate::tensor_grads::{Bucket, TensorGrads};

use collective::{Collective, Staged};
use gradsync_runtime::backend::Failure;
pub(crate) use native::NativeEngine;
pub(crate) use python::PythonEngine;

/// A collective's outcome, as the runtime takes it.
type Done = Result<(), CommError>;

/// What runs the collectives a [`BucketTransport`] hands it.
pub(crate) trait Engine: Send + std::fmt::Debug {
    /// Collectives that may be in flight at once (1: `start` runs one whole).
    fn window(&self) -> usize;
    /// The device plane its buckets live on, if they do.
    fn plane(&self) -> Option<DevicePlane>;
    /// Whether it runs a [`Collective`] with a `chunk` (a reduce-scatter).
    fn reduce_scatters(&self) -> bool;
    /// Start `c` (its memory stays valid until it is finished or forgotten).
    fn start(&mut self, c: &Collective) -> Result<(), Failure>;
    /// Finish the oldest started collective (none: nothing to do).
    fn finish_oldest(&mut self) -> Result<(), Failure>;
    /// Collectives started and not finished.
    fn in_flight(&self) -> usize;
    /// Forget every started collective without waiting (after a failure).
    fn forget_all(&mut self);
    /// A new epoch on a fresh group; returns this rank's place `(rank, world)`.
    fn reset(&mut self) -> PyResult<(usize, usize)>;
}

/// Have `communicator` start a new epoch on a fresh group; returns its place
/// in it, `(rank, world)` (an elastic job's membership may have changed).
fn new_epoch(communicator: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    communicator.call_method0("reset")?;
    Ok((communicator.getattr("rank")?.extract()?, communicator.getattr("world")?.extract()?))
}

/// The engine for `communicator`: torch's communicator offers the shim's
/// table (`native()`), Paddle's runs collectives in Python. `window`: the
/// collectives the runtime may keep in flight.
pub(crate) fn engine_for(py: Python<'_>, communicator: Py<PyAny>, window: usize) -> PyResult<Box<dyn Engine>> {
    if communicator.bind(py).hasattr("native")? {
        Ok(Box::new(NativeEngine::new(py, communicator, window)?))
    } else {
        Ok(Box::new(PythonEngine::new(communicator)))
    }
}

/// One rank's transport (see the module docs).
#[derive(Debug)]
pub struct BucketTransport {
    rank: usize,
    world: usize,
    engine: Box<dyn Engine>,
    /// The type data buckets travel in.
    wire: Wire,
    /// Per collective started and not finished, oldest first: its staged
    /// half-width copy, if it has one.
    staged: VecDeque<Option<Staged>>,
    /// A sharded model's buckets ([`Transport::partitioned`]): only this
    /// rank's partition of each must hold the sum after its collective.
    partitioned: bool,
    /// ...and that collective is a reduce-scatter (else an all-reduce, which
    /// delivers the partition too: gloo's reduce-scatter costs more than its
    /// all-reduce; NCCL's half).
    scatter: bool,
    /// ...and each rank keeps the next rank's partition too (an elastic
    /// sharded job, [`Transport::buddies`]): the buckets are all-reduced.
    buddies: bool,
}

impl BucketTransport {
    /// Rank `rank` of `world`, its collectives run by `engine`; `partitioned`:
    /// only each rank's partition of a data bucket must hold the sum, and
    /// `scatter`: it is reduce-scattered (`None` when `engine` cannot);
    /// `buddies`: each rank keeps its buddy's partition too (then the buckets
    /// are all-reduced whatever `scatter` says).
    pub(crate) fn new(
        rank: usize,
        world: usize,
        engine: Box<dyn Engine>,
        partitioned: bool,
        scatter: bool,
        buddies: bool,
    ) -> Option<BucketTransport> {
        let buddies = partitioned && buddies;
        let scatter = partitioned && scatter && !buddies;
        if scatter && !engine.reduce_scatters() {
            return None;
        }
        let staged = VecDeque::new();
        Some(BucketTransport { rank, world, engine, wire: Wire::F32, staged, partitioned, scatter, buddies })
    }

    /// A data bucket's collective: reduce-scattered when partitioned and asked to.
    fn data(&self, c: Collective) -> Collective {
        if self.scatter {
            c.scattered(self.world)
        } else {
            c
        }
    }

    /// Whether buckets live on the device plane.
    pub fn on_device_plane(&self) -> bool {
        self.engine.plane().is_some()
    }

    /// Start collective `c`: the whole of it with a window of one (nothing
    /// stays in flight), otherwise start it for `wait_oldest`.
    fn start(&mut self, c: Collective) -> Result<(), CommError> {
        if self.engine.window() == 1 {
            return self.whole(c);
        }
        let c = self.stage(c);
        self.engine.start(&c).map_err(|f| {
            // Never started: it will not be finished.
            self.staged.pop_back();
            f.classify(self.rank)
        })
    }

    /// Collective `c`, started and finished (every earlier one finishes first).
    fn whole(&mut self, c: Collective) -> Result<(), CommError> {
        let c = self.stage(c);
        if let Err(f) = self.engine.start(&c) {
            self.staged.pop_back();
            return Err(f.classify(self.rank));
        }
        while self.engine.in_flight() > 0 {
            self.finish_oldest()?;
        }
        Ok(())
    }

    /// Finish the engine's oldest collective and widen its staged sum.
    fn finish_oldest(&mut self) -> Result<(), CommError> {
        let outcome = self.engine.finish_oldest();
        self.unstage(outcome.is_ok());
        outcome.map_err(|f| f.classify(self.rank))
    }

    /// Stage `c` in its wire type when it is a data bucket that travels
    /// narrower than float32 (see the module docs); remember either way, so
    /// the collective's finish knows.
    fn stage(&mut self, c: Collective) -> Collective {
        if self.wire == Wire::F32 || !matches!(c.tag.kind, CollectiveKind::Bucket { .. }) {
            self.staged.push_back(None);
            return c;
        }
        if c.tensor.is_some() {
            // A device bucket is rounded and widened on the device, by the shim.
            self.staged.push_back(None);
            let words = if self.wire == Wire::BF16 { Words::BF16 } else { Words::F16 };
            return Collective { words, ..c };
        }
        let mut staged = Staged::start(&c, self.wire);
        let c = c.staged(&mut staged);
        self.staged.push_back(Some(staged));
        c
    }

    /// The oldest collective finished (`ok`) or failed: widen its staged sum
    /// back into the bucket, or drop it.
    fn unstage(&mut self, ok: bool) {
        if let Some(Some(staged)) = self.staged.pop_front() {
            if ok {
                staged.finish();
            }
        }
    }
}

impl Transport for BucketTransport {
    type Store = TensorGrads;

    fn store(&self) -> TensorGrads {
        TensorGrads::new(self.engine.plane())
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_grads(&mut self, tag: CollectiveTag, bucket: &mut Bucket, factor: f64, deadline: Instant) -> Done {
        let c = Collective::bucket(tag, bucket, factor, deadline);
        self.whole(if matches!(tag.kind, CollectiveKind::Bucket { .. }) { self.data(c) } else { c })
    }

    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.whole(Collective::words(tag, words, deadline))
    }

    fn partitioned(&self) -> bool {
        self.partitioned
    }

    fn buddies(&self) -> bool {
        self.buddies
    }

    fn max_in_flight(&self) -> usize {
        self.engine.window()
    }

    /// One contiguous piece per bucket (the default is one per rank): the
    /// engine sees one tensor.
    fn pieces(&self) -> usize {
        1
    }

    /// gloo sums any of them; the conversion is [`Staged`]'s.
    fn wires(&self) -> &'static [Wire] {
        &[Wire::F32, Wire::BF16, Wire::F16]
    }

    fn set_wire(&mut self, wire: Wire) {
        self.wire = wire;
    }

    /// Buckets are averaged while they are packed (as DDP divides before its
    /// all-reduce), so the communicator thread only sums: a separate
    /// `mul_` over every bucket would cost it a full pass over the bytes.
    fn scale_when_packing(&self) -> bool {
        true
    }

    fn start_grads(&mut self, tag: CollectiveTag, bucket: &mut Bucket, factor: f64, deadline: Instant) -> Done {
        let c = Collective::bucket(tag, bucket, factor, deadline);
        self.start(if matches!(tag.kind, CollectiveKind::Bucket { .. }) { self.data(c) } else { c })
    }

    fn start_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.start(Collective::words(tag, words, deadline))
    }

    /// On the data group (NCCL on the device plane, gloo on the host), in
    /// the bucket's own type (never a narrower wire: parameters travel exact).
    fn start_gather(&mut self, tag: CollectiveTag, bucket: &mut Bucket, deadline: Instant) -> Done {
        if !self.engine.reduce_scatters() {
            let why = "this framework's engine runs all-reduces only: train it unsharded".to_string();
            return Err(CommError::Backend { rank: self.rank, tag, why });
        }
        let c = Collective::bucket(tag, bucket, 1.0, deadline).gathered(self.world);
        self.start(c)
    }

    fn wait_oldest(&mut self) -> Result<(), CommError> {
        // With a window of one, `start_*` ran the whole collective: nothing to wait for.
        if self.engine.in_flight() == 0 {
            return Ok(());
        }
        self.finish_oldest()
    }

    fn discard_in_flight(&mut self) {
        self.staged.clear();
        self.engine.forget_all();
    }

    fn reset(&mut self) {
        self.staged.clear();
        match self.engine.reset() {
            // An elastic job's new membership: this rank's place in it.
            Ok((rank, world)) => (self.rank, self.world) = (rank, world),
            // The reset agreement that follows fails and reports it.
            Err(e) => tracing::error!(rank = self.rank, error = %e, "the communicator could not start a new epoch"),
        }
    }
}
