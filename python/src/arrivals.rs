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
use crate::params::Params;
use crate::plane::PlaneGrad;
use crate::tensor_grads::{Grad, Owner, TensorGrads};

/// The version of [`Table`] (the shim checks it: `kSinkVersion`).
pub const TABLE_VERSION: u32 = 3;

/// What `give` returns.
const GIVEN: i32 = 0;
const REFUSED: i32 = 1;

/// A gradient the shim allocated (its `Given`: the tensor and, on a device,
/// the event of the stream that produced it; python/shim/given.h), held
/// until the runtime is done with its memory and then handed back to `release`.
#[derive(Debug)]
pub struct NativeTensor {
    handle: *mut c_void,
    release: unsafe extern "C" fn(*mut c_void),
}

// SAFETY: the handle is a heap `at::Tensor` owned by this value alone; its
// reference count is atomic, so it may be released from any thread (torch
// takes the interpreter lock itself should the storage's last owner be a
// Python object).
unsafe impl Send for NativeTensor {}
// SAFETY: shared references never touch the handle (only `drop` does).
unsafe impl Sync for NativeTensor {}

impl NativeTensor {
    /// Take ownership of `handle`, to be handed back to `release`.
    ///
    /// # Safety
    /// `handle` must be a `Given` the shim allocated, with the `release`
    /// that frees it, owned by nobody else.
    pub unsafe fn new(handle: *mut c_void, release: unsafe extern "C" fn(*mut c_void)) -> NativeTensor {
        NativeTensor { handle, release }
    }

    /// The shim's `Given*`, for the device plane's functions.
    pub fn handle(&self) -> *mut c_void {
        self.handle
    }
}

impl Drop for NativeTensor {
    fn drop(&mut self) {
        // SAFETY: `handle` came from the shim with this `release` and is
        // released exactly once.
        unsafe { (self.release)(self.handle) }
    }
}

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
    let owner = NativeTensor { handle, release };
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
