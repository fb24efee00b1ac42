//! [`NativeTensor`]: a gradient as the C++ shims hand it over (python/shim/given.h's
//! `Given`: the tensor, and on a device the event of the stream that produced
//! it), owned by the runtime until it is done with the memory. The hooks
//! (`arrivals`) receive them; the store (`tensor_grads`) and the device plane
//! (`plane`) hold them.

use std::ffi::c_void;

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
