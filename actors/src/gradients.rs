//! The reduced gradients of a finished step, lent to the caller.
//!
//! The bucket buffers are the only copy of the reduced gradients. Instead of
//! copying them out, the scheduler *lends* them: [`Gradients`] owns them until it
//! is dropped, and its `Drop` sends them back to the scheduler for the next
//! step. A step cannot finish while the previous step's loan is alive.

use std::sync::{Arc, Weak};

use tokio::sync::mpsc::UnboundedSender;

use crate::arrival::{ParamId, Step};
use crate::bucket_buf::BucketBuf;
use crate::messages::SchedMsg;
use crate::plan::Plan;
use crate::report::StepReport;
use crate::store::{GradStore, HostStore};

/// What `finish_step` returns.
#[derive(Debug)]
pub struct StepResult<S: GradStore = HostStore> {
    /// Counts, timings and the outcome (identical outcome on every rank).
    pub report: StepReport,
    /// The averaged gradients; `None` when the step was skipped, so a skipped
    /// step cannot be applied by accident.
    pub gradients: Option<Gradients<S>>,
}

/// The averaged gradients of one step (a loan of the bucket buffers).
#[derive(Debug)]
pub struct Gradients<S: GradStore = HostStore> {
    step: Step,
    plan: Arc<Plan>,
    buffers: Vec<S::Bucket>,
    /// Per parameter: unused on every rank, so there is no gradient.
    unused_everywhere: Vec<bool>,
    /// Where the buffers go back on drop.
    home: UnboundedSender<SchedMsg<S>>,
    /// Lets the caller-side handle see whether the loan is still alive.
    alive: Arc<()>,
}

impl<S: GradStore> Gradients<S> {
    pub(crate) fn new(
        step: Step,
        plan: Arc<Plan>,
        buffers: Vec<S::Bucket>,
        unused_everywhere: Vec<bool>,
        home: UnboundedSender<SchedMsg<S>>,
    ) -> Self {
        Gradients { step, plan, buffers, unused_everywhere, home, alive: Arc::new(()) }
    }

    /// A weak handle that dies with this loan (the runtime uses it to refuse
    /// `finish_step` while the previous gradients are still held).
    pub fn liveness(&self) -> Weak<()> {
        Arc::downgrade(&self.alive)
    }

    /// The step these gradients belong to.
    pub fn step(&self) -> Step {
        self.step
    }

    /// Where the averaged gradient of `param` lies: its bucket and the element
    /// range in it; `None` if no rank produced one (unused everywhere) or the
    /// id is unknown. Store-specific views are built on this.
    pub fn locate(&self, param: ParamId) -> Option<(&S::Bucket, std::ops::Range<usize>)> {
        if *self.unused_everywhere.get(param.index())? {
            return None;
        }
        let slot = self.plan.slots[param.index()];
        let len = self.plan.params[param.index()].numel;
        Some((&self.buffers[slot.bucket], slot.offset..slot.offset + len))
    }
}

impl<S: GradStore<Bucket = BucketBuf>> Gradients<S> {
    /// The averaged gradient of `param`, or `None` if no rank produced one
    /// (unused everywhere) or the id is unknown.
    pub fn get(&self, param: ParamId) -> Option<GradView<'_>> {
        let (buf, range) = self.locate(param)?;
        Some(GradView { buf, offset: range.start, len: range.len() })
    }

    /// Convenience: the gradient of `param` as a new vector.
    pub fn to_vec(&self, param: ParamId) -> Option<Vec<f32>> {
        self.get(param).map(|v| v.to_vec())
    }
}

impl<S: GradStore> Drop for Gradients<S> {
    fn drop(&mut self) {
        let buffers = std::mem::take(&mut self.buffers);
        // If the scheduler is gone there is nobody to give them to.
        let _ = self.home.send(SchedMsg::LoanReturned { buffers });
    }
}

/// A read-only view of one parameter's averaged gradient. It may span two
/// bucket pieces, so it is read through [`GradView::segments`] or copied.
#[derive(Debug, Clone, Copy)]
pub struct GradView<'a> {
    buf: &'a BucketBuf,
    offset: usize,
    len: usize,
}

impl<'a> GradView<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the gradient has no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values as consecutive contiguous pieces (usually one).
    pub fn segments(&self) -> impl Iterator<Item = &'a [f32]> + 'a {
        self.buf.segments(self.offset, self.len)
    }

    /// Copy into `out`, which must have [`GradView::len`] values.
    pub fn copy_to(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.len, "GradView::copy_to: wrong output length");
        self.buf.read(self.offset, out);
    }

    /// The values as a new vector.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        self.copy_to(&mut out);
        out
    }
}
