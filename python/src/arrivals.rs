//! Arrivals without the interpreter: the C entry point that
//! `gradsync.torch._arrivals` (python/shim/arrivals.cpp) calls from its
//! gradient hooks.
//!
//! ```text
//! AccumulateGrad post hook (C++, no GIL) ── give(sink, param, token, addr, tensor) ──▶ ArrivalBatch
//!                                       ◀── 0, or a code (the refusal is kept for raise_refusal)
//! ```
//!
//! A [`Sink`] shares the session's arrival batch and parameter table, so
//! arrivals from C++ and from `Session.give` meet the same checks and the same
//! batch. An arrival is for the step the runtime has open: the hooks keep no
//! step number of their own. The tensor comes as a handle the shim allocated; the runtime keeps
//! it while it reads the memory and gives it back through the shim's
//! `release` (a C++ reference count: no interpreter needed).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use gradsync_runtime::{ArrivalBatch, Rejection, Token};
use pyo3::prelude::*;

use crate::errors;
use crate::given::NativeTensor;
use crate::params::Params;
use crate::plane::PlaneGrad;
use crate::tensor_grads::{Grad, Owner, TensorGrads};

/// The version of [`Table`] (the shim checks it: `kSinkVersion`).
pub const TABLE_VERSION: u32 = 3;

/// What `give` returns.
const GIVEN: i32 = 0;
const REFUSED: i32 = 1;

/// The session's arrival batch; `None` once the session is closed.
pub type SharedBatch = Arc<Mutex<Option<ArrivalBatch<TensorGrads>>>>;

/// Where the shim's hooks hand gradients over (see the module docs).
#[derive(Debug)]
pub struct Sink {
    batch: SharedBatch,
    params: Arc<Params>,
    /// The last refusal, until the hook asks for it as an exception
    /// (`ArrivalSink.raise_refusal`).
    refused: Mutex<Option<Rejection>>,
}

/// The entry points the shim calls (its `SinkTable`, field for field).
#[repr(C)]
pub struct Table {
    version: u32,
    #[allow(clippy::type_complexity)]
    give: unsafe extern "C" fn(*const Sink, usize, u64, usize, *mut c_void, unsafe extern "C" fn(*mut c_void)) -> i32,
}

static TABLE: Table = Table { version: TABLE_VERSION, give };

/// Hand over the tensor `handle` (data at `addr`) as one additive
/// contribution to parameter `param` in the open step (as `Session.give`). Takes the handle
/// whatever the outcome; returns 0, or 1 with the refusal kept in the sink.
///
/// # Safety
/// `sink` is an `ArrivalSink`'s address, alive for the call; `addr` the data
/// of a contiguous CPU tensor with the parameter's element count and type,
/// which `handle` keeps alive and nobody writes until the runtime releases it.
unsafe extern "C" fn give(
    sink: *const Sink,
    param: usize,
    token: u64,
    addr: usize,
    handle: *mut c_void,
    release: unsafe extern "C" fn(*mut c_void),
) -> i32 {
    // SAFETY: the caller hands over a `Given` it allocated, with its `release` (this function's contract).
    let owner = unsafe { NativeTensor::new(handle, release) };
    // SAFETY: the caller vouches that `sink` is alive.
    let sink = unsafe { &*sink };
    match sink.give(param, token, addr, owner) {
        Ok(()) => GIVEN,
        Err(refusal) => {
            *sink.refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(refusal);
            REFUSED
        }
    }
}

impl Sink {
    pub(crate) fn new(batch: SharedBatch, params: Arc<Params>) -> Sink {
        Sink { batch, params, refused: Mutex::new(None) }
    }

    fn give(&self, param: usize, token: u64, addr: usize, owner: NativeTensor) -> Result<(), Rejection> {
        // The shim registered one hook per parameter index it was given.
        let id = self.params.ids[param];
        let grad = if self.params.device_plane {
            Grad::Plane(PlaneGrad { given: owner, numel: self.params.numel[param] })
        } else {
            Grad::read(self.params.at(param, addr), Owner::Native(owner))
        };
        let mut guard = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        let batch = guard.as_mut().ok_or(Rejection::Closed)?;
        batch.increment(batch.open_step(), id, Token(token), grad)
    }
}

/// A session's arrival entry for the shim's hooks (see the module docs).
/// Obtained from `Session.arrival_sink()`; keep it alive while hooks may call
/// it.
#[pyclass(module = "gradsync._native", frozen)]
pub struct ArrivalSink {
    sink: Box<Sink>,
}

impl ArrivalSink {
    pub fn new(sink: Sink) -> ArrivalSink {
        ArrivalSink { sink: Box::new(sink) }
    }
}

#[pymethods]
impl ArrivalSink {
    /// The address the shim passes to `give` (valid while this object lives).
    #[getter]
    fn address(&self) -> usize {
        &*self.sink as *const Sink as usize
    }

    /// The address of the entry-point table (static).
    #[staticmethod]
    fn table() -> usize {
        &TABLE as *const Table as usize
    }

    /// Raise the refusal `give` kept, as `RejectedError` or `ClosedError`.
    fn raise_refusal(&self, py: Python<'_>) -> PyResult<()> {
        let refusal = self.sink.refused.lock().unwrap_or_else(|p| p.into_inner()).take();
        match refusal {
            Some(refusal) => Err(errors::rejection(py, &refusal)),
            None => Ok(()),
        }
    }
}
