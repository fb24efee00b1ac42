//! [`TensorGrads`]: the one store of the torch binding, over either plane:
//!
//! * **host** (`plane` `None`): host buckets, and payloads that are either
//!   the runtime's own vectors or a tensor taken from Python, read in place;
//! * **device** ([`DevicePlane`]): buckets that are torch tensors on the
//!   parameters' device and payloads that are the hooks' tensors, every
//!   operation queued on the plane's stream (python/src/plane.rs).
//!
//! The actors call the same trait either way; only the variant differs.
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
use crate::plane::{DevicePlane, PlaneBucket, PlaneGrad};

/// One payload.
#[derive(Debug)]
pub enum Grad {
    /// Values the runtime owns.
    Owned(Vec<f32>),
    /// `numel` contiguous f32 values at `addr`, the storage of the tensor `_owner`
    /// (held, never read: the reference keeps that storage allocated).
    Tensor { addr: usize, numel: usize, _owner: Owner },
    /// A tensor on the device plane (read only by torch ops on its stream).
    Plane(PlaneGrad),
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
            Grad::Plane(_) => unreachable!("a device-plane gradient is never read on the host"),
        }
    }

    /// The device-plane tensor (host payloads never meet device buckets).
    fn plane(&self) -> &PlaneGrad {
        match self {
            Grad::Plane(g) => g,
            _ => unreachable!("a host payload on the device plane"),
        }
    }

    /// The values, writable (copied out of a held tensor first).
    fn owned(&mut self) -> &mut Vec<f32> {
        if let Grad::Tensor { .. } = self {
            *self = Grad::Owned(self.values().to_vec());
        }
        match self {
            Grad::Owned(v) => v,
            _ => unreachable!("converted above"),
        }
    }
}

/// One bucket of either plane.
#[derive(Debug)]
pub enum Bucket {
    Host(BucketBuf),
    Plane(PlaneBucket),
}

impl Bucket {
    fn host(&mut self) -> &mut BucketBuf {
        match self {
            Bucket::Host(b) => b,
            Bucket::Plane(_) => unreachable!("a device bucket in host memory"),
        }
    }

    fn plane(&mut self) -> &mut PlaneBucket {
        match self {
            Bucket::Plane(b) => b,
            Bucket::Host(_) => unreachable!("a host bucket on the device plane"),
        }
    }
}

/// The store of the torch binding (see the module docs): host buckets (as
/// [`HostStore`]) with [`Grad`] payloads, or the device plane.
#[derive(Debug, Clone, Copy, Default)]
pub struct TensorGrads {
    plane: Option<DevicePlane>,
}

impl TensorGrads {
    /// Buckets on `plane` (`None`: host memory).
    pub fn new(plane: Option<DevicePlane>) -> TensorGrads {
        TensorGrads { plane }
    }
}

impl GradStore for TensorGrads {
    type Values = Grad;
    type Bucket = Bucket;

    fn values_len(&self, values: &Grad) -> usize {
        match values {
            Grad::Owned(v) => v.len(),
            Grad::Tensor { numel, .. } => *numel,
            Grad::Plane(g) => g.numel,
        }
    }

    fn bucket_numel(&self, bucket: &Bucket) -> usize {
        match bucket {
            Bucket::Host(b) => b.numel(),
            Bucket::Plane(b) => b.numel(),
        }
    }

    fn alloc_bucket(&self, numel: usize, pieces: usize) -> Result<Bucket, AllocError> {
        match &self.plane {
            None => HostStore.alloc_bucket(numel, pieces).map(Bucket::Host),
            Some(plane) => plane.alloc(numel).map(Bucket::Plane).map_err(|why| AllocError { bytes: numel * 4, why }),
        }
    }

    fn add_assign(&self, acc: &mut Grad, more: &Grad) {
        assert_eq!(self.values_len(acc), self.values_len(more), "add_assign: length mismatch");
        if let Some(plane) = &self.plane {
            *acc = Grad::Plane(plane.sum(acc.plane(), more.plane()));
            return;
        }
        for (a, m) in acc.owned().iter_mut().zip(more.values()) {
            *a += m;
        }
    }

    fn write(&self, bucket: &mut Bucket, offset: usize, src: &Grad, mode: WriteMode) {
        self.write_scaled(bucket, offset, src, mode, 1.0);
    }

    fn write_scaled(&self, bucket: &mut Bucket, offset: usize, src: &Grad, mode: WriteMode, factor: f32) {
        match &self.plane {
            Some(plane) => plane.write(bucket.plane(), offset, src.plane(), mode == WriteMode::Add, factor),
            None if factor == 1.0 => bucket.host().write(offset, src.values(), mode),
            None => bucket.host().write_scaled(offset, src.values(), mode, factor),
        }
    }

    fn write_difference(&self, bucket: &mut Bucket, offset: usize, last: &Grad, sent: &Grad) {
        match &self.plane {
            Some(plane) => plane.difference(bucket.plane(), offset, last.plane(), sent.plane()),
            None => bucket.host().write_difference(offset, last.values(), sent.values()),
        }
    }

    fn zero(&self, bucket: &mut Bucket, offset: usize, len: usize) {
        match &self.plane {
            Some(plane) => plane.scale(bucket.plane(), offset, len, 0.0),
            None => bucket.host().zero(offset, len),
        }
    }

    fn add_from(&self, dst: &mut Bucket, dst_offset: usize, src: &Bucket, src_offset: usize, len: usize) {
        match (dst, src) {
            (Bucket::Host(d), Bucket::Host(s)) => HostStore.add_from(d, dst_offset, s, src_offset, len),
            (Bucket::Plane(d), Bucket::Plane(s)) => {
                self.plane.expect("device buckets come from a plane").add_from(d, dst_offset, s, src_offset, len)
            }
            _ => unreachable!("buckets of two planes"),
        }
    }

    fn scale(&self, bucket: &mut Bucket, offset: usize, len: usize, factor: f32) {
        match &self.plane {
            Some(plane) => plane.scale(bucket.plane(), offset, len, factor),
            None => bucket.host().scale(offset, len, factor),
        }
    }

    /// The binding never turns `check_finite` on (torch's own scalers check
    /// for overflow); a device-plane gradient would need a wait for the device.
    fn all_finite(&self, values: &Grad) -> bool {
        match values {
            Grad::Plane(_) => unreachable!("check_finite is never on for the torch binding"),
            host => host.values().iter().all(|x| x.is_finite()),
        }
    }
}
