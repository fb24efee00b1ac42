//! Numeric loops that move gradient bytes in gradsync.
//!
//! Data flows through these kernels at three points of a step:
//!
//! 1. **pack**: a parameter's local gradient is copied ([`copy`]) or added
//!    ([`add_assign`]) into its slot of a bucket buffer;
//! 2. **reduce**: during the all-reduce each rank sums its own piece of every
//!    rank's bucket and scales it by `1 / divisor` in one pass
//!    ([`reduce_scaled`]);
//! 3. **correct**: a late contribution is formed as a difference ([`sub_into`])
//!    and the reduced correction is added back ([`add_assign`]).
//!
//! Every loop works on fixed-width chunks (`LANES` elements) with a scalar tail,
//! which lets the compiler emit SIMD code without `unsafe` or intrinsics. The
//! [`cpu`] reference functions are deliberately naive; this crate's tests
//! compare the fast loops against them.
//!
//! This crate knows nothing about actors, buckets or ranks: it sees slices.
//! [`cuda_src`] holds the CUDA C versions, compiled at run time by the
//! runtime's `cuda` feature; the `gpu-check` binary compares each of them with
//! its [`cpu`] reference on a GPU.
#![deny(missing_docs)]

pub mod cuda_src;

/// Chunk width of the vectorizable loops: 16 f32 = one AVX-512 register or four
/// SSE registers, enough independent lanes for the compiler to unroll.
const LANES: usize = 16;

/// Elements that can travel through a reduction: f32 gradients and the u64
/// integers of the control collective.
pub trait Element: Copy + Default + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    /// The reduction operator (IEEE addition for floats, wrapping addition for
    /// integers, so the control collective never overflows-panics).
    fn combine(self, other: Self) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn combine(self, other: Self) -> Self {
        self + other
    }
}

impl Element for f64 {
    #[inline(always)]
    fn combine(self, other: Self) -> Self {
        self + other
    }
}

/// The gradient element types: f32 (every gradient, unless its parameter is
/// float64) and f64 (float64 gradients, reduced in float64 as torch's DDP
/// reduces them). The loops below are written once for both.
pub trait Float:
    Element
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::AddAssign
    + std::ops::MulAssign
{
    /// Zero.
    const ZERO: Self;
    /// A scale factor, given in f64 (the one type every factor is computed
    /// in), rounded to this type.
    fn factor(x: f64) -> Self;
    /// Neither NaN nor infinite.
    fn is_finite(self) -> bool;
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn factor(x: f64) -> Self {
        x as f32
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn factor(x: f64) -> Self {
        x
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
}

impl Element for u64 {
    #[inline(always)]
    fn combine(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
}

/// `dst[i] = src[i]`. Panics if the lengths differ (a caller bug, never data).
#[inline]
pub fn copy<T: Element>(dst: &mut [T], src: &[T]) {
    dst.copy_from_slice(src);
}

/// `dst[i] = 0`.
#[inline]
pub fn zero<T: Element>(dst: &mut [T]) {
    dst.fill(T::default());
}

/// `dst[i] = dst[i] ⊕ src[i]`. Panics if the lengths differ.
#[inline]
pub fn add_assign<T: Element>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "add_assign: length mismatch");
    let mut d = dst.chunks_exact_mut(LANES);
    let mut s = src.chunks_exact(LANES);
    for (dc, sc) in (&mut d).zip(&mut s) {
        for i in 0..LANES {
            dc[i] = dc[i].combine(sc[i]);
        }
    }
    for (x, y) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *x = x.combine(*y);
    }
}

/// `dst[i] = a[i] - b[i]`. Panics if the lengths differ.
#[inline]
pub fn sub_into<T: Float>(dst: &mut [T], a: &[T], b: &[T]) {
    assert!(dst.len() == a.len() && a.len() == b.len(), "sub_into: length mismatch");
    for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
        *d = x - y;
    }
}

/// Whether every value is finite (no NaN, no ±Inf). Branch-free per chunk so
/// the scan vectorizes; it is the cost of the optional non-finite check.
pub fn all_finite<T: Float>(values: &[T]) -> bool {
    let mut chunks = values.chunks_exact(LANES);
    for c in &mut chunks {
        // x * 0 is 0 for finite x and NaN for NaN or ±Inf.
        let mut acc = T::ZERO;
        for &x in c {
            acc += x * T::ZERO;
        }
        if acc != T::ZERO {
            return false;
        }
    }
    chunks.remainder().iter().all(|x| x.is_finite())
}

/// `dst[i] = src[i] * factor`: a copy and a scale in one pass. Panics if the lengths differ.
#[inline]
pub fn copy_scaled<T: Float>(dst: &mut [T], src: &[T], factor: T) {
    assert_eq!(dst.len(), src.len(), "copy_scaled: length mismatch");
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = x * factor;
    }
}

/// `dst[i] += src[i] * factor`. Panics if the lengths differ.
#[inline]
pub fn add_scaled<T: Float>(dst: &mut [T], src: &[T], factor: T) {
    assert_eq!(dst.len(), src.len(), "add_scaled: length mismatch");
    for (d, &x) in dst.iter_mut().zip(src) {
        *d += x * factor;
    }
}

/// `dst[i] *= factor`.
#[inline]
pub fn scale<T: Float>(dst: &mut [T], factor: T) {
    for x in dst.iter_mut() {
        *x *= factor;
    }
}

/// The reduce step of a reduce-scatter: `dst[i] = (dst[i] + Σ_k srcs[k][i])`,
/// then `finish` on the result chunk (the 1/divisor scale for gradients, nothing
/// for control integers), in a single pass over memory.
///
/// Sources are consumed in a fixed order, so every rank computes bit-identical
/// results for the same inputs. Panics if any source length differs from `dst`.
pub fn reduce_into<T: Element>(dst: &mut [T], srcs: &[&[T]], finish: impl Fn(&mut [T])) {
    for s in srcs {
        assert_eq!(s.len(), dst.len(), "reduce_into: length mismatch");
    }
    // Blocks of a few KiB keep the destination chunk in L1 while every source
    // streams through once.
    const BLOCK: usize = 1024;
    let mut start = 0;
    while start < dst.len() {
        let end = (start + BLOCK).min(dst.len());
        let d = &mut dst[start..end];
        for s in srcs {
            add_assign(d, &s[start..end]);
        }
        finish(d);
        start = end;
    }
}

/// [`reduce_into`] for gradients, with the `1 / divisor` average fused in.
pub fn reduce_scaled<T: Float>(dst: &mut [T], srcs: &[&[T]], factor: T) {
    if factor == T::factor(1.0) {
        reduce_into(dst, srcs, |_| {});
    } else {
        reduce_into(dst, srcs, |d| scale(d, factor));
    }
}

/// Naive reference implementations the fast loops (and later the CUDA kernels)
/// are tested against.
pub mod cpu {
    use super::Element;

    /// Reference for [`super::reduce_into`] followed by a scale of `factor`.
    pub fn reduce_scaled_reference(dst: &[f32], srcs: &[&[f32]], factor: f32) -> Vec<f32> {
        (0..dst.len())
            .map(|i| {
                let mut acc = dst[i];
                for s in srcs {
                    acc += s[i];
                }
                acc * factor
            })
            .collect()
    }

    /// Reference for [`super::add_assign`].
    pub fn add_reference<T: Element>(a: &[T], b: &[T]) -> Vec<T> {
        a.iter().zip(b).map(|(x, y)| x.combine(*y)).collect()
    }

    /// f32 → bf16, round to nearest even; NaN stays a (quiet) NaN with its
    /// sign, values beyond the largest bf16 round to infinity. Reference of
    /// the `gradsync_f32_to_bf16` kernel.
    pub fn f32_to_bf16(x: f32) -> u16 {
        let bits = x.to_bits();
        if bits & 0x7fff_ffff > 0x7f80_0000 {
            return ((bits >> 16) as u16) | 0x0040;
        }
        let lsb = (bits >> 16) & 1;
        (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
    }

    /// bf16 → f32 (exact).
    pub fn bf16_to_f32(h: u16) -> f32 {
        f32::from_bits(u32::from(h) << 16)
    }

    /// Reference of `gradsync_bf16_accumulate_f32`: `dst[i] += f32(src[i]) * scale`.
    pub fn bf16_accumulate(dst: &mut [f32], src: &[u16], scale: f32) {
        for (d, &h) in dst.iter_mut().zip(src) {
            *d += bf16_to_f32(h) * scale;
        }
    }

    /// Reference of `gradsync_pack_f32`: each `(src, offset)` copied into `bucket`.
    pub fn pack(bucket: &mut [f32], items: &[(&[f32], usize)]) {
        for (src, offset) in items {
            bucket[*offset..*offset + src.len()].copy_from_slice(src);
        }
    }

    /// Reference of `gradsync_unpack_scale_f32`: `dst[i] = bucket[offset + i] * scale`.
    pub fn unpack_scale(bucket: &[f32], items: &mut [(&mut [f32], usize)], scale: f32) {
        for (dst, offset) in items.iter_mut() {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = bucket[*offset + i] * scale;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ints(len: usize) -> impl Strategy<Value = Vec<f32>> {
        proptest::collection::vec((-1000i32..1000).prop_map(|v| v as f32), len)
    }

    proptest! {
        #[test]
        fn add_assign_matches_reference(len in 0usize..200, seed in any::<u64>()) {
            let a: Vec<f32> = (0..len).map(|i| ((i as u64 ^ seed) % 97) as f32).collect();
            let b: Vec<f32> = (0..len).map(|i| ((i as u64 * 31 + seed) % 89) as f32).collect();
            let mut d = a.clone();
            add_assign(&mut d, &b);
            prop_assert_eq!(d, cpu::add_reference(&a, &b));
        }

        #[test]
        fn reduce_scaled_matches_reference(
            (dst, srcs) in (0usize..3000).prop_flat_map(|n| (ints(n), proptest::collection::vec(ints(n), 0..5))),
            div in 1u32..9,
        ) {
            let refs: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
            let mut d = dst.clone();
            let factor = 1.0 / div as f32;
            reduce_scaled(&mut d, &refs, factor);
            prop_assert_eq!(d, cpu::reduce_scaled_reference(&dst, &refs, factor));
        }
    }

    #[test]
    fn u64_combine_wraps_instead_of_panicking() {
        let mut d = vec![u64::MAX, 1];
        add_assign(&mut d, &[2, 2]);
        assert_eq!(d, vec![1, 3]);
    }

    /// Data-driven bf16 rounding: (f32 bits, expected bf16 bits).
    #[test]
    fn bf16_rounds_to_nearest_even() {
        let cases: &[(u32, u16, &str)] = &[
            (0x3f80_0000, 0x3f80, "1.0 exact"),
            (0x3f80_8000, 0x3f80, "tie below an even mantissa stays"),
            (0x3f81_8000, 0x3f82, "tie below an odd mantissa rounds up to even"),
            (0x3f80_8001, 0x3f81, "just above the tie rounds up"),
            (0x3f80_7fff, 0x3f80, "just below the tie rounds down"),
            (0xbf81_8000, 0xbf82, "negative ties round the magnitude to even"),
            (0x7f7f_ffff, 0x7f80, "f32::MAX overflows to +inf"),
            (0x7f80_0000, 0x7f80, "+inf stays"),
            (0xff80_0000, 0xff80, "-inf stays"),
            (0x0000_0001, 0x0000, "the smallest subnormal rounds to zero"),
            (0x8000_0000, 0x8000, "-0 stays"),
        ];
        for &(f, h, what) in cases {
            assert_eq!(cpu::f32_to_bf16(f32::from_bits(f)), h, "{what}");
        }
        let nan = cpu::f32_to_bf16(f32::from_bits(0x7f80_0001));
        assert!(cpu::bf16_to_f32(nan).is_nan(), "a signalling NaN with low payload bits stays NaN");
    }

    proptest! {
        #[test]
        fn bf16_round_trip_error_is_within_half_an_ulp(x in -1e30f32..1e30f32) {
            let back = cpu::bf16_to_f32(cpu::f32_to_bf16(x));
            // bf16 keeps 8 significant bits (7 stored + the implicit one):
            // rounding to nearest errs by at most half an ulp, 2^-8 relative.
            prop_assert!((back - x).abs() <= x.abs() * (1.0 / 256.0) + f32::MIN_POSITIVE);
        }
    }

    #[test]
    fn pack_and_unpack_references_round_trip_with_scale() {
        let a = [1.0, 2.0, 3.0];
        let b = [4.0, 5.0];
        let mut bucket = vec![f32::NAN; 6];
        cpu::pack(&mut bucket, &[(&a, 0), (&b, 4)]);
        bucket[3] = 0.0;
        let (mut x, mut y) = ([0.0; 3], [0.0; 2]);
        cpu::unpack_scale(&bucket, &mut [(&mut x, 0), (&mut y, 4)], 0.5);
        assert_eq!((x, y), ([0.5, 1.0, 1.5], [2.0, 2.5]));
        let mut acc = vec![1.0; 2];
        cpu::bf16_accumulate(&mut acc, &[cpu::f32_to_bf16(2.0), cpu::f32_to_bf16(-4.0)], 0.25);
        assert_eq!(acc, vec![1.5, 0.0]);
    }

    #[test]
    fn all_finite_finds_nan_and_inf_anywhere() {
        for len in [0usize, 1, 15, 16, 17, 100] {
            let clean = vec![1.5f32; len];
            assert!(all_finite(&clean));
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in 0..len {
                    let mut v = clean.clone();
                    v[at] = bad;
                    assert!(!all_finite(&v), "len {len} at {at} value {bad}");
                }
            }
        }
    }

    #[test]
    fn f64_loops_keep_what_f32_rounds_away() {
        // 1 + 2^-30 is not an f32; a float64 gradient must keep it through every loop.
        let tiny = 2f64.powi(-30);
        let mut d = vec![1.0f64; 3];
        add_assign(&mut d, &[tiny; 3]);
        assert_eq!(d, vec![1.0 + tiny; 3]);
        let mut r = vec![0.0f64; 3];
        reduce_scaled(&mut r, &[&d, &d, &d], f64::factor(1.0 / 3.0));
        assert_eq!(r, vec![(3.0 * (1.0 + tiny)) * (1.0 / 3.0); 3]);
        let mut diff = vec![0.0f64; 3];
        sub_into(&mut diff, &d, &[1.0; 3]);
        assert_eq!(diff, vec![tiny; 3]);
        assert!(all_finite(&d) && !all_finite(&[f64::NAN]));
    }

    #[test]
    fn sub_into_is_exact_on_integers() {
        let mut d = vec![0.0; 3];
        sub_into(&mut d, &[5.0, 7.0, -1.0], &[2.0, 7.0, 4.0]);
        assert_eq!(d, vec![3.0, 0.0, -5.0]);
    }
}
