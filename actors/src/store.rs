//! Where gradient values live, and the few operations the actors need on them.
//!
//! The actors never touch gradient memory directly. They move payloads
//! ([`GradStore::Values`]) and bucket buffers ([`GradStore::Bucket`]) between
//! themselves and ask the store to combine them:
//!
//! ```text
//! ParamShard:  add_assign(held, increment)                 (increments before ready)
//! Scheduler:   pack(bucket, offset, values, Set | Add)      (a ready / merged value into its slot)
//!              zero(bucket, offset, len)                    (unused parameter at launch)
//!              add_assign(late, increment)                  (late increments)
//!              pack_difference(buf, offset, last, sent)     (late supersede → correction)
//!              add_from(bucket, offset, correction, ...)    (apply the reduced correction)
//!              scale(bucket, offset, len, factor)           (negate a retracted value; re-divide
//!                                                            when fewer ranks contributed)
//! ```
//!
//! [`HostStore`] keeps everything in host memory (`Vec<f32>` payloads, sharded
//! [`BucketBuf`]s) and runs the `gradsync-kernels` loops. The runtime's CUDA
//! store keeps payloads and buckets in device memory and enqueues the same
//! operations on the communicator's stream, so the host never waits for the GPU:
//! stream order puts every pack before the all-reduce that follows it.
//!
//! Store operations do not return errors: a device store records a failed
//! launch where its transport finds it, and the next collective fails with a
//! typed error (the pattern cudarc itself uses).

use std::fmt;

use crate::arrival::DType;
use crate::bucket_buf::{BucketBuf, WriteMode};
use crate::error::AllocError;

/// Storage for payloads and bucket buffers (see the module docs).
///
/// Implementations are cheap to clone (every parameter shard holds one) and
/// must give results that depend only on the operands, so every rank packs
/// bit-identical buckets from identical inputs.
pub trait GradStore: Clone + Send + Sync + fmt::Debug + 'static {
    /// One hook's gradient values, owned by gradsync once handed over. A value
    /// is never written after it was handed over (the difference correction
    /// relies on the packed value staying what it was).
    type Values: Send + fmt::Debug + 'static;
    /// One bucket's storage, allocated once per plan and reused every step.
    type Bucket: Send + fmt::Debug + 'static;

    /// Whether [`GradStore::all_finite`] can answer without waiting for a
    /// device; the builder refuses `check_finite` otherwise.
    const CHECKS_FINITE: bool = true;

    /// Whether buckets of `dtype` can be held (the builder refuses
    /// parameters of other types). Default: float32 only.
    fn holds(&self, dtype: DType) -> bool {
        dtype == DType::F32
    }
    /// Number of elements in `values`.
    fn values_len(&self, values: &Self::Values) -> usize;
    /// Number of elements in `bucket`.
    fn bucket_numel(&self, bucket: &Self::Bucket) -> usize;
    /// A zeroed bucket of `numel` elements of `dtype` (one it [`holds`](GradStore::holds)),
    /// split in `pieces` if the store can. Only values of that type are ever
    /// combined into it.
    fn alloc_bucket(&self, numel: usize, pieces: usize, dtype: DType) -> Result<Self::Bucket, AllocError>;
    /// `acc += more`, element-wise (same lengths).
    fn add_assign(&self, acc: &mut Self::Values, more: &Self::Values);
    /// Combine `src` into `bucket[offset .. offset + len(src)]`.
    fn pack(&self, bucket: &mut Self::Bucket, offset: usize, src: &Self::Values, mode: WriteMode);
    /// Combine `src * factor` into `bucket[offset .. offset + len(src)]`
    /// (packing for transports that only sum, see
    /// [`crate::Transport::scale_when_packing`]). The default composes
    /// `pack` and `scale` (an add unscales the slot first, which rounds for
    /// factors that are not powers of two); stores override it with one exact pass.
    ///
    /// Factors are given in f64, the type every factor is computed in, and
    /// rounded to the bucket's type.
    fn pack_scaled(&self, bucket: &mut Self::Bucket, offset: usize, src: &Self::Values, mode: WriteMode, factor: f64) {
        let len = self.values_len(src);
        if mode == WriteMode::Add {
            self.scale(bucket, offset, len, 1.0 / factor);
        }
        self.pack(bucket, offset, src, mode);
        self.scale(bucket, offset, len, factor);
    }
    /// `bucket[offset ..] = last - sent`, element-wise (same lengths).
    fn pack_difference(&self, bucket: &mut Self::Bucket, offset: usize, last: &Self::Values, sent: &Self::Values);
    /// Zero `bucket[offset .. offset + len]`.
    fn zero(&self, bucket: &mut Self::Bucket, offset: usize, len: usize);
    /// `dst[dst_offset ..][..len] += src[src_offset ..][..len]`.
    fn add_from(&self, dst: &mut Self::Bucket, dst_offset: usize, src: &Self::Bucket, src_offset: usize, len: usize);
    /// `bucket[offset .. offset + len] *= factor`.
    fn scale(&self, bucket: &mut Self::Bucket, offset: usize, len: usize, factor: f64);
    /// Whether every value is finite (only called when [`GradStore::CHECKS_FINITE`]).
    fn all_finite(&self, _values: &Self::Values) -> bool {
        true
    }
}

/// Host memory: `Vec<f32>` payloads and sharded [`BucketBuf`] buckets.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostStore;

impl GradStore for HostStore {
    type Values = Vec<f32>;
    type Bucket = BucketBuf;

    fn values_len(&self, values: &Vec<f32>) -> usize {
        values.len()
    }

    fn bucket_numel(&self, bucket: &BucketBuf) -> usize {
        bucket.numel()
    }

    fn alloc_bucket(&self, numel: usize, pieces: usize, dtype: DType) -> Result<BucketBuf, AllocError> {
        assert_eq!(dtype, DType::F32, "the builder refuses types a store does not hold");
        Ok(BucketBuf::zeroed(numel, pieces))
    }

    fn add_assign(&self, acc: &mut Vec<f32>, more: &Vec<f32>) {
        gradsync_kernels::add_assign(acc, more);
    }

    fn pack(&self, bucket: &mut BucketBuf, offset: usize, src: &Vec<f32>, mode: WriteMode) {
        bucket.write(offset, src, mode);
    }

    fn pack_scaled(&self, bucket: &mut BucketBuf, offset: usize, src: &Vec<f32>, mode: WriteMode, factor: f64) {
        bucket.write_scaled(offset, src, mode, factor as f32);
    }

    fn pack_difference(&self, bucket: &mut BucketBuf, offset: usize, last: &Vec<f32>, sent: &Vec<f32>) {
        bucket.write_difference(offset, last, sent);
    }

    fn zero(&self, bucket: &mut BucketBuf, offset: usize, len: usize) {
        bucket.zero(offset, len);
    }

    fn add_from(&self, dst: &mut BucketBuf, dst_offset: usize, src: &BucketBuf, src_offset: usize, len: usize) {
        dst.add_from(dst_offset, src, src_offset, len);
    }

    fn scale(&self, bucket: &mut BucketBuf, offset: usize, len: usize, factor: f64) {
        bucket.scale(offset, len, factor as f32);
    }

    fn all_finite(&self, values: &Vec<f32>) -> bool {
        gradsync_kernels::all_finite(values)
    }
}
