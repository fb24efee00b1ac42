//! The monitor's tick driven directly: a store and a clock of the test's
//! own, so what it decides never depends on how fast the machine runs the
//! test. One test runs the thread itself (real time, generous bounds).

use std::sync::Mutex;

use super::super::{Clock, ManualClock, MemoryKv, MeteredKv};
use super::*;

const PREFIX: &str = "job";

fn keys() -> Keys {
    Keys(PREFIX.into())
}

/// A watch of `me` over `members` on `store`, with the test's clock; the
/// epochs it cancelled are logged.
struct Rig<S: KvStore> {
    watch: Watch<S>,
    clock: ManualClock,
    cancelled: Arc<Mutex<Vec<u64>>>,
}

fn rig<S: KvStore>(store: S, clock: &ManualClock, me: MemberId, members: Vec<MemberId>, timing: Timing) -> Rig<S> {
    rig_reaching(store, clock, me, members, timing, Box::new(()))
}

fn rig_reaching<S: KvStore>(
    store: S,
    clock: &ManualClock,
    me: MemberId,
    members: Vec<MemberId>,
    timing: Timing,
    reach: Box<dyn Reach + Send>,
) -> Rig<S> {
    let cancelled = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&cancelled);
    let flags = Flags::new(Arc::new(AtomicBool::new(false)));
    let watch = Watch::new(
        store,
        keys(),
        me,
        Roster::first(members),
        timing,
        Arc::new(clock.clone()),
        Box::new(move |e| log.lock().unwrap().push(e)),
        flags,
        reach,
    );
    Rig { watch, clock: clock.clone(), cancelled }
}

impl<S: KvStore> Rig<S> {
    /// Let one beat pass on the test's clock, then tick.
    fn beat(&mut self) {
        self.clock.advance(self.watch.timing.beat);
        self.watch.tick().unwrap();
    }

    /// `n` beats, peer `m` beating once in each (on `store`, underneath any slowness).
    fn beat_with(&mut self, store: &impl KvStore, m: MemberId, n: usize) {
        for _ in 0..n {
            pulse(store, m);
            self.beat();
        }
    }

    fn broken(&self) -> Option<u64> {
        u64::try_from(self.watch.flags.broken.load(Ordering::Acquire)).ok()
    }
}

/// Peer `m` beats once.
fn pulse(store: &impl KvStore, m: MemberId) {
    store.add(&keys().beat(m), 1).unwrap();
}

#[test]
fn a_silent_watched_peer_is_accused_after_its_window_and_not_before() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut r = rig(store.clone(), &clock, 0, vec![0, 1], Timing::default());
    r.beat_with(&store, 1, 20);
    let last_beat = clock.now();
    while r.broken().is_none() {
        r.beat();
        assert!(clock.now() - last_beat <= Duration::from_secs(2), "found within its window");
    }
    assert_eq!(clock.now() - last_beat, Duration::from_secs(1), "exactly when its 1 s window ran out");
    assert_eq!(*r.cancelled.lock().unwrap(), vec![0], "cancelled once");
    assert_eq!(
        store.get(&keys().broken(0)).unwrap().as_deref(),
        Some(&b"1"[..]),
        "the others see it in their next read"
    );
    let accused = store.entries(&keys().accused(0)).unwrap();
    assert_eq!(accused.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["1"]);
    let present = store.entries(&keys().present(0)).unwrap();
    assert_eq!(present.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["0"], "it checked itself in");
    r.beat();
    assert_eq!(r.cancelled.lock().unwrap().len(), 1, "an epoch breaks once");
}

/// A store each call of which takes `rtt` of the test's clock (the test may change it).
struct Slow {
    inner: MemoryKv,
    clock: ManualClock,
    rtt: Arc<Mutex<Duration>>,
}

impl Slow {
    fn new(inner: &MemoryKv, clock: &ManualClock, rtt: Duration) -> (Slow, Arc<Mutex<Duration>>) {
        let rtt = Arc::new(Mutex::new(rtt));
        (Slow { inner: inner.clone(), clock: clock.clone(), rtt: Arc::clone(&rtt) }, rtt)
    }

    fn call<T>(&self, f: impl FnOnce(&MemoryKv) -> T) -> T {
        self.clock.advance(*self.rtt.lock().unwrap());
        f(&self.inner)
    }
}

impl KvStore for Slow {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.call(|s| s.add(key, delta))
    }
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.call(|s| s.set(key, value))
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.call(|s| s.get(key))
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        self.call(|s| s.compare_set(key, expected, desired))
    }
    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError> {
        self.call(|s| s.counters(keys))
    }
    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
        self.call(|s| s.enter(key, name, entry))
    }
    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.call(|s| s.entries(key))
    }
    fn lengths(&self, keys: &[String]) -> Result<Vec<u64>, StoreError> {
        self.call(|s| s.lengths(keys))
    }
    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        self.call(|s| s.wait(key, within))
    }
}

#[test]
fn a_slow_store_never_makes_a_beating_peer_look_lost_and_still_finds_a_silent_one() {
    for rtt in [150, 600, 3000].map(Duration::from_millis) {
        let (inner, clock) = (MemoryKv::default(), ManualClock::default());
        let (slow, _) = Slow::new(&inner, &clock, rtt);
        let mut r = rig(slow, &clock, 0, (0..8).collect(), Timing::default());
        for _ in 0..100 {
            (1..8).for_each(|m| pulse(&inner, m)); // each peer beats once per round, its writes slowed alike
            r.beat();
        }
        assert_eq!(r.broken(), None, "{rtt:?} per round trip: nobody lost");
        assert!(inner.entries(&keys().accused(0)).unwrap().is_empty());
        if rtt > Timing::default().slack() {
            continue; // every read is slower than the slack: this monitor is blind, others' evidence decides
        }
        let stopped = clock.now();
        let mut found = stopped;
        while r.broken().is_none() {
            (1..8).filter(|&m| m != 3).for_each(|m| pulse(&inner, m));
            found = clock.now();
            r.beat();
            assert!(found - stopped < Duration::from_secs(5), "{rtt:?}: found");
        }
        let accused = inner.entries(&keys().accused(0)).unwrap();
        assert_eq!(accused.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), vec!["3"], "{rtt:?}: only 3");
        assert!(found - stopped < Duration::from_millis(1500), "{rtt:?}: within 1.5 x liveness");
    }
}

/// A test's probes: every peer reachable; a silent one answers while `alive` is up.
struct Answers(Arc<AtomicBool>);

impl Reach for Answers {
    fn unreachable(&self, _peers: &[(MemberId, String)]) -> Vec<MemberId> {
        Vec::new()
    }
    fn vouches(&self, _member: MemberId, _address: &str, _within: Duration) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

#[test]
fn a_silent_peer_whose_process_answers_is_given_more_windows_and_one_that_does_not_is_not() {
    for answers in [true, false] {
        let (store, clock) = (MemoryKv::default(), ManualClock::default());
        store.set(&keys().probe(1), b"host:1").unwrap();
        let alive = Arc::new(AtomicBool::new(answers));
        let mut r = rig_reaching(
            store.clone(),
            &clock,
            0,
            vec![0, 1],
            Timing::default(),
            Box::new(Answers(Arc::clone(&alive))),
        );
        r.beat_with(&store, 1, 20);
        // Its heartbeats stop reaching the store (an overloaded store serving it last).
        let last_beat = clock.now();
        while r.broken().is_none() {
            r.beat();
            assert!(clock.now() - last_beat < Duration::from_secs(10), "found in the end");
        }
        let found = clock.now() - last_beat;
        if answers {
            assert_eq!(found, VOUCHED_FACTOR * Duration::from_secs(1), "answering: {VOUCHED_FACTOR} windows");
        } else {
            assert_eq!(found, Duration::from_secs(1), "not answering: its window");
        }
    }
    // Answering, then beating again: never accused, and the next silence starts afresh.
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    store.set(&keys().probe(1), b"host:1").unwrap();
    let alive = Arc::new(AtomicBool::new(true));
    let mut r = rig_reaching(store.clone(), &clock, 0, vec![0, 1], Timing::default(), Box::new(Answers(alive)));
    for round in 0..6 {
        for _ in 0..25 {
            r.beat(); // 2.5 s without a beat: vouched for
        }
        r.beat_with(&store, 1, 5);
        assert_eq!(r.broken(), None, "round {round}: a late peer that answers is not lost");
    }
}

#[test]
fn a_store_that_stalls_once_is_no_evidence_against_the_peers_it_held_up() {
    let (inner, clock) = (MemoryKv::default(), ManualClock::default());
    let (slow, rtt) = Slow::new(&inner, &clock, Duration::from_millis(1));
    let mut r = rig(slow, &clock, 0, vec![0, 1], Timing::default());
    r.beat_with(&inner, 1, 30);
    // The store stalls for 3 s inside this monitor's call: its peer's beats were held up too.
    *rtt.lock().unwrap() = Duration::from_secs(3);
    r.beat();
    *rtt.lock().unwrap() = Duration::from_millis(1);
    r.beat();
    assert_eq!(r.broken(), None, "a stall is nobody's silence");
    r.beat_with(&inner, 1, 30);
    assert_eq!(r.broken(), None);
}

#[test]
fn a_monitor_that_was_late_accuses_no_one_for_its_own_pause() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut r = rig(store.clone(), &clock, 0, vec![0, 1], Timing::default());
    r.beat_with(&store, 1, 20);
    // The machine stalls 3 s: neither this monitor nor its peer runs.
    clock.advance(Duration::from_secs(3));
    r.beat();
    assert_eq!(r.broken(), None, "its own pause is not the peer's silence");
    r.beat_with(&store, 1, 20);
    assert_eq!(r.broken(), None);
    // The peer stops: found after the configured window (the stall did not widen it).
    let last_beat = clock.now();
    while r.broken().is_none() {
        r.beat();
    }
    assert_eq!(clock.now() - last_beat, Duration::from_secs(1));
}

#[test]
fn a_peer_that_stalls_more_and_more_is_given_room_and_still_found_when_it_stops() {
    let timing = Timing { beat: Duration::from_millis(20), liveness: Duration::from_millis(300), ..Timing::default() };
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut r = rig(store.clone(), &clock, 0, vec![0, 1], timing);
    let beats = |r: &mut Rig<MemoryKv>, n: usize| {
        for _ in 0..n {
            pulse(&store, 1);
            r.beat();
        }
    };
    // Stalls of 200 and 250 ms, then 450: longer than the 300 ms floor, within twice the pauses seen before.
    for stall in [200, 250, 450] {
        beats(&mut r, 10);
        for _ in 0..stall / 20 {
            r.beat();
        }
    }
    beats(&mut r, 10);
    assert_eq!(r.broken(), None, "a slow peer is not a lost one");
    assert_eq!(r.watch.beating(Duration::from_millis(200)), vec![1]);
    let last_beat = clock.now();
    while r.broken().is_none() {
        r.beat();
        assert!(clock.now() - last_beat < Duration::from_secs(3), "found in the end");
    }
    assert!(clock.now() - last_beat >= Duration::from_millis(900), "its window is twice its longest stall");
    assert_eq!(r.watch.silent_now(), vec![1]);
}

#[test]
fn another_process_breaking_the_epoch_checks_this_one_in_at_once() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut r = rig(store.clone(), &clock, 0, vec![0, 1, 2], Timing::default());
    r.beat();
    store.set(&keys().broken(0), b"1").unwrap();
    r.beat();
    assert_eq!(r.broken(), Some(0));
    assert_eq!(store.entries(&keys().present(0)).unwrap().len(), 1, "checked in");
    assert!(r.watch.flags.checked_in.load(Ordering::Acquire) >= 0);
    // The next epoch is watched afresh.
    r.watch.follow(Roster { epoch: 1, ..Roster::first(vec![0, 1]) });
    r.beat();
    assert_eq!(*r.cancelled.lock().unwrap(), vec![0]);
}

#[test]
fn a_waiting_joiner_raises_the_flag_until_a_roster_counts_it() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut r = rig(store.clone(), &clock, 0, vec![0], Timing::default());
    r.beat();
    assert!(!r.watch.flags.joiner_waiting.load(Ordering::Acquire));
    store.add(&keys().joiners(), 1).unwrap();
    r.beat();
    assert!(r.watch.flags.joiner_waiting.load(Ordering::Acquire));
    r.watch.follow(Roster { epoch: 1, joiners_seen: 1, ..Roster::first(vec![0, 5]) });
    r.beat();
    assert!(!r.watch.flags.joiner_waiting.load(Ordering::Acquire));
}

#[test]
fn a_beat_costs_one_store_call_whatever_the_world() {
    for world in [2u64, 8, 512, 4096] {
        let (store, clock) = (MeteredKv::new(MemoryKv::default()), ManualClock::default());
        let mut r = rig(store.clone(), &clock, 5 % world, (0..world).collect(), Timing::default());
        r.beat(); // (the first tick also looks up the watched peers' probe addresses, once)
        let before = store.ops();
        for _ in 0..10 {
            r.beat();
        }
        let ops = store.ops().since(&before);
        assert_eq!((ops.total(), ops.set_and_count), (10, 10), "world {world}: {ops:?}");
        let watched = (world as usize - 1).min(WATCHED_FOR_TEST);
        assert_eq!(ops.counter_keys, 10 * (watched as u64 + 2), "world {world}");
    }
}

const WATCHED_FOR_TEST: usize = super::super::WATCHED;

#[test]
fn a_running_monitor_beats_and_breaks_the_epoch_when_a_peer_stops() {
    let store = MemoryKv::default();
    let timing = Timing { beat: Duration::from_millis(20), liveness: Duration::from_millis(300), ..Timing::default() };
    let cancelled = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&cancelled);
    let start = |me| {
        let log = Arc::clone(&log);
        Monitor::start(
            store.clone(),
            PREFIX,
            me,
            Roster::first(vec![0, 1]),
            timing,
            Box::new(move |e| log.lock().unwrap().push(e)),
            Arc::new(AtomicBool::new(false)),
            Box::new(()),
        )
        .unwrap()
    };
    let (a, b) = (start(0), start(1));
    let began = Instant::now();
    while a.beating(Duration::from_secs(1)) != vec![1] {
        assert!(began.elapsed() < Duration::from_secs(30), "beats seen");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(b); // its heartbeat stops
    let stopped = Instant::now();
    while a.broken() != Some(0) {
        assert!(stopped.elapsed() < Duration::from_secs(30), "found");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(stopped.elapsed() >= Duration::from_millis(250), "never before the window: {:?}", stopped.elapsed());
    assert_eq!(a.silent(), vec![1]);
    assert!(Liveness::checked_in(&a, 0, Duration::ZERO));
}
