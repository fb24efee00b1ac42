//! CUDA C sources of the device kernels, compiled at run time with NVRTC by
//! the runtime's `cuda` feature. They are plain text here so this crate builds
//! everywhere; [`crate::cpu`] holds the reference implementations every kernel
//! is checked against (on random data, with every output element written).
//!
//! * `gradsync_pack_f32`: many gradients into one bucket, one launch
//!   (`blockIdx.y` = descriptor, grid-stride over its elements);
//! * `gradsync_unpack_scale_f32`: bucket slices back to gradients, with the
//!   `1 / divisor` scale fused;
//! * `gradsync_f32_to_bf16`: on-the-wire compression, round to nearest even
//!   (NaN stays a quiet NaN, overflow rounds to infinity);
//! * `gradsync_bf16_accumulate_f32`: `dst += f32(src) * scale`, so reduced
//!   bf16 data is accumulated in f32;
//! * `gradsync_add_f32`, `gradsync_sub_f32`, `gradsync_scale_f32`: the device
//!   store's element-wise operations (merge an increment, a late supersede's
//!   difference, the `1 / divisor` scale after NCCL's sum), checked against
//!   [`crate::add_assign`], [`crate::sub_into`] and [`crate::scale`].
//!
//! Two translation units: [`STORE_CU`] is what a running GradSync needs (the
//! NCCL endpoint compiles only it), [`BUCKET_CU`] the fused pack/unpack and
//! bf16 wire kernels that `gpu-check` measures.

/// The fused pack / unpack and bf16 wire-format kernels.
pub const BUCKET_CU: &str = r#"
struct PackDesc { const float* src; unsigned long long offset; unsigned long long len; };
struct UnpackDesc { float* dst; unsigned long long offset; unsigned long long len; };

extern "C" __global__ void gradsync_pack_f32(const PackDesc* descs, float* bucket) {
    const PackDesc d = descs[blockIdx.y];
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < d.len;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        bucket[d.offset + i] = d.src[i];
    }
}

extern "C" __global__ void gradsync_unpack_scale_f32(const UnpackDesc* descs, const float* bucket, float scale) {
    const UnpackDesc d = descs[blockIdx.y];
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < d.len;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        d.dst[i] = bucket[d.offset + i] * scale;
    }
}

__device__ unsigned short gradsync_bf16_rne(float x) {
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((bits >> 16) | 0x0040u);  /* NaN: keep sign, force quiet */
    }
    unsigned int lsb = (bits >> 16) & 1u;
    return (unsigned short)((bits + 0x7fffu + lsb) >> 16);
}

extern "C" __global__ void gradsync_f32_to_bf16(const float* src, unsigned short* dst, unsigned long long n) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = gradsync_bf16_rne(src[i]);
    }
}

extern "C" __global__ void gradsync_bf16_accumulate_f32(const unsigned short* src, float* dst, unsigned long long n,
                                                        float scale) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] += __uint_as_float(((unsigned int)src[i]) << 16) * scale;
    }
}
"#;

/// The device store's element-wise kernels.
pub const STORE_CU: &str = r#"
extern "C" __global__ void gradsync_add_f32(float* dst, const float* src, unsigned long long n) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] += src[i];
    }
}

extern "C" __global__ void gradsync_sub_f32(float* dst, const float* a, const float* b, unsigned long long n) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = a[i] - b[i];
    }
}

extern "C" __global__ void gradsync_scale_f32(float* x, unsigned long long n, float scale) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] *= scale;
    }
}
"#;

/// Names of the kernels in [`BUCKET_CU`].
pub const BUCKET_KERNELS: [&str; 4] =
    ["gradsync_pack_f32", "gradsync_unpack_scale_f32", "gradsync_f32_to_bf16", "gradsync_bf16_accumulate_f32"];

/// Names of the kernels in [`STORE_CU`].
pub const STORE_KERNELS: [&str; 3] = ["gradsync_add_f32", "gradsync_sub_f32", "gradsync_scale_f32"];
