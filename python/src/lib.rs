//! `gradsync._native`: the gradsync runtime for Python, a thin binding.
//!
//! What flows through it, per rank:
//!
//! ```text
//! torch's C++ hook (_arrivals) ── ArrivalSink's C entry `give` (no interpreter) ──▶ ArrivalBatch ──▶ parameter actors
//! Paddle's Python hook ── Session.give(None, param, token, tensor, addr) ──▶ the same ArrivalBatch
//! end of backward     ── Session.finish(step) (interpreter released) ──▶ GradSync::finish_step
//!                     ◀── Step { report, gradients } ── Step.buckets() ──▶ the C++ hook's write_back ──▶ .grad
//!                                                       (Paddle: Step.copy_into_ptr(param, addr))
//! comm thread         ── BucketTransport (wire conversion) ──▶ NativeEngine: the C++ shim's table (no interpreter)
//!                                                          or PythonEngine: communicator.all_reduce(addr, …) (Paddle)
//! ```
//!
//! Buckets live in host memory, or on the **device plane**: torch tensors
//! on the parameters' device, packed and reduced (NCCL for CUDA) on a stream
//! of the shim's, with the same actors deciding (`plane`).
//!
//! Every semantic (dedup, token order, late corrections, aborts, joins,
//! desync, deadlines, the divisor, the wire type) is the Rust runtime's; this
//! crate converts types, releases the interpreter while the runtime waits,
//! and turns errors into the exception classes of `gradsync._errors`. The
//! step number is the runtime's: hooks hand gradients to the open step.
//!
//! Modules, by concept (private: the Python API is what they register):
//! `session` (the runtime as Python drives it), `step` and `report` (a
//! finished step), `settings` (names parsed into the runtime's types),
//! `params` and `memory` (gradient memory by address), `tensor_grads`
//! (the store: payloads that are tensors held in place, on either plane),
//! `plane` (the device plane's operations), `given` (a gradient as the C++
//! shims hand it over), `arrivals` (the C entry of the C++ hooks), `lane`
//! (parameter sharding's gather lane), `pieces` (one rank reading the
//! others' pieces alone), `residency` (its residency protocol, the
//! runtime's state machine), `membership` (an elastic
//! job's membership protocol over torch's store), `transport` (the
//! communicator thread's engines, and failures classified once) and
//! `collectives` (the shim's table), `errors`, `closing`.

mod arrivals;
mod closing;
mod collectives;
mod errors;
mod etcd;
mod gathers;
mod given;
mod lane;
mod membership;
mod memory;
mod params;
mod pieces;
mod plane;
mod report;
mod residency;
mod session;
mod settings;
mod step;
mod tensor_grads;
mod transport;

use pyo3::prelude::*;

/// Serve Prometheus metrics at `http://addr/metrics` (loopback only unless
/// `allow_remote`). Call once per process, before creating sessions.
#[pyfunction]
#[pyo3(signature = (addr, allow_remote = false))]
fn install_prometheus(py: Python<'_>, addr: &str, allow_remote: bool) -> PyResult<()> {
    let addr: std::net::SocketAddr = addr.parse().map_err(|e| {
        errors::raise::<errors::ConfigError>(py, format!("metrics address {addr:?}: {e}; use HOST:PORT"), &[])
    })?;
    gradsync_runtime::metrics::install_prometheus(addr, allow_remote)
        .map(|_| ())
        .map_err(|e| errors::raise::<errors::ConfigError>(py, e.to_string(), &[]))
}

/// Rank `rank`'s partition `(start, end)` of a bucket of `numel` values
/// reduce-scattered over `world` ranks (the one layout every rank and the
/// runtime's collectives use).
#[pyfunction]
fn partition(numel: usize, rank: usize, world: usize) -> (usize, usize) {
    let r = gradsync_runtime::backend::partition(numel, rank, world);
    (r.start, r.end)
}

/// What `rank` of `world` keeps of a bucket of `numel` values, as the
/// runtime lays it out in the buffer a step lends: `[(start, end, at)]`,
/// each a range of the bucket and where it begins in that buffer; its own
/// partition first, then (a `buddy_stride` above 0, and a buddy other than
/// itself) its buddy's. The runtime's one rule (`held`), read by the
/// sharded optimizer's pieces and the elastic re-shard.
#[pyfunction]
fn held_ranges(numel: usize, rank: usize, world: usize, buddy_stride: usize) -> Vec<(usize, usize, usize)> {
    let mut at = 0;
    gradsync_runtime::backend::held(numel, rank, world, buddy_stride)
        .into_iter()
        .map(|r| {
            let entry = (r.start, r.end, at);
            at += r.len();
            entry
        })
        .collect()
}

/// Where each value of a bucket of `numel` values comes from after a
/// change of members, from every member's old `places` (`(rank, world,
/// buddy_stride)`, or `None`: it holds nothing): `[(start, end, source)]`
/// covering the bucket, each source a member's index (an owner first,
/// else a buddy) or `None` where nobody holds it. The elastic re-shard's
/// one rule (`gradsync_actors::sources`).
#[pyfunction]
fn sources(numel: usize, places: Vec<Option<(usize, usize, usize)>>) -> Vec<(usize, usize, Option<usize>)> {
    gradsync_runtime::backend::sources(numel, &places).into_iter().map(|(r, s)| (r.start, r.end, s)).collect()
}

/// The runtime's version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<session::Session>()?;
    m.add_class::<step::Step>()?;
    m.add_class::<gathers::Gathers>()?;
    m.add_class::<lane::Lane>()?;
    m.add_class::<pieces::PieceServer>()?;
    m.add_class::<pieces::PieceReader>()?;
    m.add_class::<residency::Residency>()?;
    m.add_class::<report::StepReport>()?;
    m.add_class::<arrivals::ArrivalSink>()?;
    m.add_class::<membership::Membership>()?;
    m.add_class::<etcd::EtcdClient>()?;
    m.add_function(wrap_pyfunction!(install_prometheus, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(partition, m)?)?;
    m.add_function(wrap_pyfunction!(held_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(sources, m)?)?;
    m.add_function(wrap_pyfunction!(closing::wait_for_closing, m)?)?;
    Ok(())
}
