//! A sharded model's parameter gather, on the communicator like every other
//! collective: between two steps the caller hands in one buffer per bucket
//! (every rank's chunk of it back to back, its own filled by its optimizer),
//! they go to the communicator in the order given, and come back together.
//! Several gathers may be in flight (a caller that starts one per bucket
//! and unpacks each as it lands), never two of the same bucket; each is
//! answered when its own buffers are back.
//!
//! ```text
//! Gather { buffers, reply } ─▶ submit one Gather collective per buffer (tag: the open step)
//!   Done(gather) ─▶ kept by the gather it belongs to ─▶ all its buffers back? reply (buffers, Ok)
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

/// A gather in progress: the buffers back so far, those still out, the
/// first failure, and where to answer.
#[derive(Debug)]
pub(crate) struct Gathering<B> {
    back: Vec<(GatherOf, B)>,
    /// What is still with the communicator, in submission order.
    out: Vec<GatherOf>,
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
        let in_flight = |of: &GatherOf| self.gathering.iter().any(|g| g.out.contains(of));
        if let Some((of, _)) = buffers.iter().find(|(of, _)| in_flight(of)) {
            let why = format!("a gather of {of:?} was asked for while one of it was in flight");
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
        let out = buffers.iter().map(|(of, _)| *of).collect();
        self.gathering.push(Gathering { back: Vec::new(), out, failure: None, reply });
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
        let Some(at) = self.gathering.iter().position(|g| g.out.contains(&of)) else {
            tracing::warn!(rank = self.cfg.rank, %tag, "a gather collective came back with no gather of it in progress");
            return;
        };
        let gathering = &mut self.gathering[at];
        gathering.back.push((of, buffer));
        gathering.out.retain(|out| *out != of);
        if let Err(e) = result {
            gathering.failure.get_or_insert(e.into());
        }
        if !gathering.out.is_empty() {
            return;
        }
        let Gathering { back, failure, reply, .. } = self.gathering.remove(at);
        match failure {
            None => reply.send((back, Ok(()))),
            Some(error) => {
                reply.send((back, Err(error.clone())));
                self.fail(error);
            }
        }
    }
}
