//! The store protocol that changes an elastic job's roster (see the module
//! docs of [`crate::membership`]): recovery after a loss, admission of a
//! joiner, a joiner's request, and the gathering of an epoch's members
//! before its groups are built. The only write that decides anything is
//! one compare-and-set per epoch; every member's part costs the store a
//! constant number of calls, and only one party (the tallier, the
//! proposer) reads anything whose size grows with the job.

use std::time::Duration;

use serde_json::{json, Value};

use super::clock::{SharedClock, SystemClock};
use super::records::{check_in, mark_broken, probe_addresses, Keys, GATE_ALL, GATE_BROKEN};
use super::tally::{Evidence, Tallying, Verdict};
use super::watch::{probed, strides, watched};
use super::{Change, KvStore, Liveness, MemberId, MembershipError, NodeId, Reach, Roster, Timing};

/// How the `ended` record of a job that lost every member begins (the
/// reason follows); a job that finished writes `1`.
const GAVE_UP: &[u8] = b"gave up: ";

/// How many of the first members (the first ranks) write the first roster
/// whole (the others only agree on its digest): one would do, more survive
/// one dying at start.
const FIRST_WRITERS: usize = 3;

/// The newest roster in the store (`None`: the job has none): from the
/// epoch `latest` names (a hint, possibly stale), on while later ones exist.
fn newest_roster<S: KvStore>(store: &S, keys: &Keys) -> Result<Option<Roster>, MembershipError> {
    let mut epoch = match store.get(&keys.latest())? {
        Some(v) => String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0),
        None => 0,
    };
    let mut found = None;
    while let Some(bytes) = store.get(&keys.roster(epoch))? {
        found = Some(Roster::decode(&keys.roster(epoch), &bytes)?);
        epoch += 1;
    }
    Ok(found)
}

/// What a tallier records where the next change would be when too few
/// members are left: every waiting survivor ends with the same error.
fn no_quorum_record(error: &MembershipError) -> Vec<u8> {
    let MembershipError::NoQuorum { survivors, lost, minimum, .. } = error else { return Vec::new() };
    json!({ "no_quorum": { "survivors": survivors, "lost": lost, "minimum": minimum } }).to_string().into_bytes()
}

/// The error a no-quorum record (see [`no_quorum_record`]) stands for, if `bytes` is one.
fn read_no_quorum(roster: &Roster, bytes: &[u8]) -> Option<MembershipError> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    let record = v.get("no_quorum")?;
    let ids = |field: &str| -> Vec<MemberId> {
        record[field].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
    };
    Some(MembershipError::NoQuorum {
        epoch: roster.epoch,
        members: roster.members.clone(),
        survivors: ids("survivors"),
        lost: ids("lost"),
        minimum: record["minimum"].as_u64().unwrap_or(1) as usize,
    })
}

/// How the members of an epoch met before building its groups ([`Agreement::gather`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gathered {
    /// Every member arrived.
    All,
    /// The epoch broke first (a member lost): recover.
    Broken,
    /// The time ran out; these members had not arrived.
    Missing(Vec<MemberId>),
}

/// One process's side of the membership protocol: it holds the roster this
/// process belongs to, and changes it only by adopting the one roster the
/// store holds for the next epoch.
pub struct Agreement<S: KvStore> {
    store: S,
    keys: Keys,
    me: MemberId,
    /// The node this process runs on (a joiner tells the members).
    node: NodeId,
    /// The fewest members the job goes on with after a loss.
    minimum: usize,
    roster: Roster,
    timing: Timing,
    clock: SharedClock,
}

impl<S: KvStore> std::fmt::Debug for Agreement<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agreement").field("me", &self.me).field("epoch", &self.roster.epoch).finish_non_exhaustive()
    }
}

impl<S: KvStore> Agreement<S> {
    /// This process (`me`) in the job whose records are under `prefix`; no
    /// roster until [`Agreement::start`] or [`Agreement::request_join`].
    pub fn new(store: S, prefix: impl Into<String>, me: MemberId, timing: Timing) -> Self {
        Agreement {
            store,
            keys: Keys(prefix.into()),
            me,
            node: 0,
            minimum: 1,
            roster: Roster::first(Vec::new()),
            timing,
            clock: std::sync::Arc::new(SystemClock),
        }
    }

    /// After a loss, go on only with at least `minimum` members (default 1;
    /// every member of a job must use the same).
    pub fn with_minimum(mut self, minimum: usize) -> Self {
        self.minimum = minimum.max(1);
        self
    }

    /// This process runs on `node` (default 0): what a joiner tells the
    /// members, who keep its buddy copies on another node.
    pub fn on_node(mut self, node: NodeId) -> Self {
        self.node = node;
        self
    }

    /// Judge time by `clock` (default: the system's): tests drive it.
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Peers probe this process at `address` (its [`super::Probe`]) when
    /// they agree on a roster.
    pub fn publish_probe(&self, address: &str) -> Result<(), MembershipError> {
        Ok(self.store.set(&self.keys.probe(self.me), address.as_bytes())?)
    }

    /// The roster this process belongs to.
    pub fn roster(&self) -> &Roster {
        &self.roster
    }

    /// This process's id.
    pub fn me(&self) -> MemberId {
        self.me
    }

    /// The job's pacing.
    pub fn timing(&self) -> Timing {
        self.timing
    }

    /// A first member starts: the job's first roster is `initial`, member
    /// `i` on `nodes[i]`. Every first member proposes the same; they agree
    /// on its digest (a first member started with another list is told
    /// so), and the first few write it whole. If the job already went on
    /// without this process, [`MembershipError::LeftOut`].
    pub fn start(&mut self, initial: Vec<MemberId>, nodes: Vec<NodeId>) -> Result<&Roster, MembershipError> {
        let first = Roster::first_on(initial, nodes)?;
        let digest = first.digest().to_string();
        let agreed = self.store.compare_set(&self.keys.first(), b"", digest.as_bytes())?;
        if agreed != digest.as_bytes() {
            return Err(MembershipError::Malformed {
                key: self.keys.first(),
                why: format!(
                    "the job's first members agreed on another first roster (digest {}) than this process's \
                     ({digest}, {} members): were its workers started with other --nnodes/--nproc?",
                    String::from_utf8_lossy(&agreed),
                    first.world()
                ),
            });
        }
        if first.rank_of(self.me).is_some_and(|r| r < FIRST_WRITERS) {
            self.store.compare_set(&self.keys.roster(0), b"", &first.encode())?;
        }
        self.roster = first;
        // Has the job moved on? (A hint and one look past it: no whole roster is read unless it has.)
        let latest = match self.store.get(&self.keys.latest())? {
            Some(v) => String::from_utf8_lossy(&v).parse::<u64>().unwrap_or(0),
            None => 0,
        };
        if latest > 0 || self.store.get(&self.keys.change(1))?.is_some() {
            let newest = newest_roster(&self.store, &self.keys)?.unwrap_or_else(|| self.roster.clone());
            return self.adopt(newest);
        }
        let roster = self.roster.clone();
        self.adopt(roster)
    }

    /// Take `roster` as this process's own, or leave if it is not a member.
    fn adopt(&mut self, roster: Roster) -> Result<&Roster, MembershipError> {
        if roster.rank_of(self.me).is_none() {
            return Err(MembershipError::LeftOut { member: self.me, epoch: roster.epoch });
        }
        self.roster = roster;
        Ok(&self.roster)
    }

    /// Propose `next` for the next epoch; the winner's change is recorded
    /// (after `before_change`, for an admission's replies) and adopted.
    fn propose(
        &mut self,
        next: &Roster,
        before_change: impl FnOnce(&Self, &Roster) -> Result<(), MembershipError>,
    ) -> Result<Roster, MembershipError> {
        let key = self.keys.roster(next.epoch);
        let winner = Roster::decode(&key, &self.store.compare_set(&key, b"", &next.encode())?)?;
        before_change(self, &winner)?;
        let change = self.roster.change_to(&winner);
        self.store.compare_set(&self.keys.change(winner.epoch), b"", &change.encode())?;
        self.store.set(&self.keys.latest(), winner.epoch.to_string().as_bytes())?;
        Ok(winner)
    }

    /// The roster of the next epoch, if some process already decided it:
    /// its change applied to this process's roster (a few ids read). With
    /// `whole`, or when the change does not apply, the whole roster is read
    /// too (a proposer lost between its roster and its change leaves only
    /// the roster; a look after a wait ran out finds it).
    fn decided(&self, whole: bool) -> Result<Option<Roster>, MembershipError> {
        let epoch = self.roster.epoch + 1;
        if let Some(bytes) = self.store.get(&self.keys.change(epoch))? {
            if let Some(too_few) = read_no_quorum(&self.roster, &bytes) {
                return Err(too_few);
            }
            let change = Change::decode(&self.keys.change(epoch), &bytes)?;
            if let Some(next) = self.roster.apply(&change) {
                return Ok(Some(next));
            }
        } else if !whole {
            return Ok(None);
        }
        let key = self.keys.roster(epoch);
        self.store.get(&key)?.map(|bytes| Roster::decode(&key, &bytes)).transpose()
    }

    /// Wait up to `within` for the next epoch's roster to be decided.
    fn await_decided(&self, within: Duration) -> Result<Option<Roster>, MembershipError> {
        let changed = self.store.wait(&self.keys.change(self.roster.epoch + 1), within)?;
        self.decided(!changed)
    }

    /// Before building the current epoch's groups, every member says it
    /// arrived and waits (on the store, up to `within`) until all have, or
    /// the epoch broke (a member lost meanwhile).
    pub fn gather(&self, within: Duration) -> Result<Gathered, MembershipError> {
        let epoch = self.roster.epoch;
        let (arrived, gate) = (self.keys.arrived(epoch), self.keys.gathered(epoch));
        self.store.enter(&arrived, &self.me.to_string(), b"")?;
        let missing = || -> Result<Vec<MemberId>, MembershipError> {
            let here: std::collections::HashSet<MemberId> =
                self.store.entries(&arrived)?.iter().filter_map(|(name, _)| name.parse().ok()).collect();
            Ok(self.roster.members.iter().copied().filter(|m| !here.contains(m)).collect())
        };
        // The last to arrive (by the ledger's length; by name, to be sure) opens the gate.
        let length = self.store.lengths(std::slice::from_ref(&arrived))?[0];
        if length >= self.roster.world() as u64 && missing()?.is_empty() {
            self.store.compare_set(&gate, b"", GATE_ALL)?;
        }
        if self.store.wait(&gate, within)? {
            let broken = self.store.get(&gate)?.is_some_and(|state| state == GATE_BROKEN);
            return Ok(if broken { Gathered::Broken } else { Gathered::All });
        }
        Ok(Gathered::Missing(missing()?))
    }

    /// The current epoch lost a member (a collective failed, or the monitor
    /// broke the epoch): agree with the survivors on the next roster.
    /// `suspects` are members the failure named; `liveness` is what this
    /// process knows of the peers it watches (its [`super::Monitor`]).
    /// Unless its monitor did already, this process checks in: it probes
    /// the peers it watches with `reach` and enters what it found. The
    /// first survivor to claim the tally judges every member (present,
    /// reaped, accused and still silent, or quiet for the liveness window;
    /// one that still beats is waited for) and proposes the next roster; the others wait on
    /// the store for its change (and take the tally over if its rounds
    /// stop). Returns the roster this process goes on in.
    pub fn recover(
        &mut self,
        suspects: &[MemberId],
        liveness: &impl Liveness,
        reach: &dyn Reach,
    ) -> Result<&Roster, MembershipError> {
        if let Some(next) = self.decided(false)? {
            return self.adopt(next);
        }
        let epoch = self.roster.epoch;
        // (A check-in the monitor has under way is waited for, briefly: it probes first.)
        if !liveness.checked_in(epoch, self.timing.liveness / 2) {
            mark_broken(&self.store, &self.keys, epoch)?;
            let watching = watched(&self.roster, self.me, &strides(&self.roster));
            let probe = probed(&watching, liveness.beating(self.timing.liveness).as_deref());
            let peers = probe_addresses(&self.store, &self.keys, &probe)?;
            check_in(&self.store, &self.keys, &self.roster, self.me, &peers, reach)?;
        }
        let me = self.me.to_string();
        // Read the claim first: most survivors find it taken (a read, where a claim is a write).
        let claim = self.keys.tally(epoch);
        let mut tallier = match self.store.get(&claim)? {
            Some(taken) => taken,
            None => self.store.compare_set(&claim, b"", me.as_bytes())?,
        };
        let began = self.clock.now();
        let rounds_key = self.keys.tally_rounds(epoch);
        let mut rounds: Option<Vec<u8>> = None;
        loop {
            if tallier == me.as_bytes() {
                let next = self.tally(suspects)?;
                return self.adopt(next);
            }
            // Twice the liveness window: a tallier waiting for a slow member makes a round every beat.
            if let Some(next) = self.await_decided(2 * self.timing.liveness)? {
                return self.adopt(next);
            }
            let now = self.store.get(&rounds_key)?.unwrap_or_default();
            if rounds.as_ref() == Some(&now) {
                // The tallier made no round for a whole window: take it over (one of the waiters wins).
                tallier = self.store.compare_set(&claim, &tallier, me.as_bytes())?;
            }
            rounds = Some(now);
            let waited = self.clock.now().saturating_duration_since(began);
            if waited > self.timing.check_in + 4 * self.timing.liveness {
                return Err(MembershipError::Deadline {
                    what: format!("the agreement after epoch {epoch}"),
                    waited_s: waited.as_secs_f64(),
                });
            }
        }
    }

    /// This process tallies the broken epoch (see [`super::tally`]): a
    /// round whenever the counts of check-ins, accusations or obituaries
    /// move, and every beat besides; each round reads the three ledgers (one
    /// call each) and, in one batched read, the beats of the pending members
    /// that the round can judge: the accused and the suspects every round,
    /// all of them once a beat (in the first beat most are about to check
    /// in, and reading them would only slow the rounds). Returns the roster
    /// the store decided.
    fn tally(&mut self, suspects: &[MemberId]) -> Result<Roster, MembershipError> {
        let epoch = self.roster.epoch;
        let began = self.clock.now();
        let mut tallying = Tallying::new(&self.roster, suspects, self.timing, began);
        let mut all_read_at = began;
        let ledgers = [self.keys.present(epoch), self.keys.accused(epoch), self.keys.dead()];
        let mut last: Option<(Vec<u64>, std::time::Instant)> = None;
        // A round reads every check-in: while they pour in, one every quarter beat
        // is enough, unless the check-ins and obituaries say every member may be accounted for.
        let pace = self.timing.poll.max(self.timing.beat / 4);
        let world = self.roster.world() as u64;
        // This tallier's rounds, as the waiting survivors see them (they take over when it stops).
        let mut round = 0u64;
        loop {
            let seen = self.store.lengths(&ledgers)?;
            // How often to look is the machine's business (real time); who is gone, the protocol's clock.
            let now = std::time::Instant::now();
            let due = last.as_ref().is_none_or(|(c, at)| {
                let since = now.saturating_duration_since(*at);
                let complete = seen[0] + seen[2] + 1 >= world;
                (*c != seen && (since >= pace || complete)) || since >= self.timing.beat
            });
            if due {
                last = Some((seen, now));
                // (The whole roster too: one party, and a proposer lost between its roster and
                // its change leaves only the roster.)
                if let Some(next) = self.decided(true)? {
                    return Ok(next);
                }
                round += 1;
                self.store.set(&self.keys.tally_rounds(epoch), format!("{}/{round}", self.me).as_bytes())?;
                let evidence = Evidence::read(&self.store, &self.keys, epoch)?;
                let mut pending = tallying.pending(&evidence);
                if now.saturating_duration_since(all_read_at) >= self.timing.beat {
                    all_read_at = now;
                } else {
                    pending.retain(|m| evidence.accused.contains_key(m) || suspects.contains(m));
                }
                let keys: Vec<String> = pending.iter().map(|&m| self.keys.beat(m)).collect();
                let counts = if keys.is_empty() { Vec::new() } else { self.store.counters(&keys)? };
                let beats = pending.iter().copied().zip(counts).collect();
                if let Verdict::Decided(tally) = tallying.judge(self.clock.now(), &evidence, &beats) {
                    let next = match self.roster.after_loss(&tally, self.minimum) {
                        Ok(next) => next,
                        Err(too_few) => {
                            // Recorded where the others wait, so they end as this process does.
                            self.store.compare_set(&self.keys.change(epoch + 1), b"", &no_quorum_record(&too_few))?;
                            return Err(too_few);
                        }
                    };
                    return self.propose(&next, |_, _| Ok(()));
                }
            }
            std::thread::sleep(self.timing.poll);
        }
    }

    /// The one member that proposes a change every member asked for at the
    /// same boundary (an admission, an expulsion), the lowest-ranked of
    /// `among`; the others wait for its change, and propose themselves only
    /// if none comes within the liveness window (it was lost meanwhile).
    fn agree_once(
        &mut self,
        among: impl Fn(MemberId) -> bool,
        make: impl Fn(&mut Self) -> Result<Roster, MembershipError>,
    ) -> Result<Roster, MembershipError> {
        if let Some(next) = self.decided(false)? {
            return Ok(next);
        }
        let proposer = self.roster.members.iter().copied().find(|&m| among(m));
        if proposer != Some(self.me) {
            if let Some(next) = self.await_decided(2 * self.timing.liveness)? {
                return Ok(next);
            }
        }
        make(self)
    }

    /// Every member, after the same failed step: go on without `odd` (the
    /// members whose collectives differed from the others' right after a
    /// change of members, identical on every member since the step's vote
    /// is). A process among `odd` gets [`MembershipError::Refused`] with
    /// `why` and writes nothing. Returns the roster this process goes on in.
    pub fn expel(&mut self, odd: &[MemberId], why: &str) -> Result<&Roster, MembershipError> {
        if odd.contains(&self.me) {
            return Err(MembershipError::Refused { member: self.me, why: why.to_string() });
        }
        let next = self.agree_once(
            |m| !odd.contains(&m),
            |a| {
                let next = a.roster.without(odd)?;
                a.propose(&next, |_, _| Ok(()))
            },
        )?;
        self.adopt(next)
    }

    /// How many join requests the job has received.
    pub fn joiners_waiting(&self) -> Result<u64, MembershipError> {
        Ok(self.store.add(&self.keys.joiners(), 0)?.max(0) as u64)
    }

    /// Every member, at the same step boundary (the step whose control vote
    /// said a process waits): admit the waiting joiners whose `fingerprint`
    /// (model and optimizer layout) equals this member's; refuse the others
    /// with a message naming the difference. The epoch's rank 0 reads the
    /// requests and proposes; the others read its change.
    pub fn admit(&mut self, fingerprint: &str) -> Result<&Roster, MembershipError> {
        let next = self.agree_once(|_| true, |a| a.propose_admission(fingerprint))?;
        self.adopt(next)
    }

    /// Read the waiting requests, answer the refused, propose the roster
    /// with the accepted; the joiners of the winning roster are told before
    /// its change is recorded (so a member that read the change knows they were).
    fn propose_admission(&mut self, fingerprint: &str) -> Result<Roster, MembershipError> {
        let seen = self.joiners_waiting()?;
        let mut accepted = Vec::new();
        for n in self.roster.joiners_seen..seen {
            let (member, node, theirs) = self.join_request(n)?;
            if theirs == fingerprint {
                accepted.push((member, node));
            } else {
                let why = format!("its model and optimizer ({theirs}) are not the members' ({fingerprint})");
                self.store.set(&self.keys.admitted(member), json!({ "refused": why }).to_string().as_bytes())?;
            }
        }
        let next = self.roster.with_joiners(&accepted, seen);
        self.propose(&next, |a, winner| {
            for &j in &winner.joined {
                a.store.set(&a.keys.admitted(j), json!({ "epoch": winner.epoch }).to_string().as_bytes())?;
            }
            Ok(())
        })
    }

    /// The `n`-th join request: `(member, node, fingerprint)` (waits
    /// briefly: the joiner counts itself before it writes its request).
    fn join_request(&self, n: u64) -> Result<(MemberId, NodeId, String), MembershipError> {
        let key = self.keys.joiner(n);
        if !self.store.wait(&key, self.timing.liveness)? {
            return Err(MembershipError::Deadline {
                what: format!("reading join request {n}"),
                waited_s: self.timing.liveness.as_secs_f64(),
            });
        }
        let bytes = self.store.get(&key)?.unwrap_or_default();
        let bad = |why: &str| MembershipError::Malformed { key: key.clone(), why: why.into() };
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| bad(&e.to_string()))?;
        let member = v["member"].as_u64().ok_or_else(|| bad("no 'member'"))?;
        let node = v["node"].as_u64().ok_or_else(|| bad("no 'node'"))?;
        let fingerprint = v["fingerprint"].as_str().ok_or_else(|| bad("no 'fingerprint'"))?;
        Ok((member, node, fingerprint.to_string()))
    }

    /// A process that is not a member asks to join with its model and
    /// optimizer `fingerprint`, and waits until the members admit it at a
    /// step boundary (or refuse it). Returns the roster it joined.
    pub fn request_join(&mut self, fingerprint: &str) -> Result<&Roster, MembershipError> {
        let n = (self.store.add(&self.keys.joiners(), 1)? - 1) as u64;
        let request = json!({ "member": self.me, "node": self.node, "fingerprint": fingerprint }).to_string();
        self.store.set(&self.keys.joiner(n), request.as_bytes())?;
        let key = self.keys.admitted(self.me);
        let began = self.clock.now();
        // A joiner looks at its answer (and whether the job ended) itself,
        // backing off to a tenth of a second: a wait the store answers would
        // have to run out to look at the end, and torch's store logs each
        // time one does. Joiners are few: their looks cost the store little.
        let mut nap = self.timing.poll;
        loop {
            if let Some(bytes) = self.store.get(&key)? {
                let bad = |why: &str| MembershipError::Malformed { key: key.clone(), why: why.into() };
                let v: Value = serde_json::from_slice(&bytes).map_err(|e| bad(&e.to_string()))?;
                if let Some(why) = v["refused"].as_str() {
                    return Err(MembershipError::Refused { member: self.me, why: why.to_string() });
                }
                let epoch = v["epoch"].as_u64().ok_or_else(|| bad("no 'epoch'"))?;
                let rkey = self.keys.roster(epoch);
                let bytes = self.store.get(&rkey)?.ok_or_else(|| bad("admitted into an epoch with no roster"))?;
                self.roster = Roster::first(Vec::new());
                return self.adopt(Roster::decode(&rkey, &bytes)?);
            }
            if let Some(how) = self.store.get(&self.keys.ended())? {
                return Err(match how.strip_prefix(GAVE_UP) {
                    Some(why) => {
                        MembershipError::NoMembers { member: self.me, why: String::from_utf8_lossy(why).into_owned() }
                    }
                    None => MembershipError::Ended { member: self.me },
                });
            }
            let waited = self.clock.now().saturating_duration_since(began);
            if waited > self.timing.admission {
                return Err(MembershipError::Deadline {
                    what: "waiting to be admitted".into(),
                    waited_s: waited.as_secs_f64(),
                });
            }
            std::thread::sleep(nap);
            nap = (2 * nap).min(Duration::from_millis(100));
        }
    }

    /// The job's training loop ended (a member finished its last step):
    /// processes still waiting to join are told so.
    pub fn end(&self) -> Result<(), MembershipError> {
        Ok(self.store.set(&self.keys.ended(), b"1")?)
    }

    /// The members of the job's newest roster that no obituary names: who
    /// can still admit a joiner (empty: every member's process was reaped).
    /// Read by a supervisor, which is no member itself.
    pub fn members_left(store: &S, prefix: &str) -> Result<Vec<MemberId>, MembershipError> {
        let keys = Keys(prefix.to_string());
        let newest = newest_roster(store, &keys)?;
        let dead: std::collections::HashSet<MemberId> =
            store.entries(&keys.dead())?.iter().filter_map(|(name, _)| name.parse().ok()).collect();
        Ok(newest.map(|r| r.members).unwrap_or_default().into_iter().filter(|m| !dead.contains(m)).collect())
    }

    /// No member is left (see [`Agreement::members_left`]): the job is
    /// over, and processes waiting to join get [`MembershipError::NoMembers`]
    /// with `why` instead of waiting for an admission that cannot come.
    pub fn give_up(store: &S, prefix: &str, why: &str) -> Result<(), MembershipError> {
        let mut record = GAVE_UP.to_vec();
        record.extend_from_slice(why.as_bytes());
        Ok(store.set(&Keys(prefix.to_string()).ended(), &record)?)
    }

    /// The supervisor reaped `member`'s process: record it, so survivors
    /// need not wait to see it silent.
    pub fn obituary(store: &S, prefix: &str, member: MemberId) -> Result<(), MembershipError> {
        let keys = Keys(prefix.to_string());
        Ok(store.enter(&keys.dead(), &member.to_string(), b"1")?)
    }
}

#[cfg(test)]
#[path = "agreement_tests.rs"]
mod tests;
