//! The simulated world the specification runs on (see `tests/mod.rs`).

use std::collections::VecDeque;

use super::super::{Answer, CallId, Command, Residency, ResidencyCounts, UnitSpec};

/// One event of a rank's program (a hook firing), or a driver's act.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Op {
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
pub(super) fn train(units: &[usize]) -> Vec<Op> {
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
pub(super) fn step_end() -> Vec<Op> {
    vec![Op::Launch, Op::Serve, Op::Result, Op::Reset(true)]
}

/// A forward without backward (an evaluation) over these units, then its end.
pub(super) fn eval(units: &[usize]) -> Vec<Op> {
    let mut ops = vec![Op::Assemble];
    for &u in units {
        ops.extend([Op::Begin(u), Op::End(u)]);
    }
    ops.extend([Op::Ended, Op::Serve, Op::Reset(false)]);
    ops
}

/// Units 0 (the root) to `n`, each needing only itself.
pub(super) fn plain(n: usize) -> Vec<UnitSpec> {
    (0..=n).map(|u| UnitSpec { name: format!("unit{u}"), needs: vec![u] }).collect()
}

/// One simulated rank: its protocol, program and driver's record.
pub(super) struct Rank {
    pub(super) res: Residency,
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
    pub(super) oom_at: Option<usize>,
    /// Collectives fail from this round on (a member lost).
    pub(super) lost_from: Option<usize>,
    /// A `Lost` answer given.
    seen_lost: bool,
    /// Posts after a `Lost` answer (must stay 0).
    pub(super) posts_after_lost: usize,
    /// Per unit, the `Zeros` commands carried out for it.
    pub(super) zeros: Vec<usize>,
}

/// Every rank, the lane that pairs their rounds and the reductions' plan.
pub(super) struct World {
    pub(super) ranks: Vec<Rank>,
    /// Per round, each rank's words.
    posts: Vec<Vec<Option<Vec<u64>>>>,
    /// Per round, each rank's `asked` of its gather.
    gathers: Vec<Vec<Option<Vec<usize>>>>,
    /// Buckets (one per unit) in the plan's order: a backward's, the last unit first.
    plan: Vec<usize>,
}

impl World {
    pub(super) fn new(specs: Vec<UnitSpec>, programs: Vec<Vec<Op>>, wait: Option<usize>, prefetch: bool) -> World {
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
    pub(super) fn run(&mut self) -> &mut World {
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

    pub(super) fn counts(&self, r: usize) -> &ResidencyCounts {
        self.ranks[r].res.counts()
    }
}
