//! The rounds of the residency protocol: what an event leaves to do
//! ([`Task`]s, run in order), the [`Command`]s they become, and the
//! [`Answer`]s the driver gives back.
//!
//! A round, as one rank sees it:
//!
//! ```text
//! Post(words) ─▶ AwaitSum ◀─ Sum(every rank's words summed)
//!   └─ nobody asked ─▶ done (a serving rank stops once every rank serves)
//!   └─ else ─▶ Gather{asked, keep} ◀─ Started ─▶ FinishGather ◀─ Gathered ─▶ `keep` whole
//!              (a prefetch leaves its gathers open until the next round, or the step's end)
//! ```
//!
//! A wait for reductions (`buckets_in_flight`) asks the driver first
//! whether they settled; if not it polls: it posts a round asking for
//! nothing and waits for whichever comes first, the round's sum (a peer
//! needed a round: this rank gathers with it, then asks again) or the
//! reductions settling (the round stays open, finished before this rank's
//! next round). A poll nobody asked in is followed by a patient ask (the
//! driver waits a tick for the reductions) before the next poll, so ranks
//! that wait together do not spin rounds.

use super::{Residency, ResidencyError, UnitState};

/// What the driver does next (one at a time, in order). Those that wait
/// take an [`Answer`] before the next is asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Empty the unit's parameters (inside a step its storage is freed too).
    Release(usize),
    /// Post these words on the gather lane: a round opens (no answer).
    Post(Vec<u64>),
    /// Wait for the posted round's sum: [`Answer::Sum`] (or [`Answer::Lost`]).
    AwaitSum,
    /// Wait for the posted round's sum or for at most `most` of the step's
    /// buckets to be in their reduction, whichever comes first:
    /// [`Answer::Sum`] or [`Answer::Settled`]`(true)` (or [`Answer::Lost`]).
    AwaitSumOrReductions {
        /// Buckets that may still be in their reduction.
        most: usize,
    },
    /// Whether at most `most` of the step's buckets are in their reduction:
    /// [`Answer::Settled`]. `patient`: the driver may wait a tick for it.
    AwaitReductions {
        /// Buckets that may still be in their reduction.
        most: usize,
        /// Wait a tick before answering `false`.
        patient: bool,
    },
    /// Start the round's gathers: every bucket of the `asked` units, in
    /// unit order; this rank reads back `keep`'s. [`Answer::Started`] (or
    /// [`Answer::Lost`]).
    Gather {
        /// The units any rank asked for.
        asked: Vec<usize>,
        /// The units this rank keeps (allocates and reads back).
        keep: Vec<usize>,
    },
    /// Wait for the started gathers and read back `keep`'s:
    /// [`Answer::Gathered`] (or [`Answer::OutOfMemory`], [`Answer::Lost`]).
    FinishGather {
        /// The units this rank keeps.
        keep: Vec<usize>,
    },
    /// A gather failed in this epoch: `keep`'s parameters allocated and
    /// left zeros, no collective (no answer).
    Zeros {
        /// The units this rank needed.
        keep: Vec<usize>,
    },
}

/// The driver's answer to a [`Command`] that waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A round's words, summed over every rank.
    Sum(Vec<u64>),
    /// Whether the reductions settled (at most `most` in flight).
    Settled(bool),
    /// The gathers started.
    Started,
    /// The gathers finished, `keep` read back.
    Gathered,
    /// The gathers finished on every rank, but this rank could not allocate
    /// what it keeps: the driver raises after this answer.
    OutOfMemory,
    /// A collective of the lane failed (a member lost, in an elastic job):
    /// from now on no round makes a collective in this epoch.
    Lost,
}

impl Answer {
    fn name(&self) -> &'static str {
        match self {
            Answer::Sum(_) => "Sum",
            Answer::Settled(_) => "Settled",
            Answer::Started => "Started",
            Answer::Gathered => "Gathered",
            Answer::OutOfMemory => "OutOfMemory",
            Answer::Lost => "Lost",
        }
    }
}

/// What a round is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RoundKind {
    /// Units this rank needs now.
    Need,
    /// The next unit, ahead of its use: its gathers stay open.
    Prefetch,
    /// Every unit (`whole_parameters`): every rank rounds, asked or not.
    All,
    /// This rank's step ended: it asks nothing, until every rank serves.
    Serve,
    /// This rank waits for reductions and asks nothing.
    Poll {
        /// The wait's bound.
        most: usize,
    },
    /// A poll left open, finished before the next round.
    Polled,
}

/// A round this rank opened and has not finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Open {
    /// A poll's words posted, its sum not read yet.
    Poll,
    /// A prefetch's gathers started; `keep` arrives when they finish.
    Prefetch {
        /// The units the prefetch brings.
        keep: Vec<usize>,
    },
}

/// What the protocol waits for after a command that waits.
#[derive(Clone, Debug)]
pub(super) enum Awaiting {
    Sum { wanted: Vec<usize>, kind: RoundKind },
    SumOrReductions { most: usize },
    Reductions { most: usize, patient: bool },
    Started { asked: Vec<usize>, keep: Vec<usize>, kind: RoundKind, then: Option<Then> },
    Gathered { keep: Vec<usize>, kind: RoundKind, then: Option<Then> },
}

impl Awaiting {
    fn name(&self) -> &'static str {
        match self {
            Awaiting::Sum { .. } => "AwaitSum",
            Awaiting::SumOrReductions { .. } => "AwaitSumOrReductions",
            Awaiting::Reductions { .. } => "AwaitReductions",
            Awaiting::Started { .. } => "Gather",
            Awaiting::Gathered { .. } => "FinishGather",
        }
    }
}

/// What a round's kind does once its gathers are read back.
#[derive(Clone, Copy, Debug)]
pub(super) enum Then {
    /// Serve the next round (a rank did not serve in this one).
    ServeOn,
    /// Go on waiting for the reductions (`asked`: a peer asked in the poll).
    AfterPoll { most: usize, asked: bool },
}

impl From<Then> for Task {
    fn from(then: Then) -> Task {
        match then {
            Then::ServeOn => Task::ServeOn,
            // (After a peer asked, the reductions may have settled at once; else wait a tick.)
            Then::AfterPoll { most, asked } => Task::Await(Awaiting::Reductions { most, patient: !asked }),
        }
    }
}

/// What is left to do, in order (each decides when it is reached, on the
/// table as it is then).
#[derive(Clone, Debug)]
pub(super) enum Task {
    /// The round this rank left open finished.
    FinishOpen,
    /// Every unit but the root and `except` that nothing keeps released.
    ReleaseUnused { except: Vec<usize> },
    /// A round for `wanted` (those not whole, when it is reached).
    Round { wanted: Vec<usize>, kind: RoundKind },
    /// `unit` entered: what a prefetch brought for it is used; the order grows.
    Enter(usize),
    /// The next unit's round opened, if the step follows the last one's order.
    Prefetch,
    /// Serve rounds until every rank serves (once per step).
    Serve,
    /// The next serving round (the last one's sum had a rank not serving).
    ServeOn,
    /// Poll: a round asking for nothing while the reductions settle.
    Poll { most: usize },
    /// A command that waits, and what it waits for.
    Await(Awaiting),
    /// A command with no answer.
    Emit(Command),
}

impl Residency {
    /// The next command for the driver, or `None` when nothing is left for
    /// the events so far. Refused while a command waits for its answer.
    pub fn next_command(&mut self) -> Result<Option<Command>, ResidencyError> {
        if let Some(awaiting) = &self.awaiting {
            return Err(ResidencyError::Unanswered { awaiting: awaiting.name().into() });
        }
        while let Some(task) = self.tasks.pop_front() {
            if let Some(command) = self.run(task) {
                return Ok(Some(command));
            }
        }
        Ok(None)
    }

    /// The answer to the command that waits.
    pub fn answer(&mut self, answer: Answer) -> Result<(), ResidencyError> {
        let Some(awaiting) = self.awaiting.take() else {
            return Err(ResidencyError::Unexpected { answer: answer.name().into(), awaiting: "nothing".into() });
        };
        match (awaiting, answer) {
            (Awaiting::Sum { wanted, kind }, Answer::Sum(sum)) => return self.summed(&wanted, kind, sum),
            (Awaiting::SumOrReductions { most }, Answer::Sum(sum)) => {
                return self.summed(&[], RoundKind::Poll { most }, sum);
            }
            (Awaiting::SumOrReductions { .. }, Answer::Settled(true)) => self.open = Some(Open::Poll),
            (Awaiting::Reductions { .. }, Answer::Settled(true)) => {}
            (Awaiting::Reductions { most, .. }, Answer::Settled(false)) => self.tasks.push_front(Task::Poll { most }),
            (Awaiting::Started { keep, kind: RoundKind::Prefetch, .. }, Answer::Started) => {
                self.open = Some(Open::Prefetch { keep });
            }
            (Awaiting::Started { keep, kind, then, .. }, Answer::Started) => {
                self.tasks.push_front(Task::Await(Awaiting::Gathered { keep, kind, then }));
            }
            (Awaiting::Gathered { keep, kind, then }, Answer::Gathered) => self.finished(&keep, kind, then),
            (Awaiting::Gathered { keep, .. }, Answer::OutOfMemory) => {
                // Every rank's gathers completed; this rank raises and aborts its step.
                for u in keep {
                    self.units[u].state = UnitState::Released;
                }
                self.tasks.clear();
                self.open = None;
            }
            (Awaiting::Sum { wanted, kind }, Answer::Lost) => {
                let keep = self.missing(&wanted, kind);
                self.lost_round(keep, kind);
            }
            (Awaiting::Started { keep, kind, .. } | Awaiting::Gathered { keep, kind, .. }, Answer::Lost) => {
                self.lost_round(keep, kind);
            }
            (Awaiting::SumOrReductions { .. }, Answer::Lost) => self.broken = true,
            (awaiting, answer) => {
                let (answer, awaiting) = (answer.name().into(), awaiting.name().into());
                return Err(ResidencyError::Unexpected { answer, awaiting });
            }
        }
        Ok(())
    }

    /// Run `task`: the command it becomes, or `None` (it only changed the
    /// table or queued more tasks).
    fn run(&mut self, task: Task) -> Option<Command> {
        match task {
            Task::FinishOpen => match self.open.take() {
                None => None,
                Some(Open::Prefetch { keep }) => {
                    self.run(Task::Await(Awaiting::Gathered { keep, kind: RoundKind::Prefetch, then: None }))
                }
                Some(Open::Poll) => {
                    self.run(Task::Await(Awaiting::Sum { wanted: Vec::new(), kind: RoundKind::Polled }))
                }
            },
            Task::ReleaseUnused { except } => {
                let free: Vec<usize> = (1..self.units.len())
                    .filter(|u| !except.contains(u))
                    .filter(|&u| {
                        let unit = &self.units[u];
                        unit.state == UnitState::Whole && unit.forwards == 0 && unit.holds.is_empty()
                    })
                    .collect();
                for &u in free.iter().rev() {
                    self.units[u].state = UnitState::Released;
                    self.tasks.push_front(Task::Emit(Command::Release(u)));
                }
                None
            }
            Task::Round { wanted, kind } => self.open_round(&wanted, kind),
            Task::Enter(unit) => {
                for u in self.units[unit].spec.needs.clone() {
                    if self.units[u].state == UnitState::Prefetched {
                        self.units[u].state = UnitState::Whole;
                    }
                }
                self.order.push(unit);
                None
            }
            Task::Prefetch => {
                self.plan_prefetch();
                None
            }
            Task::Serve => {
                if !self.served && self.world > 1 {
                    self.served = true;
                    self.tasks.push_front(Task::ServeOn);
                }
                None
            }
            Task::ServeOn => self.open_round(&[], RoundKind::Serve),
            Task::Poll { most } => {
                if self.broken {
                    return None;
                }
                if self.open.is_some() {
                    self.tasks.push_front(Task::Poll { most });
                    self.tasks.push_front(Task::FinishOpen);
                    return None;
                }
                self.served = false;
                self.counts.polls += 1;
                self.tasks.push_front(Task::Await(Awaiting::SumOrReductions { most }));
                Some(Command::Post(self.words(&[], false)))
            }
            Task::Await(awaiting) => {
                let command = match &awaiting {
                    Awaiting::Sum { .. } => Command::AwaitSum,
                    Awaiting::SumOrReductions { most } => Command::AwaitSumOrReductions { most: *most },
                    Awaiting::Reductions { most, patient } => {
                        Command::AwaitReductions { most: *most, patient: *patient }
                    }
                    Awaiting::Started { asked, keep, .. } => {
                        Command::Gather { asked: asked.clone(), keep: keep.clone() }
                    }
                    Awaiting::Gathered { keep, .. } => Command::FinishGather { keep: keep.clone() },
                };
                self.awaiting = Some(awaiting);
                Some(command)
            }
            Task::Emit(command) => Some(command),
        }
    }

    /// The units of `wanted` a round of `kind` still asks for.
    fn missing(&self, wanted: &[usize], kind: RoundKind) -> Vec<usize> {
        let state = |u: &usize| self.units[*u].state;
        match kind {
            RoundKind::Serve | RoundKind::Poll { .. } | RoundKind::Polled => Vec::new(),
            RoundKind::Prefetch => wanted.iter().copied().filter(|u| state(u) == UnitState::Arriving).collect(),
            RoundKind::Need | RoundKind::All => {
                wanted.iter().copied().filter(|u| state(u) == UnitState::Released).collect()
            }
        }
    }

    /// This rank's words for a round: per unit 1 where it asks, then 1 when it serves.
    fn words(&self, asks: &[usize], serving: bool) -> Vec<u64> {
        let mut words = vec![0u64; self.units.len() + 1];
        for &u in asks {
            words[u] = 1;
        }
        words[self.units.len()] = u64::from(serving);
        words
    }

    /// Open a round of `kind` for `wanted`: its words posted (the sum comes
    /// with the next answer), or, with nothing to ask where nobody else
    /// needs to hear it, nothing.
    fn open_round(&mut self, wanted: &[usize], kind: RoundKind) -> Option<Command> {
        let asks = self.missing(wanted, kind);
        if asks.is_empty() && matches!(kind, RoundKind::Need | RoundKind::Prefetch) {
            return None;
        }
        if self.broken {
            // No collective in this epoch: what is asked is left zeros.
            if !asks.is_empty() {
                self.finished(&asks, kind, None);
                return Some(Command::Zeros { keep: asks });
            }
            return None;
        }
        if kind != RoundKind::Serve {
            self.served = false;
        }
        let words = self.words(&asks, kind == RoundKind::Serve);
        self.tasks.push_front(Task::Await(Awaiting::Sum { wanted: asks, kind }));
        Some(Command::Post(words))
    }

    /// A round's sum came back: gather what any rank asked for, keep what
    /// this rank asked for, then go on as the round's kind says.
    fn summed(&mut self, wanted: &[usize], kind: RoundKind, sum: Vec<u64>) -> Result<(), ResidencyError> {
        let units = self.units.len();
        if sum.len() != units + 1 {
            return Err(ResidencyError::SumLength { got: sum.len(), want: units + 1 });
        }
        let asked: Vec<usize> = (0..units).filter(|&u| sum[u] > 0).collect();
        let then = match kind {
            RoundKind::Serve if (sum[units] as usize) < self.world => Some(Then::ServeOn),
            RoundKind::Poll { most } => Some(Then::AfterPoll { most, asked: !asked.is_empty() }),
            _ => None,
        };
        if asked.is_empty() {
            if let Some(then) = then {
                self.tasks.push_front(then.into());
            }
            return Ok(());
        }
        let keep: Vec<usize> = wanted.iter().copied().filter(|u| asked.contains(u)).collect();
        self.tasks.push_front(Task::Await(Awaiting::Started { asked, keep, kind, then }));
        Ok(())
    }

    /// The round's gathers read back: `keep` whole (a prefetch's until
    /// used), counted; then what the round's kind does next.
    fn finished(&mut self, keep: &[usize], kind: RoundKind, then: Option<Then>) {
        let state = if kind == RoundKind::Prefetch { UnitState::Prefetched } else { UnitState::Whole };
        for &u in keep {
            self.units[u].state = state;
            self.counts.gathers[u] += 1;
        }
        self.counts.rounds += 1;
        if kind != RoundKind::All {
            let whole = self.units[1..].iter().filter(|u| u.state.is_whole()).count();
            self.counts.most_whole = self.counts.most_whole.max(whole);
        }
        if let Some(then) = then {
            self.tasks.push_front(then.into());
        }
    }

    /// A collective of the round failed: no more collectives in this epoch;
    /// what this rank keeps is left zeros and counts as whole (the step
    /// runs to its end, and the members settle).
    fn lost_round(&mut self, keep: Vec<usize>, kind: RoundKind) {
        self.broken = true;
        self.open = None;
        if !keep.is_empty() {
            self.finished(&keep, kind, None);
            self.tasks.push_front(Task::Emit(Command::Zeros { keep }));
        }
    }

    /// Open the next unit's round ahead of its use when the step so far
    /// follows the last step's order and that unit is not whole.
    fn plan_prefetch(&mut self) {
        if !self.prefetch || self.open.is_some() || self.broken {
            return;
        }
        let at = self.order.len();
        if at >= self.learned.len() || self.order[..] != self.learned[..at] {
            return;
        }
        let next = self.learned[at];
        let missing: Vec<usize> = self.units[next]
            .spec
            .needs
            .iter()
            .copied()
            .filter(|&u| self.units[u].state == UnitState::Released)
            .collect();
        if missing.is_empty() {
            return;
        }
        for &u in &missing {
            self.units[u].state = UnitState::Arriving;
        }
        self.counts.prefetched += 1;
        self.tasks.push_front(Task::Round { wanted: missing, kind: RoundKind::Prefetch });
    }
}
