//! The store protocol that changes an elastic job's roster (see the module
//! docs of [`crate::membership`]): recovery after a loss, admission of a
//! joiner, and a joiner's request. Every wait polls the store and has a
//! deadline; the only write that decides anything is one compare-and-set
//! per epoch.

use std::thread::sleep;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{KvStore, Liveness, MemberId, MembershipError, NodeId, Reach, Roster, StoreError, Tally};

/// How the protocol paces itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Between two looks at the store while waiting.
    pub poll: Duration,
    /// A member that has not checked in this long after its epoch broke (or
    /// whose heartbeat stopped this long ago) is lost. Also the monitor's
    /// silence threshold.
    pub liveness: Duration,
    /// A member named by the failing collective (its socket closed) that has
    /// not checked in this long after the failure, and whose heartbeat has
    /// not moved for as long, is lost without waiting for `liveness` (a live
    /// one's monitor checks in within a beat).
    pub suspect_grace: Duration,
    /// A member whose heartbeat still moves but that has not checked in this
    /// long after its epoch broke is lost all the same (its monitor beats
    /// but cannot reach the agreement).
    pub check_in: Duration,
    /// How long a joiner waits to be admitted.
    pub admission: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            poll: Duration::from_millis(5),
            liveness: Duration::from_secs(1),
            suspect_grace: Duration::from_millis(250),
            check_in: Duration::from_secs(30),
            admission: Duration::from_secs(300),
        }
    }
}

/// How the `ended` record of a job that lost every member begins (the
/// reason follows); a job that finished writes `1`.
const GAVE_UP: &[u8] = b"gave up: ";

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

/// Check `me` in to the agreement on `roster`'s next epoch: probe the peers
/// in `beating` that published a probe, and write the check-in naming those
/// it could not reach. Called by the agreement and by the liveness monitor
/// (whichever of this process comes first).
pub(super) fn check_in<S: KvStore>(
    store: &S,
    keys: &Keys,
    roster: &Roster,
    me: MemberId,
    beating: &[MemberId],
    reach: &dyn Reach,
) -> Result<(), StoreError> {
    let mut peers = Vec::new();
    for &m in roster.members.iter().filter(|&&m| m != me && beating.contains(&m)) {
        if let Some(address) = store.get(&keys.probe(m))? {
            peers.push((m, String::from_utf8_lossy(&address).into_owned()));
        }
    }
    let unreachable = reach.unreachable(&peers);
    store.set(&keys.present(roster.epoch, me), json!(unreachable).to_string().as_bytes())
}

/// Where the protocol's records live under a job's prefix.
#[derive(Debug, Clone)]
pub(super) struct Keys(pub(super) String);

impl Keys {
    pub(super) fn roster(&self, epoch: u64) -> String {
        format!("{}/roster/{epoch}", self.0)
    }
    pub(super) fn latest(&self) -> String {
        format!("{}/latest", self.0)
    }
    pub(super) fn failed(&self, epoch: u64) -> String {
        format!("{}/failed/{epoch}", self.0)
    }
    pub(super) fn present(&self, epoch: u64, member: MemberId) -> String {
        format!("{}/present/{epoch}/{member}", self.0)
    }
    pub(super) fn dead(&self, member: MemberId) -> String {
        format!("{}/dead/{member}", self.0)
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
    fn joiner(&self, n: u64) -> String {
        format!("{}/joiner/{n}", self.0)
    }
    fn admitted(&self, member: MemberId) -> String {
        format!("{}/admitted/{member}", self.0)
    }
    fn ended(&self) -> String {
        format!("{}/ended", self.0)
    }
}

/// One process's side of the membership protocol: it holds the roster this
/// process belongs to, and changes it only by adopting the one roster the
/// store holds for the next epoch.
#[derive(Debug)]
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
    /// `i` on `nodes[i]` (every first member proposes the same; the first
    /// write wins). If the job already went on without this process,
    /// [`MembershipError::LeftOut`].
    pub fn start(&mut self, initial: Vec<MemberId>, nodes: Vec<NodeId>) -> Result<&Roster, MembershipError> {
        let key = self.keys.roster(0);
        let first = self.store.compare_set(&key, b"", &Roster::first_on(initial, nodes)?.encode())?;
        self.roster = Roster::decode(&key, &first)?;
        let latest = self.latest()?;
        self.adopt(latest)
    }

    /// The newest roster in the store.
    fn latest(&self) -> Result<Roster, MembershipError> {
        newest_roster(&self.store, &self.keys)?.ok_or_else(|| MembershipError::Malformed {
            key: self.keys.roster(0),
            why: "the job has no roster: is this the job's store?".into(),
        })
    }

    /// Take `roster` as this process's own, or leave if it is not a member.
    fn adopt(&mut self, roster: Roster) -> Result<&Roster, MembershipError> {
        if roster.rank_of(self.me).is_none() {
            return Err(MembershipError::LeftOut { member: self.me, epoch: roster.epoch });
        }
        if roster.epoch > self.roster.epoch || self.roster.members.is_empty() {
            self.store.set(&self.keys.latest(), roster.epoch.to_string().as_bytes())?;
        }
        self.roster = roster;
        Ok(&self.roster)
    }

    /// Propose `next` for the next epoch and adopt whichever roster won.
    fn propose(&mut self, next: &Roster) -> Result<&Roster, MembershipError> {
        let key = self.keys.roster(next.epoch);
        let winner = self.store.compare_set(&key, b"", &next.encode())?;
        let winner = Roster::decode(&key, &winner)?;
        self.adopt(winner)
    }

    /// The roster of the next epoch, if some process already decided it.
    fn decided(&self) -> Result<Option<Roster>, MembershipError> {
        let key = self.keys.roster(self.roster.epoch + 1);
        self.store.get(&key)?.map(|bytes| Roster::decode(&key, &bytes)).transpose()
    }

    /// The current epoch lost a member (a collective failed, or the monitor
    /// broke the epoch): agree with the survivors on the next roster.
    /// `suspects` are members the failure named; `liveness` is what this
    /// process knows of the members' heartbeats (its [`super::Monitor`]): a
    /// member whose heartbeat moves is waited for, however slow it is to
    /// check in (up to [`Timing::check_in`]). Before it checks in, this
    /// process probes the peers whose heartbeat moves with `reach` and
    /// names those it cannot reach in its check-in. Returns the roster this
    /// process goes on in.
    pub fn recover(
        &mut self,
        suspects: &[MemberId],
        liveness: &impl Liveness,
        reach: &dyn Reach,
    ) -> Result<&Roster, MembershipError> {
        let epoch = self.roster.epoch;
        self.store.set(&self.keys.failed(epoch), b"1")?;
        let beating = liveness.beating(self.timing.liveness);
        check_in(&self.store, &self.keys, &self.roster, self.me, &beating, reach)?;
        let began = Instant::now();
        loop {
            if let Some(next) = self.decided()? {
                return self.adopt(next);
            }
            let (tally, unknown) = self.tally(suspects, liveness, began.elapsed())?;
            if unknown.is_empty() {
                let next = self.roster.after_loss(&tally, self.minimum)?;
                return self.propose(&next);
            }
            sleep(self.timing.poll);
        }
    }

    /// Who is present (and whom each could not reach), and who is not
    /// known yet; the others are gone: reaped (an obituary), or silent. A
    /// member is silent when its heartbeat stopped for its window; when it is a
    /// suspect quiet since `suspect_grace`; when it has not checked in for
    /// `liveness` and is not beating (with no monitor: nobody is known to
    /// beat); or after `check_in` whatever its heartbeat does.
    fn tally(
        &self,
        suspects: &[MemberId],
        liveness: &impl Liveness,
        waited: Duration,
    ) -> Result<(Tally, Vec<MemberId>), MembershipError> {
        let epoch = self.roster.epoch;
        let mut tally = Tally::default();
        let mut unknown = Vec::new();
        let silent = liveness.silent();
        let (grace, window) = (self.timing.suspect_grace, self.timing.liveness);
        // Quiet: not checked in for that long, and no heartbeat seen in it either.
        let (beating_grace, beating_window) = (liveness.beating(grace), liveness.beating(window));
        let quiet_for_grace = |m: MemberId| waited >= grace && !beating_grace.contains(&m);
        let quiet_for_window = |m: MemberId| waited >= window && !beating_window.contains(&m);
        for &m in &self.roster.members {
            if let Some(record) = self.store.get(&self.keys.present(epoch, m))? {
                tally.present.push(m);
                // The members it could not reach (`[]`: none).
                let apart: Vec<MemberId> = serde_json::from_slice(&record).unwrap_or_default();
                tally.unreachable.extend(apart.into_iter().map(|other| (m, other)));
            } else {
                let reaped = self.store.get(&self.keys.dead(m))?.is_some();
                let gone = reaped
                    || silent.contains(&m)
                    || (suspects.contains(&m) && quiet_for_grace(m))
                    || quiet_for_window(m)
                    || waited >= self.timing.check_in;
                if !gone {
                    unknown.push(m);
                }
            }
        }
        Ok((tally, unknown))
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
        if let Some(next) = self.decided()? {
            return self.adopt(next);
        }
        let next = self.roster.without(odd)?;
        self.propose(&next)
    }

    /// How many join requests the job has received.
    pub fn joiners_waiting(&self) -> Result<u64, MembershipError> {
        Ok(self.store.add(&self.keys.joiners(), 0)?.max(0) as u64)
    }

    /// Every member, at the same step boundary (the step whose control vote
    /// said a process waits): admit the waiting joiners whose `fingerprint`
    /// (model and optimizer layout) equals this member's; refuse the others
    /// with a message naming the difference.
    pub fn admit(&mut self, fingerprint: &str) -> Result<&Roster, MembershipError> {
        if let Some(next) = self.decided()? {
            return self.admit_adopt(next);
        }
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
        let key = self.keys.roster(next.epoch);
        let winner = Roster::decode(&key, &self.store.compare_set(&key, b"", &next.encode())?)?;
        self.admit_adopt(winner)
    }

    /// Adopt an admission's roster and tell its joiners.
    fn admit_adopt(&mut self, next: Roster) -> Result<&Roster, MembershipError> {
        for &j in &next.joined {
            self.store.set(&self.keys.admitted(j), json!({ "epoch": next.epoch }).to_string().as_bytes())?;
        }
        self.adopt(next)
    }

    /// The `n`-th join request: `(member, node, fingerprint)` (waits
    /// briefly: the joiner counts itself before it writes its request).
    fn join_request(&self, n: u64) -> Result<(MemberId, NodeId, String), MembershipError> {
        let key = self.keys.joiner(n);
        let began = Instant::now();
        loop {
            if let Some(bytes) = self.store.get(&key)? {
                let bad = |why: &str| MembershipError::Malformed { key: key.clone(), why: why.into() };
                let v: Value = serde_json::from_slice(&bytes).map_err(|e| bad(&e.to_string()))?;
                let member = v["member"].as_u64().ok_or_else(|| bad("no 'member'"))?;
                let node = v["node"].as_u64().ok_or_else(|| bad("no 'node'"))?;
                let fingerprint = v["fingerprint"].as_str().ok_or_else(|| bad("no 'fingerprint'"))?;
                return Ok((member, node, fingerprint.to_string()));
            }
            if began.elapsed() > self.timing.liveness {
                return Err(MembershipError::Deadline {
                    what: format!("reading join request {n}"),
                    waited_s: began.elapsed().as_secs_f64(),
                });
            }
            sleep(self.timing.poll);
        }
    }

    /// A process that is not a member asks to join with its model and
    /// optimizer `fingerprint`, and waits until the members admit it at a
    /// step boundary (or refuse it). Returns the roster it joined.
    pub fn request_join(&mut self, fingerprint: &str) -> Result<&Roster, MembershipError> {
        let n = (self.store.add(&self.keys.joiners(), 1)? - 1) as u64;
        let request = json!({ "member": self.me, "node": self.node, "fingerprint": fingerprint }).to_string();
        self.store.set(&self.keys.joiner(n), request.as_bytes())?;
        let key = self.keys.admitted(self.me);
        let began = Instant::now();
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
            if began.elapsed() > self.timing.admission {
                return Err(MembershipError::Deadline {
                    what: "waiting to be admitted".into(),
                    waited_s: began.elapsed().as_secs_f64(),
                });
            }
            sleep(self.timing.poll.max(Duration::from_millis(20)));
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
        let mut left = Vec::new();
        for m in newest.map(|r| r.members).unwrap_or_default() {
            if store.get(&keys.dead(m))?.is_none() {
                left.push(m);
            }
        }
        Ok(left)
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
        Ok(store.set(&Keys(prefix.to_string()).dead(member), b"1")?)
    }
}

#[cfg(test)]
mod tests {
    use std::thread;

    use super::super::MemoryKv;
    use super::*;

    fn fast() -> Timing {
        Timing {
            poll: Duration::from_millis(1),
            liveness: Duration::from_millis(400),
            suspect_grace: Duration::from_millis(50),
            check_in: Duration::from_secs(2),
            admission: Duration::from_secs(5),
        }
    }

    fn members(store: &MemoryKv, n: u64) -> Vec<Agreement<MemoryKv>> {
        (0..n)
            .map(|m| {
                let mut a = Agreement::new(store.clone(), "job", m, fast());
                a.start((0..n).collect(), vec![0; n as usize]).unwrap();
                a
            })
            .collect()
    }

    #[test]
    fn survivors_of_a_reaped_member_agree_at_once_on_one_roster() {
        let store = MemoryKv::default();
        let mut all = members(&store, 4);
        Agreement::obituary(&store, "job", 2).unwrap();
        all.remove(2);
        let began = Instant::now();
        let rosters: Vec<Roster> = thread::scope(|s| {
            let hs: Vec<_> = all.iter_mut().map(|a| s.spawn(move || a.recover(&[], &(), &()).cloned())).collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(began.elapsed() < fast().liveness, "an obituary needs no silence: {:?}", began.elapsed());
        assert!(rosters.iter().all(|r| *r == rosters[0]), "one roster: {rosters:?}");
        assert_eq!(
            (rosters[0].epoch, rosters[0].members.clone(), rosters[0].lost.clone()),
            (1, vec![0, 1, 3], vec![2])
        );
    }

    #[test]
    fn a_silent_member_is_lost_after_the_liveness_window_and_a_suspect_sooner() {
        let store = MemoryKv::default();
        let mut all = members(&store, 3);
        let mut a = all.remove(0);
        let began = Instant::now();
        // Member 1 checks in (alive), member 2 never does.
        store.set(&Keys("job".into()).present(0, 1), b"1").unwrap();
        let r = a.recover(&[], &(), &()).unwrap().clone();
        assert!(began.elapsed() >= fast().liveness);
        assert_eq!(r.members, vec![0, 1]);
        // Next epoch: member 1 is named by the failure and never checks in.
        let began = Instant::now();
        let r = a.recover(&[1], &(), &()).unwrap().clone();
        assert!(began.elapsed() < fast().liveness, "a suspect is judged after its grace");
        assert_eq!(r.members, vec![0], "one of two goes on: the store, not a majority, decides");
    }

    #[test]
    fn a_job_below_its_minimum_stops_with_the_minimum_named() {
        let store = MemoryKv::default();
        let mut all: Vec<_> = members(&store, 4).into_iter().map(|a| a.with_minimum(3)).collect();
        Agreement::obituary(&store, "job", 2).unwrap();
        Agreement::obituary(&store, "job", 3).unwrap();
        let e = thread::scope(|s| {
            let hs: Vec<_> =
                all.iter_mut().take(2).map(|a| s.spawn(move || a.recover(&[], &(), &()).cloned())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        for r in e {
            let e = r.unwrap_err();
            assert!(matches!(e, MembershipError::NoQuorum { minimum: 3, .. }), "{e}");
            assert!(e.to_string().contains("minimum of 3"), "{e}");
        }
    }

    /// A test's view of reachability: each member's side of a partition.
    struct Sides(Vec<MemberId>);

    impl Reach for Sides {
        fn unreachable(&self, peers: &[(MemberId, String)]) -> Vec<MemberId> {
            peers.iter().map(|(m, _)| *m).filter(|m| !self.0.contains(m)).collect()
        }
    }

    #[test]
    fn a_partition_whose_sides_both_reach_the_store_goes_on_on_one_side_only() {
        let store = MemoryKv::default();
        let mut all = members(&store, 5);
        for a in &all {
            a.publish_probe(&format!("host-of-{}:1", a.me())).unwrap();
        }
        // Members {0, 1} and {2, 3, 4} reach the store, not each other; all beat.
        let everyone = Heard { silent: vec![], beating: (0..5).collect() };
        let results: Vec<Result<Roster, MembershipError>> = thread::scope(|s| {
            let hs: Vec<_> = all
                .iter_mut()
                .map(|a| {
                    let side = Sides(if a.me() < 2 { vec![0, 1] } else { vec![2, 3, 4] });
                    let everyone = &everyone;
                    s.spawn(move || a.recover(&[], everyone, &side).cloned())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let rosters: Vec<&Roster> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(rosters.len(), 3, "only one side goes on: {results:?}");
        assert!(rosters.iter().all(|r| r.members == vec![2, 3, 4] && r.epoch == 1), "the larger side: {rosters:?}");
        for (m, r) in results.iter().enumerate().take(2) {
            assert_eq!(r.as_ref().unwrap_err(), &MembershipError::LeftOut { member: m as u64, epoch: 1 });
        }
        // Equal sides: still one roster (the side holding rank 0), the other left out.
        let store = MemoryKv::default();
        let mut all = members(&store, 4);
        for a in &all {
            a.publish_probe("h:1").unwrap();
        }
        let everyone = Heard { silent: vec![], beating: (0..4).collect() };
        let went_on: Vec<bool> = thread::scope(|s| {
            let hs: Vec<_> = all
                .iter_mut()
                .map(|a| {
                    let side = Sides(if a.me() % 2 == 0 { vec![0, 2] } else { vec![1, 3] });
                    let everyone = &everyone;
                    s.spawn(move || a.recover(&[], everyone, &side).is_ok())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(went_on, vec![true, false, true, false]);
    }

    #[test]
    fn a_member_the_others_left_out_learns_it_and_leaves() {
        let store = MemoryKv::default();
        let mut all = members(&store, 3);
        Agreement::obituary(&store, "job", 2).unwrap();
        // Member 1 is alive but too slow, so 0 sees it silent (monitor's
        // view) and 2 is dead: 0 goes on alone, and the store says so to 1.
        let r = all[0].recover(&[], &Heard { silent: vec![1], beating: vec![] }, &()).unwrap().clone();
        assert_eq!(r.members, vec![0]);
        assert_eq!(all[1].recover(&[], &(), &()).unwrap_err(), MembershipError::LeftOut { member: 1, epoch: 1 });
        // Member 1 had gone silent; member 0 and a third survivor decide.
        let store = MemoryKv::default();
        let mut all = members(&store, 3);
        let decided = all[0].roster().after_loss(&Tally { present: vec![0, 2], ..Tally::default() }, 1).unwrap();
        store.compare_set(&Keys("job".into()).roster(1), b"", &decided.encode()).unwrap();
        let e = all[1].recover(&[], &(), &()).unwrap_err();
        assert_eq!(e, MembershipError::LeftOut { member: 1, epoch: 1 });
        assert_eq!(all[2].recover(&[], &(), &()).unwrap().members, vec![0, 2]);
    }

    #[test]
    fn a_joiner_is_admitted_at_the_members_boundary_and_a_mismatch_is_refused() {
        let store = MemoryKv::default();
        let mut all = members(&store, 2);
        let joiner = thread::spawn({
            let store = store.clone();
            move || Agreement::new(store, "job", 7, fast()).request_join("model A").cloned()
        });
        let odd = thread::spawn({
            let store = store.clone();
            move || Agreement::new(store, "job", 8, fast()).request_join("model B").cloned()
        });
        while all[0].joiners_waiting().unwrap() < 2 {
            thread::sleep(Duration::from_millis(1));
        }
        let rosters: Vec<Roster> = all.iter_mut().map(|a| a.admit("model A").unwrap().clone()).collect();
        assert_eq!(rosters[0], rosters[1]);
        assert_eq!((rosters[0].members.clone(), rosters[0].joined.clone()), (vec![0, 1, 7], vec![7]));
        assert_eq!(joiner.join().unwrap().unwrap(), rosters[0], "the joiner adopts the members' roster");
        let e = odd.join().unwrap().unwrap_err();
        assert!(matches!(&e, MembershipError::Refused { member: 8, why } if why.contains("model B")), "{e}");
        assert_eq!(all[0].joiners_waiting().unwrap(), rosters[0].joiners_seen, "nothing left waiting");
        let late = thread::spawn({
            let store = store.clone();
            move || Agreement::new(store, "job", 9, fast()).request_join("model A").cloned()
        });
        all[0].end().unwrap();
        assert_eq!(late.join().unwrap().unwrap_err(), MembershipError::Ended { member: 9 }, "the job ended first");
    }

    /// A test's view of the heartbeats.
    struct Heard {
        silent: Vec<MemberId>,
        beating: Vec<MemberId>,
    }

    impl Liveness for Heard {
        fn silent(&self) -> Vec<MemberId> {
            self.silent.clone()
        }
        fn beating(&self, _within: Duration) -> Vec<MemberId> {
            self.beating.clone()
        }
    }

    #[test]
    fn a_slow_member_whose_heartbeat_moves_is_waited_for_not_left_out() {
        let store = MemoryKv::default();
        let mut all = members(&store, 3);
        let mut a = all.remove(0);
        let late = thread::spawn({
            let store = store.clone();
            move || {
                // Member 1 is slow to check in (a loaded machine), well past the liveness window.
                thread::sleep(fast().liveness * 2);
                store.set(&Keys("job".into()).present(0, 1), b"1").unwrap();
            }
        });
        store.set(&Keys("job".into()).present(0, 2), b"1").unwrap();
        let r = a.recover(&[1], &Heard { silent: vec![], beating: vec![1] }, &()).unwrap().clone();
        late.join().unwrap();
        assert_eq!(r.members, vec![0, 1, 2], "nobody lost: 1 was slow, not dead");
        // A member that beats but never checks in is lost after the check-in deadline.
        store.set(&Keys("job".into()).present(1, 2), b"1").unwrap();
        let began = Instant::now();
        let r = a.recover(&[], &Heard { silent: vec![], beating: vec![1] }, &()).unwrap().clone();
        assert!(began.elapsed() >= fast().check_in, "{:?}", began.elapsed());
        assert_eq!(r.members, vec![0, 2]);
    }

    #[test]
    fn a_desync_right_after_a_change_sends_the_odd_members_away() {
        let store = MemoryKv::default();
        let mut all = members(&store, 3);
        let why = "ranks disagree on the plan";
        let e = all[2].expel(&[2], why).unwrap_err();
        assert_eq!(e, MembershipError::Refused { member: 2, why: why.into() });
        let r0 = all[0].expel(&[2], why).unwrap().clone();
        let r1 = all[1].expel(&[2], why).unwrap().clone();
        assert_eq!(r0, r1, "one roster");
        assert_eq!((r0.epoch, r0.members.clone(), r0.lost.clone()), (1, vec![0, 1], vec![2]));
    }

    #[test]
    fn a_joiner_of_a_job_with_no_member_left_gives_up() {
        let store = MemoryKv::default();
        let _all = members(&store, 2);
        assert_eq!(Agreement::members_left(&store, "job").unwrap(), vec![0, 1]);
        Agreement::obituary(&store, "job", 0).unwrap();
        Agreement::obituary(&store, "job", 1).unwrap();
        assert!(Agreement::members_left(&store, "job").unwrap().is_empty());
        let joiner = thread::spawn({
            let store = store.clone();
            move || Agreement::new(store, "job", 7, fast()).request_join("model A").cloned()
        });
        Agreement::give_up(&store, "job", "members 0 and 1 died").unwrap();
        let e = joiner.join().unwrap().unwrap_err();
        assert!(matches!(&e, MembershipError::NoMembers { member: 7, why } if why.contains("members 0 and 1")), "{e}");
    }

    #[test]
    fn a_late_first_member_finds_the_job_moved_on() {
        let store = MemoryKv::default();
        let mut all = members(&store, 3);
        Agreement::obituary(&store, "job", 2).unwrap();
        thread::scope(|s| {
            for a in all.iter_mut().take(2) {
                s.spawn(move || a.recover(&[], &(), &()).unwrap().clone());
            }
        });
        let mut late = Agreement::new(store, "job", 2, fast());
        assert_eq!(
            late.start(vec![0, 1, 2], vec![0; 3]).unwrap_err(),
            MembershipError::LeftOut { member: 2, epoch: 1 }
        );
    }
}
