//! [`Gathers`]: a sharded wrapper's gather buffers (one per bucket, or one
//! for the partial gradient norms of a clip), owned by the runtime's store
//! (host memory, or tensors on the device plane) and lent to Python as
//! tensors over their memory.
//!
//! ```text
//! Session.gather_buffers(sizes) ─▶ Gathers (one buffer per bucket: `world` chunks of equal length)
//! Python writes its own chunk into the views ─▶ Session.gather(gathers) ─▶ GradSync::gather (the communicator)
//!                                                       ◀── every rank's chunk in place, the buffers back here
//! ```
//!
//! A buffer may also travel alone: `Session.gather_start(gathers, i)` hands
//! buffer `i` to the communicator and returns, `Session.gather_wait(gathers,
//! i)` waits for it (so a caller packs the next bucket, or unpacks this one,
//! while the others are in flight):
//!
//! ```text
//! Held ─ gather_start ─▶ Out (PendingGather) ─ gather_wait ─▶ Held     (failed or not)
//!                                            └──────────────▶ Gone     (the runtime never answered: `lost`)
//! ```
//!
//! The buffers move into the runtime for the gather and come back with its
//! outcome, failed or not; only when the runtime is gone or stops
//! answering do they not come back, and [`Gathers::lost`] then says the
//! views must not be used again (the wrapper allocates new ones).

use std::sync::Mutex;

use gradsync_runtime::{GatherOf, PendingGather};
use pyo3::prelude::*;

use crate::tensor_grads::Bucket;

/// A gather buffer as Python reads it: bucket index (`None`: the norms),
/// address, element count, element type, and whether the address is a
/// device-plane bucket's (`_collectives.bucket_tensor`) rather than host memory.
type Entry = (Option<usize>, usize, usize, &'static str, bool);

/// Where one gather buffer is (see the module docs).
#[derive(Debug)]
pub(crate) enum Slot {
    /// Here: Python reads and writes it.
    Held(GatherOf, Bucket),
    /// With the communicator, alone (`Session.gather_start`), until waited for.
    Out(PendingGather<Bucket>),
    /// With the gather lane (`Lane.start`), until waited for.
    Lane,
    /// With a gather that never answered (or being gathered with the others).
    Gone,
}

/// One buffer per bucket of a sharded wrapper's plan (see the module docs).
#[pyclass(module = "gradsync._native")]
pub struct Gathers {
    /// Each buffer, in the order the gathers run. Behind a lock only
    /// because Python objects must be shareable between threads.
    pub(crate) slots: Mutex<Vec<Slot>>,
    /// The buffers as Python reads them, fixed at allocation.
    pub(crate) entries: Vec<Entry>,
    /// A gather took buffers and they never came back.
    pub(crate) lost: bool,
}

impl Gathers {
    /// The buffers `buffers`, lent to Python through their entries.
    pub(crate) fn new(buffers: Vec<(GatherOf, Bucket)>) -> Gathers {
        let entries = buffers
            .iter()
            .map(|(of, bucket)| {
                let index = match of {
                    GatherOf::Bucket(index) => Some(*index),
                    GatherOf::Norm => None,
                };
                let (address, numel, dtype) = bucket.lent().expect("a gather buffer is allocated in one piece");
                (index, address, numel, dtype, matches!(bucket, Bucket::Plane(_)))
            })
            .collect();
        let slots = buffers.into_iter().map(|(of, bucket)| Slot::Held(of, bucket)).collect();
        Gathers { slots: Mutex::new(slots), entries, lost: false }
    }

    /// The slots, for the one caller that holds this object mutably.
    pub(crate) fn slots(&mut self) -> &mut Vec<Slot> {
        self.slots.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[pymethods]
impl Gathers {
    /// `(bucket index or None for the norms, address, element count,
    /// element type, on the device plane)` per buffer. The memory lives as long as this object, unless
    /// :attr:`lost`.
    fn entries(&self) -> Vec<Entry> {
        self.entries.clone()
    }

    /// Whether a gather took the buffers and never gave them back (the
    /// runtime stopped answering): their memory must not be used again.
    #[getter]
    fn lost(&self) -> bool {
        self.lost
    }
}
