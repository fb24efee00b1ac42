//! [`NcclEndpoint`]: one rank's NCCL communicator as a [`Transport`].
//!
//! The endpoint lives on the GradSync's communicator thread (one OS thread per
//! communicator; it is moved there, never shared). Each collective is
//! enqueued on the dedicated comm stream behind the packs the scheduler
//! already enqueued there, followed by the `1 / divisor` scale kernel and a
//! completion event. The thread then *polls* that event against the
//! collective's deadline; that poll loop is the watchdog:
//!
//! ```text
//! enqueue ncclAllReduce + scale + event ──▶ poll event ──complete──▶ Ok
//!                                              │
//!                          deadline passed ────┴──▶ ncclCommAbort ──▶ CommError::Timeout
//!                          NCCL async error ──────▶ ncclCommAbort ──▶ CommError::Device
//! ```
//!
//! An aborted communicator cannot be re-synchronized: every later collective
//! (including a `reset` agreement) fails with [`CommError::Device`] saying so;
//! drop the GradSync and build a new endpoint with a fresh id.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, PushKernelArg};
use cudarc::nccl::{result as nccl, sys};
use gradsync_actors::{CollectiveTag, CommError, Interrupt, Transport};

use super::{grid_for, CudaError, DeviceStore, StoreKernels};
use crate::rendezvous::{LaunchEnv, RendezvousError, ID_BYTES};

/// Polls of the completion event before the watchdog starts sleeping between polls.
const SPIN_POLLS: u32 = 4096;
/// Sleep between polls once spinning is over (collectives longer than a few ms).
const POLL_SLEEP: Duration = Duration::from_micros(50);

/// An initialized `ncclComm_t`, aborted when dropped.
struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL allows a communicator to be used from any thread as long as
// calls on it are not concurrent. `RawComm` is owned by one `NcclEndpoint`,
// which is moved to the communicator thread and never shared.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: `self.0` was initialized by `ncclCommInitRank` and is released
        // exactly once, here. Abort (not destroy) so a hung peer cannot hang us.
        if let Err(e) = unsafe { nccl::comm_abort(self.0) } {
            tracing::warn!(?e, "ncclCommAbort failed while dropping the communicator");
        }
    }
}

/// Why building an endpoint from the launcher's environment failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The rendezvous (environment variables, TCP exchange of the id) failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// CUDA or NCCL failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// One rank of an NCCL communicator, driven by a GradSync's communicator thread.
pub struct NcclEndpoint {
    rank: usize,
    world: usize,
    /// `None` once aborted (by the watchdog or a device error).
    comm: Option<RawComm>,
    /// Why the communicator was aborted, for the collectives that follow.
    aborted: Option<String>,
    /// The dedicated, non-blocking comm stream.
    stream: Arc<CudaStream>,
    /// Packs on `stream`; handed to the actors through [`Transport::store`].
    store: DeviceStore,
    /// Recorded after each collective; the watchdog polls it.
    done: CudaEvent,
    /// Set by the interrupter at shutdown: the watchdog stops waiting.
    cancel: Arc<AtomicBool>,
}

impl std::fmt::Debug for NcclEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEndpoint")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("aborted", &self.aborted)
            .finish_non_exhaustive()
    }
}

/// Whether the NCCL library can be loaded on this machine.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the NCCL library and reports success.
    unsafe { sys::is_culib_present() }
}

/// A fresh NCCL unique id (rank 0 makes it; the rendezvous shares it).
pub fn new_id() -> Result<[u8; ID_BYTES], CudaError> {
    if !nccl_present() {
        return Err(CudaError::NoNccl);
    }
    let id = nccl::get_uniqueid().map_err(|e| CudaError::Driver(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal.map(|c| c as u8))
}

impl NcclEndpoint {
    /// Join an NCCL communicator of `world` ranks as `rank` on `ctx`'s device.
    /// Every rank passes the same `id` (see [`new_id`] and
    /// [`crate::rendezvous::share_id`]). Blocks until every rank has joined.
    pub fn connect(ctx: &Arc<CudaContext>, rank: usize, world: usize, id: [u8; ID_BYTES]) -> Result<Self, CudaError> {
        if !nccl_present() {
            return Err(CudaError::NoNccl);
        }
        let driver = |e: cudarc::driver::DriverError| CudaError::Driver(e.to_string());
        ctx.bind_to_thread().map_err(driver)?;
        let kernels = Arc::new(StoreKernels::compile(ctx)?);
        let stream = ctx.new_stream().map_err(driver)?;
        let done = ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(driver)?;
        let unique = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm = std::mem::MaybeUninit::uninit();
        let (n, r) = (world as i32, rank as i32);
        // SAFETY: `comm` is written by NCCL before it is read; the id is the
        // 128-byte unique id shared by all ranks; the context is current.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), n, unique, r).map_err(|e| CudaError::Nccl {
                rank,
                world,
                why: format!("{e:?}"),
            })?;
            comm.assume_init()
        };
        let store = DeviceStore::new(Arc::clone(&stream), kernels);
        Ok(NcclEndpoint {
            rank,
            world,
            comm: Some(RawComm(comm)),
            aborted: None,
            stream,
            store,
            done,
            cancel: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Set up from torchrun's variables: the device `LOCAL_RANK`, a fresh id
    /// from rank 0 shared over TCP within `timeout`, then [`NcclEndpoint::connect`].
    pub fn from_launch_env(env: &LaunchEnv, timeout: Duration) -> Result<Self, LaunchError> {
        super::probe()?;
        let ctx = CudaContext::new(env.local_rank).map_err(|e| CudaError::Driver(e.to_string()))?;
        let mine = if env.rank == 0 { new_id()? } else { [0u8; ID_BYTES] };
        let id = crate::rendezvous::share_id(env, &mine, timeout)?;
        Ok(NcclEndpoint::connect(&ctx, env.rank, env.world, id)?)
    }

    /// The comm stream (packs, all-reduces and scales run here).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The live communicator, or the error that ended it.
    fn live(&self, tag: CollectiveTag) -> Result<sys::ncclComm_t, CommError> {
        match (&self.comm, &self.aborted) {
            (Some(c), None) => Ok(c.0),
            (_, why) => Err(CommError::Device {
                rank: self.rank,
                tag,
                why: format!(
                    "the communicator was aborted earlier ({}); NCCL cannot re-synchronize it: \
                     drop this GradSync and connect a new endpoint with a fresh id",
                    why.as_deref().unwrap_or("unknown cause")
                ),
            }),
        }
    }

    /// Abort the communicator (unblocks kernels stuck waiting for peers) and
    /// remember why.
    fn abort(&mut self, why: String) {
        self.aborted.get_or_insert(why);
        self.comm = None; // `RawComm::drop` calls ncclCommAbort
    }

    fn device_error(&mut self, tag: CollectiveTag, why: String) -> CommError {
        self.abort(why.clone());
        CommError::Device { rank: self.rank, tag, why }
    }

    /// Before enqueueing: the context is current and no store operation failed.
    fn prepare(&mut self, tag: CollectiveTag) -> Result<sys::ncclComm_t, CommError> {
        let comm = self.live(tag)?;
        let ctx = Arc::clone(self.stream.context());
        if let Err(e) = ctx.bind_to_thread().and_then(|()| ctx.check_err()) {
            return Err(self.device_error(tag, format!("CUDA: {e}")));
        }
        Ok(comm)
    }

    /// NCCL's asynchronous error for the communicator, if any.
    fn async_error(&self, comm: sys::ncclComm_t) -> Option<String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live (checked by the caller) and `state` is a valid out pointer.
        let queried = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        match (queried, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {
                None
            }
            (sys::ncclResult_t::ncclSuccess, e) => Some(format!("NCCL asynchronous error {e:?}")),
            (e, _) => Some(format!("ncclCommGetAsyncError failed: {e:?}")),
        }
    }

    /// The watchdog: record the completion event and poll it until it fires,
    /// the deadline passes (abort, `Timeout`), NCCL reports an error (abort,
    /// `Device`) or the GradSync shuts down (abort, `Cancelled`).
    fn wait(&mut self, comm: sys::ncclComm_t, tag: CollectiveTag, deadline: Instant) -> Result<(), CommError> {
        let started = Instant::now();
        if let Err(e) = self.done.record(&self.stream) {
            return Err(self.device_error(tag, format!("recording the completion event: {e}")));
        }
        let mut polls = 0u32;
        loop {
            match self.done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.device_error(tag, format!("CUDA: {e}"))),
            }
            if let Some(why) = self.async_error(comm) {
                return Err(self.device_error(tag, why));
            }
            if self.cancel.load(Ordering::Relaxed) {
                self.abort("shutdown".into());
                return Err(CommError::Cancelled { rank: self.rank, tag });
            }
            let now = Instant::now();
            if now >= deadline {
                let waited = now - started;
                self.abort(format!("{tag} passed its deadline after {waited:?}"));
                return Err(CommError::Timeout { rank: self.rank, tag, missing: Vec::new(), waited });
            }
            if polls < SPIN_POLLS {
                polls += 1;
                std::hint::spin_loop();
            } else {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }

    /// Enqueue an in-place sum of `buf` over all ranks on the comm stream.
    fn enqueue_sum<T: cudarc::driver::DeviceRepr>(
        &mut self,
        comm: sys::ncclComm_t,
        tag: CollectiveTag,
        buf: &mut CudaSlice<T>,
        dtype: sys::ncclDataType_t,
    ) -> Result<(), CommError> {
        let count = buf.len();
        let enqueued = {
            let (ptr, _record) = buf.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` addresses `count` elements of `dtype` on this
            // context's device, alive while `_record` is (until after the call,
            // which only enqueues); `comm` is live and belongs to this device;
            // the stream handle is the comm stream's.
            unsafe {
                nccl::all_reduce(
                    ptr as *const std::ffi::c_void,
                    ptr as *mut std::ffi::c_void,
                    count,
                    dtype,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    self.stream.cu_stream() as sys::cudaStream_t,
                )
            }
        };
        enqueued.map(|_| ()).map_err(|e| self.device_error(tag, format!("ncclAllReduce: {e:?}")))
    }
}

impl Transport for NcclEndpoint {
    type Store = DeviceStore;

    fn store(&self) -> DeviceStore {
        self.store.clone()
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// One contiguous device buffer per bucket.
    fn pieces(&self) -> usize {
        1
    }

    fn all_reduce_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut CudaSlice<f32>,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let factor = factor as f32;
        let comm = self.prepare(tag)?;
        self.enqueue_sum(comm, tag, bucket, sys::ncclDataType_t::ncclFloat32)?;
        let n = bucket.len() as u64;
        if factor != 1.0 && n > 0 {
            let stream = Arc::clone(&self.stream);
            let mut launch = stream.launch_builder(&self.store.kernels().scale);
            launch.arg(&mut *bucket).arg(&n).arg(&factor);
            // SAFETY: the arguments match `gradsync_scale_f32(float*, unsigned long long, float)`
            // in type and order; the bucket holds `n` elements.
            if let Err(e) = unsafe { launch.launch(grid_for(n as usize)) } {
                return Err(self.device_error(tag, format!("scale kernel: {e}")));
            }
        }
        self.wait(comm, tag, deadline)
    }

    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        let comm = self.prepare(tag)?;
        let stream = Arc::clone(&self.stream);
        let mut dev = match stream.clone_htod(words.as_slice()) {
            Ok(d) => d,
            Err(e) => return Err(self.device_error(tag, format!("copying control words: {e}"))),
        };
        self.enqueue_sum(comm, tag, &mut dev, sys::ncclDataType_t::ncclUint64)?;
        self.wait(comm, tag, deadline)?;
        // The stream has drained (the event fired), so this copy does not wait on peers.
        stream.memcpy_dtoh(&dev, words.as_mut_slice()).map_err(|e| self.device_error(tag, format!("{e}")))
    }

    /// Nothing to forget locally; an aborted communicator stays aborted (see
    /// the module docs), so the reset agreement that follows fails with a
    /// `Device` error that says to rebuild.
    fn reset(&mut self) {}

    fn interrupter(&self) -> Option<Interrupt> {
        let cancel = Arc::clone(&self.cancel);
        Some(Box::new(move || cancel.store(true, Ordering::Relaxed)))
    }
}
