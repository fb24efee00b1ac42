//! Collectives on torch's gloo engine without the interpreter: the C
//! function table of `gradsync.torch._collectives` (python/shim/collectives.cpp),
//! called from the communicator thread.
//!
//! ```text
//! communicator.native() ── (table address, endpoint address) ──▶ NativeGloo
//! NativeGloo::start ─▶ table.start(endpoint, addr, …) ─▶ Flight   (c10d allreduce, no GIL)
//! NativeGloo::finish ─▶ table.finish(flight)                       (wait, copy back, scale)
//! a failure          ─▶ table.behind(endpoint, seq)                (who never reached it: the store's positions)
//! ```
//!
//! The endpoint belongs to the Python communicator (it keeps the group and the
//! store alive); [`crate::transport::NativeEngine`] holds that communicator for
//! as long as it holds the address, and reads the address again after every
//! reset (the only time Python replaces the endpoint).

use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::time::{Duration, Instant};

use gradsync_runtime::backend::CollectiveTag;

/// What a collective does with its memory (the shim's `op`: `kAllReduce`,
/// `kReduceScatter`, `kAllGather` in python/shim/shim.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Every rank gets the sum.
    AllReduce = 0,
    /// Each rank gets the sum of its chunk only (a sharded model's buckets).
    ReduceScatter = 1,
    /// Every rank's chunk lands in every rank's memory (a sharded model's parameters).
    AllGather = 2,
}

/// The version of [`Table`] this side speaks (the shim's `kVersion`).
pub const TABLE_VERSION: u32 = 10;

/// Bytes for one error message from the shim.
const ERROR_BYTES: usize = 2048;

/// A shim error message buffer.
pub(crate) type ErrorText = [c_char; ERROR_BYTES];

/// An empty error message buffer.
pub(crate) fn error_text() -> ErrorText {
    [0; ERROR_BYTES]
}

/// The shim's function table (its `Table`, field for field). The fields
/// after `forget` are the device plane's (python/src/plane.rs).
#[repr(C)]
#[allow(clippy::type_complexity)]
pub struct Table {
    version: u32,
    #[allow(clippy::type_complexity)]
    start: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        i64,
        i32,
        f64,
        i32,
        i64,
        i64,
        *mut *mut c_void,
        *mut i64,
        *mut c_char,
        usize,
    ) -> i32,
    finish: unsafe extern "C" fn(*mut c_void, *mut c_char, usize) -> i32,
    forget: unsafe extern "C" fn(*mut c_void),
    start_tensor: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        *mut c_void,
        i32,
        f64,
        i32,
        i64,
        i64,
        *mut *mut c_void,
        *mut i64,
        *mut c_char,
        usize,
    ) -> i32,
    pub(crate) alloc: unsafe extern "C" fn(*mut c_void, i64, i32, *mut *mut c_void, *mut c_char, usize) -> i32,
    pub(crate) free: unsafe extern "C" fn(*mut c_void),
    pub(crate) pack:
        unsafe extern "C" fn(*mut c_void, *mut c_void, i64, *mut c_void, i32, f64, *mut c_char, usize) -> i32,
    pub(crate) difference:
        unsafe extern "C" fn(*mut c_void, *mut c_void, i64, *mut c_void, *mut c_void, *mut c_char, usize) -> i32,
    pub(crate) scale: unsafe extern "C" fn(*mut c_void, *mut c_void, i64, i64, f64, *mut c_char, usize) -> i32,
    pub(crate) add_from:
        unsafe extern "C" fn(*mut c_void, *mut c_void, i64, *mut c_void, i64, i64, *mut c_char, usize) -> i32,
    pub(crate) sum:
        unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, *mut *mut c_void, *mut c_char, usize) -> i32,
    pub(crate) release_given: unsafe extern "C" fn(*mut c_void),
    // The membership store and cancellation (python/src/membership.rs).
    pub(crate) store_add:
        unsafe extern "C" fn(*mut c_void, *const c_char, usize, i64, *mut i64, *mut c_char, usize) -> i32,
    pub(crate) store_set:
        unsafe extern "C" fn(*mut c_void, *const c_char, usize, *const u8, usize, *mut c_char, usize) -> i32,
    pub(crate) store_get: unsafe extern "C" fn(
        *mut c_void,
        *const c_char,
        usize,
        *mut i32,
        *mut u8,
        usize,
        *mut usize,
        *mut c_char,
        usize,
    ) -> i32,
    pub(crate) store_compare_set: unsafe extern "C" fn(
        *mut c_void,
        *const c_char,
        usize,
        *const u8,
        usize,
        *const u8,
        usize,
        *mut u8,
        usize,
        *mut usize,
        *mut c_char,
        usize,
    ) -> i32,
    pub(crate) cancel_epoch: unsafe extern "C" fn(*mut c_void, i64),
    // Which ranks never reached a failed collective (its `seq`).
    behind: unsafe extern "C" fn(*mut c_void, i64, *mut i64, usize, *mut usize) -> i32,
    // The membership store's batched read (keys concatenated, their lengths), ledgers and waits.
    pub(crate) store_counters:
        unsafe extern "C" fn(*mut c_void, *const c_char, *const usize, usize, *mut i64, *mut c_char, usize) -> i32,
    pub(crate) store_append:
        unsafe extern "C" fn(*mut c_void, *const c_char, usize, *const u8, usize, *mut c_char, usize) -> i32,
    pub(crate) store_wait:
        unsafe extern "C" fn(*mut c_void, *const c_char, usize, i64, *mut i32, *mut c_char, usize) -> i32,
}

/// What the shim's functions return (its `Outcome`): done, failed, or cut
/// short by a broken membership epoch.
const CANCELLED: i32 = 2;

impl Table {
    /// The shim's table at `table` (an address from `_collectives.table()`,
    /// which lives as long as the process: Python never unloads an
    /// extension module), if it speaks this side's version.
    ///
    /// # Safety
    /// `table` must be the address `_collectives.table()` returned.
    pub unsafe fn at(table: usize) -> Result<&'static Table, String> {
        // SAFETY: the caller vouches that `table` is the shim's static table.
        let table: &'static Table = unsafe { &*(table as *const Table) };
        if table.version != TABLE_VERSION {
            return Err(format!("the shim speaks version {}, this runtime {TABLE_VERSION}", table.version));
        }
        Ok(table)
    }
}

/// What a collective sums: float32 or float64 buckets and corrections,
/// control words (summed as int64), or a bucket staged in its half-width wire type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Words {
    F32,
    I64,
    BF16,
    F16,
    F64,
}

impl Words {
    /// The name the Python communicator knows the type by.
    pub fn label(self) -> &'static str {
        match self {
            Words::F32 => "float32",
            Words::I64 => "int64",
            Words::BF16 => "bfloat16",
            Words::F16 => "float16",
            Words::F64 => "float64",
        }
    }

    /// The shim's element code (its `Elem`).
    pub(crate) fn code(self) -> i32 {
        match self {
            Words::F32 => 0,
            Words::I64 => 1,
            Words::BF16 => 2,
            Words::F16 => 3,
            Words::F64 => 4,
        }
    }
}

/// One started collective: the shim's Flight, its tag, its place in the
/// epoch, start time and deadline.
#[derive(Debug)]
struct Flight {
    handle: *mut c_void,
    tag: CollectiveTag,
    seq: i64,
    started: Instant,
    timeout: Duration,
}

/// A collective that failed in the shim, as facts (classified by
/// `gradsync_runtime::backend::Failure`).
#[derive(Debug)]
pub struct ShimError {
    pub tag: CollectiveTag,
    /// The failed collective's place in its epoch (the `seq` of the position
    /// it wrote): the ranks whose position is before it never joined it.
    pub seq: i64,
    /// What the shim said (torch's or gloo's message).
    pub message: String,
    /// How long this rank waited, and the deadline it was given.
    pub waited: Duration,
    pub timeout: Duration,
    /// Cut short by a broken membership epoch (the shim's `kCancelled`).
    pub cancelled: bool,
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
        // SAFETY: as this function's own contract.
        let table = unsafe { Table::at(table) }?;
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
    /// `factor` when finished (float buckets; control words are not scaled).
    /// `op` reduce-scatters instead, in place (rank `r` gets the sum of its
    /// chunk, `gradsync_actors::plan::partition`), or all-gathers `chunk`s.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        tag: CollectiveTag,
        addr: usize,
        numel: usize,
        words: Words,
        factor: f64,
        (op, chunk): (Op, usize),
        timeout: Duration,
    ) -> Result<(), ShimError> {
        let (table, endpoint) = (self.table, self.endpoint as *mut c_void);
        self.launch(tag, timeout, |timeout_ms, handle, seq, err| {
            // SAFETY: the endpoint is alive (see `new`); `addr` holds `numel`
            // elements of `words` until this collective is finished or
            // forgotten (the runtime's contract with its transport);
            // `handle`, `seq` and `err` outlive the call.
            unsafe {
                (table.start)(
                    endpoint,
                    addr as *mut c_void,
                    numel as i64,
                    words.code(),
                    factor,
                    op as i32,
                    chunk as i64,
                    timeout_ms,
                    handle,
                    seq,
                    err.as_mut_ptr(),
                    err.len(),
                )
            }
        })
    }

    /// Start summing the device-plane bucket `bucket` (the shim's `Bucket*` of
    /// the plane at `plane`) on the endpoint's data group, travelling as
    /// `words`, scaled by `factor` when finished; `op` and `chunk` as for [`Self::start`].
    #[allow(clippy::too_many_arguments)]
    pub fn start_tensor(
        &mut self,
        tag: CollectiveTag,
        plane: usize,
        bucket: usize,
        words: Words,
        factor: f64,
        (op, chunk): (Op, usize),
        timeout: Duration,
    ) -> Result<(), ShimError> {
        let (table, endpoint) = (self.table, self.endpoint as *mut c_void);
        self.launch(tag, timeout, |timeout_ms, handle, seq, err| {
            // SAFETY: the endpoint and the plane are alive (the communicator
            // holds both); the bucket is the runtime's and untouched until
            // this collective is finished or forgotten; `handle`, `seq` and
            // `err` outlive the call.
            unsafe {
                (table.start_tensor)(
                    endpoint,
                    plane as *mut c_void,
                    bucket as *mut c_void,
                    words.code(),
                    factor,
                    op as i32,
                    chunk as i64,
                    timeout_ms,
                    handle,
                    seq,
                    err.as_mut_ptr(),
                    err.len(),
                )
            }
        })
    }

    /// Run one of the shim's start functions and keep its Flight.
    fn launch(
        &mut self,
        tag: CollectiveTag,
        timeout: Duration,
        start: impl FnOnce(i64, *mut *mut c_void, *mut i64, &mut ErrorText) -> i32,
    ) -> Result<(), ShimError> {
        let started = Instant::now();
        // Whole milliseconds, rounded up: the library never gives up before the runtime's deadline.
        let timeout_ms = i64::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i64::MAX).max(1);
        let mut handle = std::ptr::null_mut();
        let mut seq = 0i64;
        let mut err = error_text();
        let rc = start(timeout_ms, &mut handle, &mut seq, &mut err);
        if rc != 0 {
            let waited = started.elapsed();
            return Err(ShimError { tag, seq, message: message(&err), waited, timeout, cancelled: rc == CANCELLED });
        }
        self.flights.push_back(Flight { handle, tag, seq, started, timeout });
        Ok(())
    }

    /// Finish the oldest started collective (none: nothing to do).
    pub fn finish_oldest(&mut self) -> Result<(), ShimError> {
        let Some(flight) = self.flights.pop_front() else { return Ok(()) };
        let mut err = error_text();
        // SAFETY: `flight.handle` came from `start` and is finished once;
        // `finish` frees it whatever the outcome.
        let rc = unsafe { (self.table.finish)(flight.handle, err.as_mut_ptr(), err.len()) };
        if rc != 0 {
            return Err(ShimError {
                tag: flight.tag,
                seq: flight.seq,
                message: message(&err),
                waited: flight.started.elapsed(),
                timeout: flight.timeout,
                cancelled: rc == CANCELLED,
            });
        }
        Ok(())
    }

    /// The ranks whose position in the store is below `seq`: they never
    /// reached the collective started there (empty if the store cannot say).
    pub fn behind(&self, seq: i64) -> Vec<usize> {
        const MOST: usize = 4096;
        let mut ranks = vec![0i64; MOST];
        let mut n = 0usize;
        // SAFETY: the endpoint is alive (see `new`); `ranks` holds `MOST`
        // entries and `n` outlives the call.
        let rc = unsafe { (self.table.behind)(self.endpoint as *mut c_void, seq, ranks.as_mut_ptr(), MOST, &mut n) };
        if rc != 0 {
            return Vec::new();
        }
        ranks.truncate(n);
        ranks.into_iter().filter_map(|r| usize::try_from(r).ok()).collect()
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

pub(crate) fn message(err: &[c_char]) -> String {
    // SAFETY: the shim writes a NUL-terminated string into `err` (and the
    // buffer starts zeroed, so an untouched one is empty).
    let text = unsafe { CStr::from_ptr(err.as_ptr()) };
    text.to_string_lossy().into_owned()
}
