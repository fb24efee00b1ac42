//! Membership of an elastic job: which processes train together, in which
//! epoch, and how they agree to change that when one is lost or one joins.
//!
//! The state lives in a key-value store that outlives every training
//! process (torch's `TCPStore` hosted by gradsync's supervisor, an etcd
//! cluster ([`EtcdKv`]), or any store with an atomic compare-and-set:
//! [`KvStore`]), never in rank 0. What flows:
//!
//! ```text
//! every member ── Monitor (own thread) ── beat/{id} += 1 every beat ──▶ store
//!                     │ sees failed/{e}, a silent peer, a waiting joiner
//!                     ├─▶ checks in present/{e}/{id}; cancels epoch e's collectives
//!                     └─▶ joiner_waiting flag ─▶ this rank's control vote ─▶ StepReport::admit
//!
//! a step fails ─▶ Agreement::recover ─ failed/{e}; probe the beating peers ─▶ present/{e}/{id} = [unreachable]
//!                                     ─▶ who is present, who reaches whom, who is lost?
//!                                     ─▶ compare_set(roster/{e+1}) ─▶ the one Roster every survivor adopts
//! a joiner ─▶ Agreement::request_join ─ joiner/{n} ─▶ (members after the step that voted "admit")
//!          Agreement::admit ─▶ compare_set(roster/{e+1}) ─▶ admitted/{id} ─▶ the joiner adopts it
//! ```
//!
//! A roster of epoch `e + 1` is written once, by compare-and-set, so every
//! process that adopts one adopts the same: the store is the arbiter, and
//! two sides of a partition can never both go on. So no majority is
//! needed: the next roster is the largest set of members that checked in
//! (they reach the store) and reach one another (each probes the others'
//! [`Probe`] before it checks in), as long as it holds the job's minimum
//! ([`Agreement::with_minimum`]). A side cut off from the store cannot
//! write a roster and stops; a side that reaches the store but not the
//! winners finds a roster without it. A member left out of the roster it
//! finds (it was silent too long, or on the smaller side) gets
//! [`MembershipError::LeftOut`] and leaves; its supervisor can start it
//! again as a joiner. The collectives of a new epoch run on a fresh group
//! (gloo cannot abort one in flight); which member's state the others take
//! after a change is decided on that group (see `gradsync.torch.elastic`).

mod agreement;
mod etcd;
mod monitor;
mod reach;
mod roster;
mod store;

pub use agreement::{Agreement, Timing};
pub use etcd::EtcdKv;
pub use monitor::{Canceller, Liveness, Monitor, PAUSE_FACTOR, SPREAD};
pub use reach::{Probe, Reach, TcpReach};
pub use roster::{Roster, Tally};
pub use store::{KvStore, MemoryKv, StoreError};

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
