//! [`Session`]: one rank's runtime, as Python drives it: registration and
//! settings, arrivals, the end of each step, reset, the timeline.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gradsync_runtime::backend::{GradStore, Transport};
use gradsync_runtime::{
    ArrivalBatch, ChromeTrace, DType, Divisor, GatherOf, GradSync, Place, Rejection, StepReport as RustReport,
    StepResult, Token,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrivals::{ArrivalSink, SharedBatch, Sink};
use crate::closing;
use crate::errors::{self, dict, value};
use crate::gathers::{Gathers, Slot};
use crate::membership::Membership;
use crate::memory::Elem;
use crate::params::Params;
use crate::report::StepReport;
use crate::settings;
use crate::step::{Step, DETACH_BYTES};
use crate::tensor_grads::{Grad, TensorGrads};
use crate::transport::{engine_for, BucketTransport};

/// One rank's gradient synchronizer, its collectives run by `communicator`
/// (see `gradsync.torch`). Most programs use `gradsync.torch.DistributedDataParallel`
/// rather than this class.
#[pyclass(module = "gradsync._native")]
pub struct Session {
    /// `None` once closed.
    sync: Option<GradSync<TensorGrads>>,
    /// Arrivals checked and held until a bucket can launch (one wake-up of
    /// the actors per group instead of per gradient); delivered before every
    /// step end. `None` once closed.
    batch: SharedBatch,
    params: Arc<Params>,
    /// Every step's timeline, when recording.
    trace: Option<ChromeTrace>,
    /// Where buckets live (host or device plane): gather buffers are allocated here.
    store: TensorGrads,
}

fn closed(py: Python<'_>) -> PyErr {
    errors::raise::<errors::ClosedError>(py, "this gradsync session is closed".into(), &[])
}

impl Session {
    fn sync(&mut self, py: Python<'_>) -> PyResult<&mut GradSync<TensorGrads>> {
        self.sync.as_mut().ok_or_else(|| closed(py))
    }

    /// Run `offer` on the batch (refusals become `RejectedError`).
    fn offer(
        &self,
        py: Python<'_>,
        offer: impl FnOnce(&mut ArrivalBatch<TensorGrads>) -> Result<(), Rejection>,
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

    fn wrap(&mut self, py: Python<'_>, result: StepResult<TensorGrads>) -> PyResult<Step> {
        self.record(&result.report);
        let report = Py::new(py, StepReport::new(&result.report))?;
        Ok(Step::new(report, result.gradients, Arc::clone(&self.params)))
    }

    /// Host memory cannot be handed to buckets on the device plane: only
    /// the C++ hooks (the ledger) give it tensors.
    fn refuse_on_device_plane(&self, py: Python<'_>) -> PyResult<()> {
        if self.params.device_plane {
            let why = "this session keeps its buckets on the device: gradients reach it through gradsync's C++ \
                       hooks (gradsync.torch._arrivals), not from host memory"
                .to_string();
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        Ok(())
    }

    /// `step`, or the open step when `None` (the runtime's one step number).
    fn step_or_open(&self, py: Python<'_>, step: Option<u64>) -> PyResult<u64> {
        match step {
            Some(step) => Ok(step),
            None => Ok(self.sync.as_ref().ok_or_else(|| closed(py))?.current_step()),
        }
    }
}

#[pymethods]
impl Session {
    /// Register the parameters (in forward order) and start the runtime.
    /// `dtypes` name each gradient's element type (`"float32"`, `"float64"`,
    /// `"float16"`, `"bfloat16"`); float64 gradients are reduced in float64,
    /// the others in float32. Up to
    /// `in_flight` collectives overlap when the communicator has `start` and
    /// `wait_oldest`. `reorder_buckets` rebuilds the bucket plan in the order
    /// gradients arrive (after the first step, and when that order changes
    /// for several steps), the same plan on every rank. `wire_dtype`
    /// (`"float32"`, `"bfloat16"`, `"float16"`) is the type data buckets
    /// travel in; `divisor` what each step's sum is divided by
    /// (`"contributors"`, the default, `"world"`, `"sum"` or an integer).
    /// `membership` (an elastic job's `Membership`, started): its monitor's
    /// joiner flag goes into this rank's control votes (`StepReport.admit`).
    /// `partitioned` (sharded training): after a step each rank holds only
    /// its `partition` of every bucket (`Step.buckets()`), the plan is never
    /// rebuilt; `reduce_scatter`: the buckets' collective is a reduce-scatter
    /// (the default), else an all-reduce of which each rank keeps its
    /// partition (faster where the engine's reduce-scatter is not: gloo's);
    /// `buddy_stride` above 0 (an elastic sharded job): rank `r` also keeps
    /// the partition of rank `(r + buddy_stride) % world` (after its own in
    /// `Step.buckets()`' buffers; the roster's `buddy_stride`), and the
    /// buckets are all-reduced.
    #[new]
    #[pyo3(signature = (communicator, rank, world, names, numels, dtypes, *, bucket_cap_bytes = 25 << 20,
                        timeout_s = 300.0, abort_policy = "skip", divisor = None, record_timeline = false,
                        param_shards = 1, in_flight = 2, reorder_buckets = true, wire_dtype = "float32",
                        membership = None, partitioned = false, reduce_scatter = true, buddy_stride = 0,
                        units = None))]
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
        wire_dtype: &str,
        membership: Option<PyRef<'_, Membership>>,
        partitioned: bool,
        reduce_scatter: bool,
        buddy_stride: usize,
        units: Option<Vec<u32>>,
    ) -> PyResult<Session> {
        if names.len() != numels.len() || names.len() != dtypes.len() {
            let why = "names, numels and dtypes must have one entry per parameter".to_string();
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(errors::raise::<errors::ConfigError>(
                py,
                format!("timeout_s {timeout_s}: must be positive"),
                &[],
            ));
        }
        let mut b = GradSync::builder();
        let mut ids = Vec::with_capacity(names.len());
        let mut elem = Vec::with_capacity(names.len());
        for ((name, &numel), dtype) in names.iter().zip(&numels).zip(&dtypes) {
            let e = Elem::parse(dtype).ok_or_else(|| {
                let why = format!(
                    "parameter {name:?} has dtype {dtype}: gradsync reduces float32 and float64 gradients, \
                     and float16 and bfloat16 ones in float32; other types cannot be averaged"
                );
                errors::raise::<errors::ConfigError>(py, why, &[])
            })?;
            // Float64 gradients get float64 buckets; the half types are widened to float32.
            let reduced = if e == Elem::F64 { DType::F64 } else { DType::F32 };
            ids.push(b.param(name.clone(), numel, reduced).map_err(|e| errors::build_error(py, &e))?);
            elem.push(e);
        }
        if let Some(units) = &units {
            if units.len() != ids.len() {
                let why = format!("units: {} given for {} parameters (one per parameter)", units.len(), ids.len());
                return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
            }
            for (&id, &unit) in ids.iter().zip(units) {
                b.unit(id, unit).map_err(|e| errors::build_error(py, &e))?;
            }
        }
        let divisor = match divisor {
            Some(d) => settings::divisor(py, &d)?,
            None => Divisor::Contributors,
        };
        b.bucket_cap_bytes(bucket_cap_bytes)
            .collective_timeout(Duration::from_secs_f64(timeout_s))
            .abort_policy(settings::policy(py, abort_policy)?)
            .wire_dtype(settings::wire(py, wire_dtype)?)
            .divisor(divisor)
            .record_timeline(record_timeline)
            .param_shards(param_shards)
            .reorder_buckets(reorder_buckets)
            .buddy_stride(buddy_stride);
        if let Some(membership) = &membership {
            b.joiner_waiting(membership.joiner_flag());
        }
        let transport = BucketTransport::new(
            rank,
            world,
            engine_for(py, communicator, in_flight)?,
            partitioned,
            reduce_scatter,
            buddy_stride > 0,
        )
        .ok_or_else(|| {
            let why = "this communicator cannot reduce-scatter: sharded gradients need gradsync.torch".to_string();
            errors::raise::<errors::ConfigError>(py, why, &[])
        })?;
        let device_plane = transport.on_device_plane();
        let store = transport.store();
        let sync = b.build(transport).map_err(|e| errors::build_error(py, &e))?;
        let batch = Arc::new(Mutex::new(Some(sync.hook().batch())));
        let params = Arc::new(Params { ids, numel: numels, elem, device_plane });
        Ok(Session { sync: Some(sync), batch, params, trace: record_timeline.then(ChromeTrace::new), store })
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

    /// The bucket plan as registered, in launch order: per bucket its element
    /// count and its members (parameter indices, back to back in that order).
    /// A partitioned session keeps it for good; otherwise it may be rebuilt
    /// in the order gradients arrive (`Step.buckets()` says which ran).
    fn plan(&mut self, py: Python<'_>) -> PyResult<Vec<(usize, Vec<usize>)>> {
        let plan = self.sync(py)?.plan();
        Ok((0..plan.num_buckets())
            .map(|b| (plan.bucket_numel(b), plan.bucket_params(b).iter().map(|p| p.index()).collect()))
            .collect())
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
    /// `addr`, for `step` (`None`: the open step). Among a step's arrivals of
    /// one parameter the highest `token` wins (use the hook's firing index);
    /// a repeated `token` is a duplicate.
    ///
    /// Low level: `addr` must be the data address of a live, contiguous CPU
    /// buffer with the parameter's element count and type, not written during
    /// the call (`gradsync.torch` checks the tensor it takes it from).
    #[pyo3(signature = (step, param, token, addr))]
    fn arrive_ptr(&self, py: Python<'_>, step: Option<u64>, param: usize, token: u64, addr: usize) -> PyResult<()> {
        self.refuse_on_device_plane(py)?;
        let step = self.step_or_open(py, step)?;
        let src = self.params.raw(param, addr)?;
        let values = if src.numel * 4 >= DETACH_BYTES { py.detach(|| Grad::copy_of(src)) } else { Grad::copy_of(src) };
        self.offer(py, |batch| batch.accumulated(step, self.params.ids[param], Token(token), values))
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

    /// The first half of `finish`: what is left of `step` launched and its
    /// agreement under way; the next `finish(step)` collects the result. A
    /// sharded rank calls it before it serves the others' parameter
    /// gathers, so that their reductions never wait for it meanwhile.
    fn begin_finish(&mut self, py: Python<'_>, step: u64) -> PyResult<()> {
        self.deliver(py)?;
        let sync = self.sync(py)?;
        py.detach(|| sync.begin_finish_step(step)).map_err(|e| errors::sync_error(py, &e))
    }

    /// The first half of `abort`, as `begin_finish` is of `finish`.
    fn begin_abort(&mut self, py: Python<'_>, step: u64, reason: Bound<'_, PyAny>) -> PyResult<()> {
        let reason = settings::abort_reason(py, &reason)?;
        self.deliver(py)?;
        let sync = self.sync(py)?;
        py.detach(|| sync.begin_abort_step(step, reason)).map_err(|e| errors::sync_error(py, &e))
    }

    /// Buffers for a sharded model's gathers: per `(bucket index, values,
    /// float64)` of `sizes`, a buffer of that many values (every rank's
    /// chunk of the bucket, back to back; a bucket index of `None`: every
    /// rank's partial gradient norm), where the buckets live.
    fn gather_buffers(&self, py: Python<'_>, sizes: Vec<(Option<usize>, usize, bool)>) -> PyResult<Gathers> {
        let mut buffers = Vec::with_capacity(sizes.len());
        for (index, numel, wide) in sizes {
            let dtype = if wide { DType::F64 } else { DType::F32 };
            let bucket = self.store.alloc_bucket(numel, 1, dtype).map_err(|e| {
                let why = format!("allocating a gather buffer of {numel} values: {e}");
                errors::raise::<errors::ConfigError>(py, why, &[])
            })?;
            buffers.push((index.map_or(GatherOf::Norm, GatherOf::Bucket), bucket));
        }
        Ok(Gathers::new(buffers))
    }

    /// Gather every rank's chunk into `gathers`' buffers (this rank's
    /// written into them first; see `GradSync::gather`). Waits with the
    /// interpreter released; a failure raises as a failed step does.
    fn gather(&mut self, py: Python<'_>, gathers: &Bound<'_, Gathers>) -> PyResult<()> {
        let mut gathers = gathers.borrow_mut();
        usable(py, &gathers)?;
        let slots = gathers.slots();
        if slots.iter().any(|slot| !matches!(slot, Slot::Held(..))) {
            let why = "a gather of one of these buffers is in flight: wait for it first".to_string();
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        let mut buffers: Vec<_> = slots
            .iter_mut()
            .filter_map(|slot| match std::mem::replace(slot, Slot::Gone) {
                Slot::Held(of, bucket) => Some((of, bucket)),
                _ => None,
            })
            .collect();
        let sync = self.sync(py)?;
        let outcome = py.detach(|| sync.gather(&mut buffers));
        let slots = gathers.slots();
        let lost = buffers.is_empty() && !slots.is_empty();
        for (slot, (of, bucket)) in slots.iter_mut().zip(buffers) {
            *slot = Slot::Held(of, bucket);
        }
        gathers.lost |= lost;
        outcome.map_err(|e| errors::sync_error(py, &e))
    }

    /// Start gathering buffer `index` of `gathers` alone (this rank's chunk
    /// written first) and return at once; :meth:`gather_wait` waits for it.
    /// Several may be in flight; each rank starts the same ones in the same
    /// order.
    fn gather_start(&mut self, py: Python<'_>, gathers: &Bound<'_, Gathers>, index: usize) -> PyResult<()> {
        let mut gathers = gathers.borrow_mut();
        usable(py, &gathers)?;
        let slot = slot_at(py, gathers.slots(), index)?;
        let Slot::Held(of, bucket) = std::mem::replace(slot, Slot::Gone) else {
            let why = format!("gather buffer {index} is already in flight");
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        };
        let sync = self.sync(py)?;
        match sync.start_gather(vec![(of, bucket)]) {
            Ok(pending) => {
                *slot_at(py, gathers.slots(), index)? = Slot::Out(pending);
                Ok(())
            }
            Err((mut back, e)) => {
                let (of, bucket) = back.pop().expect("a refused gather gives its buffer back");
                *slot_at(py, gathers.slots(), index)? = Slot::Held(of, bucket);
                Err(errors::sync_error(py, &e))
            }
        }
    }

    /// Wait for the gather of buffer `index` that :meth:`gather_start`
    /// began, with the interpreter released; a failure raises as a failed
    /// step does (the buffer is back either way, unless the runtime never
    /// answered: then :attr:`Gathers.lost`).
    fn gather_wait(&mut self, py: Python<'_>, gathers: &Bound<'_, Gathers>, index: usize) -> PyResult<()> {
        let mut gathers = gathers.borrow_mut();
        let slot = slot_at(py, gathers.slots(), index)?;
        let Slot::Out(pending) = std::mem::replace(slot, Slot::Gone) else {
            let why = format!("gather buffer {index} is not in flight: start it with gather_start");
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        };
        let sync = self.sync(py)?;
        let (mut back, outcome) = py.detach(|| sync.finish_gather(pending));
        match back.pop() {
            Some((of, bucket)) => *slot_at(py, gathers.slots(), index)? = Slot::Held(of, bucket),
            None => gathers.lost = true,
        }
        outcome.map_err(|e| errors::sync_error(py, &e))
    }

    /// This rank cannot finish `step` (`reason`: `"out_of_memory"`,
    /// `"bad_batch"`, `"non_finite"` or an integer code).
    fn abort(&mut self, py: Python<'_>, step: u64, reason: Bound<'_, PyAny>) -> PyResult<Step> {
        let reason = settings::abort_reason(py, &reason)?;
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
    /// to the other ranks' open step; returns that step (its report's outcome
    /// is `"all_joined"` once every rank shadowed it; when it applies, it
    /// lends the averages the others got). For torch's `Join` context
    /// manager, which counts the ranks still training itself.
    fn shadow_step(&mut self, py: Python<'_>) -> PyResult<Step> {
        self.deliver(py)?;
        let sync = self.sync(py)?;
        let result = py.detach(|| sync.shadow_step()).map_err(|e| errors::sync_error(py, &e))?;
        self.wrap(py, result)
    }

    /// The first half of `shadow_step`: this rank's zeros for the others'
    /// open step go out now, and the next `shadow_step` collects the
    /// result. A joined rank calls it before it serves the others' parameter
    /// gathers, so that their reductions never wait for it meanwhile.
    fn begin_shadow_step(&mut self, py: Python<'_>) -> PyResult<()> {
        self.deliver(py)?;
        let sync = self.sync(py)?;
        py.detach(|| sync.begin_shadow_step()).map_err(|e| errors::sync_error(py, &e))
    }

    /// After a failed step, on every rank: agree on the step to continue at.
    fn reset(&mut self, py: Python<'_>) -> PyResult<u64> {
        let sync = self.sync(py)?;
        py.detach(|| sync.reset()).map_err(|e| errors::sync_error(py, &e))
    }

    /// An elastic job's members changed (the communicator already holds
    /// this rank's new place, `rank` of `world`, keeping buddy copies
    /// `buddy_stride` ranks on when it keeps any): agree among the new
    /// members on the step to continue at, and on the plan. Returns that
    /// step and, under the partial policy when every member could, the
    /// failed step reduced again among them (finish it as any step's
    /// result), else `None` (the step is skipped on every member).
    #[pyo3(signature = (rank, world, buddy_stride = 1))]
    fn resume(
        &mut self,
        py: Python<'_>,
        rank: usize,
        world: usize,
        buddy_stride: usize,
    ) -> PyResult<(u64, Option<Step>)> {
        let sync = self.sync(py)?;
        let place = Place { rank, world, buddy_stride };
        let reset = py.detach(|| sync.reset_membership(place)).map_err(|e| errors::sync_error(py, &e))?;
        let redone = match reset.redone {
            Some(result) => Some(self.wrap(py, result)?),
            None => None,
        };
        Ok((reset.step, redone))
    }

    /// Divide the sum of every step that has not begun by `divisor`
    /// (`"contributors"`, `"world"`, `"sum"` or an integer); every rank at
    /// the same point (it joins each step's control vote).
    fn set_divisor(&mut self, py: Python<'_>, divisor: Bound<'_, PyAny>) -> PyResult<()> {
        let divisor = settings::divisor(py, &divisor)?;
        let sync = self.sync(py)?;
        py.detach(|| sync.set_divisor(divisor)).map_err(|e| errors::sync_error(py, &e))
    }

    /// Send data buckets as `wire` (`"float32"`, `"bfloat16"`, `"float16"`)
    /// from the first step on: only before the first bucket is launched, on
    /// every rank (the plan agreement runs again).
    fn set_wire_dtype(&mut self, py: Python<'_>, wire: &str) -> PyResult<()> {
        let wire = settings::wire(py, wire)?;
        let sync = self.sync(py)?;
        py.detach(|| sync.set_wire_dtype(wire)).map_err(|e| errors::sync_error(py, &e))
    }

    /// The current step's progress: buckets launched and reduced, parameters
    /// ready (the arrivals held in the batch delivered first).
    fn progress<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.deliver(py)?;
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

    /// Back-pressure: wait until at most `in_flight_at_most` of the current
    /// step's buckets are still in their collective (or the step failed or
    /// ended), at most `within_s` seconds; whether that point was reached.
    fn await_in_flight(&mut self, py: Python<'_>, in_flight_at_most: usize, within_s: f64) -> PyResult<bool> {
        if !within_s.is_finite() || within_s < 0.0 {
            let why = format!("within_s={within_s}: give the longest wait in seconds, 0 or more");
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        let within = std::time::Duration::from_secs_f64(within_s);
        // (A bucket's last arrival may sit in the batch: its plan-order end arrived earlier.)
        self.deliver(py)?;
        let sync = self.sync(py)?;
        let reached =
            py.detach(|| sync.await_in_flight(in_flight_at_most, within)).map_err(|e| errors::sync_error(py, &e))?;
        Ok(reached.is_some())
    }

    /// Write every recorded step's timeline as Chrome trace JSON (Perfetto);
    /// needs `record_timeline=True`.
    fn write_timeline(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<usize> {
        let Some(trace) = &self.trace else {
            return Err(errors::raise::<errors::ConfigError>(
                py,
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
        let Some(sync) = self.sync.take() else { return };
        if closing::interpreter_is_ending() {
            // Left to the process: a collective forgotten after a failure may
            // still be written into by gloo until its group is destroyed,
            // and the groups go down in any order at shutdown; freeing the
            // runtime's buckets under them corrupts the heap.
            std::mem::forget(sync);
            return;
        }
        // Dropped by the garbage collector with the interpreter held: the
        // communicator thread may be waiting for it, so join elsewhere.
        closing::in_background(sync);
    }
}

/// Refuse buffers an earlier gather lost.
fn usable(py: Python<'_>, gathers: &Gathers) -> PyResult<()> {
    if gathers.lost {
        let why = "these gather buffers were lost with an earlier gather: allocate new ones".to_string();
        return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
    }
    Ok(())
}

/// Slot `index` of `slots`, or an error naming how many there are.
fn slot_at<'s>(py: Python<'_>, slots: &'s mut [Slot], index: usize) -> PyResult<&'s mut Slot> {
    let count = slots.len();
    slots.get_mut(index).ok_or_else(|| {
        let why = format!("gather buffer {index} asked for, and there are {count}");
        errors::raise::<errors::ConfigError>(py, why, &[])
    })
}
