//! GPU detection (feature `cuda`).
//!
//! CUDA is loaded at run time, so a binary built with the feature starts on a
//! machine without a GPU; asking for the GPU there is a clear error, never a
//! panic inside the driver bindings. Every entry point checks that the driver
//! library can be loaded *before* touching it.

/// Why the GPU cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (libcuda) is not installed or not on the loader path.
    #[error("no CUDA driver library found (libcuda.so); install the NVIDIA driver or use the local backend")]
    NoDriver,
    /// The driver is present but reports no device.
    #[error("the CUDA driver reports no GPU; check CUDA_VISIBLE_DEVICES or use the local backend")]
    NoDevice,
    /// A driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(String),
    /// NVRTC (the run-time CUDA compiler) is not installed.
    #[error("no NVRTC library found (libnvrtc.so); install the CUDA toolkit's runtime compiler")]
    NoNvrtc,
    /// The kernels did not compile.
    #[error("NVRTC could not compile the gradsync kernels: {0}")]
    Compile(String),
}

/// The cudarc crate, re-exported for binaries that drive the device directly.
pub use cudarc;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};

/// The gradsync kernels ([`gradsync_kernels::cuda_src`]), compiled with NVRTC
/// for the context's device at first use and loaded.
#[derive(Debug, Clone)]
pub struct DeviceKernels {
    /// `gradsync_pack_f32(const PackDesc* descs, float* bucket)`.
    pub pack: CudaFunction,
    /// `gradsync_unpack_scale_f32(const UnpackDesc* descs, const float* bucket, float scale)`.
    pub unpack_scale: CudaFunction,
    /// `gradsync_f32_to_bf16(const float* src, unsigned short* dst, unsigned long long n)`.
    pub to_bf16: CudaFunction,
    /// `gradsync_bf16_accumulate_f32(const unsigned short* src, float* dst, unsigned long long n, float scale)`.
    pub bf16_accumulate: CudaFunction,
}

impl DeviceKernels {
    /// Compile and load the kernels for `ctx`'s device.
    pub fn compile(ctx: &Arc<CudaContext>) -> Result<DeviceKernels, CudaError> {
        // SAFETY: only tries to dlopen the NVRTC library and reports success.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::NoNvrtc);
        }
        let ptx = cudarc::nvrtc::compile_ptx(gradsync_kernels::cuda_src::KERNELS_CU)
            .map_err(|e| CudaError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx).map_err(|e| CudaError::Driver(e.to_string()))?;
        let load = |name: &str| module.load_function(name).map_err(|e| CudaError::Driver(format!("{name}: {e}")));
        Ok(DeviceKernels {
            pack: load("gradsync_pack_f32")?,
            unpack_scale: load("gradsync_unpack_scale_f32")?,
            to_bf16: load("gradsync_f32_to_bf16")?,
            bf16_accumulate: load("gradsync_bf16_accumulate_f32")?,
        })
    }
}

/// Layout of the kernels' `PackDesc`/`UnpackDesc`: a device pointer, an offset
/// into the bucket and a length, all 64-bit.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SliceDesc {
    /// Device address of the gradient.
    pub ptr: u64,
    /// Element offset in the bucket.
    pub offset: u64,
    /// Elements.
    pub len: u64,
}

// SAFETY: `SliceDesc` is `repr(C)`, plain integers, no padding: any bit
// pattern is valid and it matches the kernels' struct layout.
unsafe impl cudarc::driver::DeviceRepr for SliceDesc {}
// SAFETY: all-zero bits are a valid `SliceDesc`.
unsafe impl cudarc::driver::ValidAsZeroBits for SliceDesc {}

/// What the driver reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    /// Number of visible devices.
    pub devices: usize,
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its
    // well-known names and reports success; it calls no CUDA function.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Look for GPUs: an error (not a panic) where there is no driver or no device.
pub fn probe() -> Result<CudaInfo, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().map_err(|e| CudaError::Driver(e.to_string()))?;
    let n = cudarc::driver::CudaContext::device_count().map_err(|e| CudaError::Driver(e.to_string()))?;
    if n <= 0 {
        return Err(CudaError::NoDevice);
    }
    Ok(CudaInfo { devices: n as usize })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without a GPU this must be a typed error, not a panic.
    #[test]
    fn probe_reports_instead_of_panicking() {
        match probe() {
            Ok(info) => assert!(info.devices > 0),
            Err(e) => eprintln!("skipping GPU checks: {e}"),
        }
    }
}
