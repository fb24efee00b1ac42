//! Paddle's engine: a Python communicator (`gradsync.paddle._comm`) runs
//! each collective, called from the communicator thread with the
//! interpreter attached. Paddle's gloo runs a collective to the end inside
//! the call: `start` runs it whole and `finish_oldest` only counts it done
//! (a window of one).
//!
//! ```text
//! comm thread ── attach ──▶ communicator.all_reduce(addr, numel, "float32", factor, timeout_s)
//!             ◀── None, or (message, ranks behind) ──┘   (the facts of a failure)
//! ```
//!
//! The memory arrives as an address and an element type (a bucket that
//! travels as bfloat16 was converted by the transport) and is summed in
//! place: the communicator must not keep what it made of it.

use std::time::Instant;

use pyo3::prelude::*;

use crate::plane::DevicePlane;

use super::collective::Collective;
use super::{new_epoch, Engine};
use gradsync_runtime::backend::Failure;

/// Collectives run by a Python communicator, one at a time.
#[derive(Debug)]
pub(crate) struct PythonEngine {
    /// Has `all_reduce(addr, numel, dtype, factor, timeout_s)`, `reset()`,
    /// `rank` and `world`.
    communicator: Py<PyAny>,
    /// Collectives run by `start` and not yet finished (at most one).
    done: usize,
}

impl PythonEngine {
    pub fn new(communicator: Py<PyAny>) -> PythonEngine {
        PythonEngine { communicator, done: 0 }
    }
}

impl Engine for PythonEngine {
    fn window(&self) -> usize {
        1
    }

    fn plane(&self) -> Option<DevicePlane> {
        None
    }

    /// Paddle's communicator all-reduces only (sharding is torch's).
    fn reduce_scatters(&self) -> bool {
        false
    }

    /// Runs the whole collective.
    fn start(&mut self, c: &Collective) -> Result<(), Failure> {
        debug_assert_eq!(
            c.op,
            crate::collectives::Op::AllReduce,
            "the session refuses to partition on an engine that cannot"
        );
        let started = Instant::now();
        let timeout = c.time_left(started);
        let outcome = Python::attach(|py| {
            let args = (c.addr, c.numel, c.words.label(), c.factor, timeout.as_secs_f64());
            self.communicator
                .call_method1(py, "all_reduce", args)
                .and_then(|r| r.extract::<Option<(String, Vec<usize>)>>(py))
        });
        let (message, behind) = match outcome {
            Ok(None) => {
                self.done += 1;
                return Ok(());
            }
            Ok(Some(facts)) => facts,
            // The communicator itself broke (a bug, not a collective's failure).
            Err(e) => (format!("the communicator raised {e}"), Vec::new()),
        };
        Err(Failure { tag: c.tag, message, behind, waited: started.elapsed(), timeout, cancelled: false })
    }

    fn finish_oldest(&mut self) -> Result<(), Failure> {
        self.done = self.done.saturating_sub(1);
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.done
    }

    fn forget_all(&mut self) {
        self.done = 0;
    }

    fn reset(&mut self) -> PyResult<(usize, usize)> {
        self.done = 0;
        Python::attach(|py| new_epoch(self.communicator.bind(py)))
    }
}
