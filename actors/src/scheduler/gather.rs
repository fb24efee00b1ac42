//! A sharded model's parameter gather, on the communicator like every other
//! collective: between two steps the caller hands in one buffer per bucket
//! (every rank's chunk of it back to back, its own filled by its optimizer),
//! they go to the communicator in the order given, and come back together.
//!
//! ```text
//! Gather { buffers, reply } ─▶ submit one Gather collective per buffer (tag: the open step)
//!   Done(gather) ─▶ kept ─▶ all back? reply (buffers, Ok)
//!   Done(failed) ─▶ kept ─▶ all back? reply (buffers, Err(first failure)); the scheduler is failed until a reset
//! ```
//!
//! The gather runs between steps, so it never interleaves with a step's
//! buckets: the caller sends it after `finish_step` returned and before the
//! next backward's gradients arrive (every rank at the same point, as with
//! the step itself). Asked while the scheduler is failed, it is refused at
//! once with that failure, without a collective.

use super::step::Lifecycle;
use super::Scheduler;
use crate::comm::CommPayload;
use crate::error::{CollectiveKind, CollectiveTag, CommError, SyncError};
use crate::messages::{GatherOf, Gathered, Reply};
use crate::store::GradStore;

/// Where a gather's buffers and outcome go.
type Answer<B> = Reply<Gathered<B>>;

/// A gather in progress: the buffers back so far, how many are still out,
/// the first failure, and where to answer.
#[derive(Debug)]
pub(crate) struct Gathering<B> {
    back: Vec<(GatherOf, B)>,
    out: usize,
    failure: Option<SyncError>,
    reply: Answer<B>,
}

impl<S: GradStore> Scheduler<S> {
    /// Start gathering `buffers` (see the module docs).
    pub(super) fn on_gather(&mut self, buffers: Vec<(GatherOf, S::Bucket)>, reply: Answer<S::Bucket>) {
        if let Lifecycle::Failed(failure) = &self.lifecycle {
            let error = failure.error.clone();
            return reply.send((buffers, Err(error)));
        }
        if self.gathering.is_some() {
            let why = "a parameter gather was asked for while another was in progress".to_string();
            return reply.send((buffers, Err(SyncError::Setting { setting: "gather", why })));
        }
        let outside = |of: &GatherOf| matches!(of, GatherOf::Bucket(index) if *index >= self.plan.num_buckets());
        if let Some(&(GatherOf::Bucket(index), _)) = buffers.iter().find(|(of, _)| outside(of)) {
            let why = format!("bucket {index} asked for, and the plan has {}", self.plan.num_buckets());
            return reply.send((buffers, Err(SyncError::Setting { setting: "gather", why })));
        }
        if buffers.is_empty() {
            return reply.send((buffers, Ok(())));
        }
        self.gathering = Some(Gathering { back: Vec::new(), out: buffers.len(), failure: None, reply });
        let timeout = self.cfg.collective_timeout;
        for (of, buffer) in buffers {
            let numel = self.store.bucket_numel(&buffer);
            let kind = match of {
                GatherOf::Bucket(index) => CollectiveKind::Gather { index, numel },
                GatherOf::Norm => CollectiveKind::Norm { numel },
            };
            let tag = CollectiveTag { step: self.step.step, kind };
            self.submit(tag, CommPayload::Grads(buffer), 1.0, timeout);
        }
    }

    /// A gather collective came back (successful or not; accounted for by `on_done`).
    pub(super) fn on_gathered(&mut self, tag: CollectiveTag, buffer: S::Bucket, result: Result<(), CommError>) {
        let of = match tag.kind {
            CollectiveKind::Gather { index, .. } => GatherOf::Bucket(index),
            CollectiveKind::Norm { .. } => GatherOf::Norm,
            _ => unreachable!("only gathers come here"),
        };
        let Some(gathering) = self.gathering.as_mut() else {
            tracing::warn!(rank = self.cfg.rank, %tag, "a gather collective came back with no gather in progress");
            return;
        };
        gathering.back.push((of, buffer));
        gathering.out -= 1;
        if let Err(e) = result {
            gathering.failure.get_or_insert(e.into());
        }
        if gathering.out > 0 {
            return;
        }
        let Gathering { back, failure, reply, .. } = self.gathering.take().expect("a gather in progress");
        match failure {
            None => reply.send((back, Ok(()))),
            Some(error) => {
                reply.send((back, Err(error.clone())));
                self.fail(error);
            }
        }
    }
}
