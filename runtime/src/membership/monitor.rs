//! The liveness monitor: one thread per process of an elastic job, off the
//! training path (it never touches a step; a healthy step pays nothing).
//!
//! Every beat it counts its own heartbeat in the store and reads its peers'.
//! It breaks the current epoch (cancels its collectives, and records
//! `failed/{e}` for the others) when a peer's heartbeat stops for that
//! peer's window: a host that vanished without closing its sockets would
//! otherwise hold gloo for its whole timeout. When another process broke the
//! epoch it checks this process in at once and cancels too, so survivors
//! agree within a beat. It also raises the joiner flag that goes into this
//! rank's control votes.
//!
//! **Slow is not dead.** On a loaded machine a healthy peer's beats come
//! late and unevenly. Each peer's window adapts to what this monitor saw of
//! it ([`Pulse::window`]): never below the configured liveness, and above
//! the spread of its recent beat intervals (mean plus [`SPREAD`] standard
//! deviations, and [`PAUSE_FACTOR`] times the longest recent pause), so a
//! peer that has been stalling is given room to stall again while a quiet
//! machine still finds a silent host within the configured window. A peer
//! counts only once its heartbeat has moved (it is in the group), and
//! [`Liveness::beating`] tells the agreement which members are alive though
//! slow to check in, so it waits for them instead of leaving them out.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::agreement::{check_in, Keys};
use super::{KvStore, MemberId, Reach, Roster, Timing};

/// Breaks an epoch: cancels every collective of its group (the transport's part).
pub type Canceller = Box<dyn Fn(u64) + Send>;

/// Standard deviations of a peer's beat intervals above their mean that
/// its window allows (a normal tail this far out is ~1e-9: phi ≈ 9 in a
/// phi-accrual detector's terms).
pub const SPREAD: f64 = 6.0;

/// A peer's window is at least this many times the longest pause between
/// its beats that this monitor saw recently.
pub const PAUSE_FACTOR: f64 = 2.0;

/// Beat intervals kept per peer.
const INTERVALS: usize = 128;

/// What a process knows of its peers' heartbeats, for the agreement (the
/// [`Monitor`]'s view; `()` knows nothing, and the agreement then judges by
/// time alone).
pub trait Liveness {
    /// Members whose heartbeat stopped for their window.
    fn silent(&self) -> Vec<MemberId>;
    /// Members whose heartbeat moved within the last `within`.
    fn beating(&self, within: Duration) -> Vec<MemberId>;
}

impl Liveness for () {
    fn silent(&self) -> Vec<MemberId> {
        Vec::new()
    }
    fn beating(&self, _within: Duration) -> Vec<MemberId> {
        Vec::new()
    }
}

enum Command {
    /// The process adopted a new roster.
    Follow(Roster),
    /// Which members' heartbeats stopped.
    Silent(Sender<Vec<MemberId>>),
    /// Which members' heartbeats moved within the duration.
    Beating(Duration, Sender<Vec<MemberId>>),
    Stop,
}

/// What the monitor saw of one peer's heartbeat.
#[derive(Debug, Clone)]
struct Pulse {
    /// The peer's beat count when last read.
    count: i64,
    /// When this monitor saw the count change.
    changed_at: Instant,
    /// Seconds between the changes it saw, newest last (at most [`INTERVALS`]).
    intervals: VecDeque<f64>,
}

impl Pulse {
    fn new(count: i64, now: Instant) -> Pulse {
        Pulse { count, changed_at: now, intervals: VecDeque::new() }
    }

    /// The count read `now`: a change is a beat.
    fn observe(&mut self, count: i64, now: Instant) {
        if count == self.count {
            return;
        }
        if self.count > 0 {
            if self.intervals.len() == INTERVALS {
                self.intervals.pop_front();
            }
            self.intervals.push_back(now.duration_since(self.changed_at).as_secs_f64());
        }
        (self.count, self.changed_at) = (count, now);
    }

    /// How long this peer may stay silent before it is lost: `floor` (the
    /// configured liveness) or more, by the spread and the longest of its
    /// recent beat intervals.
    fn window(&self, floor: Duration) -> Duration {
        let n = self.intervals.len();
        if n == 0 {
            return floor;
        }
        let mean = self.intervals.iter().sum::<f64>() / n as f64;
        let var = self.intervals.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let longest = self.intervals.iter().copied().fold(0.0, f64::max);
        let adaptive = (mean + SPREAD * var.sqrt()).max(PAUSE_FACTOR * longest);
        floor.max(Duration::from_secs_f64(adaptive.min(3600.0)))
    }

    /// Beating at `now`: its heartbeat moved within the last `within`.
    fn beating(&self, now: Instant, within: Duration) -> bool {
        self.count > 0 && now.duration_since(self.changed_at) < within
    }

    /// Silent at `now`: its heartbeat moved once (it is in the group), then
    /// stopped for longer than its window.
    fn silent(&self, now: Instant, floor: Duration) -> bool {
        self.count > 0 && now.duration_since(self.changed_at) >= self.window(floor)
    }
}

/// A running liveness monitor (see the module docs); stops when dropped.
pub struct Monitor {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
    /// The highest epoch this process saw broken (-1: none).
    broken: Arc<AtomicI64>,
    /// Raised while a join request waits (read by the scheduler's votes).
    joiner_waiting: Arc<AtomicBool>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").field("broken", &self.broken()).finish_non_exhaustive()
    }
}

/// What the monitor thread owns.
struct Watch<S: KvStore> {
    store: S,
    keys: Keys,
    me: MemberId,
    roster: Roster,
    timing: Timing,
    cancel: Canceller,
    broken: Arc<AtomicI64>,
    joiner_waiting: Arc<AtomicBool>,
    /// Per peer: what this monitor saw of its heartbeat.
    beats: HashMap<MemberId, Pulse>,
    /// Since when the store has been failing (this process may be the one cut off).
    store_failing: Option<Instant>,
    /// Probes the peers when the monitor checks this process in.
    reach: Box<dyn Reach + Send>,
}

impl Monitor {
    /// Start monitoring `roster` as member `me`, beating every `beat`;
    /// `store` should be a connection of the monitor's own (a blocking call
    /// of the training thread must not delay a heartbeat). `cancel` breaks
    /// an epoch's collectives; `joiner_waiting` is the flag it raises while a
    /// process waits to join; `reach` probes the peers when it checks this
    /// process in (see [`super::Agreement::recover`]).
    #[allow(clippy::too_many_arguments)]
    pub fn start<S: KvStore>(
        store: S,
        prefix: impl Into<String>,
        me: MemberId,
        roster: Roster,
        timing: Timing,
        beat: Duration,
        cancel: Canceller,
        joiner_waiting: Arc<AtomicBool>,
        reach: Box<dyn Reach + Send>,
    ) -> std::io::Result<Monitor> {
        let (commands, inbox) = crossbeam_channel::unbounded();
        let broken = Arc::new(AtomicI64::new(-1));
        let watching_flag = Arc::clone(&joiner_waiting);
        let mut watch = Watch {
            store,
            keys: Keys(prefix.into()),
            me,
            roster,
            timing,
            cancel,
            broken: Arc::clone(&broken),
            joiner_waiting: watching_flag,
            beats: HashMap::new(),
            store_failing: None,
            reach,
        };
        let thread = std::thread::Builder::new()
            .name(format!("gradsync-liveness-{me}"))
            .spawn(move || watch.run(&inbox, beat))?;
        Ok(Monitor { commands, thread: Some(thread), broken, joiner_waiting })
    }

    /// This process adopted `roster`: watch its members and epoch.
    pub fn follow(&self, roster: Roster) {
        let _ = self.commands.send(Command::Follow(roster));
    }

    /// Members whose heartbeats stopped for their window.
    pub fn silent(&self) -> Vec<MemberId> {
        self.ask(Command::Silent)
    }

    /// Members whose heartbeats moved within the last `within`.
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
    fn silent(&self) -> Vec<MemberId> {
        Monitor::silent(self)
    }
    fn beating(&self, within: Duration) -> Vec<MemberId> {
        Monitor::beating(self, within)
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

impl<S: KvStore> Watch<S> {
    fn run(&mut self, inbox: &Receiver<Command>, beat: Duration) {
        let mut next = Instant::now();
        loop {
            match inbox.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Ok(Command::Follow(roster)) => {
                    self.roster = roster;
                    self.beats.retain(|m, _| self.roster.members.contains(m));
                    continue;
                }
                Ok(Command::Silent(reply)) => {
                    let _ = reply.send(self.silent(Instant::now()));
                    continue;
                }
                Ok(Command::Beating(within, reply)) => {
                    let _ = reply.send(self.peers(|p| p.beating(Instant::now(), within)));
                    continue;
                }
                Ok(Command::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {}
            }
            next = Instant::now() + beat;
            match self.tick() {
                Ok(()) => self.store_failing = None,
                Err(e) => {
                    let since = *self.store_failing.get_or_insert_with(Instant::now);
                    tracing::warn!(member = self.me, error = %e, "gradsync liveness: the store did not answer");
                    if since.elapsed() >= self.timing.liveness {
                        // Cut off from the store: this process cannot take part in any agreement.
                        self.break_epoch();
                    }
                }
            }
        }
    }

    /// Members whose heartbeat has moved at least once and then stopped for its window.
    fn silent(&self, now: Instant) -> Vec<MemberId> {
        self.peers(|p| p.silent(now, self.timing.liveness))
    }

    /// The peers whose pulse passes `test`, in id order.
    fn peers(&self, test: impl Fn(&Pulse) -> bool) -> Vec<MemberId> {
        let mut found: Vec<MemberId> = self.beats.iter().filter(|(_, p)| test(p)).map(|(&m, _)| m).collect();
        found.sort_unstable();
        found
    }

    fn tick(&mut self) -> Result<(), super::StoreError> {
        self.store.add(&self.keys.beat(self.me), 1)?;
        for &m in &self.roster.members {
            if m == self.me {
                continue;
            }
            let count = self.store.add(&self.keys.beat(m), 0)?;
            // Read now: a slow store round trip must not count against the peer.
            let now = Instant::now();
            self.beats.entry(m).and_modify(|p| p.observe(count, now)).or_insert_with(|| Pulse::new(count, now));
        }
        let epoch = self.roster.epoch;
        let unbroken = self.broken.load(Ordering::Acquire) < epoch as i64;
        if unbroken {
            let silent = self.silent(Instant::now());
            if !silent.is_empty() {
                tracing::warn!(member = self.me, epoch, ?silent, "gradsync liveness: heartbeats stopped");
                self.store.set(&self.keys.failed(epoch), b"1")?;
            }
            if self.store.get(&self.keys.failed(epoch))?.is_some() {
                let beating = self.peers(|p| p.beating(Instant::now(), self.timing.liveness));
                check_in(&self.store, &self.keys, &self.roster, self.me, &beating, self.reach.as_ref())?;
                self.break_epoch();
            }
        }
        let waiting = self.store.add(&self.keys.joiners(), 0)?.max(0) as u64;
        self.joiner_waiting.store(waiting > self.roster.joiners_seen, Ordering::Release);
        Ok(())
    }

    /// Cancel the current epoch's collectives (once).
    fn break_epoch(&mut self) {
        let epoch = self.roster.epoch;
        if self.broken.fetch_max(epoch as i64, Ordering::AcqRel) < epoch as i64 {
            (self.cancel)(epoch);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::super::MemoryKv;
    use super::*;

    fn timing() -> Timing {
        Timing { liveness: Duration::from_millis(300), ..Timing::default() }
    }

    fn watching(store: &MemoryKv, me: MemberId, members: Vec<MemberId>, cancelled: &Arc<Mutex<Vec<u64>>>) -> Monitor {
        let log = Arc::clone(cancelled);
        let cancel: Canceller = Box::new(move |e| log.lock().unwrap().push(e));
        let flag = Arc::new(AtomicBool::new(false));
        Monitor::start(
            store.clone(),
            "job",
            me,
            Roster::first(members),
            timing(),
            Duration::from_millis(20),
            cancel,
            flag,
            Box::new(()),
        )
        .unwrap()
    }

    fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Duration {
        let began = Instant::now();
        while !done() {
            assert!(began.elapsed() < within, "{what} not within {within:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        began.elapsed()
    }

    #[test]
    fn a_peer_whose_heartbeat_stops_breaks_the_epoch_within_the_window() {
        let store = MemoryKv::default();
        let cancelled = Arc::new(Mutex::new(Vec::new()));
        let a = watching(&store, 0, vec![0, 1], &cancelled);
        let b = watching(&store, 1, vec![0, 1], &Arc::new(Mutex::new(Vec::new())));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(a.broken(), None, "both beating");
        drop(b); // its heartbeat stops, its sockets (none here) stay silent
        let took = wait_for("detection", Duration::from_secs(2), || a.broken() == Some(0));
        assert!(took >= Duration::from_millis(250), "not before the window: {took:?}");
        assert_eq!(a.silent(), vec![1]);
        assert_eq!(*cancelled.lock().unwrap(), vec![0], "cancelled once");
        assert!(store.get(&Keys("job".into()).failed(0)).unwrap().is_some(), "the others learn it");
    }

    #[test]
    fn a_window_grows_with_the_pauses_a_peer_showed_and_never_drops_below_the_floor() {
        let floor = Duration::from_millis(300);
        let t0 = Instant::now();
        let mut steady = Pulse::new(1, t0);
        for i in 1..50 {
            steady.observe(1 + i, t0 + Duration::from_millis(100 * i as u64));
        }
        assert_eq!(steady.window(floor), floor, "even beats: the configured window");
        let mut jittery = Pulse::new(1, t0);
        let mut at = t0;
        for (i, gap) in [100, 100, 700, 100, 100, 900, 100].into_iter().enumerate() {
            at += Duration::from_millis(gap);
            jittery.observe(2 + i as i64, at);
        }
        let window = jittery.window(floor);
        assert!(window >= Duration::from_millis(1800), "twice its longest pause: {window:?}");
        assert!(!jittery.silent(at + Duration::from_millis(1000), floor), "a pause like before is not a loss");
        assert!(jittery.silent(at + window, floor));
        let never = Pulse::new(0, t0);
        assert!(!never.silent(t0 + Duration::from_secs(60), floor), "not counted before its first beat");
    }

    #[test]
    fn a_peer_that_stalls_more_and_more_is_given_room_and_still_found_when_it_stops() {
        let store = MemoryKv::default();
        let cancelled = Arc::new(Mutex::new(Vec::new()));
        let a = watching(&store, 0, vec![0, 1], &cancelled);
        // Member 1 beats every 20 ms with stalls (a loaded machine): 200, 250 ms, then 450 ms,
        // longer than the 300 ms window but within twice the pauses seen before it.
        let beat = |n: usize| {
            for _ in 0..n {
                store.add(&Keys("job".into()).beat(1), 1).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        for stall in [200, 250, 450] {
            beat(10);
            std::thread::sleep(Duration::from_millis(stall));
        }
        beat(10);
        assert_eq!(a.broken(), None, "a slow peer is not a lost one");
        assert_eq!(a.beating(Duration::from_millis(200)), vec![1]);
        let took = wait_for("detection", Duration::from_secs(3), || a.broken() == Some(0));
        assert!(took >= Duration::from_millis(800), "its window is twice its longest stall: {took:?}");
        assert_eq!(a.silent(), vec![1]);
    }

    #[test]
    fn another_process_breaking_the_epoch_checks_this_one_in_at_once() {
        let store = MemoryKv::default();
        let cancelled = Arc::new(Mutex::new(Vec::new()));
        let a = watching(&store, 0, vec![0, 1, 2], &cancelled);
        store.set(&Keys("job".into()).failed(0), b"1").unwrap();
        wait_for("check-in", Duration::from_millis(500), || a.broken() == Some(0));
        assert!(store.get(&Keys("job".into()).present(0, 0)).unwrap().is_some());
        // The next epoch is watched afresh.
        a.follow(Roster { epoch: 1, ..Roster::first(vec![0, 1]) });
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(a.broken(), Some(0));
    }

    #[test]
    fn a_waiting_joiner_raises_the_flag_until_a_roster_counts_it() {
        let store = MemoryKv::default();
        let a = watching(&store, 0, vec![0], &Arc::new(Mutex::new(Vec::new())));
        let flag = a.joiner_flag();
        store.add(&Keys("job".into()).joiners(), 1).unwrap();
        wait_for("flag up", Duration::from_millis(500), || flag.load(Ordering::Acquire));
        a.follow(Roster { epoch: 1, joiners_seen: 1, ..Roster::first(vec![0, 5]) });
        wait_for("flag down", Duration::from_millis(500), || !flag.load(Ordering::Acquire));
    }
}
