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

use super::*;

/// One event of a rank's program (a hook firing), or a driver's act.
#[derive(Clone, Debug, PartialEq)]
enum Op {
    /// The wrapper's forward begins.
    Assemble,
    /// A unit's forward begins ...
    Begin(usize),
    /// ... and ends (its needs whole meanwhile): its call waits for its backward.
    End(usize),
    /// The wrapper's forward returned.
    Ended,
    /// A checkpoint's recomputation of the unit inside backward begins ...
    RecomputeBegin(usize),
    /// ... and ends: its call is the one whose backward comes next.
    RecomputeEnd(usize),
    /// The backward of the unit's last call begins (after the world's wait) ...
    BackBegin(usize),
    /// ... and ends (its needs whole meanwhile): the unit's bucket is ready.
    BackEnd(usize),
    /// The step's end asked for: every bucket left launched.
    Launch,
    /// The others' rounds served (the step, an evaluation, an abort ended).
    Serve,
    /// A joined rank serves the others' step whatever its last step left.
    ServeAgain,
    /// The step's result: waits until every rank's reductions completed.
    Result,
    /// Every unit released; `true`: a step ended (its order is learned).
    Reset(bool),
    /// Every unit whole (`whole_parameters`).
    AssembleAll,
}

/// A forward and backward of these units, in order (the backward reversed), and the step's end.
fn train(units: &[usize]) -> Vec<Op> {
    let mut ops = vec![Op::Assemble];
    for &u in units {
        ops.extend([Op::Begin(u), Op::End(u)]);
    }
    ops.push(Op::Ended);
    for &u in units.iter().rev() {
        ops.extend([Op::BackBegin(u), Op::BackEnd(u)]);
    }
    ops.extend(step_end());
    ops
}

/// A step's end (or an abort's): launched, served, the result, released.
fn step_end() -> Vec<Op> {
    vec![Op::Launch, Op::Serve, Op::Result, Op::Reset(true)]
}

/// A forward without backward (an evaluation) over these units, then its end.
fn eval(units: &[usize]) -> Vec<Op> {
    let mut ops = vec![Op::Assemble];
    for &u in units {
        ops.extend([Op::Begin(u), Op::End(u)]);
    }
    ops.extend([Op::Ended, Op::Serve, Op::Reset(false)]);
    ops
}

/// Units 0 (the root) to `n`, each needing only itself.
fn plain(n: usize) -> Vec<UnitSpec> {
    (0..=n).map(|u| UnitSpec { name: format!("unit{u}"), needs: vec![u] }).collect()
}

/// One simulated rank: its protocol, program and driver's record.
struct Rank {
    res: Residency,
    program: VecDeque<Op>,
    /// The command carried out that waits for its answer.
    waiting: Option<Command>,
    /// Rounds posted (the round awaited is the last).
    posted: usize,
    /// The round of the gather started last.
    gathered: Option<usize>,
    /// The units whole by the commands carried out.
    whole: Vec<bool>,
    /// Calls whose backward is still to come, per unit (innermost last).
    calls: Vec<Vec<CallId>>,
    /// Per unit: its bucket produced by backward.
    ready: Vec<bool>,
    /// Every bucket launched (the step's end asked for).
    launched_all: bool,
    /// Steps whose end this rank asked for.
    ends: usize,
    /// The world's wait before a backward (`buckets_in_flight`).
    wait: Option<usize>,
    /// Allocating this unit in a gather fails once.
    oom_at: Option<usize>,
    /// Collectives fail from this round on (a member lost).
    lost_from: Option<usize>,
    /// A `Lost` answer given.
    seen_lost: bool,
    /// Posts after a `Lost` answer (must stay 0).
    posts_after_lost: usize,
    /// Per unit, the `Zeros` commands carried out for it.
    zeros: Vec<usize>,
    /// Commands carried out, by kind, for the scenario's checks.
    releases: usize,
}

/// Every rank, the lane that pairs their rounds and the reductions' plan.
struct World {
    ranks: Vec<Rank>,
    /// Per round, each rank's words.
    posts: Vec<Vec<Option<Vec<u64>>>>,
    /// Per round, each rank's `asked` of its gather.
    gathers: Vec<Vec<Option<Vec<usize>>>>,
    /// Buckets (one per unit) in the plan's order: a backward's, the last unit first.
    plan: Vec<usize>,
}

impl World {
    fn new(specs: Vec<UnitSpec>, programs: Vec<Vec<Op>>, wait: Option<usize>, prefetch: bool) -> World {
        let world = programs.len();
        let units = specs.len();
        let ranks = programs
            .into_iter()
            .map(|program| Rank {
                res: Residency::new(specs.clone(), world, prefetch).unwrap(),
                program: program.into(),
                waiting: None,
                posted: 0,
                gathered: None,
                whole: vec![false; units],
                calls: vec![Vec::new(); units],
                ready: vec![false; units],
                launched_all: false,
                ends: 0,
                wait,
                oom_at: None,
                lost_from: None,
                seen_lost: false,
                posts_after_lost: 0,
                zeros: vec![0; units],
                releases: 0,
            })
            .collect();
        World { ranks, posts: Vec::new(), gathers: Vec::new(), plan: (0..units).rev().collect() }
    }

    /// Buckets rank `r` launched: the plan's longest prefix it produced.
    fn launched(&self, r: usize) -> usize {
        let rank = &self.ranks[r];
        self.plan.iter().take_while(|&&b| rank.launched_all || rank.ready[b]).count()
    }

    /// Rank `r`'s buckets launched and not complete (a bucket completes once every rank launched it).
    fn in_flight(&self, r: usize) -> usize {
        let complete = (0..self.ranks.len()).map(|s| self.launched(s)).min().unwrap();
        self.launched(r) - complete
    }

    /// The sum of round `k`, once every rank posted it.
    fn sum(&self, k: usize) -> Option<Vec<u64>> {
        let mut sum: Vec<u64> = Vec::new();
        for words in self.posts.get(k)? {
            let words = words.as_ref()?;
            sum.resize(words.len(), 0);
            sum.iter_mut().zip(words).for_each(|(s, w)| *s += w);
        }
        Some(sum)
    }

    /// Step every rank until every program is over; a sweep where none
    /// can move is a deadlock, too many sweeps a livelock.
    fn run(&mut self) -> &mut World {
        for sweep in 0.. {
            let moved = (0..self.ranks.len()).fold(false, |moved, r| self.step(r) | moved);
            if self.ranks.iter().all(|rank| rank.program.is_empty() && rank.waiting.is_none()) {
                return self;
            }
            assert!(moved, "deadlock: no rank can move\n{}", self.describe());
            assert!(sweep < 20_000, "livelock: the ranks keep rounding\n{}", self.describe());
        }
        unreachable!()
    }

    /// Move rank `r` by one answer, command or event: whether it moved.
    fn step(&mut self, r: usize) -> bool {
        if let Some(command) = self.ranks[r].waiting.clone() {
            let Some(answer) = self.answer(r, &command) else { return false };
            let rank = &mut self.ranks[r];
            rank.seen_lost |= answer == Answer::Lost;
            match (&command, &answer) {
                (Command::FinishGather { keep }, Answer::Gathered) => keep.iter().for_each(|&u| rank.whole[u] = true),
                (Command::FinishGather { .. }, Answer::OutOfMemory) => {
                    // The hook raises: this rank aborts its step where it stands.
                    rank.oom_at = None;
                    while rank.program.pop_front().is_some_and(|op| op != Op::Reset(true)) {}
                    step_end().into_iter().rev().for_each(|op| rank.program.push_front(op));
                }
                _ => {}
            }
            rank.waiting = None;
            rank.res.answer(answer).unwrap();
            return true;
        }
        let Some(command) = self.ranks[r].res.next_command().unwrap() else {
            self.check_table(r);
            return self.event(r);
        };
        let ranks = self.ranks.len();
        let rank = &mut self.ranks[r];
        match &command {
            Command::Release(u) => {
                assert!(rank.whole[*u], "rank {r}: unit {u} released twice");
                rank.whole[*u] = false;
                rank.releases += 1;
            }
            Command::Post(words) => {
                assert_eq!(words.len(), rank.whole.len() + 1);
                rank.posts_after_lost += usize::from(rank.seen_lost);
                let k = rank.posted;
                rank.posted += 1;
                if self.posts.len() <= k {
                    self.posts.resize(k + 1, vec![None; ranks]);
                }
                self.posts[k][r] = Some(words.clone());
            }
            Command::Zeros { keep } => {
                for &u in keep {
                    rank.whole[u] = true;
                    rank.zeros[u] += 1;
                }
            }
            Command::Gather { asked, keep } => {
                assert!(keep.iter().all(|u| asked.contains(u)), "rank {r} keeps {keep:?} of {asked:?}");
                let k = rank.posted - 1;
                rank.gathered = Some(k);
                if self.gathers.len() <= k {
                    self.gathers.resize(k + 1, vec![None; ranks]);
                }
                self.gathers[k][r] = Some(asked.clone());
                for other in self.gathers[k].iter().flatten() {
                    assert_eq!(other, asked, "round {k}: the ranks gather different units");
                }
                rank.waiting = Some(command);
            }
            _ => rank.waiting = Some(command),
        }
        true
    }

    /// The answer to `command` for rank `r`, or `None` while it must wait.
    fn answer(&self, r: usize, command: &Command) -> Option<Answer> {
        let rank = &self.ranks[r];
        let round = rank.posted.wrapping_sub(1);
        let lost = |k: usize| rank.lost_from.is_some_and(|from| k >= from);
        match command {
            Command::AwaitSum if lost(round) => Some(Answer::Lost),
            Command::AwaitSum => self.sum(round).map(Answer::Sum),
            Command::AwaitSumOrReductions { .. } if lost(round) => Some(Answer::Lost),
            Command::AwaitSumOrReductions { most } => match self.sum(round) {
                Some(sum) => Some(Answer::Sum(sum)),
                None => (self.in_flight(r) <= *most).then_some(Answer::Settled(true)),
            },
            Command::AwaitReductions { most, .. } => Some(Answer::Settled(self.in_flight(r) <= *most)),
            Command::Gather { .. } => Some(Answer::Started),
            Command::FinishGather { keep } => {
                let k = rank.gathered.unwrap();
                if lost(k) {
                    Some(Answer::Lost)
                } else if !self.gathers[k].iter().all(Option::is_some) {
                    None
                } else if rank.oom_at.is_some_and(|u| keep.contains(&u)) {
                    Some(Answer::OutOfMemory)
                } else {
                    Some(Answer::Gathered)
                }
            }
            other => panic!("{other:?} takes no answer"),
        }
    }

    /// The driver's record of whole units matches the table.
    fn check_table(&self, r: usize) {
        let rank = &self.ranks[r];
        let by_commands: Vec<usize> = (0..rank.whole.len()).filter(|&u| rank.whole[u]).collect();
        assert_eq!(by_commands, rank.res.whole_units(), "rank {r}: the commands and the table disagree");
    }

    /// Unit `unit`'s needs are whole on rank `r` (where its `what` runs).
    fn needs_whole(&self, r: usize, unit: usize, what: &str) {
        let rank = &self.ranks[r];
        for &u in &rank.res.units[unit].spec.needs {
            assert!(rank.whole[u], "rank {r}: unit {u} is not whole while unit {unit}'s {what} runs");
        }
    }

    /// Rank `r`'s next event (every command of the last one carried out): whether it moved.
    fn event(&mut self, r: usize) -> bool {
        let Some(op) = self.ranks[r].program.front().cloned() else { return false };
        match op {
            Op::Assemble => self.ranks[r].res.assemble(),
            Op::Begin(u) => {
                let call = self.ranks[r].res.forward_begins(u, false).unwrap();
                self.ranks[r].calls[u].push(call);
            }
            Op::End(u) => {
                self.needs_whole(r, u, "forward");
                let rank = &mut self.ranks[r];
                let call = rank.res.forward_ends(u, false).unwrap();
                assert_eq!(call.as_ref(), rank.calls[u].last(), "rank {r}: unit {u}'s forward ends another call");
            }
            Op::Ended => self.ranks[r].res.forward_ended(),
            Op::RecomputeBegin(u) => {
                self.ranks[r].res.forward_begins(u, true).unwrap();
            }
            Op::RecomputeEnd(u) => {
                self.needs_whole(r, u, "recomputation");
                let rank = &mut self.ranks[r];
                let call = rank.res.forward_ends(u, true).unwrap().expect("the recomputation's call");
                rank.calls[u].push(call);
            }
            Op::BackBegin(u) => {
                let rank = &mut self.ranks[r];
                let call = *rank.calls[u].last().expect("a call to go back through");
                rank.res.backward_begins(call, rank.wait).unwrap();
            }
            Op::BackEnd(u) => {
                self.needs_whole(r, u, "backward");
                let rank = &mut self.ranks[r];
                let call = rank.calls[u].pop().unwrap();
                rank.res.backward_ends(call);
                rank.ready[u] = true;
            }
            Op::Launch => {
                self.ranks[r].launched_all = true;
                self.ranks[r].ends += 1;
            }
            Op::Serve => self.ranks[r].res.serve(),
            Op::ServeAgain => self.ranks[r].res.serve_again(),
            Op::Result => {
                let ends = self.ranks[r].ends;
                if self.ranks.iter().any(|s| s.ends < ends) {
                    return false;
                }
            }
            Op::Reset(step_ended) => {
                let rank = &mut self.ranks[r];
                rank.res.reset(step_ended);
                rank.whole.iter_mut().for_each(|w| *w = false);
                rank.calls.iter_mut().for_each(Vec::clear);
                rank.ready.iter_mut().for_each(|b| *b = false);
                rank.launched_all = false;
            }
            Op::AssembleAll => self.ranks[r].res.assemble_all(),
        }
        self.ranks[r].program.pop_front();
        true
    }

    fn describe(&self) -> String {
        let mut out = String::new();
        for (r, rank) in self.ranks.iter().enumerate() {
            out += &format!(
                "rank {r}: next {:?}, waiting {:?}, posted {}, launched {}, whole {:?}\n",
                rank.program.front(),
                rank.waiting,
                rank.posted,
                self.launched(r),
                rank.res.whole_units()
            );
        }
        out
    }

    fn counts(&self, r: usize) -> &ResidencyCounts {
        self.ranks[r].res.counts()
    }
}

// ---- the specification ---------------------------------------------------------------------

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
    // The members settle on a new lane: rounds make collectives again.
    let rank = &mut world.ranks[0];
    rank.res.settled(2);
    assert!(!rank.res.broken());
    assert!(rank.res.whole_units().is_empty());
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
