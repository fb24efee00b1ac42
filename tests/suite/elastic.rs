//! Membership from Rust: ranks as threads of one process, the runtime's own
//! protocol ([`Agreement`], [`Monitor`]) over an in-memory store, and a local
//! world per membership epoch. A rank leaves mid-job; the survivors agree on
//! one roster, rebuild their `GradSync` among themselves and go on with exact
//! averages; then a new rank asks to join, every member learns it from the
//! same step's control vote, and all three train on together. Under the
//! partial policy the survivors instead keep their `GradSync`, move its
//! endpoint into the new world, and the runtime redoes the lost step.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{pid, Sent};
use gradsync::membership::{Agreement, Canceller, KvStore, MemoryKv, Monitor, Roster, Timing};
use gradsync::{AbortPolicy, DType, GradSync, LocalEndpoint, LocalWorld, Outcome, Place};

const PREFIX: &str = "job";
const NUMEL: usize = 4;

/// Each epoch's local world, its endpoints handed out by rank (across
/// processes, the transport's rendezvous in the store plays this part).
#[derive(Default)]
struct Worlds(Mutex<HashMap<u64, Vec<Option<LocalEndpoint>>>>);

impl Worlds {
    fn endpoint(&self, roster: &Roster, member: u64) -> LocalEndpoint {
        let mut worlds = self.0.lock().unwrap();
        let world = worlds
            .entry(roster.epoch)
            .or_insert_with(|| LocalWorld::connect(roster.world()).unwrap().into_iter().map(Some).collect());
        world[roster.rank_of(member).unwrap()].take().expect("one endpoint per rank")
    }
}

fn timing() -> Timing {
    Timing {
        beat: Duration::from_millis(20),
        poll: Duration::from_millis(1),
        liveness: Duration::from_millis(500),
        ..Timing::default()
    }
}

/// A `GradSync` for `member`'s place in `roster`, voting "admit" while `flag` is up.
fn build(worlds: &Worlds, roster: &Roster, member: u64, flag: &Arc<AtomicBool>) -> GradSync {
    let mut b = GradSync::builder();
    b.param("w", NUMEL, DType::F32).unwrap();
    b.collective_timeout(Duration::from_secs(20)).joiner_waiting(Arc::clone(flag));
    b.build(worlds.endpoint(roster, member)).unwrap()
}

fn monitor(store: &MemoryKv, member: u64, roster: &Roster, flag: &Arc<AtomicBool>) -> Monitor {
    // Local endpoints fail at once when a peer leaves: nothing to cancel.
    let cancel: Canceller = Box::new(|_| {});
    Monitor::start(store.clone(), PREFIX, member, roster.clone(), timing(), cancel, Arc::clone(flag), Box::new(()))
        .unwrap()
}

/// What a member saw at each of its steps: the world and the averaged value
/// (`None`: skipped).
type Seen = Vec<(u64, usize, Option<f32>)>;

fn member(store: MemoryKv, worlds: &Worlds, member: u64, steps: u64, leave_at: Option<u64>, join: bool) -> Seen {
    let mut agreement = Agreement::new(store.clone(), PREFIX, member, timing());
    let roster = if join {
        agreement.request_join("w: 4 x f32").unwrap().clone()
    } else {
        agreement.start(vec![0, 1, 2], vec![0; 3]).unwrap().clone()
    };
    let flag = Arc::new(AtomicBool::new(false));
    let watch = monitor(&store, member, &roster, &flag);
    let mut sync = build(worlds, &roster, member, &flag);
    // A joiner starts at the members' step (the Python wrapper sends it with
    // the model's state; here the members leave it in the store).
    let mut step = if join { at_epoch(&store, roster.epoch) } else { 0 };
    let mut seen = Seen::new();
    while step < steps {
        if leave_at == Some(step) {
            Agreement::obituary(&store, PREFIX, member).unwrap(); // what its supervisor would record
            return seen;
        }
        // Member m contributes (m + 1) * (step + 1) to every element.
        let value = (member + 1) as f32 * (step + 1) as f32;
        let current = sync.current_step();
        Sent::inc(0, 0, vec![value; NUMEL]).deliver(&sync, current);
        match sync.finish_step(current) {
            Ok(result) => {
                let world = agreement.roster().world();
                let avg = result.gradients.as_ref().map(|g| g.to_vec(pid(0)).unwrap()[0]);
                assert_eq!(result.report.outcome, Outcome::Applied);
                seen.push((step, world, avg));
                if result.report.admit {
                    let next = agreement.admit("w: 4 x f32").unwrap().clone();
                    store.set(&format!("{PREFIX}/step-at/{}", next.epoch), (step + 1).to_string().as_bytes()).unwrap();
                    watch.follow(next.clone());
                    sync = build(worlds, &next, member, &flag);
                }
            }
            Err(e) => {
                assert!(e.needs_reset(), "a lost peer fails the step: {e}");
                let next = agreement.recover(&[], &watch, &()).unwrap().clone();
                watch.follow(next.clone());
                sync = build(worlds, &next, member, &flag);
                seen.push((step, next.world(), None));
            }
        }
        step += 1;
        std::thread::sleep(Duration::from_millis(10)); // a step's compute: time for a joiner to arrive
    }
    seen
}

/// The loop step the members continue at in `epoch` (written when they admitted a joiner).
fn at_epoch(store: &MemoryKv, epoch: u64) -> u64 {
    let key = format!("{PREFIX}/step-at/{epoch}");
    loop {
        if let Some(v) = store.get(&key).unwrap() {
            return String::from_utf8(v).unwrap().parse().unwrap();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn survivors_agree_rebuild_and_train_on_exactly_and_a_joiner_is_admitted_at_a_boundary() {
    let store = MemoryKv::default();
    let worlds = Worlds::default();
    let steps = 30;
    let seen: Vec<Seen> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|m| {
                let (store, worlds) = (store.clone(), &worlds);
                s.spawn(move || member(store, worlds, m, steps, (m == 2).then_some(3), false))
            })
            .collect();
        // Member 3 asks to join once the survivors train at world 2.
        let (store2, worlds2) = (store.clone(), &worlds);
        let joiner = s.spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            member(store2, worlds2, 3, steps, None, true)
        });
        let mut out: Vec<Seen> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        out.push(joiner.join().unwrap());
        out
    });
    for &(step, world, avg) in &seen[0] {
        let factor = (step + 1) as f32;
        // Member m contributed (m + 1) * (step + 1); the runtime divides by the members present.
        let contributed: &[f32] = match (step, world, avg) {
            (0..=2, 3, Some(_)) => &[1.0, 2.0, 3.0],
            (3, 2, None) => continue, // the step member 2 left in: skipped by both survivors
            (_, 2, Some(_)) => &[1.0, 2.0],
            (_, 3, Some(_)) => &[1.0, 2.0, 4.0], // member 3 joined
            other => panic!("unexpected step record {other:?}"),
        };
        let expected = contributed.iter().sum::<f32>() * factor / world as f32;
        let got = avg.unwrap();
        assert!((got - expected).abs() <= 1e-6 * expected, "step {step}, world {world}: {got} != {expected}");
    }
    assert_eq!(seen[0], seen[1], "both survivors saw the same steps");
    assert_eq!(seen[2].len(), 3, "member 2 left at step 3");
    let rejoined: Seen = seen[0].iter().copied().filter(|&(s, w, _)| s > 3 && w == 3).collect();
    assert!(!rejoined.is_empty(), "a world of 3 again after the join: {:?}", seen[0]);
    assert_eq!(seen[3], rejoined, "the joiner trained the members' steps with them");
}

/// A member under the partial policy that keeps one `GradSync` for the
/// whole job: after a loss it moves its endpoint into the survivors' world
/// and resets into it; the step the loss failed comes back redone.
fn moving_member(store: MemoryKv, worlds: &Worlds, member: u64, steps: u64, leave_at: Option<u64>) -> Seen {
    let mut agreement = Agreement::new(store.clone(), PREFIX, member, timing());
    let roster = agreement.start(vec![0, 1, 2], vec![0; 3]).unwrap().clone();
    let flag = Arc::new(AtomicBool::new(false));
    let watch = monitor(&store, member, &roster, &flag);
    let endpoint = worlds.endpoint(&roster, member);
    let mover = endpoint.mover();
    let mut b = GradSync::builder();
    b.param("w", NUMEL, DType::F32).unwrap();
    b.collective_timeout(Duration::from_secs(20)).abort_policy(AbortPolicy::Partial);
    let mut sync = b.build(endpoint).unwrap();
    let mut seen = Seen::new();
    for step in 0..steps {
        if leave_at == Some(step) {
            Agreement::obituary(&store, PREFIX, member).unwrap();
            return seen; // its GradSync (and endpoint) dropped: the peers' collectives fail at once
        }
        let value = (member + 1) as f32 * (step + 1) as f32;
        let current = sync.current_step();
        Sent::inc(0, 0, vec![value; NUMEL]).deliver(&sync, current);
        let result = match sync.finish_step(current) {
            Ok(result) => result,
            Err(e) => {
                assert!(e.needs_reset(), "a lost peer fails the step: {e}");
                let next = agreement.recover(&[], &watch, &()).unwrap().clone();
                watch.follow(next.clone());
                assert!(mover.move_to(worlds.endpoint(&next, member)).is_ok(), "the endpoint is alive");
                let reset = sync
                    .reset_membership(Place {
                        rank: next.rank_of(member).unwrap(),
                        world: next.world(),
                        buddy_stride: 1,
                    })
                    .unwrap();
                assert_eq!(reset.step, current + 1, "the members continue after the lost step");
                reset.redone.expect("every survivor kept all of the lost step: it is redone")
            }
        };
        assert_eq!((result.report.step, &result.report.outcome), (current, &Outcome::Applied));
        let avg = result.gradients.as_ref().map(|g| g.to_vec(pid(0)).unwrap()[0]);
        seen.push((step, agreement.roster().world(), avg));
    }
    seen
}

#[test]
fn under_the_partial_policy_the_survivors_redo_the_lost_step_in_their_new_world() {
    let store = MemoryKv::default();
    let worlds = Worlds::default();
    let steps = 8;
    let seen: Vec<Seen> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|m| {
                let (store, worlds) = (store.clone(), &worlds);
                s.spawn(move || moving_member(store, worlds, m, steps, (m == 2).then_some(3)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(seen[0].len() as u64, steps, "no step skipped: {:?}", seen[0]);
    for &(step, world, avg) in &seen[0] {
        let contributed: &[f32] = if step < 3 { &[1.0, 2.0, 3.0] } else { &[1.0, 2.0] };
        assert_eq!(world, contributed.len());
        // The lost step (3) is averaged over the two survivors, nothing of member 2 in it.
        let expected = contributed.iter().sum::<f32>() * (step + 1) as f32 / world as f32;
        let got = avg.expect("applied");
        assert!((got - expected).abs() <= 1e-6 * expected, "step {step}, world {world}: {got} != {expected}");
    }
    assert_eq!(seen[0], seen[1], "both survivors saw the same steps");
}
