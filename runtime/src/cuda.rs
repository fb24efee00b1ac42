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
}

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
