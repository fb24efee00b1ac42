//! The one place the actors of a rank are connected: parameter shards feeding
//! the scheduler, the scheduler feeding the communicator. The runtime runs
//! what [`wire`] returns on its threads; the simulator drives the same actors
//! by hand on a virtual clock.
//!
//! ```text
//! hook ──ShardMsg──▶ shard inboxes ──SchedMsg──▶ scheduler inbox ──CommJob──▶ comm (caller's channel)
//!                                                     ▲
//!  communicator thread ── completions(inbox) ─────────┘
//! ```

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::arrival::ParamId;
use crate::comm::{CommDone, CommJob};
use crate::error::AllocError;
use crate::messages::{SchedMsg, ShardMsg};
use crate::param::ParamShard;
use crate::plan::{BucketEnds, Plan};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::store::GradStore;

/// Settings of one rank's actors.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// The scheduler's settings (its `shards` is the number of shard actors).
    pub scheduler: SchedulerConfig,
    /// Steps of history used to learn each parameter's arrival count.
    pub learning_window: usize,
    /// How long a shard keeps polling after a message before it sleeps.
    pub idle_spin: Duration,
    /// Hand consumed payloads back for reuse instead of freeing them.
    pub recycle_payloads: bool,
}

/// One rank's actors, connected and ready to run.
#[derive(Debug)]
pub struct Actors<S: GradStore> {
    /// Inboxes of the parameter shards (parameter `p` → shard `p % len`).
    pub shard_inboxes: Vec<UnboundedSender<ShardMsg<S>>>,
    /// The scheduler's inbox.
    pub scheduler_inbox: UnboundedSender<SchedMsg<S>>,
    /// The shard actors, each with the receiving end of its inbox.
    pub shards: Vec<(ParamShard<S>, UnboundedReceiver<ShardMsg<S>>)>,
    /// The scheduler, with the receiving end of its inbox.
    pub scheduler: (Scheduler<S>, UnboundedReceiver<SchedMsg<S>>),
    /// Consumed payloads coming back (with `recycle_payloads`).
    pub spent: Option<Receiver<(ParamId, S::Values)>>,
    /// Bytes of bucket buffers the scheduler has allocated.
    pub allocated: Arc<AtomicUsize>,
    /// Per parameter: the last member of its bucket in the plan in force
    /// (the scheduler rewrites it when it rebuilds the plan).
    pub bucket_ends: BucketEnds,
}

/// Connect one rank's actors for `plan`; collectives go to `comm`. The
/// scheduler allocates its first set of buckets and submits the plan
/// agreement at once.
pub fn wire<S: GradStore>(
    cfg: &ActorConfig,
    store: S,
    plan: Arc<Plan>,
    comm: Sender<CommJob<S>>,
) -> Result<Actors<S>, AllocError> {
    let shards = cfg.scheduler.shards.max(1);
    let (sched_tx, sched_rx) = unbounded_channel();
    let scheduler = Scheduler::new(cfg.scheduler.clone(), store.clone(), Arc::clone(&plan), comm, sched_tx.clone())?;
    let recycling = cfg.recycle_payloads.then(|| crossbeam_channel::bounded(2 * plan.num_params()));
    let scheduler = match &recycling {
        Some((tx, _)) => scheduler.with_spent_payloads(tx.clone()),
        None => scheduler,
    };
    let spent = recycling.map(|(_, rx)| rx);
    let allocated = scheduler.allocated_bytes();
    let bucket_ends = scheduler.bucket_ends();
    let (shard_inboxes, shard_actors) = (0..shards)
        .map(|i| {
            let (tx, rx) = unbounded_channel();
            let shard = ParamShard::new(store.clone(), i, shards, &plan, cfg.learning_window, sched_tx.clone())
                .with_idle_spin(cfg.idle_spin)
                // Arrival times feed the timeline and the plan rebuild's gain.
                .with_timestamps(cfg.scheduler.record_timeline || cfg.scheduler.reorder);
            (tx, (shard, rx))
        })
        .unzip();
    Ok(Actors {
        shard_inboxes,
        scheduler_inbox: sched_tx,
        shards: shard_actors,
        scheduler: (scheduler, sched_rx),
        spent,
        allocated,
        bucket_ends,
    })
}

/// The completion sink of a communicator thread: posts each finished
/// collective to the scheduler; `false` once the scheduler is gone.
pub fn completions<S: GradStore>(inbox: UnboundedSender<SchedMsg<S>>) -> impl FnMut(CommDone<S>) -> bool + Send {
    move |done| inbox.send(SchedMsg::Done(done)).is_ok()
}
