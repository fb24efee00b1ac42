//! [`TensorGrads`]: host buckets, and payloads that are either the runtime's
//! own vectors or a tensor taken from Python, read in place.
//!
//! `gradsync.torch` moves each gradient tensor out of `.grad` in its hook and
//! hands it over: the runtime keeps a reference to the tensor (so its memory
//! stays allocated) and packs straight from that memory into the bucket, as
//! DDP copies a gradient into its bucket. No copy on the hook path, no
//! allocation per step. Gradients of other element types are converted into
//! an owned vector instead.

use gradsync_runtime::backend::{AllocError, BucketBuf, GradStore, HostStore, WriteMode};
use pyo3::prelude::*;

use crate::arrivals::NativeTensor;
use crate::memory::{self, Elem, Raw};

/// One payload.
#[derive(Debug)]
pub enum Grad {
    /// Values the runtime owns.
    Owned(Vec<f32>),
    /// `numel` contiguous f32 values at `addr`, the storage of the tensor `_owner`
    /// (held, never read: the reference keeps that storage allocated).
    Tensor { addr: usize, numel: usize, _owner: Owner },
}

/// What keeps a [`Grad::Tensor`]'s memory allocated (held for its drop,
/// never read).
#[derive(Debug)]
#[allow(dead_code)]
pub enum Owner {
    /// A tensor handed over from Python (`Session.give`).
    Python(Py<PyAny>),
    /// A tensor handed over by the shim's hooks, without the interpreter.
    Native(NativeTensor),
}

impl Grad {
    /// The gradient at `src`, kept alive by `owner`: read in place when
    /// float32, else converted into an owned copy (and `owner` let go).
    /// `src` must be as [`Raw`] requires, and stay so while `owner` is held.
    pub fn read(src: Raw, owner: Owner) -> Grad {
        if src.elem == Elem::F32 {
            return Grad::Tensor { addr: src.addr, numel: src.numel, _owner: owner };
        }
        let mut values = Vec::new();
        memory::read(src, &mut values);
        Grad::Owned(values)
    }

    /// The values.
    fn values(&self) -> &[f32] {
        match self {
            Grad::Owned(v) => v,
            // SAFETY: `Grad::Tensor` is built only by `Grad::read` (for
            // `Session::give` and the shim's `give`) from a contiguous
            // float32 CPU tensor of `numel` elements whose data address is
            // `addr`. The held owner keeps the storage allocated, and nothing
            // writes it while the runtime holds it: the wrapper (or the
            // shim's hook) took the tensor out of `.grad` and writes into it
            // only after its step has ended, when the runtime has dropped
            // every payload of the step.
            Grad::Tensor { addr, numel, .. } => unsafe { std::slice::from_raw_parts(*addr as *const f32, *numel) },
        }
    }

    /// The values, writable (copied out of a held tensor first).
    fn owned(&mut self) -> &mut Vec<f32> {
        if let Grad::Tensor { .. } = self {
            *self = Grad::Owned(self.values().to_vec());
        }
        match self {
            Grad::Owned(v) => v,
            Grad::Tensor { .. } => unreachable!("converted above"),
        }
    }
}

/// Host buckets (as [`HostStore`]) with [`Grad`] payloads.
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorGrads;

impl GradStore for TensorGrads {
    type Values = Grad;
    type Bucket = BucketBuf;

    fn values_len(&self, values: &Grad) -> usize {
        match values {
            Grad::Owned(v) => v.len(),
            Grad::Tensor { numel, .. } => *numel,
        }
    }

    fn bucket_numel(&self, bucket: &BucketBuf) -> usize {
        bucket.numel()
    }

    fn alloc_bucket(&self, numel: usize, pieces: usize) -> Result<BucketBuf, AllocError> {
        HostStore.alloc_bucket(numel, pieces)
    }

    fn add_assign(&self, acc: &mut Grad, more: &Grad) {
        assert_eq!(self.values_len(acc), self.values_len(more), "add_assign: length mismatch");
        for (a, m) in acc.owned().iter_mut().zip(more.values()) {
            *a += m;
        }
    }

    fn write(&self, bucket: &mut BucketBuf, offset: usize, src: &Grad, mode: WriteMode) {
        bucket.write(offset, src.values(), mode);
    }

    fn write_scaled(&self, bucket: &mut BucketBuf, offset: usize, src: &Grad, mode: WriteMode, factor: f32) {
        bucket.write_scaled(offset, src.values(), mode, factor);
    }

    fn write_difference(&self, bucket: &mut BucketBuf, offset: usize, last: &Grad, sent: &Grad) {
        bucket.write_difference(offset, last.values(), sent.values());
    }

    fn zero(&self, bucket: &mut BucketBuf, offset: usize, len: usize) {
        bucket.zero(offset, len);
    }

    fn add_from(&self, dst: &mut BucketBuf, dst_offset: usize, src: &BucketBuf, src_offset: usize, len: usize) {
        HostStore.add_from(dst, dst_offset, src, src_offset, len);
    }

    fn scale(&self, bucket: &mut BucketBuf, offset: usize, len: usize, factor: f32) {
        bucket.scale(offset, len, factor);
    }

    fn all_finite(&self, values: &Grad) -> bool {
        values.values().iter().all(|x| x.is_finite())
    }
}
