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
//! allocation per step. Float64 gradients are read in place too, into float64
//! buckets (reduced in float64, as DDP reduces them); float16 and bfloat16
//! ones are widened into an owned float32 vector (exact).

use gradsync_runtime::backend::{AllocError, BucketBuf, GradStore, HostStore, WriteMode};
use gradsync_runtime::DType;

use crate::given::NativeTensor;
use crate::memory::{self, Elem, Raw};
use crate::plane::{DevicePlane, PlaneBucket, PlaneGrad};

/// One payload.
#[derive(Debug)]
pub enum Grad {
    /// Float32 values the runtime owns.
    Owned(Vec<f32>),
    /// Float64 values the runtime owns.
    OwnedWide(Vec<f64>),
    /// `numel` contiguous values at `addr` (float64 when `wide`, else
    /// float32), the storage of the tensor `_owner` (held, never read: the
    /// reference keeps that storage allocated).
    Tensor { addr: usize, numel: usize, wide: bool, _owner: Owner },
    /// A tensor on the device plane (read only by torch ops on its stream).
    Plane(PlaneGrad),
}

/// What keeps a [`Grad::Tensor`]'s memory allocated (held for its drop,
/// never read).
#[derive(Debug)]
#[allow(dead_code)]
pub enum Owner {
    /// A tensor handed over by the shim's hooks, without the interpreter.
    Native(NativeTensor),
}

impl Grad {
    /// The gradient at `src`, kept alive by `owner`: read in place when
    /// float32 or float64, else widened into an owned float32 copy (and
    /// `owner` let go). `src` must be as [`Raw`] requires, and stay so while
    /// `owner` is held.
    pub fn read(src: Raw, owner: Owner) -> Grad {
        match src.elem {
            Elem::F32 | Elem::F64 => {
                Grad::Tensor { addr: src.addr, numel: src.numel, wide: src.elem == Elem::F64, _owner: owner }
            }
            Elem::F16 | Elem::BF16 => {
                let mut values = Vec::new();
                memory::read(src, &mut values);
                Grad::Owned(values)
            }
        }
    }

    /// A copy of the gradient at `src` (`src` as [`Raw`] requires, for the
    /// call): float64 kept as float64, the other types widened to float32.
    pub fn copy_of(src: Raw) -> Grad {
        if src.elem == Elem::F64 {
            // SAFETY: `Raw`'s contract: `numel` float64 values at `addr`, alive
            // and unchanged for this call.
            let values = unsafe { std::slice::from_raw_parts(src.addr as *const f64, src.numel) };
            return Grad::OwnedWide(values.to_vec());
        }
        let mut values = Vec::new();
        memory::read(src, &mut values);
        Grad::Owned(values)
    }

    /// The float32 values (a payload of a float32 bucket).
    fn values(&self) -> &[f32] {
        match self {
            Grad::Owned(v) => v,
            // SAFETY: `Grad::Tensor` is built only by `Grad::read` (for
            // `Session::give` and the shim's `give`) from a contiguous CPU
            // tensor of `numel` elements (float32 unless `wide`) whose data
            // address is `addr`. The held owner keeps the storage allocated,
            // and nothing writes it while the runtime holds it: the wrapper
            // (or the shim's hook) took the tensor out of `.grad` and writes
            // into it only after its step has ended, when the runtime has
            // dropped every payload of the step.
            Grad::Tensor { addr, numel, wide: false, .. } => unsafe {
                std::slice::from_raw_parts(*addr as *const f32, *numel)
            },
            _ => unreachable!("a float32 bucket receives float32 host payloads only (the plan types buckets)"),
        }
    }

    /// The float64 values (a payload of a float64 bucket).
    fn wide_values(&self) -> &[f64] {
        match self {
            Grad::OwnedWide(v) => v,
            // SAFETY: as in `values`, for a tensor of `numel` float64 values.
            Grad::Tensor { addr, numel, wide: true, .. } => unsafe {
                std::slice::from_raw_parts(*addr as *const f64, *numel)
            },
            _ => unreachable!("a float64 bucket receives float64 host payloads only (the plan types buckets)"),
        }
    }

    /// Whether these are float64 values.
    fn is_wide(&self) -> bool {
        matches!(self, Grad::OwnedWide(_) | Grad::Tensor { wide: true, .. })
    }

    /// The device-plane tensor (host payloads never meet device buckets).
    fn plane(&self) -> &PlaneGrad {
        match self {
            Grad::Plane(g) => g,
            _ => unreachable!("a host payload on the device plane"),
        }
    }

    /// `self += more` (host payloads of one type; a held tensor is copied out first).
    fn add_host(&mut self, more: &Grad) {
        if self.is_wide() {
            if let Grad::Tensor { .. } = self {
                *self = Grad::OwnedWide(self.wide_values().to_vec());
            }
            let Grad::OwnedWide(acc) = self else { unreachable!("copied out above") };
            gradsync_kernels::add_assign(acc, more.wide_values());
        } else {
            if let Grad::Tensor { .. } = self {
                *self = Grad::Owned(self.values().to_vec());
            }
            let Grad::Owned(acc) = self else { unreachable!("copied out above") };
            gradsync_kernels::add_assign(acc, more.values());
        }
    }
}

/// One bucket of either plane.
#[derive(Debug)]
pub enum Bucket {
    /// Float32 values in host memory.
    Host(BucketBuf),
    /// Float64 values in host memory (float64 parameters).
    Wide(BucketBuf<f64>),
    /// A tensor on the device plane (its element type is the bucket's).
    Plane(PlaneBucket),
}

impl Bucket {
    /// Where Python finds this bucket's memory: `(address, values, element
    /// type as torch names it)`. On the device plane the address is the
    /// shim's `Bucket*` (for `_collectives.bucket_tensor`); `None` for a
    /// host bucket in several pieces.
    pub fn lent(&self) -> Option<(usize, usize, &'static str)> {
        match self {
            Bucket::Host(b) if b.num_pieces() == 1 => Some((b.piece(0).as_ptr() as usize, b.numel(), "float32")),
            Bucket::Wide(b) if b.num_pieces() == 1 => Some((b.piece(0).as_ptr() as usize, b.numel(), "float64")),
            Bucket::Host(_) | Bucket::Wide(_) => None,
            Bucket::Plane(b) => Some((b.address(), b.numel(), if b.is_wide() { "float64" } else { "float32" })),
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

    /// Float32 and float64 buckets, on either plane.
    fn holds(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F64)
    }

    fn values_len(&self, values: &Grad) -> usize {
        match values {
            Grad::Owned(v) => v.len(),
            Grad::OwnedWide(v) => v.len(),
            Grad::Tensor { numel, .. } => *numel,
            Grad::Plane(g) => g.numel,
        }
    }

    fn bucket_numel(&self, bucket: &Bucket) -> usize {
        match bucket {
            Bucket::Host(b) => b.numel(),
            Bucket::Wide(b) => b.numel(),
            Bucket::Plane(b) => b.numel(),
        }
    }

    fn alloc_bucket(&self, numel: usize, pieces: usize, dtype: DType) -> Result<Bucket, AllocError> {
        match (&self.plane, dtype) {
            (None, DType::F64) => Ok(Bucket::Wide(BucketBuf::zeroed(numel, pieces))),
            (None, _) => HostStore.alloc_bucket(numel, pieces, DType::F32).map(Bucket::Host),
            (Some(plane), dtype) => plane
                .alloc(numel, dtype == DType::F64)
                .map(Bucket::Plane)
                .map_err(|why| AllocError { bytes: numel * dtype.size(), why }),
        }
    }

    fn add_assign(&self, acc: &mut Grad, more: &Grad) {
        assert_eq!(self.values_len(acc), self.values_len(more), "add_assign: length mismatch");
        if let Some(plane) = &self.plane {
            *acc = Grad::Plane(plane.sum(acc.plane(), more.plane()));
            return;
        }
        acc.add_host(more);
    }

    fn pack(&self, bucket: &mut Bucket, offset: usize, src: &Grad, mode: WriteMode) {
        self.pack_scaled(bucket, offset, src, mode, 1.0);
    }

    fn pack_scaled(&self, bucket: &mut Bucket, offset: usize, src: &Grad, mode: WriteMode, factor: f64) {
        match bucket {
            Bucket::Plane(b) => self.on_plane().pack(b, offset, src.plane(), mode == WriteMode::Add, factor),
            Bucket::Host(b) if factor == 1.0 => b.write(offset, src.values(), mode),
            Bucket::Host(b) => b.write_scaled(offset, src.values(), mode, factor as f32),
            Bucket::Wide(b) if factor == 1.0 => b.write(offset, src.wide_values(), mode),
            Bucket::Wide(b) => b.write_scaled(offset, src.wide_values(), mode, factor),
        }
    }

    fn pack_difference(&self, bucket: &mut Bucket, offset: usize, last: &Grad, sent: &Grad) {
        match bucket {
            Bucket::Plane(b) => self.on_plane().difference(b, offset, last.plane(), sent.plane()),
            Bucket::Host(b) => b.write_difference(offset, last.values(), sent.values()),
            Bucket::Wide(b) => b.write_difference(offset, last.wide_values(), sent.wide_values()),
        }
    }

    fn zero(&self, bucket: &mut Bucket, offset: usize, len: usize) {
        match bucket {
            Bucket::Plane(b) => self.on_plane().scale(b, offset, len, 0.0),
            Bucket::Host(b) => b.zero(offset, len),
            Bucket::Wide(b) => b.zero(offset, len),
        }
    }

    fn add_from(&self, dst: &mut Bucket, dst_offset: usize, src: &Bucket, src_offset: usize, len: usize) {
        match (dst, src) {
            (Bucket::Host(d), Bucket::Host(s)) => d.add_from(dst_offset, s, src_offset, len),
            (Bucket::Wide(d), Bucket::Wide(s)) => d.add_from(dst_offset, s, src_offset, len),
            (Bucket::Plane(d), Bucket::Plane(s)) => self.on_plane().add_from(d, dst_offset, s, src_offset, len),
            _ => unreachable!("buckets of two planes or two element types"),
        }
    }

    fn scale(&self, bucket: &mut Bucket, offset: usize, len: usize, factor: f64) {
        match bucket {
            Bucket::Plane(b) => self.on_plane().scale(b, offset, len, factor),
            Bucket::Host(b) => b.scale(offset, len, factor as f32),
            Bucket::Wide(b) => b.scale(offset, len, factor),
        }
    }

    /// The binding never turns `check_finite` on (torch's own scalers check
    /// for overflow); a device-plane gradient would need a wait for the device.
    fn all_finite(&self, values: &Grad) -> bool {
        match values {
            Grad::Plane(_) => unreachable!("check_finite is never on for the torch binding"),
            wide if wide.is_wide() => gradsync_kernels::all_finite(wide.wide_values()),
            narrow => gradsync_kernels::all_finite(narrow.values()),
        }
    }
}

impl TensorGrads {
    /// The plane of a device bucket (device buckets come only from a plane).
    fn on_plane(&self) -> &DevicePlane {
        self.plane.as_ref().expect("device buckets come from a plane")
    }
}
