//! [`DeviceStore`]: payloads and buckets as `CudaSlice<f32>` in device memory.
//!
//! Every operation is *enqueued* on the communicator's stream and returns at
//! once; nothing here waits for the GPU. cudarc's event tracking does the
//! cross-stream ordering: a payload produced on the caller's stream carries a
//! write event, and passing it to a launch on the comm stream makes that stream
//! wait for it (the pack waits on the hook's event). The launch
//! records a read event on the payload, so freeing it later (its `Drop` frees
//! on its own stream after waiting for that event) never races the pack.
//!
//! Launch failures cannot be returned through [`GradStore`]'s infallible
//! operations; they are recorded on the CUDA context (`record_err`) and the
//! next collective reports them as [`gradsync_actors::CommError::Device`].

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use gradsync_actors::bucket_buf::WriteMode;
use gradsync_actors::error::AllocError;
use gradsync_actors::{DType, GradStore};

use super::{grid_for, StoreKernels};

/// Gradient storage in device memory, operated on one stream (the communicator's).
#[derive(Debug, Clone)]
pub struct DeviceStore {
    /// The communicator's stream: packs here run before the all-reduce that follows.
    stream: Arc<CudaStream>,
    /// The element-wise kernels, compiled once.
    kernels: Arc<StoreKernels>,
}

impl DeviceStore {
    /// A store that enqueues on `stream` (use the communicator's stream).
    pub fn new(stream: Arc<CudaStream>, kernels: Arc<StoreKernels>) -> Self {
        DeviceStore { stream, kernels }
    }

    /// The compiled kernels.
    pub fn kernels(&self) -> &StoreKernels {
        &self.kernels
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Keep a failure for the next collective to report (see the module docs).
    fn record<T>(&self, result: Result<T, cudarc::driver::DriverError>) {
        self.stream.context().record_err(result);
    }

    /// `dst[range] += src`, one launch.
    fn add_into(&self, dst: &mut CudaSlice<f32>, range: Range<usize>, src: &cudarc::driver::CudaView<'_, f32>) {
        let n = range.len() as u64;
        if n == 0 {
            return;
        }
        let mut dst = dst.slice_mut(range);
        let mut launch = self.stream.launch_builder(&self.kernels.add);
        launch.arg(&mut dst).arg(src).arg(&n);
        // SAFETY: the arguments match `gradsync_add_f32(float*, const float*, unsigned long long)`
        // in type and order, and both views hold exactly `n` elements.
        self.record(unsafe { launch.launch(grid_for(n as usize)) });
    }
}

impl GradStore for DeviceStore {
    type Values = CudaSlice<f32>;
    type Bucket = CudaSlice<f32>;

    /// Checking would mean waiting for the device on the hook path.
    const CHECKS_FINITE: bool = false;

    fn values_len(&self, values: &CudaSlice<f32>) -> usize {
        values.len()
    }

    fn bucket_numel(&self, bucket: &CudaSlice<f32>) -> usize {
        bucket.len()
    }

    fn alloc_bucket(&self, numel: usize, _pieces: usize, dtype: DType) -> Result<CudaSlice<f32>, AllocError> {
        assert_eq!(dtype, DType::F32, "the builder refuses types a store does not hold");
        self.stream
            .alloc_zeros::<f32>(numel)
            .map_err(|e| AllocError { bytes: numel * std::mem::size_of::<f32>(), why: e.to_string() })
    }

    fn add_assign(&self, acc: &mut CudaSlice<f32>, more: &CudaSlice<f32>) {
        let n = acc.len();
        self.add_into(acc, 0..n, &more.as_view());
    }

    fn pack(&self, bucket: &mut CudaSlice<f32>, offset: usize, src: &CudaSlice<f32>, mode: WriteMode) {
        let range = offset..offset + src.len();
        match mode {
            WriteMode::Set => {
                let mut dst = bucket.slice_mut(range);
                self.record(self.stream.memcpy_dtod(src, &mut dst));
            }
            WriteMode::Add => self.add_into(bucket, range, &src.as_view()),
        }
    }

    fn pack_difference(
        &self,
        bucket: &mut CudaSlice<f32>,
        offset: usize,
        last: &CudaSlice<f32>,
        sent: &CudaSlice<f32>,
    ) {
        let n = last.len() as u64;
        if n == 0 {
            return;
        }
        let mut dst = bucket.slice_mut(offset..offset + last.len());
        let mut launch = self.stream.launch_builder(&self.kernels.sub);
        launch.arg(&mut dst).arg(last).arg(sent).arg(&n);
        // SAFETY: the arguments match `gradsync_sub_f32(float*, const float*, const float*,
        // unsigned long long)` in type and order; all three hold `n` elements.
        self.record(unsafe { launch.launch(grid_for(n as usize)) });
    }

    fn zero(&self, bucket: &mut CudaSlice<f32>, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let mut dst = bucket.slice_mut(offset..offset + len);
        self.record(self.stream.memset_zeros(&mut dst));
    }

    fn add_from(
        &self,
        dst: &mut CudaSlice<f32>,
        dst_offset: usize,
        src: &CudaSlice<f32>,
        src_offset: usize,
        len: usize,
    ) {
        self.add_into(dst, dst_offset..dst_offset + len, &src.slice(src_offset..src_offset + len));
    }

    fn scale(&self, bucket: &mut CudaSlice<f32>, offset: usize, len: usize, factor: f64) {
        let factor = factor as f32;
        let n = len as u64;
        if n == 0 || factor == 1.0 {
            return;
        }
        let mut dst = bucket.slice_mut(offset..offset + len);
        let mut launch = self.stream.launch_builder(&self.kernels.scale);
        launch.arg(&mut dst).arg(&n).arg(&factor);
        // SAFETY: the arguments match `gradsync_scale_f32(float*, unsigned long long, float)`
        // in type and order; the view holds `n` elements.
        self.record(unsafe { launch.launch(grid_for(len)) });
    }
}

impl crate::GradHook<DeviceStore> {
    /// [`crate::GradHook::arrive`] for a gradient whose producer cudarc does not
    /// track (written through a raw pointer, by another library, or on a
    /// context with event tracking off): `ready` is an event the caller
    /// recorded on its compute stream after writing `payload`. The comm
    /// stream waits on it before anything enqueued later (this gradient's
    /// pack included); the host does not wait. A failure to enqueue the wait
    /// is reported by the next collective, like every store failure.
    pub fn arrive_after(
        &self,
        step: gradsync_actors::Step,
        param: gradsync_actors::ParamId,
        token: gradsync_actors::Token,
        payload: gradsync_actors::Payload<CudaSlice<f32>>,
        ready: &cudarc::driver::CudaEvent,
    ) -> Result<(), gradsync_actors::Rejection> {
        let store = self.store();
        store.record(store.stream.wait(ready));
        self.arrive(step, param, token, payload)
    }
}
