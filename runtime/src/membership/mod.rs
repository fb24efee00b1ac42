//! Membership of an elastic job: which processes train together, in which
//! epoch, and how they agree to change that when one is lost or one joins.
//!
//! The state lives in a key-value store that outlives every training
//! process (torch's `TCPStore` hosted by gradsync's supervisor, an etcd
//! cluster ([`EtcdKv`]), or any store with an atomic compare-and-set:
//! [`KvStore`]), never in rank 0. Every member's part of the protocol costs
//! the store a constant number of calls, so a beat and a change each cost
//! O(N) calls in all, never O(N²). What flows:
//!
//! ```text
//! every member ── Monitor (own thread), every beat:
//!                   set beat/{me}; one batched read: the beats of the few peers it watches,
//!                   broken/{e}, the join requests' count
//!                     │ a watched peer silent for its window ─▶ accused/{e} += it; broken/{e} += 1
//!                     ├─▶ broken/{e} seen: check in (present/{e} += me) and cancel epoch e's collectives
//!                     └─▶ joiner_waiting flag ─▶ this rank's control vote ─▶ StepReport::admit
//!
//! a step fails ─▶ Agreement::recover ─ check in (probing the peers it watches);
//!                   compare_set(tally/{e}): the first survivor tallies:
//!                     read present/{e}, accused/{e}, dead (one read each) and the pending members' beats
//!                     ─▶ compare_set(roster/{e+1}) ─▶ set change/{e+1} (a few ids)
//!                   the others wait on change/{e+1} (the store answers; nobody polls)
//!                     and apply it to the roster they hold
//! a joiner ─▶ Agreement::request_join ─ joiner/{n} ─▶ (members after the step that voted "admit")
//!          Agreement::admit: rank 0 proposes ─▶ admitted/{id} ─▶ change/{e+1}; the joiner adopts it
//! ```
//!
//! A roster of epoch `e + 1` is written once, by compare-and-set, so every
//! process that adopts one adopts the same: the store is the arbiter, and
//! two sides of a partition can never both go on. So no majority is
//! needed: the next roster is the largest set of members that checked in
//! (they reach the store) and reach one another (each probes the peers it
//! watches with its [`Probe`] before it checks in: [`Roster::after_loss`]),
//! as long as it holds the job's minimum ([`Agreement::with_minimum`]). A
//! side cut off from the store cannot write a roster and stops; a side that
//! reaches the store but not the winners finds a roster without it. A
//! member left out of the roster it finds (it was silent too long, or on
//! the smaller side) gets [`MembershipError::LeftOut`] and leaves; its
//! supervisor can start it again as a joiner. The collectives of a new
//! epoch run on a fresh group (gloo cannot abort one in flight); which
//! member's state the others take after a change is decided on that group
//! (see `gradsync.torch.elastic`).
//!
//! Time is read from a [`Clock`]: the system's in a job, one the tests
//! drive in the unit tests of the monitor ([`Monitor`]'s tick) and the tally.

use std::time::Duration;

mod agreement;
mod clock;
mod etcd;
mod metered;
mod monitor;
mod reach;
mod records;
mod roster;
mod store;
mod tally;
mod watch;

pub use agreement::{Agreement, Gathered};
pub use clock::{Clock, ManualClock, SharedClock, SystemClock};
pub use etcd::EtcdKv;
pub use metered::{MeteredKv, StoreOps};
pub use monitor::{Canceller, Liveness, Monitor, VOUCHED_FACTOR};
pub use reach::{Probe, Reach, TcpReach};
pub use roster::{Change, Roster, Tally};
pub use store::{frame_entry, length_key, unframe_entries, KvStore, MemoryKv, StoreError};
pub use watch::{probed, strides, watched, PAUSE_FACTOR, PROBED, SPREAD, WATCHED};

/// How the protocol paces itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// How often a monitor beats and reads the peers it watches.
    pub beat: Duration,
    /// How often the one tallier of an agreement looks at the counts of
    /// check-ins (three integers, one read) while it waits for them.
    pub poll: Duration,
    /// A member whose heartbeat stopped this long is lost (the floor of
    /// each peer's adaptive window); a member not checked in to an
    /// agreement whose beat has not moved for this long is lost too.
    pub liveness: Duration,
    /// A member named by the failing collective (its socket closed) whose
    /// heartbeat has not moved for this long since the tally began is lost
    /// without waiting for `liveness` (a live one's monitor checks in
    /// within a beat).
    pub suspect_grace: Duration,
    /// A member whose heartbeat still moves but that has not checked in this
    /// long after the tally began is lost all the same (its monitor beats
    /// but cannot reach the agreement).
    pub check_in: Duration,
    /// How long a joiner waits to be admitted.
    pub admission: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            beat: Duration::from_millis(100),
            poll: Duration::from_millis(5),
            liveness: Duration::from_secs(1),
            suspect_grace: Duration::from_millis(250),
            check_in: Duration::from_secs(30),
            admission: Duration::from_secs(300),
        }
    }
}

impl Timing {
    /// How late a monitor's tick (or how slow its read) may be before the
    /// monitor counts itself blind for that time: a beat, or a quarter of
    /// the liveness window if that is more.
    pub fn slack(&self) -> Duration {
        self.beat.max(self.liveness / 4)
    }
}

/// A process's identity in an elastic job: unique for the job's life (a
/// replacement for a lost process gets a new one).
pub type MemberId = u64;

/// The machine a member runs on, as the job's supervisors number them (one
/// supervisor per machine): members on one node are lost together when it
/// goes, so a partition's buddy copy is kept on another node.
pub type NodeId = u64;

/// Why a change of membership failed. Each says what the process should do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MembershipError {
    /// The store holding membership did not answer.
    #[error("the membership store failed: {0}; this process cannot take part in the job any more (check that the supervisor, which hosts the store, is alive and reachable)")]
    Store(#[from] StoreError),
    /// Too few members survived to go on (fewer than the job's minimum).
    #[error("epoch {epoch}: only members {survivors:?} of {members:?} can go on together (lost: {lost:?}), fewer than the job's minimum of {minimum} (Elastic(min_members=...)); no member goes on. Restart the job from its last checkpoint")]
    NoQuorum {
        /// The epoch that lost its members.
        epoch: u64,
        /// Its members.
        members: Vec<MemberId>,
        /// Those present.
        survivors: Vec<MemberId>,
        /// Those seen as lost.
        lost: Vec<MemberId>,
        /// The fewest members the job goes on with.
        minimum: usize,
    },
    /// The members went on without this process (it was silent too long).
    #[error("member {member} was left out of epoch {epoch} (its peers saw it as lost) and cannot rejoin on its own; exit, and let the supervisor start a replacement that joins the job")]
    LeftOut {
        /// This process.
        member: MemberId,
        /// The epoch that went on without it.
        epoch: u64,
    },
    /// A joining process was refused by the members.
    #[error("member {member} was refused by the job: {why}")]
    Refused {
        /// This process.
        member: MemberId,
        /// What the members said (another model, another optimizer).
        why: String,
    },
    /// The job ended before this process was admitted.
    #[error("the job ended before member {member} was admitted; nothing to do")]
    Ended {
        /// This process.
        member: MemberId,
    },
    /// Every member of the job is gone (their processes were reaped), so
    /// nobody can admit this joiner.
    #[error("member {member} cannot join: the job has no member left ({why}); the job is over, restart it from its last checkpoint")]
    NoMembers {
        /// This process.
        member: MemberId,
        /// What the supervisor saw.
        why: String,
    },
    /// Waiting for an agreement took longer than its deadline.
    #[error("{what} took longer than {waited_s:.1} s; is the job alive (its supervisor's log says)?")]
    Deadline {
        /// What was waited for.
        what: String,
        /// How long.
        waited_s: f64,
    },
    /// A stored record could not be read (another version wrote it).
    #[error(
        "the store holds a malformed membership record at {key}: {why}; is another gradsync version using this store?"
    )]
    Malformed {
        /// Where.
        key: String,
        /// What is wrong with it.
        why: String,
    },
}
