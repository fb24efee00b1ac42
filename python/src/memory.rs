//! Reading gradients out of, and writing averaged gradients into, memory the
//! Python side owns (a tensor's storage, given as an address).
//!
//! gradsync reduces float64 gradients in f64 (read and written as they are)
//! and every other float type in f32: `float16` and `bfloat16` are widened on
//! the way in (exact) and rounded back on the way out.

use half::{bf16, f16};

/// The element type of a parameter's gradient memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    F16,
    BF16,
}

impl Elem {
    /// From the names `gradsync.torch` uses (`"float32"`, …).
    pub fn parse(name: &str) -> Option<Elem> {
        match name {
            "float32" => Some(Elem::F32),
            "float64" => Some(Elem::F64),
            "float16" => Some(Elem::F16),
            "bfloat16" => Some(Elem::BF16),
            _ => None,
        }
    }
}

/// An address the caller vouches for: `numel` elements of `elem`, live,
/// aligned and not written by anyone else for the duration of the call.
#[derive(Debug, Clone, Copy)]
pub struct Raw {
    pub addr: usize,
    pub numel: usize,
    pub elem: Elem,
}

/// `out[i] = f32(src[i])`.
pub fn read(src: Raw, out: &mut Vec<f32>) {
    out.clear();
    out.reserve(src.numel);
    // SAFETY: `Raw`'s contract: `addr` holds `numel` initialized elements of
    // `elem`, properly aligned (a tensor's data pointer always is), alive and
    // unchanged until this function returns. The slices end before it does.
    unsafe {
        match src.elem {
            Elem::F32 => out.extend_from_slice(std::slice::from_raw_parts(src.addr as *const f32, src.numel)),
            Elem::F64 => {
                out.extend(std::slice::from_raw_parts(src.addr as *const f64, src.numel).iter().map(|&x| x as f32))
            }
            Elem::F16 => {
                out.extend(std::slice::from_raw_parts(src.addr as *const f16, src.numel).iter().map(|x| x.to_f32()))
            }
            Elem::BF16 => {
                out.extend(std::slice::from_raw_parts(src.addr as *const bf16, src.numel).iter().map(|x| x.to_f32()))
            }
        }
    }
}

/// Write the averaged gradient `view` into `dst` (converted to its type).
pub fn write_back(view: &[f32], dst: Raw) {
    assert_eq!(view.len(), dst.numel, "destination size checked by the caller");
    // SAFETY: `Raw`'s contract, for writing: `addr` holds `numel` elements of
    // `elem`, aligned, alive and touched by nobody else until this returns;
    // the slice ends before it does.
    unsafe {
        match dst.elem {
            Elem::F32 => {
                let out = std::slice::from_raw_parts_mut(dst.addr as *mut f32, dst.numel);
                out.copy_from_slice(view);
            }
            Elem::F64 => {
                write_converted(view, std::slice::from_raw_parts_mut(dst.addr as *mut f64, dst.numel), f64::from)
            }
            Elem::F16 => {
                write_converted(view, std::slice::from_raw_parts_mut(dst.addr as *mut f16, dst.numel), f16::from_f32)
            }
            Elem::BF16 => {
                write_converted(view, std::slice::from_raw_parts_mut(dst.addr as *mut bf16, dst.numel), bf16::from_f32)
            }
        }
    }
}

/// Write the averaged float64 gradient `view` into `dst` (a float64 parameter's memory).
pub fn write_back_wide(view: &[f64], dst: Raw) {
    assert_eq!(view.len(), dst.numel, "destination size checked by the caller");
    assert_eq!(dst.elem, Elem::F64, "float64 buckets hold float64 parameters only");
    // SAFETY: `Raw`'s contract, for writing: `addr` holds `numel` float64
    // elements, aligned, alive and touched by nobody else until this returns.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.addr as *mut f64, dst.numel) };
    out.copy_from_slice(view);
}

fn write_converted<T>(view: &[f32], out: &mut [T], convert: impl Fn(f32) -> T) {
    for (o, &x) in out.iter_mut().zip(view) {
        *o = convert(x);
    }
}
