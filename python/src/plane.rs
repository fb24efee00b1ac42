//! The device plane: buckets as torch tensors on the parameters' device,
//! every bucket operation a torch op queued on the plane's communication
//! stream, through the C functions of `gradsync.torch._collectives`
//! (python/shim/collectives.cpp, second half).
//!
//! ```text
//! hook (C++) ── Given {tensor, event on the producing stream} ──▶ PlaneGrad
//! scheduler ── DevicePlane::pack(bucket, offset, grad, …) ──▶ stream waits on the event; bucket slice = grad
//! communicator ── NativeGloo::start_tensor(plane, bucket) ──▶ c10d allreduce (NCCL on CUDA) on that stream
//! C++ hook, end of step ── Ledger::write_back ──▶ the caller's stream waits on the plane's; views or copies
//! ```
//!
//! The actors decide what goes where, exactly as with host buckets
//! ([`crate::tensor_grads::TensorGrads`] is the one store for both); the
//! plane only executes. On the CPU (what CI runs) the same functions run on
//! CPU tensors with no stream and no event.
//!
//! Every operation is queued, not waited for, so it cannot report a device
//! fault when it happens: torch raises those at the caller's next
//! synchronization. A failure the shim sees at once (an invalid argument, an
//! allocation) stops the actor with the shim's message.

use std::ffi::{c_char, c_void};

use crate::collectives::{error_text, message, Table, Words};
use crate::given::NativeTensor;

/// A wrapper's plane as the runtime calls it: the shim's table and the
/// address of the Python-owned `Plane` (kept alive by the communicator for
/// the session's life).
#[derive(Clone, Copy)]
pub struct DevicePlane {
    table: &'static Table,
    plane: usize,
}

impl std::fmt::Debug for DevicePlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlane").field("plane", &self.plane).finish_non_exhaustive()
    }
}

/// One bucket: the shim's `Bucket*` (a tensor of `numel` float32 values, or
/// float64 when `wide`, on the plane's device, and the packs staged into
/// it), freed through the shim when dropped.
#[derive(Debug)]
pub struct PlaneBucket {
    handle: *mut c_void,
    numel: usize,
    wide: bool,
    free: unsafe extern "C" fn(*mut c_void),
}

// SAFETY: the handle is a heap `Bucket` owned by this value alone (its tensors
// have atomic reference counts); it is used by one thread at a time (the
// bucket moves between actors by message).
unsafe impl Send for PlaneBucket {}

impl PlaneBucket {
    /// Its element count.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Whether it holds float64 values (else float32).
    pub fn is_wide(&self) -> bool {
        self.wide
    }

    /// The shim's `Bucket*` (for `_collectives.bucket_tensor` and the collectives).
    pub fn address(&self) -> usize {
        self.handle as usize
    }
}

impl Drop for PlaneBucket {
    fn drop(&mut self) {
        // SAFETY: the handle came from the shim's `alloc` and is freed once.
        unsafe { (self.free)(self.handle) }
    }
}

/// One handed-over gradient on the plane: the shim's `Given` (the tensor and
/// its producer's event) and its element count.
#[derive(Debug)]
pub struct PlaneGrad {
    pub given: NativeTensor,
    pub numel: usize,
}

impl DevicePlane {
    /// The plane at `plane` (a `_collectives.Plane`'s address) driven through
    /// the shim's `table`.
    ///
    /// # Safety
    /// `table` must be the address `_collectives.table()` returned and `plane`
    /// the address of a `Plane` kept alive while this value or a copy is used.
    pub unsafe fn new(table: usize, plane: usize) -> Result<DevicePlane, String> {
        // SAFETY: as this function's own contract.
        let table = unsafe { Table::at(table) }?;
        Ok(DevicePlane { table, plane })
    }

    /// The plane's address (for the collectives).
    pub fn address(&self) -> usize {
        self.plane
    }

    fn ptr(&self) -> *mut c_void {
        self.plane as *mut c_void
    }

    /// Call one of the shim's functions with an error buffer (`call(err,
    /// err_len)`, its return code); the shim's message on failure.
    fn call(call: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), String> {
        let mut err = error_text();
        if call(err.as_mut_ptr(), err.len()) != 0 {
            return Err(message(&err));
        }
        Ok(())
    }

    /// [`Self::call`] for an operation that is queued, not waited for: a
    /// failure the shim sees at once stops the actor (see the module docs).
    fn queue(what: &str, call: impl FnOnce(*mut c_char, usize) -> i32) {
        if let Err(why) = Self::call(call) {
            panic!("gradsync device plane: {what} failed: {why}");
        }
    }

    /// A zeroed bucket of `numel` float32 values (float64 when `wide`), from
    /// torch's allocator.
    pub fn alloc(&self, numel: usize, wide: bool) -> Result<PlaneBucket, String> {
        let mut handle = std::ptr::null_mut();
        let elem = if wide { Words::F64 } else { Words::F32 }.code();
        // SAFETY: the plane is alive (see `new`); `handle` and the error
        // buffer outlive the call.
        Self::call(|err, err_len| unsafe {
            (self.table.alloc)(self.ptr(), numel as i64, elem, &mut handle, err, err_len)
        })?;
        Ok(PlaneBucket { handle, numel, wide, free: self.table.free })
    }

    /// `bucket[offset..][..len(src)]` = (or `+=`, when `add`) `src * factor`.
    pub fn pack(&self, bucket: &mut PlaneBucket, offset: usize, src: &PlaneGrad, add: bool, factor: f64) {
        assert!(offset + src.numel <= bucket.numel, "write past the bucket's end");
        // SAFETY: the plane, the bucket and the given tensor are alive and
        // the range is inside the bucket (checked above); the error buffer
        // outlives the call.
        Self::queue("packing a gradient", |err, err_len| unsafe {
            (self.table.pack)(
                self.ptr(),
                bucket.handle,
                offset as i64,
                src.given.handle(),
                i32::from(add),
                factor,
                err,
                err_len,
            )
        });
    }

    /// `bucket[offset..][..len]` = `last - sent`.
    pub fn difference(&self, bucket: &mut PlaneBucket, offset: usize, last: &PlaneGrad, sent: &PlaneGrad) {
        assert!(last.numel == sent.numel && offset + last.numel <= bucket.numel, "difference out of range");
        // SAFETY: as in `write`.
        Self::queue("packing a correction", |err, err_len| unsafe {
            (self.table.difference)(
                self.ptr(),
                bucket.handle,
                offset as i64,
                last.given.handle(),
                sent.given.handle(),
                err,
                err_len,
            )
        });
    }

    /// `bucket[offset..][..len] *= factor` (zeroed when `factor` is 0).
    pub fn scale(&self, bucket: &mut PlaneBucket, offset: usize, len: usize, factor: f64) {
        assert!(offset + len <= bucket.numel, "scale past the bucket's end");
        // SAFETY: as in `write`.
        Self::queue("scaling a bucket", |err, err_len| unsafe {
            (self.table.scale)(self.ptr(), bucket.handle, offset as i64, len as i64, factor, err, err_len)
        });
    }

    /// `dst[dst_offset..][..len] += src[src_offset..][..len]`.
    pub fn add_from(&self, dst: &mut PlaneBucket, dst_offset: usize, src: &PlaneBucket, src_offset: usize, len: usize) {
        assert!(dst_offset + len <= dst.numel && src_offset + len <= src.numel, "add_from out of range");
        // SAFETY: as in `write`; `dst` and `src` are distinct buckets.
        Self::queue("adding buckets", |err, err_len| unsafe {
            (self.table.add_from)(
                self.ptr(),
                dst.handle,
                dst_offset as i64,
                src.handle,
                src_offset as i64,
                len as i64,
                err,
                err_len,
            )
        });
    }

    /// A new gradient `a + b` (neither is written: a handed-over tensor may be
    /// the caller's own `.grad`, which must only ever receive the average).
    pub fn sum(&self, a: &PlaneGrad, b: &PlaneGrad) -> PlaneGrad {
        assert_eq!(a.numel, b.numel, "sum: length mismatch");
        let mut out = std::ptr::null_mut();
        // SAFETY: the plane and both given tensors are alive; `out` and the
        // error buffer outlive the call.
        Self::queue("adding two contributions", |err, err_len| unsafe {
            (self.table.sum)(self.ptr(), a.given.handle(), b.given.handle(), &mut out, err, err_len)
        });
        // SAFETY: `out` is a new `Given` the shim allocated, released by its
        // `release_given`.
        let given = unsafe { NativeTensor::new(out, self.table.release_given) };
        PlaneGrad { given, numel: a.numel }
    }
}
