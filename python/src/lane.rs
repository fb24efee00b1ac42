//! [`Lane`]: parameter sharding's gather lane as Python drives it (the
//! runtime's `GatherLane` on a communicator of its own), for the gathers
//! of `gradsync.torch.sharding.units`.
//!
//! ```text
//! Lane.needs(words) ─▶ every rank's words summed (interpreter released) ─▶ which units this round gathers
//! Lane.buffers(sizes) ─▶ Gathers (the lane's store: host memory, or tensors on its device plane)
//! Lane.start(gathers, b)… ─▶ GatherLane::start_gather ─▶ Lane.wait(gathers, b)… in the same order
//! ```
//!
//! A buffer that starts leaves its slot (`Slot::Lane`) and comes back with
//! its wait, failed or not; only when the lane stops answering does it not
//! come back, and the `Gathers` are then `lost`.

use std::collections::VecDeque;
use std::time::Duration;

use gradsync_runtime::backend::{GradStore, Transport};
use gradsync_runtime::{DType, GatherLane, GatherOf};
use pyo3::prelude::*;

use crate::closing;
use crate::errors;
use crate::gathers::{Gathers, Slot};
use crate::tensor_grads::TensorGrads;
use crate::transport::{engine_for, BucketTransport};

/// One rank's gather lane (see the module docs).
#[pyclass(module = "gradsync._native")]
pub struct Lane {
    /// `None` once closed.
    lane: Option<GatherLane<TensorGrads>>,
    /// Per gather started and not waited for, oldest first: its buffer index
    /// (waits come in the order of the starts).
    started: VecDeque<usize>,
}

impl Lane {
    fn lane(&mut self, py: Python<'_>) -> PyResult<&mut GatherLane<TensorGrads>> {
        self.lane
            .as_mut()
            .ok_or_else(|| errors::raise::<errors::ClosedError>(py, "this gather lane is closed".into(), &[]))
    }
}

#[pymethods]
impl Lane {
    /// The lane of rank `rank` of `world`, its collectives run on
    /// `communicator` (a group of its own, apart from the session's); each
    /// may wait `timeout_s` for the other ranks.
    #[new]
    #[pyo3(signature = (communicator, rank, world, *, timeout_s = 300.0, in_flight = 2))]
    fn new(
        py: Python<'_>,
        communicator: Py<PyAny>,
        rank: usize,
        world: usize,
        timeout_s: f64,
        in_flight: usize,
    ) -> PyResult<Lane> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            let why = format!("timeout_s {timeout_s}: must be positive");
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        let engine = engine_for(py, communicator, in_flight)?;
        let transport = BucketTransport::new(rank, world, engine, false, false, false)
            .expect("an unpartitioned transport needs no reduce-scatter");
        debug_assert_eq!(transport.rank(), rank);
        let lane = GatherLane::start(transport, Duration::from_secs_f64(timeout_s))
            .map_err(|e| errors::build_error(py, &e))?;
        Ok(Lane { lane: Some(lane), started: VecDeque::new() })
    }

    /// Sum `words` over every rank (the round's needs; interpreter released).
    fn needs(&mut self, py: Python<'_>, words: Vec<u64>) -> PyResult<Vec<u64>> {
        let lane = self.lane(py)?;
        py.detach(|| lane.needs(words)).map_err(|e| errors::sync_error(py, &e))
    }

    /// Open a round without waiting for its sum (`sum_within` takes it).
    fn post_needs(&mut self, py: Python<'_>, words: Vec<u64>) -> PyResult<()> {
        let lane = self.lane(py)?;
        lane.post_needs(words).map_err(|e| errors::sync_error(py, &e))
    }

    /// The posted round's sum if it comes within `within_s` (interpreter
    /// released), else `None`: ask again.
    fn sum_within(&mut self, py: Python<'_>, within_s: f64) -> PyResult<Option<Vec<u64>>> {
        let within = Duration::from_secs_f64(within_s.max(0.0));
        let lane = self.lane(py)?;
        py.detach(|| lane.sum_within(within)).map_err(|e| errors::sync_error(py, &e))
    }

    /// Buffers for the lane's gathers: per `(bucket index, values, float64)`
    /// of `sizes`, a buffer of that many values (every rank's chunk of the
    /// bucket, back to back) in the lane's store.
    fn buffers(&mut self, py: Python<'_>, sizes: Vec<(usize, usize, bool)>) -> PyResult<Gathers> {
        let store = *self.lane(py)?.store();
        let mut buffers = Vec::with_capacity(sizes.len());
        for (index, numel, wide) in sizes {
            let dtype = if wide { DType::F64 } else { DType::F32 };
            let bucket = store.alloc_bucket(numel, 1, dtype).map_err(|e| {
                let why = format!("allocating a gather buffer of {numel} values: {e}");
                errors::raise::<errors::ConfigError>(py, why, &[])
            })?;
            buffers.push((GatherOf::Bucket(index), bucket));
        }
        Ok(Gathers::new(buffers))
    }

    /// Start gathering buffer `index` of `gathers` (this rank's chunk
    /// written first) and return at once.
    fn start(&mut self, py: Python<'_>, gathers: &Bound<'_, Gathers>, index: usize) -> PyResult<()> {
        let mut gathers = gathers.borrow_mut();
        let slots = gathers.slots();
        let count = slots.len();
        let Some(slot) = slots.get_mut(index) else {
            let why = format!("gather buffer {index} asked for, and there are {count}");
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        };
        let Slot::Held(GatherOf::Bucket(bucket_index), bucket) = std::mem::replace(slot, Slot::Lane) else {
            let why = format!("gather buffer {index} is in flight or lost");
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        };
        let lane = self.lane(py)?;
        match lane.start_gather(bucket_index, bucket) {
            Ok(()) => {
                self.started.push_back(index);
                Ok(())
            }
            Err((bucket, e)) => {
                gathers.slots()[index] = Slot::Held(GatherOf::Bucket(bucket_index), bucket);
                Err(errors::sync_error(py, &e))
            }
        }
    }

    /// Wait for the gather of buffer `index` (the oldest started), with the
    /// interpreter released; a failure raises as a failed step does.
    fn wait(&mut self, py: Python<'_>, gathers: &Bound<'_, Gathers>, index: usize) -> PyResult<()> {
        if self.started.front() != Some(&index) {
            let why =
                format!("gather buffer {index} is not the oldest in flight ({:?}): wait in start order", self.started);
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        self.started.pop_front();
        let entry = gathers.borrow().entries[index].0;
        let lane = self.lane(py)?;
        let (back, outcome) = py.detach(|| lane.wait_gather());
        let mut gathers = gathers.borrow_mut();
        match (back, entry) {
            (Some(bucket), Some(bucket_index)) => {
                gathers.slots()[index] = Slot::Held(GatherOf::Bucket(bucket_index), bucket);
            }
            _ => gathers.lost = true,
        }
        outcome.map_err(|e| errors::sync_error(py, &e))
    }

    /// After a failure, on every rank: settle what is out and open a new
    /// epoch of the lane's group (a collective).
    fn reset(&mut self, py: Python<'_>) -> PyResult<()> {
        self.started.clear();
        let lane = self.lane(py)?;
        py.detach(|| lane.reset()).map_err(|e| errors::sync_error(py, &e))
    }

    /// Stop the lane's thread (a collective still waiting fails); later
    /// calls raise `ClosedError`.
    fn close(&mut self, py: Python<'_>) {
        if let Some(lane) = self.lane.take() {
            py.detach(move || drop(lane));
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let Some(lane) = self.lane.take() else { return };
        if closing::interpreter_is_ending() {
            // Left to the process, as a session's runtime is (session.rs).
            std::mem::forget(lane);
            return;
        }
        closing::in_background(lane);
    }
}
