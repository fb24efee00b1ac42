//! The membership protocol's records: where each lives under a job's
//! prefix, and the writes several parties share (a check-in, breaking an
//! epoch, an accusation).
//!
//! | record | kind | written by | read by |
//! |---|---|---|---|
//! | `beat/{m}` | counter | member `m`'s monitor, every beat | the few members that watch `m` |
//! | `broken/{e}` | counter | whoever breaks epoch `e` | every monitor, in its batched read |
//! | `gathered/{e}` | gate | the last to arrive, or whoever breaks `e` | members waiting to start `e` |
//! | `arrived/{e}` | ledger + count | each member starting `e` | the last to arrive; a member timing out |
//! | `present/{e}` | ledger + count | each survivor of `e`, once | the one tallier |
//! | `accused/{e}` | ledger + count | a monitor that saw a peer it watches fall silent | the tallier |
//! | `dead` | ledger + count | a supervisor that reaped a member | the tallier, a supervisor |
//! | `tally/{e}` | claim | the first survivor (compare-and-set) | survivors, to know who tallies |
//! | `roster/{e}` | roster | one proposer (compare-and-set) | joiners, late starters, supervisors |
//! | `change/{e}` | change | that proposer, after its roster won | every member, waiting on it |

use serde_json::{json, Value};

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
    /// How many first members wrote the digest (the first writes the roster itself).
    pub(super) fn first_writers(&self) -> String {
        format!("{}/first/writers", self.0)
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
    /// Counted up by the tallier every round: waiting survivors see it is alive.
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
    /// The count kept beside a ledger (how many entered: read cheaply
    /// while polling); beside it, not under it (etcd keeps a ledger's
    /// entries under `{ledger}/`).
    pub(super) fn count(ledger: &str) -> String {
        format!("{ledger}.count")
    }
}

/// Break epoch `epoch` in the store: every monitor sees it in its next
/// batched read, and members waiting to start the epoch wake.
pub(super) fn mark_broken<S: KvStore>(store: &S, keys: &Keys, epoch: u64) -> Result<(), StoreError> {
    store.add(&keys.broken(epoch), 1)?;
    store.compare_set(&keys.gathered(epoch), b"", GATE_BROKEN)?;
    Ok(())
}

/// What `gathered/{e}` holds when the epoch broke before every member arrived.
pub(super) const GATE_BROKEN: &[u8] = b"broken";
/// What `gathered/{e}` holds when every member arrived.
pub(super) const GATE_ALL: &[u8] = b"all";

/// Add `entry` to `ledger` under `name`, and count it.
pub(super) fn enter_counted<S: KvStore>(store: &S, ledger: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
    store.enter(ledger, name, entry)?;
    store.add(&Keys::count(ledger), 1)?;
    Ok(())
}

/// Check `me` in to the agreement on `roster`'s next epoch: probe `probe`
/// (the peers it watches that published a probe), and enter what it found
/// in the epoch's ledger of survivors, once. Called by the agreement and
/// by the liveness monitor (whichever of this process comes first).
pub(super) fn check_in<S: KvStore>(
    store: &S,
    keys: &Keys,
    roster: &Roster,
    me: MemberId,
    probe: &[MemberId],
    reach: &dyn Reach,
) -> Result<(), StoreError> {
    let mut peers = Vec::new();
    for &m in probe.iter().filter(|&&m| m != me) {
        if let Some(address) = store.get(&keys.probe(m))? {
            peers.push((m, String::from_utf8_lossy(&address).into_owned()));
        }
    }
    let unreachable = reach.unreachable(&peers);
    let reached: Vec<MemberId> = peers.iter().map(|(m, _)| *m).filter(|m| !unreachable.contains(m)).collect();
    let entry = json!({ "reached": reached, "unreachable": unreachable }).to_string();
    enter_counted(store, &keys.present(roster.epoch), &me.to_string(), entry.as_bytes())
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
    enter_counted(store, &keys.accused(epoch), &member.to_string(), entry.as_bytes())
}

/// An accusation as entered: the accused, and the beat count its watcher last saw.
pub(super) fn read_accusation(name: &str, entry: &[u8]) -> Option<(MemberId, i64)> {
    let v: Value = serde_json::from_slice(entry).ok()?;
    Some((name.parse().ok()?, v["count"].as_i64()?))
}
