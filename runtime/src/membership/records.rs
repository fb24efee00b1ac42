//! The membership protocol's records: where each lives under a job's
//! prefix, and the writes several parties share (a check-in, breaking an
//! epoch, an accusation).
//!
//! | record | kind | written by | read by |
//! |---|---|---|---|
//! | `beat/{m}` | counter | member `m`'s monitor, every beat | the few members that watch `m` |
//! | `broken/{e}` | flag (`1`) | whoever breaks epoch `e` | every monitor, in its batched read |
//! | `gathered/{e}` | gate | the last to arrive, or whoever breaks `e` | members waiting to start `e` |
//! | `arrived/{e}` | ledger | each member starting `e` | the last to arrive; a member timing out |
//! | `present/{e}` | ledger | each survivor of `e`, once | the one tallier |
//! | `accused/{e}` | ledger | a monitor that saw a peer it watches fall silent | the tallier |
//! | `dead` | ledger | a supervisor that reaped a member | the tallier, a supervisor |
//! | `tally/{e}` | claim | the first survivor (compare-and-set) | survivors, to know who tallies |
//! | `tally/{e}/rounds` | `{tallier}/{round}` | the tallier, every round | survivors whose wait ran out |
//! | `roster/{e}` | roster | one proposer (compare-and-set); epoch 0 by its first ranks | joiners, late starters, supervisors |
//! | `change/{e}` | change | that proposer, after its roster won | every member, waiting on it |
//!
//! No key is incremented by every member: on etcd an increment is a
//! transaction retried once per writer that raced it, so N members adding
//! at once cost it O(N²). Ledgers are counted by the store (`lengths`).

use serde_json::{json, Value};

use super::watch::PROBED;
use super::{KvStore, MemberId, Reach, Roster, StoreError};

/// The keys of one job (its prefix).
#[derive(Debug, Clone)]
pub(super) struct Keys(pub(super) String);

impl Keys {
    pub(super) fn roster(&self, epoch: u64) -> String {
        format!("{}/roster/{epoch}", self.0)
    }
    /// What changed from epoch `epoch - 1` to `epoch` (a small record every member reads).
    pub(super) fn change(&self, epoch: u64) -> String {
        format!("{}/change/{epoch}", self.0)
    }
    pub(super) fn latest(&self) -> String {
        format!("{}/latest", self.0)
    }
    /// The digest of the first roster the first members agree on.
    pub(super) fn first(&self) -> String {
        format!("{}/first", self.0)
    }
    pub(super) fn broken(&self, epoch: u64) -> String {
        format!("{}/broken/{epoch}", self.0)
    }
    pub(super) fn gathered(&self, epoch: u64) -> String {
        format!("{}/gathered/{epoch}", self.0)
    }
    pub(super) fn arrived(&self, epoch: u64) -> String {
        format!("{}/arrived/{epoch}", self.0)
    }
    pub(super) fn present(&self, epoch: u64) -> String {
        format!("{}/present/{epoch}", self.0)
    }
    pub(super) fn accused(&self, epoch: u64) -> String {
        format!("{}/accused/{epoch}", self.0)
    }
    pub(super) fn dead(&self) -> String {
        format!("{}/dead", self.0)
    }
    pub(super) fn tally(&self, epoch: u64) -> String {
        format!("{}/tally/{epoch}", self.0)
    }
    /// Rewritten by the tallier every round: waiting survivors see it is alive.
    pub(super) fn tally_rounds(&self, epoch: u64) -> String {
        format!("{}/tally/{epoch}/rounds", self.0)
    }
    pub(super) fn probe(&self, member: MemberId) -> String {
        format!("{}/probe/{member}", self.0)
    }
    pub(super) fn beat(&self, member: MemberId) -> String {
        format!("{}/beat/{member}", self.0)
    }
    pub(super) fn joiners(&self) -> String {
        format!("{}/joiners", self.0)
    }
    pub(super) fn joiner(&self, n: u64) -> String {
        format!("{}/joiner/{n}", self.0)
    }
    pub(super) fn admitted(&self, member: MemberId) -> String {
        format!("{}/admitted/{member}", self.0)
    }
    pub(super) fn ended(&self) -> String {
        format!("{}/ended", self.0)
    }
}

/// Break epoch `epoch` in the store: every monitor sees it in its next
/// batched read, and members waiting to start the epoch wake.
pub(super) fn mark_broken<S: KvStore>(store: &S, keys: &Keys, epoch: u64) -> Result<(), StoreError> {
    // A put, not an add: every survivor may write it at once (an add is a retried transaction on etcd).
    store.set(&keys.broken(epoch), b"1")?;
    store.compare_set(&keys.gathered(epoch), b"", GATE_BROKEN)?;
    Ok(())
}

/// What `gathered/{e}` holds when the epoch broke before every member arrived.
pub(super) const GATE_BROKEN: &[u8] = b"broken";
/// What `gathered/{e}` holds when every member arrived.
pub(super) const GATE_ALL: &[u8] = b"all";

/// The probe addresses of `members` that published one (a read each).
pub(super) fn probe_addresses<S: KvStore>(
    store: &S,
    keys: &Keys,
    members: &[MemberId],
) -> Result<Vec<(MemberId, String)>, StoreError> {
    let mut found = Vec::new();
    for &m in members {
        if let Some(address) = store.get(&keys.probe(m))? {
            found.push((m, String::from_utf8_lossy(&address).into_owned()));
        }
    }
    Ok(found)
}

/// Check `me` in to the agreement on `roster`'s next epoch: probe `peers`
/// (the peers it watches whose heartbeat moves, at their probe addresses,
/// in [`super::watch::probed`]'s order: the first [`PROBED`], and the
/// others only if one of those could not be reached), and enter what it
/// found in the epoch's ledger of survivors. Called by the agreement and by
/// the liveness monitor (whichever of this process comes first).
pub(super) fn check_in<S: KvStore>(
    store: &S,
    keys: &Keys,
    roster: &Roster,
    me: MemberId,
    peers: &[(MemberId, String)],
    reach: &dyn Reach,
) -> Result<(), StoreError> {
    let peers: Vec<(MemberId, String)> = peers.iter().filter(|(m, _)| *m != me).cloned().collect();
    let first = peers.len().min(PROBED);
    let mut unreachable = reach.unreachable(&peers[..first]);
    let asked = if unreachable.is_empty() {
        first
    } else {
        unreachable.extend(reach.unreachable(&peers[first..]));
        peers.len()
    };
    let reached: Vec<MemberId> = peers[..asked].iter().map(|(m, _)| *m).filter(|m| !unreachable.contains(m)).collect();
    let entry = json!({ "reached": reached, "unreachable": unreachable }).to_string();
    store.enter(&keys.present(roster.epoch), &me.to_string(), entry.as_bytes())
}

/// A check-in as entered: the member, and the peers it reached and could not.
pub(super) fn read_check_in(name: &str, entry: &[u8]) -> Option<(MemberId, Vec<MemberId>, Vec<MemberId>)> {
    let member = name.parse().ok()?;
    let v: Value = serde_json::from_slice(entry).ok()?;
    let ids = |field: &str| -> Vec<MemberId> {
        v[field].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
    };
    Some((member, ids("reached"), ids("unreachable")))
}

/// Accuse `member` of silence in epoch `epoch` (`count`: the last beat its
/// watcher `by` saw): the tallier counts it gone unless its beat moved since.
pub(super) fn accuse<S: KvStore>(
    store: &S,
    keys: &Keys,
    epoch: u64,
    by: MemberId,
    member: MemberId,
    count: i64,
) -> Result<(), StoreError> {
    let entry = json!({ "by": by, "count": count }).to_string();
    store.enter(&keys.accused(epoch), &member.to_string(), entry.as_bytes())
}

/// An accusation as entered: the accused, and the beat count its watcher last saw.
pub(super) fn read_accusation(name: &str, entry: &[u8]) -> Option<(MemberId, i64)> {
    let v: Value = serde_json::from_slice(entry).ok()?;
    Some((name.parse().ok()?, v["count"].as_i64()?))
}
