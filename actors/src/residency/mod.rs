//! The residency protocol of parameter sharding by units (ZeRO-3): which
//! units are whole, which round gathers what, when a unit is released.
//!
//! A *unit* is a group of parameters gathered together (a transformer
//! block; unit 0, the root, holds what no block holds). Between its uses a
//! unit is released: each rank keeps only its pieces. [`Residency`] is one
//! rank's protocol, a state machine without I/O: the framework's hooks
//! report events (a unit's forward begins or ends, its backward begins or
//! ends, the step ends), and the machine answers with [`Command`]s for the
//! driver to carry out one at a time (release a unit's memory, post a
//! round's words on the gather lane, start or finish a round's gathers,
//! wait for reductions), the answers coming back as [`Answer`]s:
//!
//! ```text
//! hook ──event──▶ Residency ──Command──▶ driver (Python: tensors, the lane, the session)
//!                     ▲                     │
//!                     └───────Answer────────┘   (a round's sum, gathers done, reductions settled)
//! ```
//!
//! Per unit the table holds a [`UnitState`] and what keeps it whole: the
//! forwards running that need it, the backwards that hold it (a forward's
//! backward, a recomputation inside backward), and whether a prefetch
//! brought it ahead of its use. A unit is released only when another unit
//! is needed and nothing keeps it, so a unit called twice, recomputed once
//! or twice, or sharing a weight with another is never freed while
//! anything still needs it.
//!
//! **Rounds** (`rounds.rs`) pair one for one across ranks: every rank posts
//! one word per unit (1: it needs the unit now) and one *serving* word; the
//! sums say which units any rank needs, and every rank gathers that union
//! in unit order, keeping what it asked for. A rank whose step ended
//! *serves*: it joins rounds asking for nothing until every rank serves. A
//! rank waiting for its reductions (`buckets_in_flight`) polls: it joins
//! rounds while it waits, so a peer whose forward took another path (a
//! unit used on some ranks only) gets the gathers it needs and produces the
//! gradients the wait is for. Nothing is broken by a timer: every wait ends
//! because what it waits for happened.
//!
//! The machine is driven directly by its unit tests (`tests/`), on a
//! simulated world of several ranks whose lane pairs their rounds.

mod rounds;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};

pub use rounds::{Answer, Command};
use rounds::{Awaiting, Open, RoundKind, Task};

/// Where a unit's parameters stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitState {
    /// Each rank holds only its pieces: the parameters are empty.
    Released,
    /// A prefetch round is bringing it (its gathers are in flight).
    Arriving,
    /// Whole, brought ahead of its use by a prefetch: not released until used.
    Prefetched,
    /// Whole.
    Whole,
}

impl UnitState {
    /// Whether the parameters hold their values now.
    pub fn is_whole(self) -> bool {
        matches!(self, UnitState::Prefetched | UnitState::Whole)
    }
}

/// One forward of a unit, named for the events that follow it (its
/// outputs' gradients: its backward begins; its inputs' gradients: it ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallId(pub u64);

/// A unit as the protocol knows it: its name (for errors) and the units a
/// forward of it needs whole (itself first, then those owning a weight it
/// shares).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitSpec {
    /// The module's name (`(root)` for unit 0).
    pub name: String,
    /// The units whole while it runs: itself first.
    pub needs: Vec<usize>,
}

/// What the protocol did since it was built, for tests and benchmarks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResidencyCounts {
    /// Rounds joined in which somebody asked for something (serving included).
    pub rounds: u64,
    /// Per unit, the gathers of it this rank kept.
    pub gathers: Vec<u64>,
    /// The most units but the root whole at once (outside `whole_parameters`).
    pub most_whole: usize,
    /// Rounds opened ahead of the unit's use.
    pub prefetched: u64,
    /// Rounds joined while waiting for reductions (polls).
    pub polls: u64,
}

/// One unit's row of the table.
#[derive(Debug)]
struct Unit {
    spec: UnitSpec,
    state: UnitState,
    /// Forwards of units needing it that are running now.
    forwards: usize,
    /// The calls whose backward needs it whole now.
    holds: Vec<CallId>,
    /// Its forwards running now, innermost last.
    calls: Vec<CallId>,
    /// Its recomputations inside backward begun and not seen to end.
    recomputes: Vec<CallId>,
}

/// One rank's residency protocol (see the module docs).
#[derive(Debug)]
pub struct Residency {
    units: Vec<Unit>,
    /// Every call not yet forgotten: its unit and whether it recomputes.
    calls: HashMap<CallId, (usize, bool)>,
    next_call: u64,
    /// Ranks in the lane's group (a round's serving words sum to it when every rank serves).
    world: usize,
    /// The units this rank needed in this step, in order.
    order: Vec<usize>,
    /// The last step's `order`: what the next step prefetches by.
    learned: Vec<usize>,
    /// Whether the next unit (by `learned`) is gathered while the current one computes.
    prefetch: bool,
    /// The round this rank opened and has not finished (a prefetch's
    /// gathers, a poll's words), or `None`.
    open: Option<Open>,
    /// Whether this rank served the others' rounds since it last asked.
    served: bool,
    /// A gather failed in this membership epoch (a member lost): rounds
    /// make no collective and leave what is wanted zeros.
    broken: bool,
    /// What is left to do for the events so far (`rounds.rs`).
    tasks: VecDeque<Task>,
    /// The command sent that waits for its answer, or `None`.
    awaiting: Option<Awaiting>,
    counts: ResidencyCounts,
}

/// A protocol error: the driver broke the command/answer discipline, or
/// named a unit or call that does not exist. A bug in the driver.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ResidencyError {
    /// A unit index past the table.
    #[error("unit {unit} does not exist (the table has {units}); name a unit of the wrapper's own plan")]
    NoSuchUnit {
        /// The index given.
        unit: usize,
        /// How many units there are.
        units: usize,
    },
    /// A unit's needs name a unit past the table, or do not start with itself.
    #[error("unit {unit}'s needs {needs:?} must start with itself and name units of the table")]
    BadNeeds {
        /// The unit.
        unit: usize,
        /// Its needs as given.
        needs: Vec<usize>,
    },
    /// An answer came that the command sent does not take (or none was sent).
    #[error("answer {answer} does not answer {awaiting}: answer each command that waits, once, before the next")]
    Unexpected {
        /// The answer given.
        answer: String,
        /// What the protocol waited for.
        awaiting: String,
    },
    /// `next_command` was called while a command still waits for its answer.
    #[error("{awaiting} still waits for its answer: answer it before asking for the next command")]
    Unanswered {
        /// What the protocol waits for.
        awaiting: String,
    },
    /// A round's sum has another length than its words.
    #[error("a round's sum has {got} words where {want} were posted")]
    SumLength {
        /// Words in the sum.
        got: usize,
        /// Words posted.
        want: usize,
    },
}

impl Residency {
    /// The protocol of one rank of `world` over `units` (unit 0 the root),
    /// every unit released; `prefetch`: gather the next unit (by the last
    /// step's order) while the current one computes.
    pub fn new(units: Vec<UnitSpec>, world: usize, prefetch: bool) -> Result<Residency, ResidencyError> {
        let count = units.len();
        for (u, spec) in units.iter().enumerate() {
            if spec.needs.first() != Some(&u) || spec.needs.iter().any(|&n| n >= count) {
                return Err(ResidencyError::BadNeeds { unit: u, needs: spec.needs.clone() });
            }
        }
        let units: Vec<Unit> = units
            .into_iter()
            .map(|spec| Unit {
                spec,
                state: UnitState::Released,
                forwards: 0,
                holds: Vec::new(),
                calls: Vec::new(),
                recomputes: Vec::new(),
            })
            .collect();
        Ok(Residency {
            counts: ResidencyCounts { gathers: vec![0; units.len()], ..ResidencyCounts::default() },
            units,
            calls: HashMap::new(),
            next_call: 0,
            world: world.max(1),
            order: Vec::new(),
            learned: Vec::new(),
            prefetch,
            open: None,
            served: false,
            broken: false,
            tasks: VecDeque::new(),
            awaiting: None,
        })
    }

    // ---- what the table says ----------------------------------------------------------------

    /// How many units there are (the root included).
    pub fn len(&self) -> usize {
        self.units.len()
    }

    /// Whether the table has no unit (never: the root is always there).
    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Unit `unit`'s state.
    pub fn state(&self, unit: usize) -> Result<UnitState, ResidencyError> {
        Ok(self.unit(unit)?.state)
    }

    /// The units whole now, in index order.
    pub fn whole_units(&self) -> Vec<usize> {
        (0..self.units.len()).filter(|&u| self.units[u].state.is_whole()).collect()
    }

    /// The units' names, in index order.
    pub fn names(&self) -> Vec<String> {
        self.units.iter().map(|u| u.spec.name.clone()).collect()
    }

    /// What the protocol did since it was built.
    pub fn counts(&self) -> &ResidencyCounts {
        &self.counts
    }

    /// Whether rounds make no collective in this epoch (a gather failed).
    pub fn broken(&self) -> bool {
        self.broken
    }

    /// The order of units the next step prefetches by (the last step's).
    pub fn learned(&self) -> &[usize] {
        &self.learned
    }

    /// Whether the next unit (by `learned`) is gathered while the current one computes.
    pub fn prefetch(&self) -> bool {
        self.prefetch
    }

    /// Turn the prefetch on or off (`prefetch_units`).
    pub fn set_prefetch(&mut self, on: bool) {
        self.prefetch = on;
    }

    fn unit(&self, unit: usize) -> Result<&Unit, ResidencyError> {
        self.units.get(unit).ok_or(ResidencyError::NoSuchUnit { unit, units: self.units.len() })
    }

    // ---- events --------------------------------------------------------------------------------

    /// A forward of `unit` begins (`recompute`: inside a backward, a
    /// checkpoint's recomputation, held until the unit's backward ends):
    /// its units whole (a round if one is not), after every other unit
    /// nothing keeps is released. Returns the call, for the events of its
    /// backward.
    pub fn forward_begins(&mut self, unit: usize, recompute: bool) -> Result<CallId, ResidencyError> {
        self.unit(unit)?;
        self.push_ensure(unit);
        let call = CallId(self.next_call);
        self.next_call += 1;
        self.calls.insert(call, (unit, recompute));
        if recompute {
            self.hold(call, unit);
            self.units[unit].recomputes.push(call);
        } else {
            for u in self.units[unit].spec.needs.clone() {
                self.units[u].forwards += 1;
            }
            self.units[unit].calls.push(call);
        }
        Ok(call)
    }

    /// A forward of `unit` ended (`recompute`: inside a backward): the
    /// call whose backward its outputs' gradients begin, or `None` when no
    /// begun forward matches (it began before a reset).
    pub fn forward_ends(&mut self, unit: usize, recompute: bool) -> Result<Option<CallId>, ResidencyError> {
        self.unit(unit)?;
        if recompute {
            return Ok(self.units[unit].recomputes.pop());
        }
        let call = self.units[unit].calls.pop();
        if call.is_some() {
            for u in self.units[unit].spec.needs.clone() {
                self.units[u].forwards -= 1;
            }
        }
        Ok(call)
    }

    /// `call`'s backward begins (a gradient of one of its outputs arrived):
    /// its units whole and held until it ends. `wait`: first wait until at
    /// most this many of the step's buckets are still in their reduction
    /// (`buckets_in_flight`), once per call, joining rounds meanwhile.
    pub fn backward_begins(&mut self, call: CallId, wait: Option<usize>) -> Result<(), ResidencyError> {
        let Some(&(unit, _)) = self.calls.get(&call) else {
            return Ok(()); // (a call of before a reset: its units are released, nothing holds them)
        };
        if let Some(most) = wait {
            if !self.units[unit].holds.contains(&call) && !self.broken && self.world > 1 {
                // (Asked at once; a `false` answer polls: `rounds.rs`.)
                self.tasks.push_back(Task::Await(Awaiting::Reductions { most, patient: false }));
            }
        }
        self.push_ensure(unit);
        self.hold(call, unit);
        Ok(())
    }

    /// `call`'s backward ended (its inputs' gradients are computed): its
    /// hold goes, and with it every hold of its unit's recomputations
    /// (their saved tensors were read by now).
    pub fn backward_ends(&mut self, call: CallId) {
        // (Calls stay known until the step's reset: a late gradient of
        // one of its outputs still finds its units.)
        let Some(&(unit, _)) = self.calls.get(&call) else {
            return;
        };
        self.units[unit].recomputes.clear();
        for u in self.units[unit].spec.needs.clone() {
            let calls = &self.calls;
            self.units[u].holds.retain(|c| *c != call && !calls.get(c).is_some_and(|&(o, r)| r && o == unit));
        }
    }

    /// The wrapper's forward returned: every unit but the root nothing
    /// keeps is released.
    pub fn forward_ended(&mut self) {
        self.tasks.push_back(Task::ReleaseUnused { except: Vec::new() });
    }

    /// The wrapper's forward begins: the root unit (and what it shares)
    /// whole, kept until the step ends; then the first prefetch.
    pub fn assemble(&mut self) {
        let wanted = self.units[0].spec.needs.clone();
        self.tasks.push_back(Task::Round { wanted, kind: RoundKind::Need });
        self.tasks.push_back(Task::Prefetch);
    }

    /// Every unit whole (`whole_parameters`): one round asking for all that
    /// are not. Units the driver released first (to gather them in another
    /// dtype) are reported with [`released`](Self::released) before.
    pub fn assemble_all(&mut self) {
        let wanted = (0..self.units.len()).collect();
        self.tasks.push_back(Task::Round { wanted, kind: RoundKind::All });
    }

    /// The driver released `unit`'s memory itself (it was whole in another
    /// dtype than the one about to be gathered).
    pub fn released(&mut self, unit: usize) -> Result<(), ResidencyError> {
        self.unit(unit)?;
        self.units[unit].state = UnitState::Released;
        Ok(())
    }

    /// This rank's step (or an evaluation, an abort, a join's shadow step)
    /// ended: serve the others' rounds until every rank serves, then finish
    /// what this rank opened. The driver then reads back the pieces of
    /// [`whole_units`](Self::whole_units) and calls [`reset`](Self::reset).
    pub fn serve(&mut self) {
        self.tasks.push_back(Task::FinishOpen);
        self.tasks.push_back(Task::Serve);
        self.tasks.push_back(Task::FinishOpen);
    }

    /// Serve the next step's rounds whatever this rank's last step left (a
    /// rank out of data shadowing the others' step: `join`).
    pub fn serve_again(&mut self) {
        self.served = false;
        self.serve();
    }

    /// Every unit released (the driver emptied them after reading back
    /// what it keeps). `step_ended`: a step's order of units is what the
    /// next step prefetches by (not after an evaluation or `whole_parameters`).
    pub fn reset(&mut self, step_ended: bool) {
        if step_ended && !self.order.is_empty() {
            self.learned = std::mem::take(&mut self.order);
        }
        self.order.clear();
        self.clear_units();
        self.served = false;
    }

    /// After a failed step's reset on every rank: the lane starts a new
    /// epoch, nothing is owed to anyone's rounds, whatever was open is gone,
    /// and rounds make collectives again (the new epoch's).
    pub fn forget(&mut self) {
        self.tasks.clear();
        self.awaiting = None;
        self.open = None;
        self.served = true;
        self.broken = false;
    }

    /// The members settled after a change, on a new lane of `world` ranks:
    /// every unit released without reading it back, nothing owed, rounds
    /// make collectives again.
    pub fn settled(&mut self, world: usize) {
        self.forget();
        self.order.clear();
        self.clear_units();
        self.world = world.max(1);
        self.broken = false;
    }

    fn clear_units(&mut self) {
        for unit in &mut self.units {
            unit.state = UnitState::Released;
            unit.forwards = 0;
            unit.holds.clear();
            unit.calls.clear();
            unit.recomputes.clear();
        }
        self.calls.clear();
    }

    /// `unit` and the units it shares weights with whole: what is open
    /// finished first, every other unit nothing keeps released, a round
    /// for what is missing, then the next unit's prefetch.
    fn push_ensure(&mut self, unit: usize) {
        let needs = self.units[unit].spec.needs.clone();
        self.tasks.push_back(Task::FinishOpen);
        self.tasks.push_back(Task::ReleaseUnused { except: needs.clone() });
        self.tasks.push_back(Task::Round { wanted: needs, kind: RoundKind::Need });
        self.tasks.push_back(Task::Enter(unit));
        self.tasks.push_back(Task::Prefetch);
    }

    fn hold(&mut self, call: CallId, unit: usize) {
        for u in self.units[unit].spec.needs.clone() {
            if !self.units[u].holds.contains(&call) {
                self.units[u].holds.push(call);
            }
        }
    }
}
