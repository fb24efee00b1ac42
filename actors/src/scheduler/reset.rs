//! Agreements outside the step loop: the plan agreement before the first
//! bucket, and the reset after a failed step. Both are small u64 collectives
//! in which every rank writes its own slot, submitted through the same path as
//! every other collective.

use super::control::disagreement;
use super::reorder::positions_of;
use super::step::{Failure, Lifecycle, StepState};
use super::Scheduler;
use crate::arrival::Step;
use crate::comm::CommPayload;
use crate::error::{CollectiveKind, CollectiveTag, CommError, SyncError};
use crate::messages::{Place, Reply, Resumption};
use crate::plan::Fnv;
use crate::store::GradStore;

/// Mixed into the plan digest of a rank whose buckets are reduce-scattered.
const PARTITIONED: u64 = 0x7061_7274_6974_696f;
/// ...and of one that keeps its buddy's partition too.
const BUDDIES: u64 = 0x6275_6464_6965_7321;

impl<S: GradStore> Scheduler<S> {
    /// Submit this rank's plan digest (model, bucket layout, abort policy) in
    /// its own slot of a `W`-word vector: the first collective of every rank.
    pub(super) fn propose_plan(&mut self) {
        let mut h = Fnv::default();
        h.write(self.plan.fingerprint());
        h.write(self.cfg.policy.code());
        h.write(self.cfg.wire.code());
        if self.cfg.partitioned {
            // A rank that reduce-scatters must not meet one that all-reduces.
            h.write(PARTITIONED);
        }
        if self.cfg.buddy_stride > 0 {
            h.write(BUDDIES);
            h.write(self.cfg.buddy_stride as u64);
        }
        self.plan_proposed = true;
        let mut words = vec![0u64; self.cfg.world];
        words[self.cfg.rank] = h.0;
        let tag = CollectiveTag { step: 0, kind: CollectiveKind::Plan { len: words.len() } };
        self.submit(tag, CommPayload::Words(words), 1.0, self.cfg.collective_timeout);
    }

    /// The plan agreement returned: launch what waited for it, or fail every
    /// rank alike, naming the odd ranks, before any gradient is summed.
    pub(super) fn on_plan_agreed(&mut self, words: &[u64]) {
        match disagreement(words) {
            None => {
                self.plan_agreed = true;
                self.launch_ready_buckets();
                self.start_control_once_launched();
            }
            Some(d) => self.fail(SyncError::Desync {
                step: self.step.step,
                ranks: d.ranks,
                groups: d.groups,
                majority: d.majority,
                fingerprints: words.to_vec(),
            }),
        }
        self.answer_waiting_progress();
    }

    /// Abandon the current step and propose `proposed` as the restart step.
    /// Every rank writes its proposal into its own slot of the agreement
    /// vector, so the sum tells everyone every proposal; the maximum wins.
    ///
    /// With a new `membership` (this rank's [`Place`] after a change of members),
    /// this rank takes its new place first: the agreement runs among the new
    /// members, ranks that had joined (out of data) count again, and the plan
    /// is agreed again before the next bucket (a process that joined the job
    /// proposes it for the first time). The vector then has a second half:
    /// in its slot, the step this rank can contribute again (`salvage.rs`);
    /// the members redo it only if every slot names the same step.
    pub(super) fn on_reset(
        &mut self,
        proposed: Step,
        membership: Option<Place>,
        reply: Reply<Result<Resumption, SyncError>>,
    ) {
        if membership.is_some() && self.salvage.as_ref().is_some_and(|s| s.flush_pending(self.cfg.shards)) {
            // The caller finished the failed step; its shards are still forwarding it.
            self.deferred_reset = Some((proposed, membership, reply));
            return;
        }
        if membership.is_none() {
            // A plain reset runs the batch again: nothing is redone.
            self.drop_salvage();
        }
        if let Some(req) = self.lifecycle.take_finish() {
            req.reply.send(Err(SyncError::Poisoned { step: self.step.step, cause: "reset requested".into() }));
        }
        self.next.clear();
        if let Some(place) = membership {
            self.cfg.rank = place.rank;
            self.cfg.world = place.world;
            if self.cfg.buddy_stride > 0 {
                self.cfg.buddy_stride = place.buddy_stride.max(1);
            }
            self.joined = 0;
            self.plan_proposed = false;
            self.plan_agreed = false;
        }
        // A plan rebuild cut short by the failure: keep the plan in force.
        self.order.pending = false;
        // The failed step's partitions are void.
        self.free_partitions();
        if let Some(place) = membership {
            // The partitions follow the new ranks (a plain reset keeps them where they are).
            if let Some(parts) = self.partitions.take() {
                self.partitions = Some(parts.moved(&self.plan, place.rank, place.world, self.cfg.buddy_stride));
            }
        }
        if self.partitions.is_some() {
            // Whole buffers are allocated as buckets fill.
            self.buffers.current.iter_mut().for_each(|b| *b = None);
        } else if self.buffers.current.is_empty() {
            // Buffers lost in a failed collective (pieces held by peers) are replaced.
            if let Err(e) = self.ensure_buffers() {
                return reply.send(Err(e.into()));
            }
        }
        for b in 0..self.plan.num_buckets() {
            if self.partitions.is_none() && self.buffers.current[b].is_none() {
                match self.store.alloc_bucket(self.plan.bucket_numel(b), self.cfg.pieces, self.plan.bucket_dtype(b)) {
                    Ok(fresh) => self.buffers.current[b] = Some(fresh),
                    Err(e) => return reply.send(Err(e.into())),
                }
            }
        }
        let halves = if membership.is_some() { 2 } else { 1 };
        let mut words = vec![0u64; self.cfg.world * halves];
        words[self.cfg.rank] = proposed + 1;
        if let Some(salvage) = self.salvage.as_ref().filter(|s| membership.is_some() && s.complete(self.cfg.shards)) {
            words[self.cfg.world + self.cfg.rank] = salvage.step + 1;
        }
        // Identical on every rank whatever it proposes, so proposals never look like a desync.
        let tag = CollectiveTag { step: 0, kind: CollectiveKind::Reset { len: words.len() } };
        self.lifecycle = Lifecycle::Resetting(reply);
        // Peers reach their reset only after their own failing collective gives up
        // (at most one deadline after ours), so the agreement waits longer.
        let timeout = self.cfg.collective_timeout * 3;
        // If the communicator is gone, `submit` fails the scheduler, which answers `reply`.
        self.submit(tag, CommPayload::Words(words), 1.0, timeout);
    }

    /// After a change of members, every member takes the bucket layout of
    /// the new rank 0 before the plan agreement: a joiner starts from the
    /// first plan while the members may have rebuilt theirs in the order
    /// gradients arrive, and a loss during an order collective can leave
    /// survivors with different layouts. It is an order collective in which
    /// only rank 0 speaks (its plan's launch order as positions, the others
    /// zeros), so the summed order, and the plan built from it, is rank 0's
    /// on every member. Later steps wait for it like for any rebuild.
    fn adopt_first_members_layout(&mut self) {
        let words = if self.cfg.rank == 0 {
            positions_of(self.plan.launch_order(), self.plan.num_params())
        } else {
            vec![0u64; self.plan.num_params()]
        };
        self.start_reorder(self.step.step, words);
    }

    /// The reset agreement returned: open the agreed step (a new generation
    /// of actor messages), or stay failed. After a membership reset, the
    /// members first take rank 0's bucket layout.
    pub(super) fn on_reset_agreed(&mut self, result: Result<Vec<u64>, CommError>) {
        let Lifecycle::Resetting(reply) = std::mem::replace(&mut self.lifecycle, Lifecycle::Open) else {
            unreachable!("an agreement result arrives while resetting")
        };
        match result {
            Ok(words) => {
                let world = self.cfg.world.min(words.len());
                let (proposals, redo) = words.split_at(world);
                let agreed = proposals.iter().copied().max().unwrap_or(1).saturating_sub(1);
                // Every member can contribute the same failed step again, and
                // none of them went past it: it is reduced among them.
                let redo = match redo.first() {
                    Some(&first) if first != 0 && redo.iter().all(|&w| w == first) => Some(first - 1),
                    _ => None,
                }
                .filter(|&s| agreed == s + 1 && self.salvage.as_ref().is_some_and(|v| v.step == s));
                match redo {
                    Some(_) => self.redo = self.salvage.take(),
                    None => self.drop_salvage(),
                }
                self.epoch += 1;
                // A plan agreement that failed is run again when the next step begins.
                self.plan_proposed &= self.plan_agreed;
                let contributors = self.cfg.world - self.joined;
                self.step = StepState::new(
                    redo.unwrap_or(agreed),
                    self.plan.num_params(),
                    self.plan.num_buckets(),
                    contributors,
                    self.cfg.divisor,
                );
                if words.len() == 2 * world {
                    // A membership reset (its agreement has the redo half).
                    self.adopt_first_members_layout();
                }
                reply.send(Ok(Resumption { step: agreed, redo }));
            }
            Err(e) => {
                let error = SyncError::from(e);
                self.lifecycle = Lifecycle::Failed(Failure { step: self.step.step, error: error.clone() });
                reply.send(Err(error));
            }
        }
    }
}
