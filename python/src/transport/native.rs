//! torch's engine: the C++ shim's collectives, called from the communicator
//! thread without the interpreter (python/src/collectives.rs), on host
//! buckets or on the device plane's.
//!
//! ```text
//! communicator.native() ── (table, endpoint) ──▶ NativeGloo   (gloo: control words, host buckets)
//! communicator.plane()  ── (table, plane)    ──▶ DevicePlane  (device buckets, summed on the data group)
//! a failure ── ShimError + table.behind(seq) ──▶ Failure (classified by the transport)
//! ```
//!
//! Python is entered only to reset: the communicator opens the next epoch's
//! group, and the endpoint's address is read again.

use std::time::Instant;

use pyo3::prelude::*;

use crate::collectives::{NativeGloo, ShimError};
use crate::errors;
use crate::plane::DevicePlane;

use super::collective::Collective;
use super::{new_epoch, Engine};
use gradsync_runtime::backend::Failure;

/// The shim's collectives over the endpoint of a `gradsync.torch._comm.TorchCommunicator`.
#[derive(Debug)]
pub(crate) struct NativeEngine {
    /// The communicator (it keeps the endpoint, the plane and their groups alive).
    communicator: Py<PyAny>,
    gloo: NativeGloo,
    plane: Option<DevicePlane>,
    /// Collectives that may be in flight at once.
    window: usize,
}

impl NativeEngine {
    /// The engine over `communicator` (which has `native()` and `plane()`).
    pub fn new(py: Python<'_>, communicator: Py<PyAny>, window: usize) -> PyResult<NativeEngine> {
        let bound = communicator.bind(py);
        let (table, endpoint): (usize, usize) = bound.call_method0("native")?.extract()?;
        let reinstall = |why: String| {
            errors::raise::<errors::ConfigError>(
                py,
                format!("gradsync.torch._collectives: {why}; reinstall gradsync"),
                &[],
            )
        };
        // SAFETY: `native()` returns the shim's table and an endpoint the
        // communicator keeps until its next reset, and this engine holds the
        // communicator (and reads the endpoint again after each reset).
        let gloo = unsafe { NativeGloo::new(table, endpoint) }.map_err(reinstall)?;
        let plane = match bound.call_method0("plane")?.extract::<Option<(usize, usize)>>()? {
            // SAFETY: `plane()` returns the shim's table and a Plane the
            // communicator keeps for its whole life, and this engine (and the
            // session whose store copies it) holds the communicator.
            Some((table, plane)) => Some(unsafe { DevicePlane::new(table, plane) }.map_err(reinstall)?),
            None => None,
        };
        Ok(NativeEngine { communicator, gloo, plane, window: window.max(1) })
    }

    /// A shim failure as facts: the ranks behind read from the store.
    fn failure(&self, e: ShimError) -> Failure {
        let behind = if e.cancelled { Vec::new() } else { self.gloo.behind(e.seq) };
        Failure { tag: e.tag, message: e.message, behind, waited: e.waited, timeout: e.timeout, cancelled: e.cancelled }
    }
}

impl Engine for NativeEngine {
    fn window(&self) -> usize {
        self.window
    }

    fn plane(&self) -> Option<DevicePlane> {
        self.plane
    }

    fn reduce_scatters(&self) -> bool {
        true
    }

    fn start(&mut self, c: &Collective) -> Result<(), Failure> {
        let timeout = c.time_left(Instant::now());
        let started = match (c.tensor, &self.plane) {
            (Some(bucket), Some(plane)) => {
                self.gloo.start_tensor(c.tag, plane.address(), bucket, c.words, c.factor, (c.op, c.chunk), timeout)
            }
            _ => self.gloo.start(c.tag, c.addr, c.numel, c.words, c.factor, (c.op, c.chunk), timeout),
        };
        started.map_err(|e| self.failure(e))
    }

    fn finish_oldest(&mut self) -> Result<(), Failure> {
        self.gloo.finish_oldest().map_err(|e| self.failure(e))
    }

    fn in_flight(&self) -> usize {
        self.gloo.in_flight()
    }

    fn forget_all(&mut self) {
        self.gloo.forget_all();
    }

    fn reset(&mut self) -> PyResult<(usize, usize)> {
        self.gloo.forget_all();
        Python::attach(|py| {
            let communicator = self.communicator.bind(py);
            let place = new_epoch(communicator)?;
            // The new group has a new endpoint; the old one is gone with it.
            let (_, endpoint): (usize, usize) = communicator.call_method0("native")?.extract()?;
            self.gloo.set_endpoint(endpoint);
            Ok(place)
        })
    }
}
