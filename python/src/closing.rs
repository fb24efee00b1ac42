//! Sessions that end without `close`: dropped by the garbage collector (a
//! wrapper that went out of scope) or at interpreter shutdown.
//!
//! Dropping a session joins the runtime's threads, which may wait for the
//! interpreter (a collective in flight on the Python path, a held gradient
//! whose Python object must be freed). The garbage collector drops it with
//! the interpreter held, so the join runs on a thread of its own; those
//! threads are kept here and [`wait_for_closing`] (registered with `atexit`
//! by the package) joins them before shutdown. A close still waiting for the
//! interpreter when shutdown begins would be ended by Python mid-release,
//! which aborts the process. A session dropped once shutdown has begun is
//! not stopped at all ([`interpreter_is_ending`]): the process is ending.

use std::sync::Mutex;
use std::thread::JoinHandle;

use pyo3::prelude::*;

/// Closes running in the background, oldest first (finished ones are pruned).
static CLOSING: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Whether the interpreter is shutting down (`sys.is_finalizing()`; the
/// caller is attached to it).
pub fn interpreter_is_ending() -> bool {
    Python::attach(|py| {
        py.import("sys").and_then(|sys| sys.getattr("is_finalizing")?.call0()?.extract::<bool>()).unwrap_or(true)
    })
}

/// Drop `what` on a thread of its own, remembered until [`wait_for_closing`].
pub fn in_background<T: Send + 'static>(what: T) {
    let spawned = std::thread::Builder::new().name("gradsync-close".into()).spawn(move || drop(what));
    let mut closing = CLOSING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    closing.retain(|handle| !handle.is_finished());
    // No thread to be had: the closure, and `what` with it, was dropped on
    // this thread by the failed spawn; nothing is left to wait for.
    if let Ok(handle) = spawned {
        closing.push(handle);
    }
}

/// Wait, with the interpreter released, until every session dropped without
/// `close` has stopped its threads. The package registers it with `atexit`;
/// calling it at other times is harmless.
#[pyfunction]
pub fn wait_for_closing(py: Python<'_>) {
    let handles = std::mem::take(&mut *CLOSING.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
    py.detach(move || {
        for handle in handles {
            let _ = handle.join();
        }
    });
}
