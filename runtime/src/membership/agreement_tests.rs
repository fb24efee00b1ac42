//! The agreement over an in-memory store, members as threads. Decisions
//! that depend on time (a silent member, a suspect's grace, the check-in
//! deadline) are judged by a clock the test drives.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Instant;

use super::super::records::accuse;
use super::super::{Clock, ManualClock, MemoryKv, MeteredKv, Tally};
use super::*;

fn fast() -> Timing {
    Timing {
        beat: Duration::from_millis(20),
        poll: Duration::from_millis(1),
        liveness: Duration::from_millis(400),
        suspect_grace: Duration::from_millis(50),
        check_in: Duration::from_secs(2),
        admission: Duration::from_secs(5),
    }
}

fn keys() -> Keys {
    Keys("job".into())
}

fn members_on<S: KvStore + Clone>(store: &S, n: u64, clock: &ManualClock) -> Vec<Agreement<S>> {
    (0..n)
        .map(|m| {
            let mut a = Agreement::new(store.clone(), "job", m, fast()).with_clock(Arc::new(clock.clone()));
            a.start((0..n).collect(), vec![0; n as usize]).unwrap();
            a
        })
        .collect()
}

fn members(store: &MemoryKv, n: u64) -> Vec<Agreement<MemoryKv>> {
    members_on(store, n, &ManualClock::default())
}

/// Member `m` checks in to the agreement after `epoch` (reaching nobody in particular).
fn checks_in(store: &impl KvStore, epoch: u64, m: MemberId) {
    store.enter(&keys().present(epoch), &m.to_string(), br#"{"reached":[],"unreachable":[]}"#).unwrap();
}

/// Move `clock` on by `step` every real millisecond until `done` is raised.
fn drive(clock: &ManualClock, step: Duration, done: &AtomicBool) {
    while !done.load(Ordering::Acquire) {
        clock.advance(step);
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn survivors_of_a_reaped_member_agree_on_one_roster_without_waiting_for_silence() {
    let store = MemoryKv::default();
    let mut all = members(&store, 4); // their clock never moves: nothing may wait for time to pass
    Agreement::obituary(&store, "job", 2).unwrap();
    all.remove(2);
    let rosters: Vec<Roster> = thread::scope(|s| {
        let hs: Vec<_> = all.iter_mut().map(|a| s.spawn(move || a.recover(&[], &(), &()).cloned())).collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert!(rosters.iter().all(|r| *r == rosters[0]), "one roster: {rosters:?}");
    assert_eq!((rosters[0].epoch, rosters[0].members.clone(), rosters[0].lost.clone()), (1, vec![0, 1, 3], vec![2]));
}

#[test]
fn a_silent_member_is_lost_after_the_liveness_window_and_a_suspect_after_its_grace() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut all = members_on(&store, 3, &clock);
    let mut a = all.remove(0);
    checks_in(&store, 0, 1); // member 1 is alive; member 2 never checks in and never beats
    let done = AtomicBool::new(false);
    let (r, waited) = thread::scope(|s| {
        s.spawn(|| drive(&clock, Duration::from_millis(10), &done));
        let began = clock.now();
        let r = a.recover(&[], &(), &()).unwrap().clone();
        done.store(true, Ordering::Release);
        (r, clock.now() - began)
    });
    assert!(waited >= fast().liveness, "not before the window: {waited:?}");
    assert_eq!(r.members, vec![0, 1]);
    // Next epoch: member 1 is named by the failure and never checks in.
    let done = AtomicBool::new(false);
    let (r, waited) = thread::scope(|s| {
        s.spawn(|| drive(&clock, Duration::from_millis(10), &done));
        let began = clock.now();
        let r = a.recover(&[1], &(), &()).unwrap().clone();
        done.store(true, Ordering::Release);
        (r, clock.now() - began)
    });
    assert!(waited >= fast().suspect_grace && waited < fast().liveness, "a suspect after its grace: {waited:?}");
    assert_eq!(r.members, vec![0], "one of two goes on: the store, not a majority, decides");
}

#[test]
fn a_job_below_its_minimum_stops_with_the_minimum_named_on_every_survivor() {
    let store = MemoryKv::default();
    let mut all: Vec<_> = members(&store, 4).into_iter().map(|a| a.with_minimum(3)).collect();
    Agreement::obituary(&store, "job", 2).unwrap();
    Agreement::obituary(&store, "job", 3).unwrap();
    let e = thread::scope(|s| {
        let hs: Vec<_> = all.iter_mut().take(2).map(|a| s.spawn(move || a.recover(&[], &(), &()).cloned())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for r in e {
        let e = r.unwrap_err();
        assert!(
            matches!(&e, MembershipError::NoQuorum { minimum: 3, survivors, .. } if *survivors == vec![0, 1]),
            "{e}"
        );
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
    // Members {0, 1} and {2, 3, 4} reach the store, not each other.
    let results: Vec<Result<Roster, MembershipError>> = thread::scope(|s| {
        let hs: Vec<_> = all
            .iter_mut()
            .map(|a| {
                let side = Sides(if a.me() < 2 { vec![0, 1] } else { vec![2, 3, 4] });
                s.spawn(move || a.recover(&[], &(), &side).cloned())
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
    let went_on: Vec<bool> = thread::scope(|s| {
        let hs: Vec<_> = all
            .iter_mut()
            .map(|a| {
                let side = Sides(if a.me() % 2 == 0 { vec![0, 2] } else { vec![1, 3] });
                s.spawn(move || a.recover(&[], &(), &side).is_ok())
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
    // Member 1 is alive but was silent: its watcher (0) accused it and its beat has not moved since.
    accuse(&store, &keys(), 0, 0, 1, 0).unwrap();
    let r = all[0].recover(&[], &(), &()).unwrap().clone();
    assert_eq!(r.members, vec![0]);
    assert_eq!(all[1].recover(&[], &(), &()).unwrap_err(), MembershipError::LeftOut { member: 1, epoch: 1 });
    // A roster decided without member 1: it finds it and leaves; the others adopt it.
    let store = MemoryKv::default();
    let mut all = members(&store, 3);
    let decided = all[0].roster().after_loss(&Tally { present: vec![0, 2], ..Tally::default() }, 1).unwrap();
    store.compare_set(&keys().roster(1), b"", &decided.encode()).unwrap();
    let e = all[1].recover(&[], &(), &()).unwrap_err();
    assert_eq!(e, MembershipError::LeftOut { member: 1, epoch: 1 });
    assert_eq!(all[2].recover(&[], &(), &()).unwrap().members, vec![0, 2]);
}

#[test]
fn a_falsely_accused_member_whose_beat_moves_is_waited_for() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut all = members_on(&store, 3, &clock);
    let mut a = all.remove(0);
    checks_in(&store, 0, 2);
    accuse(&store, &keys(), 0, 2, 1, 5).unwrap(); // its watcher saw 5, then nothing for a window
    store.set(&keys().beat(1), b"6").unwrap(); // ...but it beat again since
    let done = AtomicBool::new(false);
    let r = thread::scope(|s| {
        s.spawn(|| {
            // ...but it beats again (it was starved, not dead) and checks in late.
            for _ in 0..30 {
                store.add(&keys().beat(1), 1).unwrap();
                clock.advance(fast().beat);
                thread::sleep(Duration::from_millis(2));
            }
            checks_in(&store, 0, 1);
            drive(&clock, fast().beat, &done);
        });
        let r = a.recover(&[], &(), &()).unwrap().clone();
        done.store(true, Ordering::Release);
        r
    });
    assert_eq!(r.members, vec![0, 1, 2], "slow, not dead");
}

#[test]
fn a_slow_member_whose_heartbeat_moves_is_waited_for_until_the_check_in_deadline() {
    let (store, clock) = (MemoryKv::default(), ManualClock::default());
    let mut all = members_on(&store, 3, &clock);
    let mut a = all.remove(0);
    checks_in(&store, 0, 2);
    let done = AtomicBool::new(false);
    let r = thread::scope(|s| {
        s.spawn(|| {
            // Member 1 beats but is slow to check in: well past the liveness window.
            for _ in 0..60 {
                store.add(&keys().beat(1), 1).unwrap();
                clock.advance(fast().beat);
                thread::sleep(Duration::from_millis(1));
            }
            checks_in(&store, 0, 1);
            drive(&clock, fast().beat, &done);
        });
        let r = a.recover(&[1], &(), &()).unwrap().clone();
        done.store(true, Ordering::Release);
        r
    });
    assert_eq!(r.members, vec![0, 1, 2], "nobody lost: 1 was slow, not dead");
    // A member that beats but never checks in is lost at the check-in deadline.
    checks_in(&store, 1, 2);
    let done = AtomicBool::new(false);
    let (r, waited) = thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Acquire) {
                store.add(&keys().beat(1), 1).unwrap();
                clock.advance(fast().beat);
                thread::sleep(Duration::from_millis(1));
            }
        });
        let began = clock.now();
        let r = a.recover(&[], &(), &()).unwrap().clone();
        done.store(true, Ordering::Release);
        (r, clock.now() - began)
    });
    assert!(waited >= fast().check_in, "{waited:?}");
    assert_eq!(r.members, vec![0, 2]);
}

#[test]
fn a_tallier_lost_in_its_tally_is_taken_over() {
    let store = MemoryKv::default();
    let mut all = members(&store, 3);
    // Member 0 claimed the tally and died before a round (its process reaped).
    store.compare_set(&keys().tally(0), b"", b"0").unwrap();
    Agreement::obituary(&store, "job", 0).unwrap();
    let (a1, rest) = all.split_at_mut(2);
    let rosters: Vec<Roster> = thread::scope(|s| {
        let h1 = s.spawn(|| a1[1].recover(&[], &(), &()).cloned().unwrap());
        let h2 = s.spawn(|| rest[0].recover(&[], &(), &()).cloned().unwrap());
        vec![h1.join().unwrap(), h2.join().unwrap()]
    });
    assert_eq!(rosters[0], rosters[1]);
    assert_eq!(rosters[0].members, vec![1, 2]);
    assert_ne!(store.get(&keys().tally(0)).unwrap().unwrap(), b"0", "taken over");
}

#[test]
fn a_change_among_512_members_costs_the_store_a_few_calls_per_member_and_leaves_none_out() {
    let store = MeteredKv::new(MemoryKv::default());
    let n = 512u64;
    let mut all = members_on(&store, n, &ManualClock::default());
    Agreement::obituary(&store, "job", 77).unwrap();
    all.remove(77);
    let before = store.ops();
    let rosters: Vec<Roster> = thread::scope(|s| {
        let hs: Vec<_> = all.iter_mut().map(|a| s.spawn(move || a.recover(&[], &(), &()).cloned())).collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    let ops = store.ops().since(&before);
    assert!(rosters.iter().all(|r| r.members.len() == 511 && r.lost == vec![77] && *r == rosters[0]));
    // Each survivor, a constant number whatever the world (no monitor here,
    // so each checks in itself): a look for a decision, the break mark (2),
    // its check-in (the probe addresses of the 8 peers it watches, and the
    // entry), a look at the claim, a wait and the change: about 15; the
    // tallier's rounds besides (three ledgers and the pending beats each).
    // With a monitor that checked in, about 5 (`gradsync-bench membership`).
    assert!(ops.total() <= 16 * n, "{} calls for {n} members: {ops:?}", ops.total());
    assert!(ops.entries <= 3 * 100, "only the tallier reads the ledgers: {ops:?}");
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
fn a_late_first_member_finds_the_job_moved_on_and_another_first_roster_is_refused() {
    let store = MemoryKv::default();
    let mut all = members(&store, 3);
    Agreement::obituary(&store, "job", 2).unwrap();
    thread::scope(|s| {
        for a in all.iter_mut().take(2) {
            s.spawn(move || a.recover(&[], &(), &()).unwrap().clone());
        }
    });
    let mut late = Agreement::new(store.clone(), "job", 2, fast());
    assert_eq!(late.start(vec![0, 1, 2], vec![0; 3]).unwrap_err(), MembershipError::LeftOut { member: 2, epoch: 1 });
    let mut other = Agreement::new(store, "job", 5, fast());
    let e = other.start(vec![0, 1, 2, 5], vec![0; 4]).unwrap_err();
    assert!(matches!(&e, MembershipError::Malformed { why, .. } if why.contains("4 members")), "{e}");
}

#[test]
fn members_gather_before_their_groups_and_a_missing_or_broken_epoch_is_told() {
    let store = MemoryKv::default();
    let all = members(&store, 3);
    let met: Vec<Gathered> = thread::scope(|s| {
        let hs: Vec<_> = all.iter().map(|a| s.spawn(move || a.gather(Duration::from_secs(60)).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(met, vec![Gathered::All; 3]);
    let store = MemoryKv::default();
    let all = members(&store, 3);
    let began = Instant::now();
    assert_eq!(all[0].gather(Duration::from_millis(50)).unwrap(), Gathered::Missing(vec![1, 2]));
    assert!(began.elapsed() < Duration::from_secs(30));
    mark_broken(&store, &keys(), 0).unwrap();
    assert_eq!(all[1].gather(Duration::from_secs(60)).unwrap(), Gathered::Broken, "woken by the break");
}
