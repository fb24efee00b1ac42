//! `gpu-check`: what gradsync needs from a GPU, checked on the GPU.
//!
//! 1. kernels against their CPU references on fresh random data, outputs
//!    poisoned first so an unwritten element fails: bf16 compression (exact),
//!    bf16 accumulate (relative error), pack (exact), unpack with scale (exact),
//!    and the device store's add / sub / scale (exact);
//! 2. a world-1 NCCL all-reduce on a dedicated stream (exact);
//! 3. pack-kernel bandwidth against a device-to-device copy of the same bytes,
//!    in the same run;
//! 4. overlap: a compute kernel on the main stream and pack + all-reduce on the
//!    comm stream, timed with events from a common origin.
//!
//! Exits 0 with a `SKIP` line where there is no GPU, 1 if any check fails.
//! `scripts/gpu-check.sh` builds it and runs it, then runs the end-to-end
//! `nccl_sync` example (a GradSync over NCCL with device payloads) on one rank.

use std::process::ExitCode;
use std::sync::Arc;

use gradsync::cuda::cudarc::driver::sys::CUevent_flags;
use gradsync::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use gradsync::cuda::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use gradsync::cuda::{self, DeviceKernels, SliceDesc};
use gradsync_kernels::cpu;

type Check = Result<String, String>;

/// SplitMix64, seeded from the clock: every run draws new data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2000.0
    }
}

use gradsync::cuda::grid_for as grid;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn check_bf16(stream: &Arc<CudaStream>, k: &DeviceKernels, rng: &mut Rng) -> Check {
    let n = 32 << 20;
    let mut src: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    for (i, v) in
        [f32::INFINITY, f32::NEG_INFINITY, f32::MAX, 1.0e-40, -0.0, f32::from_bits(0x7fc0_0000)].iter().enumerate()
    {
        src[i * 997] = *v;
    }
    let d_src = stream.clone_htod(&src).map_err(err)?;
    let mut d_dst = stream.clone_htod(&vec![0xffffu16; n]).map_err(err)?; // poison: no input here maps to 0xffff
    let n64 = n as u64;
    // SAFETY: argument types and order match `gradsync_f32_to_bf16`; both buffers hold n elements.
    unsafe { stream.launch_builder(&k.to_bf16).arg(&d_src).arg(&mut d_dst).arg(&n64).launch(grid(n)) }.map_err(err)?;
    let got = stream.clone_dtoh(&d_dst).map_err(err)?;
    let bad = (0..n).filter(|&i| got[i] != cpu::f32_to_bf16(src[i])).count();
    if bad > 0 {
        return Err(format!("bf16 compression: {bad} of {n} elements differ from the CPU reference"));
    }
    // Accumulate: dst += f32(bf16) * scale, against the reference (FMA may round once instead of twice).
    let dst0: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    // Finite in bf16, not only in f32: the largest f32 values round to bf16
    // infinity, and inf - inf in the comparison below would read as NaN.
    let finite: Vec<u16> = src
        .iter()
        .map(|&x| cpu::f32_to_bf16(x))
        .map(|h| if cpu::bf16_to_f32(h).is_finite() { h } else { cpu::f32_to_bf16(1.0) })
        .collect();
    let d_h = stream.clone_htod(&finite).map_err(err)?;
    let mut d_acc = stream.clone_htod(&dst0).map_err(err)?;
    let scale = 0.25f32;
    // SAFETY: argument types and order match `gradsync_bf16_accumulate_f32`; both buffers hold n elements.
    unsafe {
        stream.launch_builder(&k.bf16_accumulate).arg(&d_h).arg(&mut d_acc).arg(&n64).arg(&scale).launch(grid(n))
    }
    .map_err(err)?;
    let got = stream.clone_dtoh(&d_acc).map_err(err)?;
    let mut want = dst0;
    cpu::bf16_accumulate(&mut want, &finite, scale);
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        num += f64::from(g - w).powi(2);
        den += f64::from(*w).powi(2);
    }
    let rel = (num / den).sqrt();
    if rel.is_nan() || rel >= 1e-6 {
        return Err(format!("bf16 accumulate: relative error {rel:e} (limit 1e-6)"));
    }
    Ok(format!("bf16 compress exact on {n} values; accumulate relative error {rel:.1e}"))
}

/// The device store's element-wise kernels against `gradsync_kernels`' loops, bit for bit.
fn check_store_ops(stream: &Arc<CudaStream>, k: &DeviceKernels, rng: &mut Rng) -> Check {
    let n = (8 << 20) + 3;
    let a: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let (d_a, d_b) = (stream.clone_htod(&a).map_err(err)?, stream.clone_htod(&b).map_err(err)?);
    let n64 = n as u64;
    let same = |got: &[f32], want: &[f32]| got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
    // add: dst += src
    let mut d_acc = stream.clone_htod(&a).map_err(err)?;
    // SAFETY: matches `gradsync_add_f32(float*, const float*, unsigned long long)`; both hold n values.
    unsafe { stream.launch_builder(&k.store.add).arg(&mut d_acc).arg(&d_b).arg(&n64).launch(grid(n)) }.map_err(err)?;
    let mut want = a.clone();
    gradsync_kernels::add_assign(&mut want, &b);
    let bad_add = same(&stream.clone_dtoh(&d_acc).map_err(err)?, &want);
    // sub: dst = a - b, into a poisoned output
    let mut d_diff = stream.clone_htod(&vec![f32::NAN; n]).map_err(err)?;
    // SAFETY: matches `gradsync_sub_f32(float*, const float*, const float*, unsigned long long)`.
    unsafe { stream.launch_builder(&k.store.sub).arg(&mut d_diff).arg(&d_a).arg(&d_b).arg(&n64).launch(grid(n)) }
        .map_err(err)?;
    let mut want = vec![0.0; n];
    gradsync_kernels::sub_into(&mut want, &a, &b);
    let bad_sub = same(&stream.clone_dtoh(&d_diff).map_err(err)?, &want);
    // scale: x *= 1/3
    let factor = 1.0f32 / 3.0;
    let mut d_x = stream.clone_htod(&a).map_err(err)?;
    // SAFETY: matches `gradsync_scale_f32(float*, unsigned long long, float)`.
    unsafe { stream.launch_builder(&k.store.scale).arg(&mut d_x).arg(&n64).arg(&factor).launch(grid(n)) }
        .map_err(err)?;
    let mut want = a.clone();
    gradsync_kernels::scale(&mut want, factor);
    let bad_scale = same(&stream.clone_dtoh(&d_x).map_err(err)?, &want);
    if bad_add + bad_sub + bad_scale > 0 {
        return Err(format!(
            "of {n} values, add {bad_add}, sub {bad_sub}, scale {bad_scale} differ from the CPU loops"
        ));
    }
    Ok(format!("add, sub and scale bit-exact against the CPU loops on {n} values"))
}

/// Gradients of random sizes, packed by the kernel and by the CPU reference.
struct Packed {
    grads: Vec<Vec<f32>>,
    d_grads: Vec<CudaSlice<f32>>,
    offsets: Vec<usize>,
    bucket: CudaSlice<f32>,
    numel: usize,
}

/// The descriptor table of `slices` at bucket `offsets` on the device, and the
/// launch shape of the pack/unpack kernels for it (`blockIdx.y` = descriptor).
fn descriptors(
    stream: &Arc<CudaStream>,
    slices: &[CudaSlice<f32>],
    offsets: &[usize],
) -> Result<(CudaSlice<SliceDesc>, LaunchConfig), String> {
    let descs: Vec<SliceDesc> = slices
        .iter()
        .zip(offsets)
        .map(|(d, &off)| SliceDesc { ptr: d.device_ptr(stream).0, offset: off as u64, len: d.len() as u64 })
        .collect();
    let cfg = LaunchConfig { grid_dim: (32, descs.len() as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    Ok((stream.clone_htod(&descs).map_err(err)?, cfg))
}

fn pack_on_device(stream: &Arc<CudaStream>, k: &DeviceKernels, rng: &mut Rng) -> Result<Packed, String> {
    let grads: Vec<Vec<f32>> =
        (0..1500).map(|_| (0..1 + (rng.next() % 90_000) as usize).map(|_| rng.f32()).collect()).collect();
    let d_grads: Vec<CudaSlice<f32>> =
        grads.iter().map(|g| stream.clone_htod(g)).collect::<Result<_, _>>().map_err(err)?;
    let mut offsets = Vec::new();
    let mut at = 0;
    for g in &grads {
        offsets.push(at);
        at += g.len();
    }
    let (d_descs, cfg) = descriptors(stream, &d_grads, &offsets)?;
    let mut bucket = stream.clone_htod(&vec![f32::NAN; at]).map_err(err)?;
    // SAFETY: the descriptors point into live device allocations (`d_grads`) and
    // inside `bucket`; argument order matches `gradsync_pack_f32`.
    unsafe { stream.launch_builder(&k.pack).arg(&d_descs).arg(&mut bucket).launch(cfg) }.map_err(err)?;
    Ok(Packed { grads, d_grads, offsets, bucket, numel: at })
}

fn check_pack_unpack(stream: &Arc<CudaStream>, k: &DeviceKernels, rng: &mut Rng) -> Check {
    let p = pack_on_device(stream, k, rng)?;
    let got = stream.clone_dtoh(&p.bucket).map_err(err)?;
    let mut want = vec![f32::NAN; p.numel];
    let items: Vec<(&[f32], usize)> = p.grads.iter().map(|g| g.as_slice()).zip(p.offsets.iter().copied()).collect();
    cpu::pack(&mut want, &items);
    let bad = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
    if bad > 0 {
        return Err(format!("pack: {bad} of {} elements wrong or unwritten", p.numel));
    }
    // Unpack with the 1/4 scale into poisoned gradients.
    let mut outs: Vec<CudaSlice<f32>> =
        p.grads.iter().map(|g| stream.clone_htod(&vec![f32::NAN; g.len()])).collect::<Result<_, _>>().map_err(err)?;
    let (d_descs, cfg) = descriptors(stream, &outs, &p.offsets)?;
    let scale = 0.25f32;
    // SAFETY: descriptors point into the live `outs` allocations and inside the bucket.
    unsafe { stream.launch_builder(&k.unpack_scale).arg(&d_descs).arg(&p.bucket).arg(&scale).launch(cfg) }
        .map_err(err)?;
    for (i, o) in outs.iter_mut().enumerate() {
        let got = stream.clone_dtoh(o).map_err(err)?;
        if got.iter().zip(&p.grads[i]).any(|(g, x)| g.to_bits() != (x * scale).to_bits()) {
            return Err(format!("unpack: gradient {i} differs from the reference or is unwritten"));
        }
    }
    drop(p.d_grads);
    Ok(format!("pack and unpack exact: {} gradients, {} values", p.grads.len(), p.numel))
}

fn check_nccl(comm: &Comm, stream: &Arc<CudaStream>, rng: &mut Rng) -> Check {
    let data: Vec<f32> = (0..(16 << 20)).map(|_| rng.f32()).collect();
    let mut d = stream.clone_htod(&data).map_err(err)?;
    comm.all_reduce_in_place(&mut d, &ReduceOp::Sum).map_err(|e| format!("ncclAllReduce: {e:?}"))?;
    let got = stream.clone_dtoh(&d).map_err(err)?;
    if got.iter().zip(&data).any(|(g, x)| g.to_bits() != x.to_bits()) {
        return Err("world-1 all-reduce changed the data".into());
    }
    Ok(format!("world-1 NCCL all-reduce exact on {} values (comm stream)", data.len()))
}

fn timed(stream: &Arc<CudaStream>, reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f32, String> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).map_err(err)?;
    for _ in 0..reps {
        f()?;
    }
    let end = stream.record_event(flags).map_err(err)?;
    end.synchronize().map_err(err)?;
    Ok(start.elapsed_ms(&end).map_err(err)? / reps as f32)
}

fn check_bandwidth(stream: &Arc<CudaStream>, k: &DeviceKernels, rng: &mut Rng) -> Check {
    let mut p = pack_on_device(stream, k, rng)?;
    let (d_descs, cfg) = descriptors(stream, &p.d_grads, &p.offsets)?;
    let pack_ms = timed(stream, 20, || {
        // SAFETY: as in `pack_on_device`.
        unsafe { stream.launch_builder(&k.pack).arg(&d_descs).arg(&mut p.bucket).launch(cfg) }.map(|_| ()).map_err(err)
    })?;
    let src = stream.clone_htod(&vec![1.0f32; p.numel]).map_err(err)?;
    let mut dst = stream.clone_htod(&vec![0.0f32; p.numel]).map_err(err)?;
    let copy_ms = timed(stream, 20, || stream.memcpy_dtod(&src, &mut dst).map_err(err))?;
    let gb = 2.0 * (p.numel * 4) as f32 / 1e9; // read + write
    Ok(format!(
        "pack {:.1} GB/s vs device-to-device copy {:.1} GB/s of the same {} MB: {:.0}% of the copy",
        gb / (pack_ms / 1e3),
        gb / (copy_ms / 1e3),
        (p.numel * 4) >> 20,
        100.0 * copy_ms / pack_ms
    ))
}

const SPIN_CU: &str = r#"
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"#;

fn check_overlap(ctx: &Arc<CudaContext>, comm: &Comm, k: &DeviceKernels, rng: &mut Rng) -> Check {
    let main = ctx.default_stream();
    let side = comm.stream();
    let spin = ctx
        .load_module(gradsync::cuda::cudarc::nvrtc::compile_ptx(SPIN_CU).map_err(err)?)
        .map_err(err)?
        .load_function("spin")
        .map_err(err)?;
    let mut p = pack_on_device(&side, k, rng)?;
    side.synchronize().map_err(err)?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let origin = main.record_event(flags).map_err(err)?;
    side.wait(&origin).map_err(err)?;
    let cycles: i64 = 200_000_000; // ~0.1 s at ~2 GHz
    let m0 = main.record_event(flags).map_err(err)?;
    // SAFETY: `spin` takes one 64-bit integer.
    unsafe { main.launch_builder(&spin).arg(&cycles).launch(LaunchConfig::for_num_elems(1)) }.map_err(err)?;
    let m1 = main.record_event(flags).map_err(err)?;
    let c0 = side.record_event(flags).map_err(err)?;
    comm.all_reduce_in_place(&mut p.bucket, &ReduceOp::Sum).map_err(|e| format!("{e:?}"))?;
    let c1 = side.record_event(flags).map_err(err)?;
    m1.synchronize().map_err(err)?;
    c1.synchronize().map_err(err)?;
    let t = |e: &gradsync::cuda::cudarc::driver::CudaEvent| origin.elapsed_ms(e).map_err(err);
    let (ms, me, cs, ce) = (t(&m0)?, t(&m1)?, t(&c0)?, t(&c1)?);
    let line = format!("main stream compute [{ms:.2}, {me:.2}] ms, comm stream all-reduce [{cs:.2}, {ce:.2}] ms");
    if cs < me && ms < ce {
        Ok(format!("overlap: {line}"))
    } else {
        Err(format!("no overlap: {line}"))
    }
}

fn main() -> ExitCode {
    let info = match cuda::probe() {
        Ok(info) => info,
        Err(e) => {
            println!("SKIP: no GPU checks on this machine: {e}");
            return ExitCode::SUCCESS;
        }
    };
    let ctx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("FAIL: cannot open device 0: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("gpu-check: {} device(s); using device 0", info.devices);
    let kernels = match DeviceKernels::compile(&ctx) {
        Ok(k) => k,
        Err(e) => {
            println!("FAIL: {e}");
            return ExitCode::FAILURE;
        }
    };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64);
    let mut rng = Rng(seed);
    println!("random seed {seed}");
    let comm_stream = match ctx.new_stream() {
        Ok(s) => s,
        Err(e) => {
            println!("FAIL: cannot create the comm stream: {e}");
            return ExitCode::FAILURE;
        }
    };
    let comm = match Id::new().and_then(|id| Comm::from_rank(comm_stream.clone(), 0, 1, id)) {
        Ok(c) => c,
        Err(e) => {
            println!("FAIL: NCCL init: {e:?}");
            return ExitCode::FAILURE;
        }
    };
    let main_stream = ctx.default_stream();
    let checks: Vec<(&str, Check)> = vec![
        ("kernels: bf16", check_bf16(&main_stream, &kernels, &mut rng)),
        ("kernels: pack/unpack", check_pack_unpack(&main_stream, &kernels, &mut rng)),
        ("kernels: store ops", check_store_ops(&main_stream, &kernels, &mut rng)),
        ("nccl", check_nccl(&comm, &comm_stream, &mut rng)),
        ("bandwidth", check_bandwidth(&main_stream, &kernels, &mut rng)),
        ("overlap", check_overlap(&ctx, &comm, &kernels, &mut rng)),
    ];
    let mut failed = 0;
    for (name, r) in &checks {
        match r {
            Ok(msg) => println!("PASS {name}: {msg}"),
            Err(msg) => {
                failed += 1;
                println!("FAIL {name}: {msg}");
            }
        }
    }
    println!("{} passed, {} failed", checks.len() - failed, failed);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
