//! [`Step`]: a finished step as Python holds it: its report, and the
//! averaged gradients lent until released.

use std::sync::{Arc, Mutex, MutexGuard};

use gradsync_runtime::Gradients;
use pyo3::prelude::*;

use crate::errors;
use crate::memory;
use crate::params::Params;
use crate::report::StepReport;
use crate::tensor_grads::{Bucket, TensorGrads};

/// Copy above this many bytes with the interpreter released.
pub const DETACH_BYTES: usize = 256 << 10;

/// The lent gradients of a step: `None` once released, or for a step that
/// does not apply.
type Lent = Option<Gradients<TensorGrads>>;

/// A finished step: its report, and (when it applies) the averaged
/// gradients, lent until [`Step::release`] or garbage collection. Weakly
/// referenceable, so a wrapper can tell whether views of it are still alive.
#[pyclass(module = "gradsync._native", weakref)]
pub struct Step {
    report: Py<StepReport>,
    /// Behind a lock only because Python objects must be shareable between threads.
    gradients: Mutex<Lent>,
    params: Arc<Params>,
}

impl Step {
    pub fn new(report: Py<StepReport>, gradients: Lent, params: Arc<Params>) -> Step {
        Step { report, gradients: Mutex::new(gradients), params }
    }

    /// The host memory of a bucket (one contiguous piece in this binding).
    fn host(bucket: &Bucket) -> PyResult<Piece<'_>> {
        let not_contiguous = || pyo3::exceptions::PyRuntimeError::new_err("bucket memory is not contiguous");
        match bucket {
            Bucket::Host(b) if b.num_pieces() == 1 => Ok(Piece::Narrow(b.piece(0))),
            Bucket::Wide(b) if b.num_pieces() == 1 => Ok(Piece::Wide(b.piece(0))),
            Bucket::Host(_) | Bucket::Wide(_) => Err(not_contiguous()),
            Bucket::Plane(_) => Err(Python::attach(|py| {
                let why = "this step's buckets are on the device: read them with buckets() (gradsync.torch does)";
                errors::raise::<errors::ConfigError>(py, why.to_string(), &[])
            })),
        }
    }

    /// The lent gradients. A lock poisoned by a panic in an earlier call is
    /// an error, never read as "nothing lent".
    fn lent(&self) -> PyResult<MutexGuard<'_, Lent>> {
        self.gradients.lock().map_err(|_| {
            pyo3::exceptions::PyRuntimeError::new_err(
                "this step's gradients are unusable: an earlier call on it panicked (a gradsync bug, please report it)",
            )
        })
    }
}

#[pymethods]
impl Step {
    /// The step's report.
    #[getter]
    fn report(&self, py: Python<'_>) -> Py<StepReport> {
        self.report.clone_ref(py)
    }

    /// Whether the step's gradients may be applied (applied or partial) and
    /// are not released yet.
    #[getter]
    fn applied(&self) -> PyResult<bool> {
        Ok(self.lent()?.is_some())
    }

    /// Whether parameter `param` has an averaged gradient (`False`: unused on
    /// every rank, or the step does not apply).
    fn has(&self, param: usize) -> PyResult<bool> {
        let Some(&id) = self.params.ids.get(param) else { return Ok(false) };
        Ok(self.lent()?.as_ref().is_some_and(|g| g.has(id)))
    }

    /// Write parameter `param`'s averaged gradient into `addr` (converted to
    /// its type); `False` if it has none. `addr` must be the data address of
    /// a live, contiguous CPU buffer with the parameter's element count and
    /// type, written by nobody else during the call.
    fn copy_into_ptr(&self, py: Python<'_>, param: usize, addr: usize) -> PyResult<bool> {
        let dst = self.params.raw(param, addr)?;
        let id = self.params.ids[param];
        let guard = self.lent()?;
        let Some((bucket, range)) = guard.as_ref().and_then(|g| g.locate(id)) else { return Ok(false) };
        let piece = Self::host(bucket)?;
        let write = || match piece {
            Piece::Narrow(values) => memory::write_back(&values[range], dst),
            Piece::Wide(values) => memory::write_back_wide(&values[range], dst),
        };
        if dst.numel * 4 >= DETACH_BYTES {
            py.detach(write);
        } else {
            write();
        }
        Ok(true)
    }

    /// Every bucket as `(address, numel, members, dtype, start)`: `numel`
    /// values of `dtype` (`"float32"` or `"float64"`) at `address` holding
    /// the averaged gradients of the parameter indices `members`, back to
    /// back in that order from the bucket's offset 0, the buffer holding the
    /// bucket from offset `start` on (0; a partitioned session's buffers hold
    /// this rank's partition). Same lifetime as [`Step::address`].
    /// On the device plane `address` is the shim's `Bucket*` instead,
    /// for `gradsync.torch._collectives.bucket_tensor` (the tensor it makes
    /// shares the bucket's memory, whose lifetime is the same).
    fn buckets(&self) -> PyResult<Vec<BucketEntry>> {
        let guard = self.lent()?;
        let Some(g) = guard.as_ref() else { return Ok(Vec::new()) };
        g.buckets()
            .map(|(bucket, members, start)| {
                let members = members.iter().map(|p| p.index()).collect();
                let (address, numel, dtype) = bucket
                    .lent()
                    .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("bucket memory is not contiguous"))?;
                Ok((address, numel, members, dtype, start))
            })
            .collect()
    }

    /// Return the gradients' buffers to the runtime now.
    fn release(&self) -> PyResult<()> {
        self.lent()?.take();
        Ok(())
    }
}

/// A bucket as [`Step::buckets`] lists it: address, element count, members,
/// element type, where in the bucket the buffer starts.
type BucketEntry = (usize, usize, Vec<usize>, &'static str, usize);

/// A host bucket's one contiguous piece, of either element type.
#[derive(Clone, Copy)]
enum Piece<'a> {
    Narrow(&'a [f32]),
    Wide(&'a [f64]),
}
