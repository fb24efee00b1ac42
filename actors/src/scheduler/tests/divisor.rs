//! What each step is divided by, and where the division happens (packing or after the sum); settings every rank must share.

use super::*;

/// Invariant: a rank that joined contributes zeros; the step is averaged
/// over the ranks that contributed, and later steps launch with that divisor.
#[test]
fn joined_ranks_are_left_out_of_the_divisor_until_every_rank_has_joined() {
    let mut r = rank(3, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 3.0);
    let b = r.job();
    assert_eq!(b.factor, 1.0 / 3.0);
    r.reduce_bucket(b, (3.0 + 6.0 + 0.0) / 3.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.control(
        control,
        &[peer(1, RankStatus::Finished, &[false], &[true]), peer(2, RankStatus::Joined, &[false], &[false])],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!((result.report.joined.clone(), result.report.contributors), (vec![2], 2));
    assert_eq!(values(&result, r.p(0)), Some(vec![4.5, 4.5]), "(3 + 6) / 2");
    drop(result);
    let returned = r.home.try_recv().unwrap();
    r.send(returned);
    // Step 1: the divisor is known at launch.
    r.inc(1, 0, 1.0);
    assert_eq!(r.job().factor, 0.5);
    // This rank joins too in step 2, and so does rank 1: every rank has joined.
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    let answer = r.end(0, StepEnd::Join);
    r.flushed(0, &[]);
    let b = r.job();
    r.done(b);
    let control = r.job();
    let CommPayload::Words(words) = &control.payload else { panic!() };
    assert_eq!(words[0], crate::scheduler::control::JOINED);
    r.control(control, &[peer(1, RankStatus::Joined, &[false], &[false])]);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::AllJoined);
    assert!(result.gradients.is_none());
}

#[test]
fn a_transport_that_only_sums_gets_buckets_already_averaged() {
    let mut r = rank(2, 0, &[2, 2]);
    r.sched.cfg.scale_when_packing = true;
    // Bucket 0 holds p1. Its second increment arrives before the plan is
    // agreed, so it is merged into the packed (already scaled) slot.
    r.inc(0, 1, 3.0);
    r.ready(0, 1, 1, PayloadKind::Increment, 5.0, Readiness::Extra);
    r.inc(0, 0, 7.0);
    r.agree_plan();
    for (bucket, expected) in [(0, 4.0), (1, 3.5)] {
        let job = r.job();
        assert_eq!(kind(&job), CollectiveKind::Bucket { index: bucket, numel: 2 });
        assert_eq!(job.factor, 1.0, "bucket {bucket}: the communicator must only sum");
        let CommPayload::Grads(buf) = &job.payload else { panic!("bucket payload") };
        assert_eq!(buf.piece(0), &[expected, expected], "bucket {bucket}: (sum of increments) / world");
    }
}

#[test]
fn a_transport_that_scales_gets_raw_sums_and_the_factor() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 3.0);
    let job = r.job();
    assert_eq!(job.factor, 0.5);
    let CommPayload::Grads(buf) = &job.payload else { panic!("bucket payload") };
    assert_eq!(buf.piece(0), &[3.0, 3.0]);
}

/// DDP's `divide_by_initial_world_size=True`: a joined rank's zeros count,
/// so the step is the sum over the whole world; the setting takes effect at
/// the next step that has not begun and joins the control fingerprint.
#[test]
fn a_world_divisor_counts_joined_ranks_and_applies_from_the_next_step() {
    let mut r = rank(3, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 3.0);
    let b = r.job();
    assert_eq!(b.factor, 1.0 / 3.0);
    // Changed after step 0 began: step 0 keeps dividing by its contributors.
    r.configure(Setting::Divisor(Divisor::World)).unwrap();
    r.reduce_bucket(b, (3.0 + 6.0) / 3.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.control(
        control,
        &[peer(1, RankStatus::Finished, &[false], &[true]), peer(2, RankStatus::Joined, &[false], &[false])],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![4.5, 4.5]), "step 0: (3 + 6) / 2 contributors");
    drop(result);
    let returned = r.home.try_recv().unwrap();
    r.send(returned);
    // Step 1 divides by the world: rank 2 (joined) still counts.
    r.inc(1, 0, 3.0);
    let b = r.job();
    assert_eq!(b.factor, 1.0 / 3.0, "the world, joined ranks included");
    r.reduce_bucket(b, (3.0 + 6.0) / 3.0);
    let (answer, control) = r.finish_to_control(1, &[0]);
    r.control(
        control,
        &[peer(1, RankStatus::Finished, &[false], &[true]), peer(2, RankStatus::Joined, &[false], &[false])],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![3.0, 3.0]), "step 1: (3 + 6) / 3 ranks");
}

#[test]
fn ranks_dividing_differently_fail_the_step_with_a_desync() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.configure(Setting::Divisor(Divisor::Sum)).unwrap();
    r.inc_reduced(0, 0, 1.0);
    let (answer, mut control) = r.finish_to_control(0, &[0]);
    // The peer's vote, as a rank that divides by its contributors computes it.
    let CommPayload::Words(words) = &mut control.payload else { panic!("control words") };
    let own = words[r.world + r.rank];
    let vote = ControlVote {
        rank: 1,
        world: 2,
        status: RankStatus::Finished,
        fingerprint: own ^ 1,
        late: &[false],
        used: &[true],
        retract: None,
        reorder: false,
        admit: false,
    };
    gradsync_kernels::add_assign(words, &vote.encode());
    r.done(control);
    let err = answer.try_recv().unwrap().unwrap_err();
    assert!(matches!(err, SyncError::Desync { ref ranks, .. } if !ranks.is_empty()), "{err}");
}

/// A wire type chosen after the runtime started (a comm hook registered
/// before the first step) joins the one plan agreement, which is submitted
/// when the first step begins; data buckets then carry the type. Once the
/// first step began it can no longer change, and nothing changes.
#[test]
fn a_wire_type_chosen_before_the_first_step_joins_the_plan_agreement() {
    let mut r = rank(1, 0, &[2]);
    r.no_job(); // nothing is agreed before the first step begins
    r.configure(Setting::Wire(Wire::BF16)).unwrap();
    r.inc(0, 0, 1.0);
    let mut plan = r.job();
    assert!(matches!(kind(&plan), CollectiveKind::Plan { .. }), "the agreement comes first: {}", plan.tag);
    r.no_job(); // the bucket is complete but waits for the agreement
    let refused = r.configure(Setting::Wire(Wire::F32)).unwrap_err();
    assert!(matches!(refused, SyncError::Setting { .. }) && refused.to_string().contains("began"), "{refused}");
    let CommPayload::Words(words) = &mut plan.payload else { panic!("plan words") };
    mirror_vote(words, 1, 1);
    r.done(plan);
    let bucket = r.job();
    assert_eq!((kind(&bucket), bucket.wire), (CollectiveKind::Bucket { index: 0, numel: 2 }, Wire::BF16));
    r.done(bucket);
    let (answer, control) = r.finish_to_control(0, &[0]);
    assert_eq!(control.wire, Wire::F32, "the control vote travels exactly");
    r.done(control);
    assert_eq!(answer.try_recv().unwrap().unwrap().report.outcome, Outcome::Applied);
}
