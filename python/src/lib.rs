//! `gradsync._native`: the gradsync runtime for Python, a thin binding.
//!
//! What flows through it, per rank:
//!
//! ```text
//! gradsync.torch hook ── Session.give(step, param, token, tensor, addr) ──▶ ArrivalBatch ──▶ parameter actors
//! C++ hook (_arrivals) ── ArrivalSink's C entry `give` (no interpreter) ──▶ the same ArrivalBatch
//! end of backward     ── Session.finish(step) (interpreter released) ──▶ GradSync::finish_step
//!                     ◀── Step { report, gradients } ── Step.copy_into_ptr(param, addr) ──▶ .grad
//! comm thread         ── PyTransport ──▶ the shim's C table (c10d gloo, no interpreter),
//!                                       or communicator.all_reduce(addr, …) (torch.distributed)
//! ```
//!
//! Every semantic (dedup, token order, late corrections, aborts, joins,
//! desync, deadlines) is the Rust runtime's; this crate converts types,
//! releases the interpreter while the runtime waits, and turns errors into
//! the exception classes of `gradsync._errors`.

mod arrivals;
mod closing;
mod errors;
mod memory;
mod shim;
mod store;
mod transport;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gradsync_runtime::{
    AbortPolicy, AbortReason, ArrivalBatch, ChromeTrace, DType, Divisor, GradSync, Gradients, Outcome, ParamId,
    Rejection, StepReport as RustReport, StepResult, Token,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use arrivals::{ArrivalSink, SharedBatch, Sink};
use errors::{dict, value};
use memory::{Elem, Raw};
use store::{Grad, Owner, TensorStore};
use transport::PyTransport;

/// Copy above this many bytes with the interpreter released.
const DETACH_BYTES: usize = 256 << 10;

/// What the binding needs to know about each registered parameter.
#[derive(Debug)]
struct Params {
    ids: Vec<ParamId>,
    numel: Vec<usize>,
    elem: Vec<Elem>,
}

impl Params {
    /// Parameter `param`'s gradient memory at `addr`, checked: the index in
    /// range, the address not null.
    fn raw(&self, param: usize, addr: usize) -> PyResult<Raw> {
        if param >= self.ids.len() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "parameter index {param} out of range: {} parameters are registered",
                self.ids.len()
            )));
        }
        if addr == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("null address"));
        }
        Ok(self.at(param, addr))
    }

    /// As [`Params::raw`], unchecked: for callers that registered `param`
    /// themselves (the shim's hooks).
    fn at(&self, param: usize, addr: usize) -> Raw {
        Raw { addr, numel: self.numel[param], elem: self.elem[param] }
    }
}

/// One rank's gradient synchronizer, its collectives run by `communicator`
/// (see `gradsync.torch`). Most programs use `gradsync.torch.DistributedDataParallel`
/// rather than this class.
#[pyclass(module = "gradsync._native")]
struct Session {
    /// `None` once closed.
    sync: Option<GradSync<TensorStore>>,
    /// Arrivals checked and held until a bucket can launch (one wake-up of
    /// the actors per group instead of per gradient); delivered before every
    /// step end. `None` once closed.
    batch: SharedBatch,
    params: Arc<Params>,
    /// Every step's timeline, when recording.
    trace: Option<ChromeTrace>,
}

fn closed(py: Python<'_>) -> PyErr {
    errors::raise(py, "ClosedError", "this gradsync session is closed".into(), &[])
}

fn parse_policy(py: Python<'_>, name: &str) -> PyResult<AbortPolicy> {
    match name {
        "skip" => Ok(AbortPolicy::Skip),
        "partial" => Ok(AbortPolicy::Partial),
        other => {
            Err(errors::raise(py, "ConfigError", format!("abort_policy {other:?}: use \"skip\" or \"partial\""), &[]))
        }
    }
}

fn parse_divisor(py: Python<'_>, divisor: &Bound<'_, PyAny>) -> PyResult<Divisor> {
    if let Ok(n) = divisor.extract::<u32>() {
        if n == 0 {
            return Err(errors::raise(py, "ConfigError", "divisor 0: division by zero".into(), &[]));
        }
        return Ok(Divisor::Fixed(n));
    }
    match divisor.extract::<String>()?.as_str() {
        "world" | "contributors" => Ok(Divisor::WorldSize),
        "sum" => Ok(Divisor::Sum),
        other => Err(errors::raise(
            py,
            "ConfigError",
            format!("divisor {other:?}: use \"world\" (average), \"sum\" or a positive integer"),
            &[],
        )),
    }
}

fn parse_reason(reason: &Bound<'_, PyAny>) -> PyResult<AbortReason> {
    if let Ok(code) = reason.extract::<u32>() {
        return Ok(AbortReason::Other(code));
    }
    Ok(match reason.extract::<String>()?.as_str() {
        "out_of_memory" | "oom" => AbortReason::OutOfMemory,
        "bad_batch" => AbortReason::BadBatch,
        "non_finite" => AbortReason::NonFinite,
        _ => AbortReason::Other(0),
    })
}

impl Session {
    fn sync(&mut self, py: Python<'_>) -> PyResult<&mut GradSync<TensorStore>> {
        self.sync.as_mut().ok_or_else(|| closed(py))
    }

    /// Run `offer` on the batch (refusals become `RejectedError`).
    fn offer(
        &self,
        py: Python<'_>,
        offer: impl FnOnce(&mut ArrivalBatch<TensorStore>) -> Result<(), Rejection>,
    ) -> PyResult<()> {
        let mut guard = self.batch.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let batch = guard.as_mut().ok_or_else(|| closed(py))?;
        offer(batch).map_err(|e| errors::rejection(py, &e))
    }

    /// Send every held arrival to the actors (before a step ends).
    fn deliver(&self, py: Python<'_>) -> PyResult<()> {
        self.offer(py, ArrivalBatch::deliver)
    }

    /// Add a finished step to the timeline, when recording.
    fn record(&mut self, report: &RustReport) {
        if let Some(trace) = &mut self.trace {
            trace.add(report);
        }
    }

    fn wrap(&mut self, py: Python<'_>, result: StepResult<TensorStore>) -> PyResult<Step> {
        self.record(&result.report);
        let report = Py::new(py, StepReport::new(&result.report))?;
        Ok(Step { report, gradients: Mutex::new(result.gradients), params: Arc::clone(&self.params) })
    }
}

#[pymethods]
impl Session {
    /// Register the parameters (in forward order) and start the runtime.
    /// `dtypes` name each gradient's element type (`"float32"`, `"float64"`,
    /// `"float16"`, `"bfloat16"`); gradsync reduces in float32. Up to
    /// `in_flight` collectives overlap when the communicator has `start` and
    /// `wait_oldest`. `reorder_buckets` rebuilds the bucket plan in the order
    /// gradients arrive (after the first step, and when that order changes
    /// for several steps), the same plan on every rank.
    #[new]
    #[pyo3(signature = (communicator, rank, world, names, numels, dtypes, *, bucket_cap_bytes = 25 << 20,
                        timeout_s = 300.0, abort_policy = "skip", divisor = None, record_timeline = false,
                        param_shards = 1, in_flight = 2, reorder_buckets = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        communicator: Py<PyAny>,
        rank: usize,
        world: usize,
        names: Vec<String>,
        numels: Vec<usize>,
        dtypes: Vec<String>,
        bucket_cap_bytes: usize,
        timeout_s: f64,
        abort_policy: &str,
        divisor: Option<Bound<'_, PyAny>>,
        record_timeline: bool,
        param_shards: usize,
        in_flight: usize,
        reorder_buckets: bool,
    ) -> PyResult<Session> {
        if names.len() != numels.len() || names.len() != dtypes.len() {
            let why = "names, numels and dtypes must have one entry per parameter".to_string();
            return Err(errors::raise(py, "ConfigError", why, &[]));
        }
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(errors::raise(py, "ConfigError", format!("timeout_s {timeout_s}: must be positive"), &[]));
        }
        let mut b = GradSync::builder();
        let mut ids = Vec::with_capacity(names.len());
        let mut elem = Vec::with_capacity(names.len());
        for ((name, &numel), dtype) in names.iter().zip(&numels).zip(&dtypes) {
            let e = Elem::parse(dtype).ok_or_else(|| {
                let why = format!(
                    "parameter {name:?} has dtype {dtype}: gradsync reduces float32 and converts float64, \
                     float16 and bfloat16; other types cannot be averaged"
                );
                errors::raise(py, "ConfigError", why, &[])
            })?;
            ids.push(b.param(name.clone(), numel, DType::F32).map_err(|e| errors::build_error(py, &e))?);
            elem.push(e);
        }
        let divisor = match divisor {
            Some(d) => parse_divisor(py, &d)?,
            None => Divisor::WorldSize,
        };
        b.bucket_cap_bytes(bucket_cap_bytes)
            .collective_timeout(Duration::from_secs_f64(timeout_s))
            .abort_policy(parse_policy(py, abort_policy)?)
            .divisor(divisor)
            .record_timeline(record_timeline)
            .param_shards(param_shards)
            .reorder_buckets(reorder_buckets);
        // Collectives overlap only with a communicator that can start and wait separately.
        let windowed =
            ["start", "wait_oldest", "discard"].iter().all(|m| communicator.bind(py).hasattr(*m).unwrap_or(false));
        let window = if windowed { in_flight } else { 1 };
        let sync = b
            .build(PyTransport::new(py, rank, world, communicator, window)?)
            .map_err(|e| errors::build_error(py, &e))?;
        let batch = Arc::new(Mutex::new(Some(sync.hook().batch())));
        let params = Arc::new(Params { ids, numel: numels, elem });
        Ok(Session { sync: Some(sync), batch, params, trace: record_timeline.then(ChromeTrace::new) })
    }

    /// This rank.
    #[getter]
    fn rank(&mut self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.sync(py)?.rank())
    }

    /// Number of ranks.
    #[getter]
    fn world(&mut self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.sync(py)?.world())
    }

    /// The open step (the one arrivals are for, and the next to end).
    #[getter]
    fn current_step(&mut self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.sync(py)?.current_step())
    }

    /// Bytes of bucket buffers and metadata the runtime holds.
    #[getter]
    fn memory_bytes(&mut self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.sync(py)?.memory_bytes())
    }

    /// Hand over parameter `param`'s whole local gradient so far, read from
    /// `addr`. Among a step's arrivals of one parameter the highest `token`
    /// wins (use the hook's firing index); a repeated `token` is a duplicate.
    ///
    /// Low level: `addr` must be the data address of a live, contiguous CPU
    /// buffer with the parameter's element count and type, not written during
    /// the call (`gradsync.torch` checks the tensor it takes it from).
    fn arrive_ptr(&self, py: Python<'_>, step: u64, param: usize, token: u64, addr: usize) -> PyResult<()> {
        if self.sync.is_none() {
            return Err(closed(py));
        }
        let src = self.params.raw(param, addr)?;
        let mut values = Vec::new();
        if src.numel * 4 >= DETACH_BYTES {
            py.detach(|| memory::read(src, &mut values));
        } else {
            memory::read(src, &mut values);
        }
        self.offer(py, |batch| batch.accumulated(step, self.params.ids[param], Token(token), Grad::Owned(values)))
    }

    /// Hand over `tensor`, one additive contribution to parameter `param`'s
    /// gradient (a `.grad` the caller has just moved out of the parameter):
    /// contributions with distinct tokens are summed, a repeated token is a
    /// duplicate. A float32 tensor is read in place (the runtime keeps a
    /// reference until the step ends; the caller must not write it before);
    /// other float types are converted into a copy.
    ///
    /// Low level: `addr` must be `tensor`'s data address, and the tensor
    /// contiguous, on the CPU, with the parameter's element count and type.
    fn give(
        &self,
        py: Python<'_>,
        step: u64,
        param: usize,
        token: u64,
        tensor: Py<PyAny>,
        addr: usize,
    ) -> PyResult<()> {
        if self.sync.is_none() {
            return Err(closed(py));
        }
        let grad = Grad::read(self.params.raw(param, addr)?, Owner::Python(tensor));
        self.offer(py, |batch| batch.increment(step, self.params.ids[param], Token(token), grad))
    }

    /// The entry through which `gradsync.torch`'s native hooks hand
    /// gradients over without the interpreter (the checks and batch of
    /// `give`).
    fn arrival_sink(&self) -> ArrivalSink {
        ArrivalSink::new(Sink::new(Arc::clone(&self.batch), Arc::clone(&self.params)))
    }

    /// Backward of `step` is over: launch what is left, agree with every rank
    /// and return the finished step. Waits with the interpreter released.
    fn finish(&mut self, py: Python<'_>, step: u64) -> PyResult<Step> {
        self.deliver(py)?;
        let sync = self.sync(py)?;
        let result = py.detach(|| sync.finish_step(step)).map_err(|e| errors::sync_error(py, &e))?;
        self.wrap(py, result)
    }

    /// This rank cannot finish `step` (`reason`: `"out_of_memory"`,
    /// `"bad_batch"`, `"non_finite"` or an integer code).
    fn abort(&mut self, py: Python<'_>, step: u64, reason: Bound<'_, PyAny>) -> PyResult<Step> {
        let reason = parse_reason(&reason)?;
        self.deliver(py)?;
        let sync = self.sync(py)?;
        let result = py.detach(|| sync.abort_step(step, reason)).map_err(|e| errors::sync_error(py, &e))?;
        self.wrap(py, result)
    }

    /// This rank is out of data: contribute zeros to every later step until
    /// every rank has joined. Returns `(first_step, steps_shadowed)`.
    fn join(&mut self, py: Python<'_>) -> PyResult<(u64, u64)> {
        self.deliver(py)?;
        let sync = self.sync(py)?;
        let joined = py.detach(|| sync.join()).map_err(|e| errors::sync_error(py, &e))?;
        Ok((joined.first_step, joined.steps))
    }

    /// One step of `join`: this rank is out of data and contributes zeros
    /// to the other ranks' open step; returns that step's report (outcome
    /// `"all_joined"` once every rank shadowed it). For torch's `Join`
    /// context manager, which counts the ranks still training itself.
    fn shadow_step(&mut self, py: Python<'_>) -> PyResult<Py<StepReport>> {
        self.deliver(py)?;
        let sync = self.sync(py)?;
        let report = py.detach(|| sync.shadow_step()).map_err(|e| errors::sync_error(py, &e))?;
        self.record(&report);
        Py::new(py, StepReport::new(&report))
    }

    /// After a failed step, on every rank: agree on the step to continue at.
    fn reset(&mut self, py: Python<'_>) -> PyResult<u64> {
        let sync = self.sync(py)?;
        py.detach(|| sync.reset()).map_err(|e| errors::sync_error(py, &e))
    }

    /// The current step's progress: buckets launched and reduced, parameters ready.
    fn progress<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let sync = self.sync(py)?;
        let p = py.detach(|| sync.progress()).map_err(|e| errors::sync_error(py, &e))?;
        dict(
            py,
            vec![
                ("step", value(py, p.step)),
                ("buckets_launched", value(py, p.buckets_launched)),
                ("buckets_done", value(py, p.buckets_done)),
                ("params_ready", value(py, p.params_ready)),
            ],
        )
    }

    /// Write every recorded step's timeline as Chrome trace JSON (Perfetto);
    /// needs `record_timeline=True`.
    fn write_timeline(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<usize> {
        let Some(trace) = &self.trace else {
            return Err(errors::raise(
                py,
                "ConfigError",
                "no timeline: create the session with record_timeline=True".into(),
                &[],
            ));
        };
        let file = std::fs::File::create(&path)?;
        trace.write_json(std::io::BufWriter::new(file))?;
        Ok(trace.len())
    }

    /// Stop the runtime's threads (waits for a collective in flight to end).
    /// Every later call raises `ClosedError`.
    fn close(&mut self, py: Python<'_>) {
        // Held arrivals die with the session (their tensors are released here).
        self.batch.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        if let Some(sync) = self.sync.take() {
            // The communicator thread may need the interpreter to finish its collective.
            py.detach(move || drop(sync));
        }
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.sync.is_none()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(sync) = self.sync.take() {
            // Dropped by the garbage collector with the interpreter held: the
            // communicator thread may be waiting for it, so join elsewhere.
            closing::in_background(sync);
        }
    }
}

/// A finished step: its report, and (when it applies) the averaged
/// gradients, lent until [`Step::release`] or garbage collection. Weakly
/// referenceable, so a wrapper can tell whether views of it are still alive.
#[pyclass(module = "gradsync._native", weakref)]
struct Step {
    report: Py<StepReport>,
    /// Behind a lock only because Python objects must be shareable between threads.
    gradients: Mutex<Option<Gradients<TensorStore>>>,
    params: Arc<Params>,
}

#[pymethods]
impl Step {
    /// The step's report.
    #[getter]
    fn report(&self, py: Python<'_>) -> Py<StepReport> {
        self.report.clone_ref(py)
    }

    /// Whether the step's gradients may be applied (applied or partial).
    #[getter]
    fn applied(&self) -> bool {
        self.gradients.lock().map(|g| g.is_some()).unwrap_or(false)
    }

    /// Whether parameter `param` has an averaged gradient (`False`: unused on
    /// every rank, or the step does not apply).
    fn has(&self, param: usize) -> bool {
        let Some(&id) = self.params.ids.get(param) else { return false };
        self.gradients.lock().map(|g| g.as_ref().is_some_and(|g| g.has(id))).unwrap_or(false)
    }

    /// Write parameter `param`'s averaged gradient into `addr` (converted to
    /// its type); `False` if it has none. Same address contract as
    /// `Session.arrive_ptr`, for writing.
    fn copy_into_ptr(&self, py: Python<'_>, param: usize, addr: usize) -> PyResult<bool> {
        let dst = self.params.raw(param, addr)?;
        let id = self.params.ids[param];
        let guard = self.gradients.lock().map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("poisoned lock"))?;
        let Some(view) = guard.as_ref().and_then(|g| g.get(id)) else { return Ok(false) };
        if dst.numel * 4 >= DETACH_BYTES {
            py.detach(|| memory::write(view, dst));
        } else {
            memory::write(view, dst);
        }
        Ok(true)
    }

    /// The address of parameter `param`'s averaged gradient inside the
    /// step's bucket memory (float32, the parameter's element count), or
    /// `None` if it has none. The memory belongs to this `Step`: it stays
    /// valid while this object lives and is not released, and goes back to
    /// the runtime when it is collected (`gradsync.torch` hands out tensors
    /// that view it and keep the object alive).
    fn address(&self, param: usize) -> PyResult<Option<usize>> {
        let Some(&id) = self.params.ids.get(param) else { return Ok(None) };
        let guard = self.gradients.lock().map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("poisoned lock"))?;
        let Some((bucket, range)) = guard.as_ref().and_then(|g| g.locate(id)) else { return Ok(None) };
        if bucket.num_pieces() != 1 {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("bucket memory is not contiguous"));
        }
        Ok(Some(bucket.piece(0)[range].as_ptr() as usize))
    }

    /// Every bucket as `(address, numel, members)`: `numel` float32 values
    /// at `address` holding the averaged gradients of the parameter indices
    /// `members`, back to back in that order. Same lifetime as [`Step::address`].
    fn buckets(&self) -> PyResult<Vec<(usize, usize, Vec<usize>)>> {
        let guard = self.gradients.lock().map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("poisoned lock"))?;
        let Some(g) = guard.as_ref() else { return Ok(Vec::new()) };
        g.buckets()
            .map(|(bucket, members)| {
                if bucket.num_pieces() != 1 {
                    return Err(pyo3::exceptions::PyRuntimeError::new_err("bucket memory is not contiguous"));
                }
                let piece = bucket.piece(0);
                Ok((piece.as_ptr() as usize, piece.len(), members.iter().map(|p| p.index()).collect()))
            })
            .collect()
    }

    /// Return the gradients' buffers to the runtime now.
    fn release(&self) {
        if let Ok(mut g) = self.gradients.lock() {
            g.take();
        }
    }
}

/// What one rank learned about one step (identical outcome on every rank).
#[pyclass(module = "gradsync._native", frozen, get_all)]
struct StepReport {
    /// The step.
    step: u64,
    /// This rank.
    rank: usize,
    /// `"applied"`, `"partial"`, `"skipped"` or `"all_joined"`.
    outcome: String,
    /// Ranks that aborted, with their reasons (skipped or partial steps).
    aborted: Vec<(usize, String)>,
    /// Ranks whose gradients are in the result.
    contributors: u32,
    /// Ranks that had joined (run out of data).
    joined: Vec<usize>,
    /// Distinct arrivals accepted on this rank.
    arrivals: u64,
    /// Re-deliveries ignored.
    duplicates: u64,
    /// Refused arrivals that named this step.
    rejected: u64,
    /// The first refusals, as messages.
    rejections: Vec<String>,
    /// Arrivals after their bucket was launched.
    late_arrivals: u64,
    /// Indices of the parameters corrected after the data buckets.
    corrected: Vec<usize>,
    /// Correction collectives issued (0 or 1).
    corrections: u32,
    /// Parameters with no arrival on this rank.
    unused_local: u32,
    /// Indices of the parameters with no arrival on any rank (no gradient).
    unused_everywhere: Vec<usize>,
    /// Data buckets all-reduced.
    buckets_launched: u32,
    /// Buckets launched before the end of backward.
    buckets_launched_before_finish: u32,
    /// Buckets reduced before the end of backward (overlap).
    buckets_done_before_finish: u32,
    /// Bytes this rank put into collectives.
    bytes_launched: u64,
    /// Seconds from the end of backward to the result (communication not hidden).
    exposed_comm_s: f64,
    /// Seconds the communicator spent in collectives.
    comm_busy_s: f64,
}

impl StepReport {
    fn new(r: &RustReport) -> StepReport {
        let aborted = match &r.outcome {
            Outcome::Skipped { aborted } | Outcome::Partial { excluded: aborted } => {
                aborted.iter().map(|(rank, why)| (*rank, why.label().into_owned())).collect()
            }
            Outcome::Applied | Outcome::AllJoined => Vec::new(),
        };
        StepReport {
            step: r.step,
            rank: r.rank,
            outcome: r.outcome.label().to_string(),
            aborted,
            contributors: r.contributors,
            joined: r.joined.clone(),
            arrivals: r.arrivals,
            duplicates: r.duplicates,
            rejected: r.rejected,
            rejections: r.rejections.iter().map(|x| x.to_string()).collect(),
            late_arrivals: r.late_arrivals,
            corrected: r.corrected.iter().map(|p| p.index()).collect(),
            corrections: r.corrections,
            unused_local: r.unused_local,
            unused_everywhere: r.unused_everywhere.iter().map(|p| p.index()).collect(),
            buckets_launched: r.buckets_launched,
            buckets_launched_before_finish: r.buckets_launched_before_finish,
            buckets_done_before_finish: r.buckets_done_before_finish,
            bytes_launched: r.bytes_launched,
            exposed_comm_s: r.exposed_comm.as_secs_f64(),
            comm_busy_s: r.comm_busy.as_secs_f64(),
        }
    }
}

#[pymethods]
impl StepReport {
    /// The report as a dictionary.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        dict(
            py,
            vec![
                ("step", value(py, self.step)),
                ("rank", value(py, self.rank)),
                ("outcome", value(py, self.outcome.clone())),
                ("aborted", value(py, self.aborted.clone())),
                ("contributors", value(py, self.contributors)),
                ("joined", value(py, self.joined.clone())),
                ("arrivals", value(py, self.arrivals)),
                ("duplicates", value(py, self.duplicates)),
                ("rejected", value(py, self.rejected)),
                ("rejections", value(py, self.rejections.clone())),
                ("late_arrivals", value(py, self.late_arrivals)),
                ("corrected", value(py, self.corrected.clone())),
                ("corrections", value(py, self.corrections)),
                ("unused_local", value(py, self.unused_local)),
                ("unused_everywhere", value(py, self.unused_everywhere.clone())),
                ("buckets_launched", value(py, self.buckets_launched)),
                ("buckets_launched_before_finish", value(py, self.buckets_launched_before_finish)),
                ("buckets_done_before_finish", value(py, self.buckets_done_before_finish)),
                ("bytes_launched", value(py, self.bytes_launched)),
                ("exposed_comm_s", value(py, self.exposed_comm_s)),
                ("comm_busy_s", value(py, self.comm_busy_s)),
            ],
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "StepReport(step={}, rank={}, outcome={:?}, contributors={}, late_arrivals={}, corrected={:?}, \
             exposed_comm_s={:.6})",
            self.step,
            self.rank,
            self.outcome,
            self.contributors,
            self.late_arrivals,
            self.corrected,
            self.exposed_comm_s
        )
    }
}

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
    m.add_class::<Session>()?;
    m.add_class::<Step>()?;
    m.add_class::<StepReport>()?;
    m.add_class::<ArrivalSink>()?;
    m.add_function(wrap_pyfunction!(install_prometheus, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(closing::wait_for_closing, m)?)?;
    Ok(())
}
