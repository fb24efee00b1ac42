//! Collectives on torch's gloo engine without the interpreter: the C
//! function table of `gradsync.torch._collectives` (python/shim/collectives.cpp),
//! called from the communicator thread.
//!
//! ```text
//! communicator.native() ── (table address, endpoint address) ──▶ NativeGloo
//! NativeGloo::start ─▶ table.start(endpoint, addr, …) ─▶ Flight   (c10d allreduce, no GIL)
//! NativeGloo::finish ─▶ table.finish(flight)                       (wait, copy back, scale)
//! ```
//!
//! The endpoint belongs to the Python communicator (it keeps the group and the
//! store alive); [`crate::transport::PyTransport`] holds that communicator for
//! as long as it holds the address, and reads the address again after every
//! reset (the only time Python replaces the endpoint).

use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::time::{Duration, Instant};

use gradsync_runtime::backend::CollectiveTag;

/// The version of [`Table`] this side speaks (the shim's `kVersion`).
pub const TABLE_VERSION: u32 = 3;

/// Bytes for one error message from the shim.
const ERROR_BYTES: usize = 2048;

/// The shim's function table (its `Table`, field for field).
#[repr(C)]
pub struct Table {
    version: u32,
    #[allow(clippy::type_complexity)]
    start: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        i64,
        i32,
        f32,
        i64,
        *mut *mut c_void,
        *mut i64,
        *mut c_char,
        usize,
    ) -> i32,
    finish: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32,
    forget: unsafe extern "C" fn(*mut c_void),
}

/// What a collective sums: float32 buckets and corrections, control words
/// (summed as int64), or a bucket staged in its half-width wire type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Words {
    F32,
    I64,
    BF16,
    F16,
}

impl Words {
    /// The name the Python communicator knows the type by.
    pub fn label(self) -> &'static str {
        match self {
            Words::F32 => "float32",
            Words::I64 => "int64",
            Words::BF16 => "bfloat16",
            Words::F16 => "float16",
        }
    }

    /// The shim's element code (its `Elem`).
    fn code(self) -> i32 {
        match self {
            Words::F32 => 0,
            Words::I64 => 1,
            Words::BF16 => 2,
            Words::F16 => 3,
        }
    }
}

/// One started collective: the shim's Flight, its tag, its place in the
/// epoch and start time.
#[derive(Debug)]
struct Flight {
    handle: *mut c_void,
    tag: CollectiveTag,
    seq: i64,
    started: Instant,
}

/// A collective that failed in the shim: what gloo said, for the Python side
/// to turn into a typed failure.
#[derive(Debug)]
pub struct ShimError {
    pub tag: CollectiveTag,
    /// The failed collective's place in its epoch (the `seq` of the position
    /// it wrote): the ranks whose position is before it never joined it.
    pub seq: i64,
    pub message: String,
    pub waited: Duration,
}

/// The communicator thread's native path (see the module docs).
#[derive(Debug)]
pub struct NativeGloo {
    table: &'static Table,
    /// The Python-owned `Endpoint` of the current group.
    endpoint: usize,
    /// Started collectives, oldest first.
    flights: VecDeque<Flight>,
}

// SAFETY: the table is immutable static data of the shim, the endpoint is
// only used from the thread that owns this value (the communicator thread,
// one at a time), and each Flight is an owned heap object of the shim that
// no other thread touches.
unsafe impl Send for NativeGloo {}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("version", &self.version).finish_non_exhaustive()
    }
}

impl NativeGloo {
    /// The shim at `table` (an address from `_collectives.table()`, which
    /// lives as long as the process, since Python never unloads an extension
    /// module) over the endpoint at `endpoint`.
    ///
    /// # Safety
    /// `table` must be the address `_collectives.table()` returned and
    /// `endpoint` the address of an `Endpoint` the caller keeps alive.
    pub unsafe fn new(table: usize, endpoint: usize) -> Result<NativeGloo, String> {
        // SAFETY: the caller vouches that `table` is the shim's static table.
        let table: &'static Table = unsafe { &*(table as *const Table) };
        if table.version != TABLE_VERSION {
            return Err(format!("the shim speaks version {}, this runtime {TABLE_VERSION}", table.version));
        }
        Ok(NativeGloo { table, endpoint, flights: VecDeque::new() })
    }

    /// Use the endpoint at `endpoint` from now on (after a reset).
    pub fn set_endpoint(&mut self, endpoint: usize) {
        self.endpoint = endpoint;
    }

    /// Collectives started and not finished.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Start summing `numel` `words` at `addr` over every rank, scaled by
    /// `factor` when finished (float32 only).
    pub fn start(
        &mut self,
        tag: CollectiveTag,
        addr: usize,
        numel: usize,
        words: Words,
        factor: f32,
        timeout: Duration,
    ) -> Result<(), ShimError> {
        let started = Instant::now();
        let timeout_ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX).max(1);
        let mut handle = std::ptr::null_mut();
        let mut seq = 0i64;
        let mut err = [0 as c_char; ERROR_BYTES];
        // SAFETY: the endpoint is alive (see `new`); `addr` holds `numel`
        // elements of `words` until this collective is finished or forgotten
        // (the runtime's contract with its transport); `handle`, `seq` and
        // `err` outlive the call.
        let rc = unsafe {
            (self.table.start)(
                self.endpoint as *mut c_void,
                addr as *mut c_void,
                numel as i64,
                words.code(),
                factor,
                timeout_ms,
                &mut handle,
                &mut seq,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            return Err(ShimError { tag, seq, message: message(&err), waited: started.elapsed() });
        }
        self.flights.push_back(Flight { handle, tag, seq, started });
        Ok(())
    }

    /// Finish the oldest started collective (none: nothing to do).
    pub fn finish_oldest(&mut self) -> Result<(), ShimError> {
        let Some(flight) = self.flights.pop_front() else { return Ok(()) };
        let mut err = [0 as c_char; ERROR_BYTES];
        // SAFETY: `flight.handle` came from `start` and is finished once;
        // `finish` frees it whatever the outcome.
        let rc = unsafe { (self.table.finish)(flight.handle, err.as_mut_ptr(), err.len()) };
        if rc != 0 {
            return Err(ShimError {
                tag: flight.tag,
                seq: flight.seq,
                message: message(&err),
                waited: flight.started.elapsed(),
            });
        }
        Ok(())
    }

    /// Forget every started collective without waiting (after a failure).
    pub fn forget_all(&mut self) {
        for flight in self.flights.drain(..) {
            // SAFETY: each handle came from `start` and is freed once.
            unsafe { (self.table.forget)(flight.handle) };
        }
    }
}

impl Drop for NativeGloo {
    fn drop(&mut self) {
        self.forget_all();
    }
}

fn message(err: &[c_char]) -> String {
    // SAFETY: the shim writes a NUL-terminated string into `err` (and the
    // buffer starts zeroed, so an untouched one is empty).
    let text = unsafe { CStr::from_ptr(err.as_ptr()) };
    text.to_string_lossy().into_owned()
}
