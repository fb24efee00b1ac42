//! The liveness monitor: one thread per process of an elastic job, off the
//! training path (it never touches a step; a healthy step pays nothing).
//!
//! Every beat it writes its own heartbeat and reads, in the same call
//! ([`KvStore::set_and_count`]: one round trip on etcd, two on a TCPStore),
//! the heartbeats of the few peers it watches ([`super::watch`]), whether
//! the epoch broke, and how many processes asked to join: one store call
//! per member per beat, whatever the size of the job. When a peer it
//! watches falls silent for that peer's window it accuses it in the store and breaks the epoch (cancels its collectives,
//! and marks `broken/{e}` for the others): a host that vanished without
//! closing its sockets would otherwise hold gloo for its whole timeout. When
//! another process broke the epoch it checks this process in at once and
//! cancels too, so survivors agree within a beat. It also raises the joiner
//! flag that goes into this rank's control votes.
//!
//! **Slow is not dead.** On a loaded machine a healthy peer's beats come
//! late and unevenly; each peer's window adapts to what this monitor saw of
//! it (see [`super::watch`]). Silence is judged per peer at the instant its
//! beat was read (the start of the batched read), against the end of the
//! read that last showed it move, so a slow store delays detection by its
//! round trip and never accuses anyone. A monitor that was itself late (a
//! tick more than [`Timing::slack`] behind, or a store call that much
//! slower than its recent ones: a stall) was not watching: it accuses no
//! one until its peers have had a whole window in its sight again. Before
//! it accuses a peer it probes it: a peer whose process answers is alive
//! and its beats late (a store that serves some clients far slower than
//! others, as an overloaded etcd does), and it is given [`VOUCHED_FACTOR`]
//! windows; a cut host, a stopped or killed process does not answer.
//!
//! The tick is a state machine ([`Watch::tick`]) over a store and a clock,
//! driven directly by the unit tests; the thread only calls it every beat.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::clock::{SharedClock, SystemClock};
use super::records::{accuse, check_in, mark_broken, probe_addresses, Keys};
use super::watch::{probed, strides, watched, Pulse};
use super::{KvStore, MemberId, Reach, Roster, StoreError, Timing};

/// How many of its beats' store calls a monitor remembers the duration of.
const RECENT: usize = 16;

/// A watched peer that looks silent but whose process answers a probe is
/// accused only once silent this many times its window (its heartbeats do
/// not reach the store, or reach it late: a store that serves some clients
/// far slower than others, or a peer cut off from the store alone).
pub const VOUCHED_FACTOR: u32 = 3;

/// Breaks an epoch: cancels every collective of its group (the transport's part).
pub type Canceller = Box<dyn Fn(u64) + Send>;

/// What a process knows of the peers it watches, for the agreement (the
/// [`Monitor`]'s view; `()` knows nothing).
pub trait Liveness {
    /// The peers this process watches whose heartbeat moved within the last
    /// `within` (whom its check-in probes); `None`: it watches nobody.
    fn beating(&self, within: Duration) -> Option<Vec<MemberId>>;
    /// Whether this process has checked in to the agreement that follows
    /// `epoch`, waiting up to `within` for a check-in already under way.
    fn checked_in(&self, epoch: u64, within: Duration) -> bool;
}

impl Liveness for () {
    fn beating(&self, _within: Duration) -> Option<Vec<MemberId>> {
        None
    }
    fn checked_in(&self, _epoch: u64, _within: Duration) -> bool {
        false
    }
}

enum Command {
    /// The process adopted a new roster.
    Follow(Roster),
    /// Which watched peers' heartbeats stopped.
    Silent(Sender<Vec<MemberId>>),
    /// Which watched peers' heartbeats moved within the duration.
    Beating(Duration, Sender<Vec<MemberId>>),
    Stop,
}

/// A running liveness monitor (see the module docs); stops when dropped.
pub struct Monitor {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    /// The highest epoch this process saw broken (-1: none).
    broken: Arc<AtomicI64>,
    /// The highest epoch this process checked in after (-1: none).
    checked_in: Arc<AtomicI64>,
    /// The highest epoch whose check-in the monitor took on (-1: none): set
    /// before it cancels, so the training thread waits for that check-in
    /// instead of making a second one.
    checking_in: Arc<AtomicI64>,
    /// Raised while a join request waits (read by the scheduler's votes).
    joiner_waiting: Arc<AtomicBool>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").field("broken", &self.broken()).finish_non_exhaustive()
    }
}

/// What the monitor thread owns: one member's watch over its peers.
pub(super) struct Watch<S: KvStore> {
    store: S,
    keys: Keys,
    me: MemberId,
    roster: Roster,
    timing: Timing,
    clock: SharedClock,
    cancel: Canceller,
    flags: Flags,
    /// The peers watched in this epoch.
    watched: Vec<MemberId>,
    /// The keys of the one batched read: the watched peers' beats, then
    /// `broken/{e}`, then the join requests' count.
    reads: Vec<String>,
    /// Per watched peer: what this monitor saw of its heartbeat.
    pulses: HashMap<MemberId, Pulse>,
    /// The probe addresses of peers watched in this epoch or an earlier
    /// one, each looked up once in a quiet tick (a member's never changes;
    /// `None`: it had published none then, looked up again only before an
    /// accusation): a check-in then costs the store no read per peer.
    addresses: HashMap<MemberId, Option<String>>,
    /// This process's own heartbeat count.
    count: i64,
    /// When the previous tick ended (its read came back).
    last_tick: Option<Instant>,
    /// How long the last beats' store calls took (at most [`RECENT`]): a
    /// store that is slow all the time is this store's pace; one call far
    /// slower than those (a stall) makes the monitor blind for that time.
    recent: VecDeque<Duration>,
    /// Silence counts only from here on: the end of this monitor's last
    /// blind spell (a late tick, a slow read).
    sighted: Instant,
    /// Watched peers that looked silent but answered a probe, and when the
    /// first such answer came (cleared when the peer beats again).
    vouched: HashMap<MemberId, Instant>,
    /// Since when the store has been failing (this process may be the one cut off).
    store_failing: Option<Instant>,
    /// Probes the watched peers when the monitor checks this process in.
    reach: Box<dyn Reach + Send>,
}

impl Monitor {
    /// Start monitoring `roster` as member `me`, beating every
    /// [`Timing::beat`]; `store` should be a connection of the monitor's
    /// own (a blocking call of the training thread must not delay a
    /// heartbeat). `cancel` breaks an epoch's collectives; `joiner_waiting`
    /// is the flag it raises while a process waits to join; `reach` probes
    /// the watched peers when it checks this process in (see
    /// [`super::Agreement::recover`]).
    #[allow(clippy::too_many_arguments)]
    pub fn start<S: KvStore>(
        store: S,
        prefix: impl Into<String>,
        me: MemberId,
        roster: Roster,
        timing: Timing,
        cancel: Canceller,
        joiner_waiting: Arc<AtomicBool>,
        reach: Box<dyn Reach + Send>,
    ) -> std::io::Result<Monitor> {
        let (commands, inbox) = crossbeam_channel::unbounded();
        let flags = Flags::new(joiner_waiting);
        let mut watch = Watch::new(
            store,
            Keys(prefix.into()),
            me,
            roster,
            timing,
            Arc::new(SystemClock),
            cancel,
            flags.clone(),
            reach,
        );
        let thread =
            std::thread::Builder::new().name(format!("gradsync-liveness-{me}")).spawn(move || watch.run(&inbox))?;
        let Flags { broken, checked_in, checking_in, joiner_waiting } = flags;
        Ok(Monitor { commands, thread: Some(thread), broken, checked_in, checking_in, joiner_waiting })
    }

    /// This process adopted `roster`: watch its members and epoch.
    pub fn follow(&self, roster: Roster) {
        let _ = self.commands.send(Command::Follow(roster));
    }

    /// Watched peers whose heartbeats stopped for their window.
    pub fn silent(&self) -> Vec<MemberId> {
        self.ask(Command::Silent)
    }

    /// Watched peers whose heartbeats moved within the last `within`.
    pub fn beating(&self, within: Duration) -> Vec<MemberId> {
        self.ask(|tx| Command::Beating(within, tx))
    }

    fn ask(&self, command: impl FnOnce(Sender<Vec<MemberId>>) -> Command) -> Vec<MemberId> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.commands.send(command(tx)).is_err() {
            return Vec::new();
        }
        rx.recv_timeout(Duration::from_secs(5)).unwrap_or_default()
    }

    /// The highest epoch seen broken, if any.
    pub fn broken(&self) -> Option<u64> {
        u64::try_from(self.broken.load(Ordering::Acquire)).ok()
    }

    /// The flag a [`crate::GradSyncBuilder::joiner_waiting`] reads.
    pub fn joiner_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.joiner_waiting)
    }
}

impl Liveness for Monitor {
    fn beating(&self, within: Duration) -> Option<Vec<MemberId>> {
        Some(Monitor::beating(self, within))
    }
    fn checked_in(&self, epoch: u64, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.checked_in.load(Ordering::Acquire) >= epoch as i64 {
                return true;
            }
            if self.checking_in.load(Ordering::Acquire) < epoch as i64 || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a [`Watch`] shares with its [`Monitor`] (see the fields of [`Monitor`]).
#[derive(Clone, Default)]
pub(super) struct Flags {
    pub(super) broken: Arc<AtomicI64>,
    pub(super) checked_in: Arc<AtomicI64>,
    pub(super) checking_in: Arc<AtomicI64>,
    pub(super) joiner_waiting: Arc<AtomicBool>,
}

impl Flags {
    fn new(joiner_waiting: Arc<AtomicBool>) -> Flags {
        let none = || Arc::new(AtomicI64::new(-1));
        Flags { broken: none(), checked_in: none(), checking_in: none(), joiner_waiting }
    }
}

impl<S: KvStore> Watch<S> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        store: S,
        keys: Keys,
        me: MemberId,
        roster: Roster,
        timing: Timing,
        clock: SharedClock,
        cancel: Canceller,
        flags: Flags,
        reach: Box<dyn Reach + Send>,
    ) -> Self {
        let sighted = clock.now();
        let mut watch = Watch {
            store,
            keys,
            me,
            roster: Roster::first(Vec::new()),
            timing,
            clock,
            cancel,
            flags,
            watched: Vec::new(),
            reads: Vec::new(),
            pulses: HashMap::new(),
            addresses: HashMap::new(),
            vouched: HashMap::new(),
            count: 0,
            last_tick: None,
            recent: VecDeque::new(),
            sighted,
            store_failing: None,
            reach,
        };
        watch.follow(roster);
        watch
    }

    fn run(&mut self, inbox: &Receiver<Command>) {
        let mut next = Instant::now();
        loop {
            match inbox.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Ok(Command::Follow(roster)) => {
                    self.follow(roster);
                    continue;
                }
                Ok(Command::Silent(reply)) => {
                    let _ = reply.send(self.silent_now());
                    continue;
                }
                Ok(Command::Beating(within, reply)) => {
                    let _ = reply.send(self.beating(within));
                    continue;
                }
                Ok(Command::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {}
            }
            next = Instant::now() + self.timing.beat;
            self.tick_or_note_failure();
        }
    }

    /// One beat: [`Watch::tick`], and if the store keeps failing for the
    /// liveness window, break the epoch (this process is cut off from the
    /// store and can take part in no agreement).
    pub(super) fn tick_or_note_failure(&mut self) {
        match self.tick() {
            Ok(()) => self.store_failing = None,
            Err(e) => {
                let now = self.clock.now();
                let since = *self.store_failing.get_or_insert(now);
                tracing::warn!(member = self.me, error = %e, "gradsync liveness: the store did not answer");
                if now.saturating_duration_since(since) >= self.timing.liveness {
                    self.break_epoch();
                }
            }
        }
    }

    /// Watch `roster` from now on: its peers for this member, a fresh
    /// window for each newly watched one.
    pub(super) fn follow(&mut self, roster: Roster) {
        self.watched = watched(&roster, self.me, &strides(&roster));
        let keep: HashSet<MemberId> = self.watched.iter().copied().collect();
        self.pulses.retain(|m, _| keep.contains(m));
        self.vouched.clear();
        self.reads = self.watched.iter().map(|&m| self.keys.beat(m)).collect();
        self.reads.push(self.keys.broken(roster.epoch));
        self.reads.push(self.keys.joiners());
        self.roster = roster;
    }

    /// The watched peers silent by the last read.
    fn silent_now(&self) -> Vec<MemberId> {
        let now = self.clock.now();
        self.peers(|p| p.silent(now, self.timing.liveness, self.sighted))
    }

    /// The watched peers whose heartbeat moved within `within`.
    pub(super) fn beating(&self, within: Duration) -> Vec<MemberId> {
        let now = self.clock.now();
        self.peers(|p| p.beating(now, within))
    }

    /// The watched peers whose pulse passes `test`, in id order.
    fn peers(&self, test: impl Fn(&Pulse) -> bool) -> Vec<MemberId> {
        let mut found: Vec<MemberId> = self.pulses.iter().filter(|(_, p)| test(p)).map(|(&m, _)| m).collect();
        found.sort_unstable();
        found
    }

    /// One beat (see the module docs): own heartbeat, one batched read,
    /// then the judgement of each watched peer at the instant it was read.
    pub(super) fn tick(&mut self) -> Result<(), StoreError> {
        let slack = self.timing.slack();
        let began = self.clock.now();
        // Late: this tick began more than the slack after it was due (the thread was starved).
        let late = self.last_tick.is_some_and(|last| began.saturating_duration_since(last) > self.timing.beat + slack);
        self.count += 1;
        let sent = self.clock.now();
        let values =
            self.store.set_and_count(&self.keys.beat(self.me), self.count.to_string().as_bytes(), &self.reads)?;
        let read = self.clock.now();
        self.last_tick = Some(read);
        let took = read.saturating_duration_since(sent);
        let mut usual: Vec<Duration> = self.recent.iter().copied().collect();
        usual.sort_unstable();
        let pace = usual.get(usual.len() / 2).copied().unwrap_or_default();
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(took);
        if late || took > pace + slack {
            // This monitor was not watching (its thread was starved, or the
            // store slow): none of that time counts against a peer.
            self.sighted = read;
        }
        for (&m, &count) in self.watched.iter().zip(&values) {
            let sighted = self.sighted;
            let pulse = self.pulses.entry(m).or_insert_with(|| Pulse::new(count, read));
            if pulse.count != count {
                self.vouched.remove(&m);
            }
            pulse.observe(count, read, sighted);
        }
        let n = self.watched.len();
        let (broken_in_store, joiners) = (values[n], values[n + 1].max(0) as u64);
        self.flags.joiner_waiting.store(joiners > self.roster.joiners_seen, Ordering::Release);
        let epoch = self.roster.epoch;
        if self.flags.broken.load(Ordering::Acquire) >= epoch as i64 {
            return Ok(());
        }
        let looks_silent: Vec<(MemberId, i64, Duration)> = self
            .watched
            .iter()
            .filter_map(|m| self.pulses.get(m).map(|p| (*m, p)))
            .filter(|(_, p)| p.silent(sent, self.timing.liveness, self.sighted))
            .map(|(m, p)| (m, p.count, p.window(self.timing.liveness)))
            .collect();
        let silent: Vec<(MemberId, i64)> = looks_silent
            .into_iter()
            .filter(|&(m, _, window)| !self.vouched_for(m, window, read))
            .map(|(m, count, _)| (m, count))
            .collect();
        if !silent.is_empty() {
            let ids: Vec<MemberId> = silent.iter().map(|(m, _)| *m).collect();
            tracing::warn!(member = self.me, epoch, silent = ?ids, "gradsync liveness: heartbeats stopped");
            for &(m, count) in &silent {
                accuse(&self.store, &self.keys, epoch, self.me, m, count)?;
            }
            mark_broken(&self.store, &self.keys, epoch)?;
        }
        if broken_in_store > 0 || !silent.is_empty() {
            // Take the check-in on, cancel (the training thread stops waiting at once), then probe and
            // check in; a watched peer whose address is not known yet is not probed.
            self.flags.checking_in.fetch_max(epoch as i64, Ordering::AcqRel);
            self.break_epoch();
            let probe = probed(&self.watched, Some(&self.beating(self.timing.liveness)));
            self.learn_addresses(&probe)?;
            let peers: Vec<(MemberId, String)> =
                probe.iter().filter_map(|m| Some((*m, self.addresses.get(m)?.clone()?))).collect();
            check_in(&self.store, &self.keys, &self.roster, self.me, &peers, self.reach.as_ref())?;
            self.flags.checked_in.fetch_max(epoch as i64, Ordering::AcqRel);
        } else {
            // A quiet tick: learn the watched peers' probe addresses now, off the path of an agreement.
            let watched = self.watched.clone();
            self.learn_addresses(&watched)?;
        }
        Ok(())
    }

    /// Whether silent-looking peer `m` is still given time: its process
    /// answers a probe (briefly: a quarter of the liveness window), and it
    /// has not been silent [`VOUCHED_FACTOR`] windows since it first did.
    fn vouched_for(&mut self, m: MemberId, window: Duration, now: Instant) -> bool {
        if !matches!(self.addresses.get(&m), Some(Some(_))) {
            // Not published when last looked for (a peer that was still starting): look again, once.
            if self.look_up(vec![m]).is_err() {
                return false;
            }
        }
        let Some(Some(address)) = self.addresses.get(&m) else { return false };
        if let Some(&since) = self.vouched.get(&m) {
            if now.saturating_duration_since(since) + window >= VOUCHED_FACTOR * window {
                return false;
            }
        }
        if !self.reach.vouches(m, address, self.timing.liveness / 4) {
            return false;
        }
        if !self.vouched.contains_key(&m) {
            tracing::warn!(member = self.me, peer = m, "gradsync liveness: a peer's heartbeats stopped but it answers");
        }
        self.vouched.entry(m).or_insert(now);
        true
    }

    /// Look up the probe addresses of those of `members` not looked up yet.
    fn learn_addresses(&mut self, members: &[MemberId]) -> Result<(), StoreError> {
        let unknown: Vec<MemberId> = members.iter().copied().filter(|m| !self.addresses.contains_key(m)).collect();
        if unknown.is_empty() {
            return Ok(());
        }
        self.look_up(unknown)
    }

    /// Read the probe addresses of `members` into [`Watch::addresses`].
    fn look_up(&mut self, members: Vec<MemberId>) -> Result<(), StoreError> {
        let found: HashMap<MemberId, String> =
            probe_addresses(&self.store, &self.keys, &members)?.into_iter().collect();
        for m in members {
            self.addresses.insert(m, found.get(&m).cloned());
        }
        Ok(())
    }

    /// Cancel the current epoch's collectives (once).
    fn break_epoch(&mut self) {
        let epoch = self.roster.epoch;
        if self.flags.broken.fetch_max(epoch as i64, Ordering::AcqRel) < epoch as i64 {
            (self.cancel)(epoch);
        }
    }
}

#[cfg(test)]
#[path = "monitor_tests.rs"]
mod tests;
