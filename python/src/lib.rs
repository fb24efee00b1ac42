//! `gradsync._native`: the gradsync runtime for Python, a thin binding.
//!
//! What flows through it, per rank:
//!
//! ```text
//! gradsync.torch hook ── Session.give(None, param, token, tensor, addr) ──▶ ArrivalBatch ──▶ parameter actors
//! C++ hook (_arrivals) ── ArrivalSink's C entry `give` (no interpreter) ──▶ the same ArrivalBatch
//! end of backward     ── Session.finish(step) (interpreter released) ──▶ GradSync::finish_step
//!                     ◀── Step { report, gradients } ── Step.copy_into_ptr(param, addr) ──▶ .grad
//!                                                       (device plane: Step.buckets() ──▶ tensors ──▶ .grad)
//! comm thread         ── PyTransport (wire conversion) ──▶ the C++ shim's table (c10d gloo, no interpreter),
//!                                                          or communicator.all_reduce(addr, …) (Python)
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
//! shims hand it over), `arrivals` (the C entry of the C++ hooks), `membership` (an elastic job's membership protocol over torch's store), `transport` and `collectives` (the communicator thread's way
//! to gloo), `errors`, `closing`.

mod arrivals;
mod closing;
mod collectives;
mod errors;
mod etcd;
mod given;
mod membership;
mod memory;
mod params;
mod plane;
mod report;
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
    let addr: std::net::SocketAddr = addr
        .parse()
        .map_err(|e| errors::raise(py, "ConfigError", format!("metrics address {addr:?}: {e}; use HOST:PORT"), &[]))?;
    gradsync_runtime::metrics::install_prometheus(addr, allow_remote)
        .map(|_| ())
        .map_err(|e| errors::raise(py, "ConfigError", e.to_string(), &[]))
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
    m.add_class::<report::StepReport>()?;
    m.add_class::<arrivals::ArrivalSink>()?;
    m.add_class::<membership::Membership>()?;
    m.add_class::<etcd::EtcdClient>()?;
    m.add_function(wrap_pyfunction!(install_prometheus, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(closing::wait_for_closing, m)?)?;
    Ok(())
}
