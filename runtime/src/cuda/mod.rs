//! The CUDA backend (feature `cuda`): gradients in device memory, NCCL on a
//! dedicated stream.
//!
//! ```text
//! caller's stream:  backward kernel writes grad ──(cudarc write event)──┐
//! hook:             GradHook<DeviceStore>::increment(step, p, token, grad)   (moves the CudaSlice;
//!                   arrive_after(.., event) where cudarc does not track the producer)
//! actors:           dedup / count / plan order, exactly as on the host
//! comm stream:      wait(grad's event) → pack kernel → ncclAllReduce → scale
//!                   (enqueued by the scheduler and the communicator thread;
//!                    stream order, not the host, orders pack before reduce)
//! comm thread:      polls the completion event against the deadline; on
//!                   timeout it aborts the communicator (the watchdog)
//! caller:           Gradients::locate → bucket slice; using it on its own
//!                   stream waits on the all-reduce's event (cudarc tracking)
//! ```
//!
//! * [`store`]: [`DeviceStore`], the [`gradsync_actors::GradStore`] over `CudaSlice<f32>`;
//! * [`nccl`]: [`NcclEndpoint`], the [`gradsync_actors::Transport`] over NCCL.
//!
//! CUDA is loaded at run time, so a binary built with the feature starts on a
//! machine without a GPU; asking for the GPU there is a clear error, never a
//! panic inside the driver bindings. Every entry point checks that the driver
//! library can be loaded *before* touching it.

pub mod nccl;
pub mod store;

pub use nccl::NcclEndpoint;
pub use store::DeviceStore;

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
    /// The NCCL library is not installed.
    #[error("no NCCL library found (libnccl.so.2); install NCCL or use the local backend")]
    NoNccl,
    /// NCCL failed to create the communicator.
    #[error(
        "NCCL could not join rank {rank} of {world}: {why}; check that every rank uses the same id and world size"
    )]
    Nccl {
        /// This rank.
        rank: usize,
        /// World size.
        world: usize,
        /// NCCL's error.
        why: String,
    },
}

/// The cudarc crate, re-exported for binaries that drive the device directly.
pub use cudarc;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};

/// Compile one CUDA C source for `ctx`'s device with NVRTC and load it.
fn compile_module(ctx: &Arc<CudaContext>, source: &str) -> Result<Arc<cudarc::driver::CudaModule>, CudaError> {
    // SAFETY: only tries to dlopen the NVRTC library and reports success.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let ptx = cudarc::nvrtc::compile_ptx(source).map_err(|e| CudaError::Compile(e.to_string()))?;
    ctx.load_module(ptx).map_err(|e| CudaError::Driver(e.to_string()))
}

fn load(module: &Arc<cudarc::driver::CudaModule>, name: &str) -> Result<CudaFunction, CudaError> {
    module.load_function(name).map_err(|e| CudaError::Driver(format!("{name}: {e}")))
}

/// The device store's kernels ([`gradsync_kernels::cuda_src::STORE_CU`]),
/// compiled with NVRTC for the context's device when an endpoint connects.
#[derive(Debug, Clone)]
pub struct StoreKernels {
    /// `gradsync_add_f32(float* dst, const float* src, unsigned long long n)`: `dst += src`.
    pub add: CudaFunction,
    /// `gradsync_sub_f32(float* dst, const float* a, const float* b, unsigned long long n)`: `dst = a - b`.
    pub sub: CudaFunction,
    /// `gradsync_scale_f32(float* x, unsigned long long n, float scale)`: `x *= scale`.
    pub scale: CudaFunction,
}

impl StoreKernels {
    /// Compile and load the store's kernels for `ctx`'s device.
    pub fn compile(ctx: &Arc<CudaContext>) -> Result<StoreKernels, CudaError> {
        let module = compile_module(ctx, gradsync_kernels::cuda_src::STORE_CU)?;
        Ok(StoreKernels {
            add: load(&module, "gradsync_add_f32")?,
            sub: load(&module, "gradsync_sub_f32")?,
            scale: load(&module, "gradsync_scale_f32")?,
        })
    }
}

/// Every gradsync kernel: the store's and the fused bucket / bf16 kernels
/// ([`gradsync_kernels::cuda_src::BUCKET_CU`]) that `gpu-check` measures.
#[derive(Debug, Clone)]
pub struct DeviceKernels {
    /// The store's element-wise kernels.
    pub store: StoreKernels,
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
    /// Compile and load every kernel for `ctx`'s device.
    pub fn compile(ctx: &Arc<CudaContext>) -> Result<DeviceKernels, CudaError> {
        let module = compile_module(ctx, gradsync_kernels::cuda_src::BUCKET_CU)?;
        Ok(DeviceKernels {
            store: StoreKernels::compile(ctx)?,
            pack: load(&module, "gradsync_pack_f32")?,
            unpack_scale: load(&module, "gradsync_unpack_scale_f32")?,
            to_bf16: load(&module, "gradsync_f32_to_bf16")?,
            bf16_accumulate: load(&module, "gradsync_bf16_accumulate_f32")?,
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

/// Launch shape for the element-wise kernels (grid-stride loops): 256 threads
/// per block, enough blocks to cover `n` up to a cap (the loops stride past it).
pub fn grid_for(n: usize) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 8192) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Joining a one-rank NCCL world from launcher variables: on a machine
    /// without a GPU (or without NCCL), a typed error naming what is missing.
    #[test]
    fn launch_without_a_gpu_is_a_typed_error() {
        let env = crate::rendezvous::LaunchEnv {
            rank: 0,
            world: 1,
            local_rank: 0,
            master: "127.0.0.1:0".parse().expect("valid address"),
        };
        match NcclEndpoint::from_launch_env(&env, std::time::Duration::from_secs(5)) {
            Ok(ep) => assert_eq!(ep.stream().context().ordinal(), 0),
            Err(nccl::LaunchError::Cuda(e @ (CudaError::NoDriver | CudaError::NoDevice | CudaError::NoNccl))) => {
                eprintln!("skipping the NCCL check: {e}")
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
        match nccl::new_id() {
            Ok(id) => assert!(id.iter().any(|&b| b != 0), "an NCCL id is not all zeros"),
            Err(e) => assert_eq!(e, CudaError::NoNccl),
        }
    }

    /// On a machine without a GPU this must be a typed error, not a panic.
    #[test]
    fn probe_reports_instead_of_panicking() {
        match probe() {
            Ok(info) => assert!(info.devices > 0),
            Err(e) => eprintln!("skipping GPU checks: {e}"),
        }
    }
}
