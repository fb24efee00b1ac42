//! The residency protocol's specification, as scenarios run on a simulated
//! world: every rank's [`Residency`] driven by a program of events (the
//! hooks a model's forward and backward fire), the commands carried out on
//! a simulated lane that pairs rounds across ranks (a round's sum is ready
//! once every rank posted it; a gather finishes once every rank started
//! it) and simulated reductions (a rank launches its buckets in the plan's
//! order as its backward produces them, a bucket completes once every rank
//! launched it). The world is stepped rank by rank; a sweep where no rank
//! can move is a deadlock, and too many steps a livelock: both fail.
//!
//! Each rank's driver keeps its own record of the whole units (from the
//! commands alone) and checks it against the table after every command,
//! and that a unit's needs are whole whenever its forward or backward runs.

mod world;

use super::{Answer, Command, Residency, ResidencyError, UnitSpec};
use world::{eval, plain, step_end, train, Op, World};

#[test]
fn a_step_gathers_each_unit_where_it_is_used_and_releases_it_after() {
    let mut world = World::new(plain(3), vec![train(&[1, 2, 3]); 2], None, false);
    world.run();
    for r in 0..2 {
        let counts = world.counts(r);
        // The root once, each block in its forward and again in its backward (the
        // forward's end released them all).
        assert_eq!(counts.gathers, vec![1, 2, 2, 2], "rank {r}");
        assert_eq!(counts.most_whole, 1, "rank {r}: one block whole at a time");
        assert_eq!(counts.polls, 0);
        assert!(world.ranks[r].res.whole_units().is_empty(), "every unit released at the step's end");
    }
}

#[test]
fn the_next_step_prefetches_by_the_last_steps_order() {
    let program = [train(&[1, 2, 3]), train(&[1, 2, 3])].concat();
    let mut world = World::new(plain(3), vec![program; 2], None, true);
    world.run();
    let (r0, r1) = (world.counts(0), world.counts(1));
    assert_eq!(world.ranks[0].res.learned(), &[1, 2, 3, 3, 2, 1]);
    assert!(r0.prefetched > 0, "the second step gathers ahead of use");
    assert_eq!(r0.rounds, r1.rounds, "the ranks' rounds pair one for one");
    assert!(r0.most_whole <= 2, "a prefetch holds at most the next block besides the current one");
    assert_eq!(r0.gathers, vec![2, 4, 4, 4], "a prefetched unit is gathered once, as if asked when used");
}

#[test]
fn a_unit_used_on_some_ranks_only_is_gathered_with_every_rank_and_kept_by_its_user() {
    // Rank 1's forward takes a branch through unit 3; rank 0's does not.
    let programs = vec![train(&[1, 2]), train(&[1, 2, 3])];
    let mut world = World::new(plain(3), programs, None, false);
    world.run();
    assert_eq!(world.counts(0).gathers[3], 0, "rank 0 served unit 3's gathers without keeping it");
    assert_eq!(world.counts(1).gathers[3], 2);
    assert_eq!(world.counts(0).rounds, world.counts(1).rounds);
}

#[test]
fn waiting_for_reductions_never_deadlocks_against_a_peers_rounds() {
    // Unit 3 is used on rank 1 only, so its bucket (first in the plan) is
    // launched by rank 0 only at its step's end: rank 1's wait lasts until
    // then, and meanwhile rank 0 (calling its blocks twice) needs rounds
    // for its own backward. Rank 1 polls: rank 0 never waits on it.
    for most in [0, 1] {
        let programs = vec![
            [train(&[1, 2, 1, 2]), train(&[1, 2, 1, 2])].concat(),
            [train(&[1, 2, 3]), train(&[1, 2, 3])].concat(),
        ];
        let mut world = World::new(plain(3), programs, Some(most), true);
        world.run();
        assert!(world.counts(1).polls > 0, "buckets_in_flight={most}: rank 1 joined rank 0's rounds while it waited");
        assert_eq!(world.counts(0).gathers[3], 0);
        assert_eq!(world.counts(1).gathers[3], 4);
        assert_eq!(world.counts(0).rounds, world.counts(1).rounds);
    }
}

#[test]
fn ranks_that_wait_together_each_settle() {
    // The same graph everywhere: every wait settles as the peers launch.
    let mut world = World::new(plain(4), vec![train(&[1, 2, 3, 4]); 3], Some(0), false);
    world.run();
    for r in 0..3 {
        assert_eq!(world.counts(r).gathers, vec![1, 2, 2, 2, 2]);
    }
}

#[test]
fn a_recomputed_unit_is_held_until_its_backward_ends() {
    // Units 1 and 2 in one checkpointed segment: recomputed together inside
    // backward, so unit 1 stays whole (held) while unit 2's backward runs.
    let mut program = vec![Op::Assemble, Op::Begin(1), Op::End(1), Op::Begin(2), Op::End(2), Op::Ended];
    program.extend([Op::RecomputeBegin(1), Op::RecomputeEnd(1), Op::RecomputeBegin(2), Op::RecomputeEnd(2)]);
    program.extend([Op::BackBegin(2), Op::BackEnd(2), Op::BackBegin(1), Op::BackEnd(1)]);
    program.extend(step_end());
    let mut world = World::new(plain(2), vec![program; 2], None, false);
    world.run();
    assert_eq!(world.counts(0).gathers, vec![1, 2, 2], "unit 1 is not gathered a third time for its backward");
    assert_eq!(world.counts(0).most_whole, 2);
}

#[test]
fn a_unit_recomputed_twice_is_whole_for_both_and_its_backward() {
    // A block checkpointed twice (an outer and an inner checkpoint): two
    // recomputations, then its backward.
    let mut program = vec![Op::Assemble, Op::Begin(1), Op::End(1), Op::Begin(2), Op::End(2), Op::Ended];
    program.extend([Op::BackBegin(2), Op::BackEnd(2)]);
    program.extend([Op::RecomputeBegin(1), Op::RecomputeEnd(1), Op::RecomputeBegin(1), Op::RecomputeEnd(1)]);
    program.extend([Op::BackBegin(1), Op::BackEnd(1)]);
    program.extend(step_end());
    let mut world = World::new(plain(2), vec![program; 2], Some(0), false);
    world.run();
    assert_eq!(world.counts(0).gathers, vec![1, 2, 2]);
}

#[test]
fn a_unit_sharing_a_weight_has_its_owner_whole_while_it_runs() {
    // Unit 3 uses a weight unit 1 owns (tied embeddings across blocks).
    let mut specs = plain(3);
    specs[3].needs = vec![3, 1];
    let mut world = World::new(specs, vec![train(&[1, 2, 3]); 2], Some(0), false);
    world.run(); // (`needs_whole` checks unit 1 at each of unit 3's events)
    assert_eq!(world.counts(0).gathers[1], 4, "unit 1 again for unit 3's forward and backward");
}

#[test]
fn a_unit_called_twice_stays_whole_until_both_backwards_end() {
    let mut program = vec![Op::Assemble, Op::Begin(1), Op::End(1), Op::Begin(2), Op::End(2)];
    program.extend([Op::Begin(1), Op::End(1), Op::Ended]);
    program.extend([
        Op::BackBegin(1),
        Op::BackEnd(1),
        Op::BackBegin(2),
        Op::BackEnd(2),
        Op::BackBegin(1),
        Op::BackEnd(1),
    ]);
    program.extend(step_end());
    let mut world = World::new(plain(2), vec![program; 2], None, false);
    world.run();
    assert_eq!(world.counts(0).gathers, vec![1, 4, 2]);
}

#[test]
fn an_abort_mid_forward_serves_the_others_and_the_next_step_is_whole() {
    // Rank 0's forward raises inside unit 2 (its end never seen) and aborts.
    let aborted = [vec![Op::Assemble, Op::Begin(1), Op::End(1), Op::Begin(2)], step_end()].concat();
    let programs = vec![[aborted, train(&[1, 2])].concat(), [train(&[1, 2]), train(&[1, 2])].concat()];
    let mut world = World::new(plain(2), programs, Some(0), true);
    world.run();
    assert_eq!(world.counts(1).gathers, vec![2, 4, 4]);
    assert_eq!(world.counts(0).rounds, world.counts(1).rounds);
}

#[test]
fn out_of_memory_in_a_gather_completes_the_round_everywhere() {
    let mut world = World::new(plain(2), vec![[train(&[1, 2]), train(&[1, 2])].concat(); 2], Some(0), false);
    world.ranks[1].oom_at = Some(2);
    world.run();
    // Rank 1 aborted its first step at unit 2's gather and trained the second.
    assert_eq!(world.counts(1).gathers, vec![2, 3, 2]);
    assert_eq!(world.counts(0).gathers, vec![2, 4, 4]);
}

#[test]
fn an_evaluation_learns_no_order_and_a_join_shadows_the_others_step() {
    // Rank 0 evaluates, trains, and runs out of data: it shadows rank 1's second step.
    let shadow = vec![Op::Launch, Op::ServeAgain, Op::Result, Op::Reset(false)];
    let programs = vec![
        [eval(&[1, 2]), train(&[1, 2]), shadow].concat(),
        [eval(&[1, 2]), train(&[1, 2]), train(&[1, 2])].concat(),
    ];
    let mut world = World::new(plain(2), programs, Some(0), true);
    world.run();
    assert_eq!(world.ranks[0].res.learned(), &[1, 2, 2, 1], "the evaluation's order is not learned");
    assert_eq!(world.counts(0).gathers, vec![2, 3, 3], "the shadow keeps nothing");
    assert_eq!(world.counts(0).rounds, world.counts(1).rounds);
}

#[test]
fn whole_parameters_gathers_every_unit_in_one_round() {
    let all = vec![Op::AssembleAll, Op::Serve, Op::Reset(false)];
    let mut world = World::new(plain(3), vec![[train(&[1]), all].concat(); 2], None, false);
    world.run();
    assert_eq!(world.counts(0).gathers, vec![2, 3, 1, 1]);
    assert_eq!(world.counts(0).most_whole, 1, "whole_parameters is not counted as residency");
}

#[test]
fn a_member_lost_mid_round_leaves_zeros_and_no_more_collectives() {
    let mut world = World::new(plain(3), vec![train(&[1, 2, 3]); 2], Some(0), false);
    for rank in &mut world.ranks {
        rank.lost_from = Some(2); // (the round of unit 2's forward)
    }
    world.run();
    for r in 0..2 {
        let rank = &world.ranks[r];
        assert!(rank.res.broken());
        assert_eq!(rank.posts_after_lost, 0, "rank {r} posted after the lane failed");
        assert!(rank.zeros[2] > 0 && rank.zeros[3] > 0, "rank {r}: what it needed is zeros: {:?}", rank.zeros);
    }
    // The members settle on a new lane (elastic), or every rank resets the
    // failed step on a new epoch of the lane: rounds make collectives again.
    let (settled, reset) = world.ranks.split_at_mut(1);
    settled[0].res.settled(2);
    reset[0].res.forget();
    reset[0].res.reset(false);
    for rank in [&settled[0], &reset[0]] {
        assert!(!rank.res.broken());
        assert!(rank.res.whole_units().is_empty());
    }
    reset[0].res.assemble();
    assert_eq!(reset[0].res.next_command().unwrap(), Some(Command::Post(vec![1, 0, 0, 0, 0])));
}

#[test]
fn a_driver_that_breaks_the_discipline_is_told_what_to_do() {
    assert_eq!(
        Residency::new(vec![UnitSpec { name: "x".into(), needs: vec![1] }], 2, false).unwrap_err(),
        ResidencyError::BadNeeds { unit: 0, needs: vec![1] }
    );
    let mut res = Residency::new(plain(1), 2, false).unwrap();
    assert!(matches!(res.answer(Answer::Started), Err(ResidencyError::Unexpected { .. })));
    assert_eq!(res.forward_begins(5, false).unwrap_err(), ResidencyError::NoSuchUnit { unit: 5, units: 2 });
    res.assemble();
    assert_eq!(res.next_command().unwrap(), Some(Command::Post(vec![1, 0, 0])));
    assert_eq!(res.next_command().unwrap(), Some(Command::AwaitSum));
    assert!(matches!(res.next_command(), Err(ResidencyError::Unanswered { .. })));
    assert_eq!(res.answer(Answer::Sum(vec![2, 0])).unwrap_err(), ResidencyError::SumLength { got: 2, want: 3 });
}

#[test]
fn one_rank_makes_no_serving_rounds_and_never_waits() {
    let mut world = World::new(plain(2), vec![train(&[1, 2])], Some(0), false);
    world.run();
    assert_eq!(world.counts(0).gathers, vec![1, 2, 2]);
    assert_eq!(world.counts(0).polls, 0);
}
