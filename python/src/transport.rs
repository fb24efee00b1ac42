//! A [`Transport`] whose collectives run in Python, through an object with
//! the communicator protocol of `gradsync.torch` (`torch.distributed` gloo on
//! CPU): the runtime's communicator thread attaches to the interpreter for
//! each collective and hands the bucket over as an address, which the Python
//! side wraps as a tensor without copying.
//!
//! ```text
//! comm thread ── attach ──▶ communicator.all_reduce(addr, numel, "f32", factor, tag, kind, timeout_s)
//!             ◀── ok / _CollectiveFailed(kind, missing, peer) ──┘   (GIL released while gloo waits)
//! ```
//!
//! The bucket is one contiguous piece ([`Transport::pieces`] is 1), so the
//! address covers it whole. Collectives may overlap: `start` launches one and
//! returns, `wait_oldest` finishes the oldest, up to `window` at a time. The
//! communicator must not keep the tensor it makes after the collective finished.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gradsync_runtime::backend::{BucketBuf, CollectiveTag, CommError, Transport};
use pyo3::prelude::*;

use crate::store::TensorStore;

/// One rank's endpoint over a Python communicator.
#[derive(Debug)]
pub struct PyTransport {
    rank: usize,
    world: usize,
    /// Has `all_reduce`, `start`, `wait_oldest`, `discard` and `reset` (see
    /// `gradsync.torch._comm`).
    communicator: Py<PyAny>,
    /// Collectives that may be in flight at once.
    window: usize,
    /// Tags and start times of the started collectives, oldest first.
    started: VecDeque<(CollectiveTag, Instant)>,
}

impl PyTransport {
    pub fn new(rank: usize, world: usize, communicator: Py<PyAny>, window: usize) -> Self {
        PyTransport { rank, world, communicator, window: window.max(1), started: VecDeque::new() }
    }

    /// Call `method` for one collective over `numel` elements at `addr`.
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        method: &str,
        tag: CollectiveTag,
        addr: usize,
        numel: usize,
        dtype: &str,
        factor: f32,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let started = Instant::now();
        let timeout = deadline.saturating_duration_since(started).max(Duration::from_millis(1));
        Python::attach(|py| {
            let args = (addr, numel, dtype, factor, tag.to_string(), tag.kind.label(), timeout.as_secs_f64());
            self.communicator
                .call_method1(py, method, args)
                .map(|_| ())
                .map_err(|e| self.translate(py, e, tag, started.elapsed()))
        })
    }

    /// Start one collective: the whole of it with a window of one (nothing
    /// stays in flight), otherwise `start` it and remember it for
    /// `wait_oldest`.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        tag: CollectiveTag,
        addr: usize,
        numel: usize,
        dtype: &str,
        factor: f32,
        deadline: Instant,
    ) -> Result<(), CommError> {
        if self.window == 1 {
            return self.call("all_reduce", tag, addr, numel, dtype, factor, deadline);
        }
        self.call("start", tag, addr, numel, dtype, factor, deadline)?;
        self.started.push_back((tag, Instant::now()));
        Ok(())
    }

    /// A Python failure as the runtime's error: the communicator raises
    /// `_CollectiveFailed` with `kind` (`"timeout"`, `"peer_gone"`, `"backend"`),
    /// `missing` and `peer`; anything else is a backend error.
    fn translate(&self, py: Python<'_>, e: PyErr, tag: CollectiveTag, waited: Duration) -> CommError {
        let rank = self.rank;
        let value = e.value(py);
        let kind: Option<String> = value.getattr("kind").ok().and_then(|k| k.extract().ok());
        let why = value.str().map(|s| s.to_string()).unwrap_or_else(|_| "unprintable error".into());
        match kind.as_deref() {
            Some("timeout") => {
                let missing = value.getattr("missing").ok().and_then(|m| m.extract().ok()).unwrap_or_default();
                CommError::Timeout { rank, tag, missing, waited }
            }
            Some("peer_gone") => match value.getattr("peer").ok().and_then(|p| p.extract::<usize>().ok()) {
                Some(peer) => CommError::PeerGone { rank, peer, tag },
                None => CommError::Backend { rank, tag, why },
            },
            _ => CommError::Backend { rank, tag, why },
        }
    }
}

impl Transport for PyTransport {
    type Store = TensorStore;

    fn store(&self) -> TensorStore {
        TensorStore
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// One contiguous piece per bucket: the communicator sees one tensor.
    fn pieces(&self) -> usize {
        1
    }

    fn all_reduce_f32(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut BucketBuf,
        factor: f32,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let piece = bucket.piece_mut(0);
        self.call("all_reduce", tag, piece.as_mut_ptr() as usize, piece.len(), "float32", factor, deadline)
    }

    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        // Summed as int64: two's complement makes the wrapping sums identical.
        self.call("all_reduce", tag, words.as_mut_ptr() as usize, words.len(), "int64", 1.0, deadline)
    }

    fn max_in_flight(&self) -> usize {
        self.window
    }

    /// Buckets are averaged while they are packed (as DDP divides before its
    /// all-reduce), so the communicator thread only sums: a separate
    /// `mul_` over every bucket would cost it a full pass over the bytes.
    fn scale_when_packing(&self) -> bool {
        true
    }

    fn start_f32(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut BucketBuf,
        factor: f32,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let piece = bucket.piece_mut(0);
        self.start(tag, piece.as_mut_ptr() as usize, piece.len(), "float32", factor, deadline)
    }

    fn start_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.start(tag, words.as_mut_ptr() as usize, words.len(), "int64", 1.0, deadline)
    }

    fn wait_oldest(&mut self) -> Result<(), CommError> {
        // Nothing started with a window of one: `start_*` ran the whole collective.
        let Some((tag, started)) = self.started.pop_front() else { return Ok(()) };
        Python::attach(|py| {
            self.communicator
                .call_method0(py, "wait_oldest")
                .map(|_| ())
                .map_err(|e| self.translate(py, e, tag, started.elapsed()))
        })
    }

    fn discard_in_flight(&mut self) {
        self.started.clear();
        let outcome = Python::attach(|py| self.communicator.call_method0(py, "discard").map(|_| ()));
        if let Err(e) = outcome {
            tracing::error!(rank = self.rank, error = %e, "the communicator could not discard its collectives");
        }
    }

    fn reset(&mut self) {
        let outcome = Python::attach(|py| self.communicator.call_method0(py, "reset").map(|_| ()));
        if let Err(e) = outcome {
            // The reset agreement that follows fails and reports it.
            tracing::error!(rank = self.rank, error = %e, "the communicator could not start a new epoch");
        }
    }
}
