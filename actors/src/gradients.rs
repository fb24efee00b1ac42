//! The reduced gradients of a finished step, lent to the caller.
//!
//! The bucket buffers are the only copy of the reduced gradients. Instead of
//! copying them out, the scheduler *lends* them: [`Gradients`] owns them until
//! it is dropped, and its [`LoanHome`] hands them back for a later step. The
//! next step does not wait for them (it packs into a second set of buffers,
//! allocated the first time a loan outlives a step's start), but a step cannot
//! *finish* while the previous step's loan is alive, so at most two sets exist.

use std::sync::{Arc, Weak};

use crate::arrival::{ParamId, Step};
use crate::bucket_buf::BucketBuf;
use crate::plan::Plan;
use crate::report::StepReport;
use crate::store::{GradStore, HostStore};

/// What ending a step returns.
#[derive(Debug)]
pub struct StepResult<S: GradStore = HostStore> {
    /// Counts, timings and the outcome (identical outcome on every rank).
    pub report: StepReport,
    /// The averaged gradients; `None` when the step was skipped, so a skipped
    /// step cannot be applied by accident.
    pub gradients: Option<Gradients<S>>,
}

/// Where lent bucket buffers go when the loan ends (a one-shot handle; the
/// wiring makes it post to the scheduler's inbox).
pub struct LoanHome<B>(Box<dyn FnOnce(Vec<B>) + Send>);

impl<B> LoanHome<B> {
    /// A home that receives the buffers through `give_back`.
    pub fn new(give_back: impl FnOnce(Vec<B>) + Send + 'static) -> Self {
        LoanHome(Box::new(give_back))
    }
}

impl<B> std::fmt::Debug for LoanHome<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoanHome")
    }
}

/// The averaged gradients of one step (a loan of the bucket buffers).
#[derive(Debug)]
pub struct Gradients<S: GradStore = HostStore> {
    step: Step,
    plan: Arc<Plan>,
    buffers: Vec<S::Bucket>,
    /// Per parameter: unused on every rank, so there is no gradient.
    unused_everywhere: Vec<bool>,
    /// Where the buffers go back on drop (taken by `drop`).
    home: Option<LoanHome<S::Bucket>>,
    /// Lets the caller-side handle see whether the loan is still alive.
    alive: Arc<()>,
    /// A partitioned step's: per bucket, where in the bucket this rank's
    /// partition (its buffer) starts. `None`: the buffers are whole buckets.
    starts: Option<Vec<usize>>,
}

impl<S: GradStore> Gradients<S> {
    pub(crate) fn new(
        step: Step,
        plan: Arc<Plan>,
        buffers: Vec<S::Bucket>,
        unused_everywhere: Vec<bool>,
        home: LoanHome<S::Bucket>,
    ) -> Self {
        Gradients { step, plan, buffers, unused_everywhere, home: Some(home), alive: Arc::new(()), starts: None }
    }

    /// A partitioned step's gradients: buffer `b` holds bucket `b` from
    /// `starts[b]` on (this rank's partition).
    pub(crate) fn starting_at(mut self, starts: Option<Vec<usize>>) -> Self {
        self.starts = starts;
        self
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

    /// Whether `param` has a gradient (`false`: unused on every rank, or an
    /// id of another GradSync).
    pub fn has(&self, param: ParamId) -> bool {
        self.unused_everywhere.get(param.index()).is_some_and(|unused| !unused)
    }

    /// Where the averaged gradient of `param` lies: its bucket buffer and the
    /// element range in it; `None` if it has none. Store-specific views (a
    /// device slice) are built on this.
    /// A partitioned step answers `None`: its buffers hold parts of buckets
    /// ([`Gradients::buckets`] says which).
    pub fn locate(&self, param: ParamId) -> Option<(&S::Bucket, std::ops::Range<usize>)> {
        if !self.has(param) || self.starts.is_some() {
            return None;
        }
        let slot = self.plan.slot(param);
        let len = self.plan.param_numel(param);
        Some((&self.buffers[slot.bucket], slot.offset..slot.offset + len))
    }
}

impl<S: GradStore> Gradients<S> {
    /// Every bucket buffer with its members in slot order (members sit back
    /// to back from offset 0 of the bucket) and where in the bucket the
    /// buffer starts (0, except for a partitioned step, whose buffers hold
    /// this rank's partition of each bucket), for callers that hand out
    /// views of whole buckets. Members unused everywhere are listed too
    /// ([`Gradients::has`] says which have a gradient).
    pub fn buckets(&self) -> impl Iterator<Item = (&S::Bucket, &[ParamId], usize)> + '_ {
        self.buffers
            .iter()
            .enumerate()
            .map(|(b, buf)| (buf, self.plan.bucket_params(b), self.starts.as_ref().map_or(0, |s| s[b])))
    }
}

impl<S: GradStore<Bucket = BucketBuf>> Gradients<S> {
    /// The averaged gradient of `param`, or `None` if no rank produced one
    /// (unused everywhere) or the id is unknown.
    pub fn get(&self, param: ParamId) -> Option<GradView<'_>> {
        let (buf, range) = self.locate(param)?;
        Some(GradView { buf, offset: range.start, len: range.len() })
    }

    /// Copy the averaged gradient of `param` into `out` (the caller's own
    /// buffer, no allocation). Returns `false`, leaving `out` untouched, if
    /// `param` has no gradient. Panics if `out` does not have the parameter's
    /// length, like `copy_from_slice`.
    pub fn copy_into(&self, param: ParamId, out: &mut [f32]) -> bool {
        match self.get(param) {
            Some(view) => {
                view.copy_to(out);
                true
            }
            None => false,
        }
    }

    /// Visit every parameter that has a gradient, in registration order.
    pub fn for_each(&self, mut visit: impl FnMut(ParamId, GradView<'_>)) {
        for &p in self.plan.param_ids() {
            if let Some(view) = self.get(p) {
                visit(p, view);
            }
        }
    }

    /// The gradient of `param` as a new vector (allocates; prefer
    /// [`Gradients::copy_into`] in a training loop).
    pub fn to_vec(&self, param: ParamId) -> Option<Vec<f32>> {
        self.get(param).map(|v| v.to_vec())
    }
}

impl<S: GradStore> Drop for Gradients<S> {
    fn drop(&mut self) {
        if let Some(LoanHome(give_back)) = self.home.take() {
            give_back(std::mem::take(&mut self.buffers));
        }
    }
}

/// A read-only view of one parameter's averaged gradient.
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

    /// The values as consecutive contiguous runs (usually one), for reading
    /// without a copy.
    pub fn chunks(&self) -> impl Iterator<Item = &'a [f32]> + 'a {
        self.buf.chunks(self.offset, self.len)
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
