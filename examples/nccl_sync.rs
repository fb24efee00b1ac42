//! Data-parallel gradient sync on GPUs: NCCL on a dedicated stream, gradients
//! never leaving device memory, launched like any torchrun job.
//!
//! ```text
//! cargo build --release --features cuda --example nccl_sync
//! torchrun --nproc-per-node=8 --no-python target/release/examples/nccl_sync --steps 50
//! # or without torchrun, one process per GPU:
//! RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 target/release/examples/nccl_sync
//! ```
//!
//! Each step plays the arrival pattern that breaks DDP: every parameter's
//! gradient comes in two recompute segments (`Increment`, tokens 0 and 1), the
//! tied embedding's first segment is delivered twice (a re-fired hook), and
//! one parameter is unused on odd steps. "Backward" uploads each segment's
//! gradient on a compute stream (a real framework's autograd kernels would
//! write it there); gradsync packs it on its comm stream after that stream's
//! event, so the host never waits. Every rank then checks every averaged
//! gradient against the exact value, which it can compute because the
//! synthetic gradients are integers (sums are exact in any order).
//!
//! Exit status: 0 when exact, 1 on a mismatch or a gradsync error, 2 when the
//! launch variables or the GPU are missing (with a message saying which).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gradsync::cuda::cudarc::driver::CudaStream;
use gradsync::cuda::{self, DeviceStore, NcclEndpoint};
use gradsync::rendezvous::LaunchEnv;
use gradsync::{DType, GradSync, ParamId, Token};

/// (name, elements): a tied embedding, two layers, and a head bias that is
/// unused on odd steps.
const PARAMS: [(&str, usize); 4] = [("embed", 1 << 20), ("layer0.w", 3 << 18), ("layer1.w", 1000), ("head.bias", 77)];
const UNUSED_ON_ODD_STEPS: usize = 3;

/// Segment `seg` of `param`'s gradient on `rank` at `step`: small integers.
fn segment(rank: usize, step: u64, param: usize, seg: u64, numel: usize) -> Vec<f32> {
    (0..numel).map(|i| ((rank * 7 + step as usize * 3 + param * 5 + seg as usize * 11 + i) % 17) as f32 - 8.0).collect()
}

/// The exact averaged gradient every rank must get.
fn expected(world: usize, step: u64, param: usize, numel: usize) -> Vec<f32> {
    let mut sum = vec![0.0f32; numel];
    for rank in 0..world {
        for seg in 0..2 {
            for (s, v) in sum.iter_mut().zip(segment(rank, step, param, seg, numel)) {
                *s += v;
            }
        }
    }
    let factor = 1.0 / world as f32;
    sum.iter().map(|s| s * factor).collect()
}

fn flag(name: &str, default: u64) -> Result<u64, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).ok_or(format!("{name} needs a number")),
    }
}

fn run_step(
    gs: &mut GradSync<DeviceStore>,
    compute: &std::sync::Arc<CudaStream>,
    ids: &[ParamId],
    step: u64,
) -> Result<f32, String> {
    let (rank, world) = (gs.rank(), gs.world());
    let hook = gs.hook();
    // Backward runs in reverse registration order; each parameter's two segments.
    for (p, &(_, numel)) in PARAMS.iter().enumerate().rev() {
        if p == UNUSED_ON_ODD_STEPS && step % 2 == 1 {
            continue;
        }
        for seg in 0..2 {
            let grad = compute.clone_htod(&segment(rank, step, p, seg, numel)).map_err(|e| e.to_string())?;
            hook.increment(step, ids[p], Token(seg), grad).map_err(|e| e.to_string())?;
        }
        if p == 0 {
            // The tied embedding's hook fires again for segment 0: gradsync must ignore it.
            let again = compute.clone_htod(&segment(rank, step, p, 0, numel)).map_err(|e| e.to_string())?;
            hook.increment(step, ids[p], Token(0), again).map_err(|e| e.to_string())?;
        }
    }
    let result = gs.finish_step(step).map_err(|e| e.to_string())?;
    let grads = result.gradients.ok_or(format!("step {step} was skipped: {:?}", result.report.outcome))?;
    let mut worst = 0.0f32;
    for (p, &(name, numel)) in PARAMS.iter().enumerate() {
        let want = if p == UNUSED_ON_ODD_STEPS && step % 2 == 1 { None } else { Some(expected(world, step, p, numel)) };
        match (grads.locate(ids[p]), want) {
            (None, None) => {}
            (Some((bucket, range)), Some(want)) => {
                // The compute stream waits for the all-reduce's event before this copy.
                let got = compute.clone_dtoh(&bucket.slice(range)).map_err(|e| e.to_string())?;
                for (g, w) in got.iter().zip(&want) {
                    worst = worst.max((g - w).abs());
                }
            }
            (got, _) => return Err(format!("step {step}: {name} present={} but expected the opposite", got.is_some())),
        }
    }
    Ok(worst)
}

fn main() -> ExitCode {
    let steps = match flag("--steps", 20) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("nccl_sync: {e}");
            return ExitCode::from(2);
        }
    };
    let env = match LaunchEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("nccl_sync: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = cuda::probe() {
        eprintln!("nccl_sync: rank {}: {e}", env.rank);
        return ExitCode::from(2);
    }
    let endpoint = match NcclEndpoint::from_launch_env(&env, Duration::from_secs(120)) {
        Ok(ep) => ep,
        Err(e) => {
            eprintln!("nccl_sync: rank {}: {e}", env.rank);
            return ExitCode::from(2);
        }
    };
    let compute = match endpoint.stream().context().new_stream() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("nccl_sync: rank {}: compute stream: {e}", env.rank);
            return ExitCode::from(1);
        }
    };
    let mut builder = GradSync::builder();
    let ids: Vec<ParamId> = PARAMS
        .iter()
        .map(|&(name, numel)| builder.param(name, numel, DType::F32).expect("valid registration"))
        .collect();
    builder.bucket_cap_bytes(4 << 20).collective_timeout(Duration::from_secs(60));
    let mut gs = match builder.build(endpoint) {
        Ok(gs) => gs,
        Err(e) => {
            eprintln!("nccl_sync: rank {}: {e}", env.rank);
            return ExitCode::from(1);
        }
    };
    let started = Instant::now();
    let mut worst = 0.0f32;
    for step in 0..steps {
        match run_step(&mut gs, &compute, &ids, step) {
            Ok(diff) => worst = worst.max(diff),
            Err(e) => {
                eprintln!("nccl_sync: rank {}: {e}", env.rank);
                return ExitCode::from(1);
            }
        }
        if env.rank == 0 && (step + 1) % 10 == 0 {
            eprintln!(
                "step {}/{steps}, {:.1} ms/step",
                step + 1,
                started.elapsed().as_secs_f64() * 1e3 / (step + 1) as f64
            );
        }
    }
    let verdict = if worst == 0.0 { "OK" } else { "MISMATCH" };
    println!(
        "rank {}/{}: {steps} steps, recompute + re-fired hooks + unused parameter; max abs diff {worst:e} {verdict}",
        env.rank, env.world
    );
    if worst == 0.0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
