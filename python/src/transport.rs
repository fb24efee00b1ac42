//! A [`Transport`] whose collectives run in Python, through an object with
//! the communicator protocol of `gradsync.torch` (`torch.distributed` gloo on
//! CPU): the runtime's communicator thread attaches to the interpreter for
//! each collective and hands the bucket over as an address, which the Python
//! side wraps as a tensor without copying.
//!
//! ```text
//! comm thread ── attach ──▶ communicator.all_reduce(addr, numel, "f32", factor, tag, kind, timeout_s)
//!             ◀── ok / _CollectiveFailed(kind, missing, peer) ──┘   (GIL released while gloo waits)
//! ```
//!
//! When the communicator offers a native path (`communicator.native()`
//! returns the addresses of `gradsync.torch._collectives`' function table and
//! endpoint), collectives skip Python altogether: the thread calls torch's
//! gloo engine through [`NativeGloo`] without the interpreter lock, and
//! attaches only to name the culprits of a failure and to reset.
//!
//! The bucket is one contiguous piece ([`Transport::pieces`] is 1), so the
//! address covers it whole. Collectives may overlap: `start` launches one and
//! returns, `wait_oldest` finishes the oldest, up to `window` at a time. The
//! communicator must not keep the tensor it makes after the collective finished.
//!
//! **Wire types.** A host bucket that travels as bfloat16 or float16
//! ([`Transport::set_wire`]) is rounded here into a half-width buffer of this
//! transport's before the collective starts; the communicator (native or
//! Python) sums whatever element type it is handed, and the sum is widened
//! back into the bucket when it finishes. A device-plane bucket is rounded
//! and widened by the shim on the device (python/shim/collectives.cpp,
//! `start_tensor`). Control words and corrections always travel as they are.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use gradsync_runtime::backend::{CollectiveKind, CollectiveTag, CommError, Transport};
use gradsync_runtime::Wire;
use half::{bf16, f16};
use pyo3::prelude::*;

use crate::collectives::{NativeGloo, ShimError, Words};
use crate::errors;
use crate::plane::DevicePlane;
use crate::tensor_grads::{Bucket, TensorGrads};

/// One collective as the runtime asks for it: `numel` `words` at `addr`,
/// summed over every rank, then scaled by `factor`, by `deadline`.
#[derive(Clone, Copy, Debug)]
struct Collective {
    tag: CollectiveTag,
    addr: usize,
    numel: usize,
    words: Words,
    factor: f64,
    deadline: Instant,
    /// A device-plane bucket (the shim's `Bucket*`): summed on the data group,
    /// converted to the wire type by the shim; `addr` is unused.
    tensor: Option<usize>,
}

impl Collective {
    /// A bucket (one contiguous piece: [`Transport::pieces`] is 1), summed
    /// in its own element type.
    fn bucket(tag: CollectiveTag, bucket: &mut Bucket, factor: f64, deadline: Instant) -> Self {
        let host = |addr: usize, numel: usize, words: Words| Collective {
            tag,
            addr,
            numel,
            words,
            factor,
            deadline,
            tensor: None,
        };
        match bucket {
            Bucket::Host(bucket) => {
                let piece = bucket.piece_mut(0);
                host(piece.as_mut_ptr() as usize, piece.len(), Words::F32)
            }
            Bucket::Wide(bucket) => {
                let piece = bucket.piece_mut(0);
                host(piece.as_mut_ptr() as usize, piece.len(), Words::F64)
            }
            Bucket::Plane(bucket) => Collective {
                tag,
                addr: 0,
                numel: bucket.numel(),
                words: if bucket.is_wide() { Words::F64 } else { Words::F32 },
                factor,
                deadline,
                tensor: Some(bucket.address()),
            },
        }
    }

    /// Time from `now` to the deadline; at least a millisecond, so a late
    /// collective still gets a deadline gloo accepts.
    fn time_left(&self, now: Instant) -> Duration {
        self.deadline.saturating_duration_since(now).max(Duration::from_millis(1))
    }

    /// This collective's data moved into `staged` (rounded to its wire type):
    /// the collective now sums that buffer, unscaled; [`Staged::finish`]
    /// widens and scales the sum back into the bucket.
    fn staged(self, staged: &mut Staged) -> Self {
        Collective { addr: staged.wire.as_mut_ptr() as usize, words: staged.words, factor: 1.0, ..self }
    }

    /// Control words, summed as int64: two's complement makes the wrapping
    /// sums identical.
    fn words(tag: CollectiveTag, words: &mut [u64], deadline: Instant) -> Self {
        Collective {
            tag,
            addr: words.as_mut_ptr() as usize,
            numel: words.len(),
            words: Words::I64,
            factor: 1.0,
            deadline,
            tensor: None,
        }
    }
}

/// A data bucket's half-width copy while its collective runs.
#[derive(Debug)]
struct Staged {
    /// The bucket's values rounded to the wire type (bf16 or f16 bits).
    wire: Vec<u16>,
    words: Words,
    /// The bucket: `numel` values (float64 when `wide`, else float32) the
    /// sum is widened back into.
    bucket: usize,
    numel: usize,
    wide: bool,
    factor: f64,
}

impl Staged {
    /// Round the `c.numel` float values at `c.addr` to `wire`.
    fn start(c: &Collective, wire: Wire) -> Staged {
        let wide = c.words == Words::F64;
        let (wire, words) = if wide {
            // SAFETY: `c.addr` holds the bucket's `c.numel` float64 values (one
            // piece, `Collective::bucket`), owned by the runtime and untouched
            // by anyone else until this collective is finished or forgotten.
            let values = unsafe { std::slice::from_raw_parts(c.addr as *const f64, c.numel) };
            match wire {
                Wire::BF16 => (values.iter().map(|&x| bf16::from_f64(x).to_bits()).collect(), Words::BF16),
                Wire::F16 => (values.iter().map(|&x| f16::from_f64(x).to_bits()).collect(), Words::F16),
                Wire::F32 => unreachable!("buckets travel as they are on a float32 wire"),
            }
        } else {
            // SAFETY: as above, for float32 values.
            let values = unsafe { std::slice::from_raw_parts(c.addr as *const f32, c.numel) };
            match wire {
                Wire::BF16 => (values.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(), Words::BF16),
                Wire::F16 => (values.iter().map(|&x| f16::from_f32(x).to_bits()).collect(), Words::F16),
                Wire::F32 => unreachable!("buckets travel as they are on a float32 wire"),
            }
        };
        Staged { wire, words, bucket: c.addr, numel: c.numel, wide, factor: c.factor }
    }

    /// Widen the summed wire values back into the bucket, scaled.
    fn finish(self) {
        let widen: fn(u16) -> f64 = match self.words {
            Words::BF16 => |h| bf16::from_bits(h).to_f64(),
            _ => |h| f16::from_bits(h).to_f64(),
        };
        if self.wide {
            // SAFETY: as in `start`: the bucket is still the runtime's and
            // untouched until this collective is reported finished.
            let out = unsafe { std::slice::from_raw_parts_mut(self.bucket as *mut f64, self.numel) };
            for (o, &h) in out.iter_mut().zip(&self.wire) {
                *o = widen(h) * self.factor;
            }
        } else {
            // SAFETY: as above, for float32 values.
            let out = unsafe { std::slice::from_raw_parts_mut(self.bucket as *mut f32, self.numel) };
            let factor = self.factor as f32;
            for (o, &h) in out.iter_mut().zip(&self.wire) {
                // A half value is exact in float32: the same product as before.
                *o = widen(h) as f32 * factor;
            }
        }
    }
}

/// One rank's endpoint over a Python communicator.
#[derive(Debug)]
pub struct PyTransport {
    rank: usize,
    world: usize,
    /// Has `all_reduce`, `start`, `wait_oldest`, `discard` and `reset` (see
    /// `gradsync.torch._comm`).
    communicator: Py<PyAny>,
    /// Collectives that may be in flight at once.
    window: usize,
    /// Tags and start times of the collectives started in Python, oldest first.
    started: VecDeque<(CollectiveTag, Instant)>,
    /// The native path, when the communicator has one.
    native: Option<NativeGloo>,
    /// The type data buckets travel in.
    wire: Wire,
    /// Per collective started and not finished, oldest first: its staged
    /// half-width copy, if it has one.
    staged: VecDeque<Option<Staged>>,
    /// Where buckets live when they are on the device plane (the
    /// communicator's `plane()`; `None`: host memory).
    plane: Option<DevicePlane>,
}

impl PyTransport {
    /// The transport over `communicator`; its native path is taken when it
    /// offers one (`native()` returning addresses rather than `None`).
    pub fn new(py: Python<'_>, rank: usize, world: usize, communicator: Py<PyAny>, window: usize) -> PyResult<Self> {
        let native = match native_addresses(py, &communicator)? {
            // SAFETY: `native()` returns the shim's table and an endpoint the
            // communicator keeps until its next reset, and this transport
            // holds the communicator.
            Some((table, endpoint)) => Some(unsafe { NativeGloo::new(table, endpoint) }.map_err(|why| {
                errors::raise(py, "ConfigError", format!("gradsync.torch._collectives: {why}; reinstall gradsync"), &[])
            })?),
            None => None,
        };
        let plane = match plane_addresses(py, &communicator)? {
            // SAFETY: `plane()` returns the shim's table and a Plane the
            // communicator keeps for its whole life, and this transport (and
            // the session whose store copies it) holds the communicator.
            Some((table, plane)) => Some(unsafe { DevicePlane::new(table, plane) }.map_err(|why| {
                errors::raise(py, "ConfigError", format!("gradsync.torch._collectives: {why}; reinstall gradsync"), &[])
            })?),
            None => None,
        };
        if plane.is_some() && native.is_none() {
            let why = "buckets on the device need gradsync's C++ collectives (communicator.native())".to_string();
            return Err(errors::raise(py, "ConfigError", why, &[]));
        }
        Ok(PyTransport {
            rank,
            world,
            communicator,
            window: window.max(1),
            started: VecDeque::new(),
            native,
            wire: Wire::F32,
            staged: VecDeque::new(),
            plane,
        })
    }

    /// Whether buckets live on the device plane.
    pub fn on_device_plane(&self) -> bool {
        self.plane.is_some()
    }

    /// Call `method` for collective `c` in Python.
    fn call(&self, method: &str, c: Collective) -> Result<(), CommError> {
        let started = Instant::now();
        let timeout = c.time_left(started);
        Python::attach(|py| {
            let args = (
                c.addr,
                c.numel,
                c.words.label(),
                c.factor,
                c.tag.to_string(),
                c.tag.kind.label(),
                timeout.as_secs_f64(),
            );
            self.communicator
                .call_method1(py, method, args)
                .map(|_| ())
                .map_err(|e| self.translate(py, e, c.tag, started.elapsed()))
        })
    }

    /// Start collective `c`: the whole of it with a window of one (nothing
    /// stays in flight), otherwise start it and remember it for
    /// `wait_oldest`.
    fn start(&mut self, c: Collective) -> Result<(), CommError> {
        if self.window == 1 {
            return self.whole(c);
        }
        let c = self.stage(c);
        if self.native.is_some() {
            return self.start_native(c);
        }
        if let Err(e) = self.call("start", c) {
            self.staged.pop_back();
            return Err(e);
        }
        self.started.push_back((c.tag, Instant::now()));
        Ok(())
    }

    /// Collective `c`, started and finished (natively, every earlier one
    /// finishes first: gloo completes them in order anyway).
    fn whole(&mut self, c: Collective) -> Result<(), CommError> {
        let c = self.stage(c);
        if self.native.is_none() {
            let outcome = self.call("all_reduce", c);
            self.unstage(outcome.is_ok());
            return outcome;
        }
        self.start_native(c)?;
        while self.native.as_ref().is_some_and(|n| n.in_flight() > 0) {
            self.finish_native()?;
        }
        Ok(())
    }

    /// Stage `c` in its wire type when it is a data bucket that travels
    /// narrower than float32 (see the module docs); remember either way, so
    /// the collective's finish knows.
    fn stage(&mut self, c: Collective) -> Collective {
        if self.wire == Wire::F32 || !matches!(c.tag.kind, CollectiveKind::Bucket { .. }) {
            self.staged.push_back(None);
            return c;
        }
        if c.tensor.is_some() {
            // A device bucket is rounded and widened on the device, by the shim.
            self.staged.push_back(None);
            let words = if self.wire == Wire::BF16 { Words::BF16 } else { Words::F16 };
            return Collective { words, ..c };
        }
        let mut staged = Staged::start(&c, self.wire);
        let c = c.staged(&mut staged);
        self.staged.push_back(Some(staged));
        c
    }

    /// The oldest collective finished (`ok`) or failed: widen its staged sum
    /// back into the bucket, or drop it.
    fn unstage(&mut self, ok: bool) {
        if let Some(Some(staged)) = self.staged.pop_front() {
            if ok {
                staged.finish();
            }
        }
    }

    /// Start collective `c` on the native path.
    fn start_native(&mut self, c: Collective) -> Result<(), CommError> {
        let Some(native) = &mut self.native else { return Ok(()) };
        let timeout = c.time_left(Instant::now());
        let started = match (c.tensor, &self.plane) {
            (Some(bucket), Some(plane)) => {
                native.start_tensor(c.tag, plane.address(), bucket, c.words, c.factor, timeout)
            }
            _ => native.start(c.tag, c.addr, c.numel, c.words, c.factor, timeout),
        };
        match started {
            Ok(()) => Ok(()),
            Err(e) => {
                // Never started: it will not be finished.
                self.staged.pop_back();
                Err(self.failure(e))
            }
        }
    }

    /// Finish the oldest native collective.
    fn finish_native(&mut self) -> Result<(), CommError> {
        let Some(native) = &mut self.native else { return Ok(()) };
        let outcome = native.finish_oldest();
        self.unstage(outcome.is_ok());
        outcome.map_err(|e| self.failure(e))
    }

    /// A native failure as the runtime's error: the communicator's
    /// `failure(message, tag, seq)` reads the store positions and classifies
    /// it against the failed collective's position.
    fn failure(&self, e: ShimError) -> CommError {
        Python::attach(|py| {
            match self.communicator.call_method1(py, "failure", (e.message.as_str(), e.tag.to_string(), e.seq)) {
                Ok(failed) => self.classify(failed.bind(py), e.tag, e.waited),
                Err(err) => self.translate(py, err, e.tag, e.waited),
            }
        })
    }

    /// A Python failure as the runtime's error (see [`PyTransport::classify`]).
    fn translate(&self, py: Python<'_>, e: PyErr, tag: CollectiveTag, waited: Duration) -> CommError {
        self.classify(e.value(py).as_any(), tag, waited)
    }

    /// The communicator's `_CollectiveFailed` (with `kind` `"timeout"`,
    /// `"peer_gone"` or `"backend"`, `missing` and `peer`) as the runtime's
    /// error; anything else is a backend error.
    fn classify(&self, value: &Bound<'_, PyAny>, tag: CollectiveTag, waited: Duration) -> CommError {
        let rank = self.rank;
        let kind: Option<String> = value.getattr("kind").ok().and_then(|k| k.extract().ok());
        let why = value.str().map(|s| s.to_string()).unwrap_or_else(|_| "unprintable error".into());
        match kind.as_deref() {
            Some("timeout") => {
                let missing = value.getattr("missing").ok().and_then(|m| m.extract().ok()).unwrap_or_default();
                CommError::Timeout { rank, tag, missing, waited }
            }
            Some("peer_gone") => match value.getattr("peer").ok().and_then(|p| p.extract::<usize>().ok()) {
                Some(peer) => CommError::PeerGone { rank, peer, tag },
                None => CommError::Backend { rank, tag, why },
            },
            _ => CommError::Backend { rank, tag, why },
        }
    }
}

impl Transport for PyTransport {
    type Store = TensorGrads;

    fn store(&self) -> TensorGrads {
        TensorGrads::new(self.plane)
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    /// One contiguous piece per bucket: the communicator sees one tensor.
    fn pieces(&self) -> usize {
        1
    }

    fn all_reduce_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut Bucket,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.whole(Collective::bucket(tag, bucket, factor, deadline))
    }

    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.whole(Collective::words(tag, words, deadline))
    }

    fn max_in_flight(&self) -> usize {
        self.window
    }

    /// gloo sums any of them; the conversion is [`Staged`]'s.
    fn wires(&self) -> &'static [Wire] {
        &[Wire::F32, Wire::BF16, Wire::F16]
    }

    fn set_wire(&mut self, wire: Wire) {
        self.wire = wire;
    }

    /// Buckets are averaged while they are packed (as DDP divides before its
    /// all-reduce), so the communicator thread only sums: a separate
    /// `mul_` over every bucket would cost it a full pass over the bytes.
    fn scale_when_packing(&self) -> bool {
        true
    }

    fn start_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut Bucket,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError> {
        self.start(Collective::bucket(tag, bucket, factor, deadline))
    }

    fn start_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.start(Collective::words(tag, words, deadline))
    }

    fn wait_oldest(&mut self) -> Result<(), CommError> {
        if self.native.is_some() {
            return self.finish_native();
        }
        // Nothing started with a window of one: `start_*` ran the whole collective.
        let Some((tag, started)) = self.started.pop_front() else { return Ok(()) };
        let outcome = Python::attach(|py| {
            self.communicator
                .call_method0(py, "wait_oldest")
                .map(|_| ())
                .map_err(|e| self.translate(py, e, tag, started.elapsed()))
        });
        self.unstage(outcome.is_ok());
        outcome
    }

    fn discard_in_flight(&mut self) {
        self.started.clear();
        self.staged.clear();
        if let Some(native) = &mut self.native {
            return native.forget_all();
        }
        let outcome = Python::attach(|py| self.communicator.call_method0(py, "discard").map(|_| ()));
        if let Err(e) = outcome {
            tracing::error!(rank = self.rank, error = %e, "the communicator could not discard its collectives");
        }
    }

    fn reset(&mut self) {
        self.staged.clear();
        if let Some(native) = &mut self.native {
            native.forget_all();
        }
        let outcome = Python::attach(|py| {
            self.communicator.call_method0(py, "reset")?;
            // An elastic job's new membership: the communicator's place in it.
            let communicator = self.communicator.bind(py);
            self.rank = communicator.getattr("rank")?.extract()?;
            self.world = communicator.getattr("world")?.extract()?;
            // The new group has a new endpoint; the old one is gone with it.
            if let (Some(native), Some((_, endpoint))) = (&mut self.native, native_addresses(py, &self.communicator)?) {
                native.set_endpoint(endpoint);
            }
            Ok::<_, PyErr>(())
        });
        if let Err(e) = outcome {
            // The reset agreement that follows fails and reports it.
            tracing::error!(rank = self.rank, error = %e, "the communicator could not start a new epoch");
        }
    }
}

/// `(table, plane)` addresses when the communicator keeps buckets on the
/// device plane.
fn plane_addresses(py: Python<'_>, communicator: &Py<PyAny>) -> PyResult<Option<(usize, usize)>> {
    let communicator = communicator.bind(py);
    if !communicator.hasattr("plane")? {
        return Ok(None);
    }
    communicator.call_method0("plane")?.extract()
}

/// `(table, endpoint)` addresses when the communicator has a native path.
fn native_addresses(py: Python<'_>, communicator: &Py<PyAny>) -> PyResult<Option<(usize, usize)>> {
    let communicator = communicator.bind(py);
    if !communicator.hasattr("native")? {
        return Ok(None);
    }
    communicator.call_method0("native")?.extract()
}
