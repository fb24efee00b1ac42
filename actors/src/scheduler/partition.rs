//! A partitioned scheduler's memory (sharded training): whole bucket buffers
//! live only while a bucket fills or is in its reduce-scatter; what a step
//! keeps is this rank's *partition* of each bucket.
//!
//! ```text
//! first arrival ──▶ full buffer (an idle one, or allocated) ──▶ packed ──▶ reduce-scatter
//!                                                                              │
//!     partition (range of the bucket) ◀── copied out ◀─────────────────────────┘
//!     full buffer ──▶ idle (IDLE kept for the next bucket, the rest freed)
//!     partition ──▶ lent with the step's result ──▶ freed when the loan ends
//! ```
//!
//! Corrections and the divisor's rescale then act on the partitions (only
//! the part of a corrected parameter inside this rank's range), and the step
//! lends the partitions instead of the buckets. So a rank holds its
//! partitions (the plan's bytes / world) plus the buckets filling or in
//! flight, never a whole set.
//!
//! A partition is allocated when its bucket is reduced and freed when the
//! loan of the step's result ends (the optimizer's `zero_grad()` drops the
//! gradients that view it), as `zero_grad(set_to_none=True)` frees unsharded
//! gradients: in a step's backward a rank holds the partitions of the
//! buckets reduced so far, not every partition of the step before. The
//! allocation per bucket and step is what that costs (a caching allocator's
//! on a device, `calloc` on the host).
//!
//! With a *buddy* (an elastic sharded job, [`crate::Transport::buddies`]) a
//! rank also keeps the partition of rank `(rank + stride) % world` (the
//! stride puts it on another node when the job spans several: the roster
//! decides it), laid after its own in the same buffer: the bucket is
//! all-reduced, so both are there, and the rank steps a copy of that
//! partition's optimizer state every step. A lost rank's partition then
//! lives on at its buddy; the price is a second partition (2 / world of the
//! plan's bytes). After a change of members the partitions follow the new
//! ranks ([`Partitions::new`] again).

use std::ops::Range;
use std::sync::atomic::Ordering;

use super::Scheduler;
use crate::arrival::DType;
use crate::error::AllocError;
use crate::plan::{held, Plan};
use crate::store::GradStore;

/// Whole bucket buffers kept between uses (more are freed): the next bucket
/// to fill takes the one the last reduced bucket left, so a steady backward
/// allocates nothing, and a rank holds one whole bucket between steps.
pub(crate) const IDLE: usize = 1;

/// A partitioned scheduler's partitions and idle buffers (see the module docs).
#[derive(Debug)]
pub(crate) struct Partitions<B> {
    /// Per bucket: the ranges a step keeps, back to back in its partition
    /// buffer: this rank's ([`Partitions::start`]), then its buddy's (when
    /// it keeps one).
    pub(crate) held: Vec<Vec<Range<usize>>>,
    /// This step's reduced partitions, by bucket (`None` until reduced).
    pub(crate) parts: Vec<Option<B>>,
    /// Whole buffers between uses: element count, type, buffer.
    idle: Vec<(usize, DType, B)>,
}

impl<B> Partitions<B> {
    /// The partitions of `plan`'s buckets for `rank` of `world`, and with a
    /// `stride` above 0 those of rank `(rank + stride) % world` too.
    pub(crate) fn new(plan: &Plan, rank: usize, world: usize, stride: usize) -> Self {
        let held = (0..plan.num_buckets()).map(|b| held(plan.bucket_numel(b), rank, world, stride)).collect();
        let parts = (0..plan.num_buckets()).map(|_| None).collect();
        Partitions { held, parts, idle: Vec::new() }
    }

    /// Where this rank's own partition of bucket `b` starts (what a lent
    /// buffer holds first).
    pub(crate) fn start(&self, b: usize) -> usize {
        self.held[b][0].start
    }

    /// Values a step keeps of bucket `b` (its partition, and its buddy's).
    pub(crate) fn kept(&self, b: usize) -> usize {
        self.held[b].iter().map(|r| r.len()).sum()
    }

    /// The same partitions for `rank` of `world` (a change of members):
    /// whole buffers stay idle for reuse. Free a step's partitions first
    /// (`Scheduler::free_partitions`): they are cut for the old ranks.
    pub(crate) fn moved(self, plan: &Plan, rank: usize, world: usize, stride: usize) -> Self {
        let mut fresh = Partitions::new(plan, rank, world, stride);
        fresh.idle = self.idle;
        fresh
    }

    /// Bytes of bucket `b`'s partition buffer under `plan`.
    pub(crate) fn bytes(&self, plan: &Plan, b: usize) -> usize {
        self.kept(b) * plan.bucket_dtype(b).size()
    }

    /// Where a correction of `len` values at bucket `b`'s offset `offset`
    /// lands in what this rank keeps: per kept range it meets, `(offset in
    /// the partition buffer, values to skip in the correction, values)`.
    pub(crate) fn in_partition(&self, b: usize, offset: usize, len: usize) -> Vec<(usize, usize, usize)> {
        let mut at = 0;
        let mut hits = Vec::new();
        for range in &self.held[b] {
            let (lo, hi) = (offset.max(range.start), (offset + len).min(range.end));
            if lo < hi {
                hits.push((at + lo - range.start, lo - offset, hi - lo));
            }
            at += range.len();
        }
        hits
    }

    /// This step's partitions, every bucket reduced (to lend them).
    pub(crate) fn take(&mut self) -> Vec<B> {
        self.parts.iter_mut().map(|p| p.take().expect("every bucket is reduced at completion")).collect()
    }

    /// Free this step's partitions (a step that does not apply, or a
    /// reset); returns the bytes they held.
    pub(crate) fn clear(&mut self, plan: &Plan) -> usize {
        let freed = (0..self.parts.len()).filter(|&b| self.parts[b].is_some()).map(|b| self.bytes(plan, b)).sum();
        self.parts.iter_mut().for_each(|p| *p = None);
        freed
    }
}

impl<S: GradStore> Scheduler<S> {
    /// Give bucket `b` a whole buffer to pack into if it has none yet (a
    /// partitioned step allocates them on first use).
    pub(super) fn ensure_full(&mut self, b: usize) -> Result<(), AllocError> {
        if self.buffers.current[b].is_some() {
            return Ok(());
        }
        let (numel, dtype) = (self.plan.bucket_numel(b), self.plan.bucket_dtype(b));
        let parts = self.partitions.as_mut().expect("only a partitioned step lacks a buffer before launch");
        let reuse = parts.idle.iter().position(|&(n, d, _)| n == numel && d == dtype);
        let buf = match reuse {
            Some(i) => parts.idle.swap_remove(i).2,
            None => {
                let buf = self.store.alloc_bucket(numel, self.cfg.pieces, dtype)?;
                self.allocated.fetch_add(numel * dtype.size(), Ordering::Relaxed);
                buf
            }
        };
        self.buffers.current[b] = Some(buf);
        Ok(())
    }

    /// Free this step's partitions (a step that does not apply, or a
    /// reset) and take them out of the memory figure.
    pub(super) fn free_partitions(&mut self) {
        if let Some(parts) = self.partitions.as_mut() {
            self.allocated.fetch_sub(parts.clear(&self.plan), Ordering::Relaxed);
        }
    }

    /// Bucket `b` was reduce-scattered into `full`: keep this rank's
    /// partition of it, and let the whole buffer go idle (or free it).
    pub(super) fn keep_partition(&mut self, b: usize, full: S::Bucket) -> Result<(), AllocError> {
        let (numel, dtype) = (self.plan.bucket_numel(b), self.plan.bucket_dtype(b));
        let parts = self.partitions.as_mut().expect("partitioned");
        let kept = parts.kept(b);
        let mut part = self.store.alloc_bucket(kept, 1, dtype)?;
        self.allocated.fetch_add(kept * dtype.size(), Ordering::Relaxed);
        let mut at = 0;
        for range in &parts.held[b] {
            self.store.add_from(&mut part, at, &full, range.start, range.len());
            at += range.len();
        }
        parts.parts[b] = Some(part);
        if parts.idle.len() < IDLE {
            parts.idle.push((numel, dtype, full));
        } else {
            drop(full);
            self.allocated.fetch_sub(numel * dtype.size(), Ordering::Relaxed);
        }
        Ok(())
    }
}
