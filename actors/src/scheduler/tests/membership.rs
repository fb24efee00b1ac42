//! Elastic membership: joiners admitted at one step, resets among new members, a step redone among the survivors.

use super::*;
use crate::messages::Place;

/// Invariant: one rank's monitor seeing a joiner is enough: every rank's
/// report of that step says to admit it (the same boundary everywhere), and
/// a rank's own flag goes into its vote.
#[test]
fn a_joiner_seen_by_one_rank_is_admitted_by_every_rank_at_the_same_step() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    let (n, u) = ([false], [true]);
    r.control(control, &[Peer { admit: true, ..peer(1, RankStatus::Finished, &n, &u) }]);
    assert!(answer.try_recv().unwrap().unwrap().report.admit, "a peer's vote");
    r.inc_reduced(1, 0, 1.0);
    let (answer, control) = r.finish_to_control(1, &[0]);
    r.control(control, &[peer(1, RankStatus::Finished, &n, &u)]);
    assert!(!answer.try_recv().unwrap().unwrap().report.admit, "nobody waiting");

    let flag = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut r = rank(2, 1, &[2]);
    r.sched.cfg.joiner_waiting = Some(Arc::clone(&flag));
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (_answer, control) = r.finish_to_control(0, &[0]);
    let CommPayload::Words(words) = &control.payload else { panic!() };
    assert_eq!(words.last().copied().unwrap() >> 32, 1, "its own vote says so");
}

/// Invariant: a reset into a new membership takes the new place before the
/// agreement (its length is the new world), and agrees the plan again
/// among the new members before any bucket launches.
#[test]
fn a_membership_reset_agrees_among_the_new_members_and_then_on_the_plan() {
    let mut r = rank(3, 2, &[2]);
    r.agree_plan();
    r.inc(0, 0, 1.0);
    let bucket = r.job();
    let gone = CommError::PeerGone { rank: 2, peer: 1, tag: bucket.tag };
    r.fail(bucket, gone);
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset {
        proposed: 1,
        membership: Some(Place { rank: 1, world: 2, buddy_stride: 1 }),
        reply: Reply::Blocking(tx),
    });
    let mut agreement = r.job();
    assert_eq!(kind(&agreement), CollectiveKind::Reset { len: 4 }, "two members now (and the redo half)");
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    assert_eq!(words, &vec![0, 2, 0, 0], "rank 2 is rank 1 now; under the skip policy nothing to redo");
    words[0] = 2;
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 1, redo: None }));
    (r.world, r.rank, r.epoch) = (2, 1, 1);
    let same: Vec<ParamId> = r.plan.launch_order().collect();
    r.adopt_layout(&same);
    assert!(r.sched.begin(), "the step begins");
    let plan = r.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 2 }, "the plan is agreed again, among two");
}

/// Invariant: after a change of members every member takes the new rank
/// 0's bucket layout before the plan agreement: a joiner, which starts from
/// the first plan, takes the plan the members rebuilt in the order their
/// gradients arrive (else the plan agreement fails: a desync).
#[test]
fn after_a_membership_reset_every_member_takes_rank_0s_layout() {
    let mut joiner = rank(3, 2, &[2, 2, 2]);
    let (tx, agreed) = mpsc::sync_channel(1);
    joiner.send(SchedMsg::Reset {
        proposed: 0,
        membership: Some(Place { rank: 2, world: 3, buddy_stride: 1 }),
        reply: Reply::Blocking(tx),
    });
    let mut agreement = joiner.job();
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    words[0] = 8;
    words[1] = 8; // the members are at step 7
    joiner.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 7, redo: None }));
    joiner.epoch = 1;
    joiner.inc(7, 0, 1.0); // the first step begins while the layout is in flight: it waits
    let members: Vec<ParamId> = [0, 2, 1].iter().map(|&i| joiner.p(i)).collect();
    assert_ne!(joiner.plan.launch_order().collect::<Vec<_>>(), members, "the members rebuilt theirs");
    joiner.adopt_layout(&members);
    assert_eq!(joiner.sched.plan.launch_order().collect::<Vec<_>>(), members, "the joiner has the members' layout");
    let plan = joiner.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 3 });
    let CommPayload::Words(words) = &plan.payload else { panic!() };
    let mut members_plan = rank(3, 0, &[2, 2, 2]);
    members_plan.sched.plan = Arc::new(members_plan.plan.reordered(&members));
    members_plan.sched.plan_proposed = false;
    members_plan.sched.propose_plan();
    let CommPayload::Words(theirs) = &members_plan.job().payload else { panic!() };
    assert_eq!(words[2], theirs[0], "the same plan digest as a member that rebuilt it");
}

/// A rank of three under the partial policy loses a peer while step 0's
/// first bucket is in flight; after the failure the rest of its backward
/// still arrives (a late increment of p1, all of p0), then the flush and the
/// caller's finish. Returns the rank (now rank 1 of 2) and the reset's
/// agreement job.
fn lose_a_peer_mid_step() -> (Rank, CommJob, mpsc::Receiver<Result<Resumption, SyncError>>) {
    let mut r = rank_with(3, 2, &[2, 2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    r.inc(0, 1, 6.0); // bucket 0 = p1, launched
    let bucket = r.job();
    r.ready(0, 1, 1, PayloadKind::Increment, 1.0, Readiness::Extra); // late, before the failure
    r.fail(
        bucket,
        CommError::PeerGone {
            rank: 2,
            peer: 1,
            tag: CollectiveTag { step: 0, kind: CollectiveKind::Bucket { index: 0, numel: 2 } },
        },
    );
    assert_eq!(r.sched.phase(), "failed");
    r.inc(0, 0, 4.0); // backward goes on after the failure
    r.ready(0, 1, 2, PayloadKind::Increment, 0.5, Readiness::Extra);
    let failed = r.end(0, StepEnd::Finish);
    assert!(failed.try_recv().unwrap().is_err(), "the caller learns the step failed");
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset {
        proposed: 1,
        membership: Some(Place { rank: 1, world: 2, buddy_stride: 1 }),
        reply: Reply::Blocking(tx),
    });
    r.no_job(); // the shard has not flushed step 0 yet: the reset waits for it
    r.flushed(0, &[0, 1]);
    let agreement = r.job();
    (r.world, r.rank, r.epoch) = (2, 1, 1);
    (r, agreement, agreed)
}

/// Invariant (partial policy, a member lost mid-step): every new member
/// kept its whole contribution to the failed step, so they reduce it again
/// among themselves: the result is the exact average over the survivors
/// (nothing of the lost member, nothing summed twice).
#[test]
fn a_step_failed_by_a_lost_member_is_reduced_again_among_the_survivors() {
    let (mut r, mut agreement, agreed) = lose_a_peer_mid_step();
    assert_eq!(kind(&agreement), CollectiveKind::Reset { len: 4 });
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    assert_eq!(words, &vec![0, 2, 0, 1], "proposes step 1; can redo step 0");
    words[0] = 2;
    words[2] = 1; // the other survivor can redo step 0 too
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 1, redo: Some(0) }));
    assert_eq!(r.sched.current_step(), 0, "step 0 again");
    let same: Vec<ParamId> = r.plan.launch_order().collect();
    r.adopt_layout(&same);
    let answer = r.end(0, StepEnd::Finish); // the runtime's redo: no new arrival
    let plan = r.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 2 }, "among the two survivors first");
    let mut plan = plan;
    let CommPayload::Words(w) = &mut plan.payload else { panic!() };
    mirror_vote(w, 2, 1);
    r.done(plan);
    let b0 = r.job();
    let CommPayload::Grads(buf) = &b0.payload else { panic!() };
    assert_eq!(buf.piece(0), &[7.5, 7.5], "p1: packed 6 + late 1 + 0.5 after the failure");
    assert_eq!(b0.factor, 0.5, "averaged over the two survivors");
    r.reduce_bucket(b0, (7.5 + 2.5) / 2.0);
    let b1 = r.job();
    let CommPayload::Grads(buf) = &b1.payload else { panic!() };
    assert_eq!(buf.piece(0), &[4.0, 4.0], "p0 arrived after the failure");
    r.reduce_bucket(b1, (4.0 + 2.0) / 2.0);
    let control = r.job();
    let (none, both) = ([false; 2], [true; 2]);
    r.control(control, &[Peer { retract: Some(&none), ..peer(0, RankStatus::Finished, &none, &both) }]);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(
        (result.report.step, result.report.outcome.clone(), result.report.contributors),
        (0, Outcome::Applied, 2)
    );
    assert_eq!(values(&result, r.p(1)), Some(vec![5.0, 5.0]));
    assert_eq!(values(&result, r.p(0)), Some(vec![3.0, 3.0]));
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 1));
}

/// Invariant: if any new member cannot redo the same step (it had applied
/// it before the loss and failed in the next one), every member skips:
/// never a mix of redone and skipped.
#[test]
fn a_redo_needs_every_member_to_offer_the_same_step() {
    let (mut r, mut agreement, agreed) = lose_a_peer_mid_step();
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    words[0] = 3;
    words[2] = 2; // the other survivor applied step 0 and lost step 1
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 2, redo: None }));
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 2));
    let same: Vec<ParamId> = r.plan.launch_order().collect();
    r.adopt_layout(&same);
    r.epoch = 1;
    r.inc(2, 0, 1.0);
    let plan = r.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 2 }, "a fresh step 2, nothing of step 0 in it");
}
