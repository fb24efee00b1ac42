//! [`Residency`]: the residency protocol of parameter sharding by units
//! (`gradsync_runtime::residency`), for `gradsync.torch.sharding.units`.
//!
//! ```text
//! module hooks ─event─▶ Residency ─next_command()─▶ ("post", words) … ─▶ the Python driver (tensors, Lane, Session)
//!                          ▲                                                  │
//!                          └──────────── answer("sum", [...]) … ──────────────┘
//! ```
//!
//! Commands come as tuples whose first item names them: `("release", u)`,
//! `("post", words)`, `("await_sum",)`, `("await_sum_or_reductions", most)`,
//! `("await_reductions", most, patient)`, `("gather", asked, keep)`,
//! `("finish_gather", keep)`, `("zeros", keep)`. Answers name theirs:
//! `"sum"` (with the sum), `"settled"` (with a bool), `"started"`,
//! `"gathered"`, `"out_of_memory"`, `"lost"`. The protocol's logic is all in
//! Rust; this layer only converts.

use gradsync_runtime::residency::{self as protocol, Answer, CallId, Command, ResidencyError, UnitSpec, UnitState};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors;

/// One rank's residency protocol (see the module docs).
#[pyclass(module = "gradsync._native")]
pub struct Residency {
    inner: protocol::Residency,
}

fn refused(py: Python<'_>, e: ResidencyError) -> PyErr {
    errors::raise::<errors::ConfigError>(py, format!("the residency protocol's driver: {e}"), &[])
}

#[pymethods]
impl Residency {
    /// The protocol of one rank of `world` over the units named `names`
    /// (unit 0 the root), unit `u` needing `needs[u]` whole (itself first,
    /// then the units owning weights it shares); `prefetch`: gather the next
    /// unit, by the last step's order, while the current one computes.
    #[new]
    #[pyo3(signature = (names, needs, world, *, prefetch = true))]
    fn new(py: Python<'_>, names: Vec<String>, needs: Vec<Vec<usize>>, world: usize, prefetch: bool) -> PyResult<Self> {
        if names.len() != needs.len() {
            let why = format!("{} unit names for {} units' needs", names.len(), needs.len());
            return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
        }
        let units = names.into_iter().zip(needs).map(|(name, needs)| UnitSpec { name, needs }).collect();
        let inner = protocol::Residency::new(units, world, prefetch).map_err(|e| refused(py, e))?;
        Ok(Residency { inner })
    }

    /// A forward of `unit` begins (`recompute`: inside a backward); its call.
    fn forward_begins(&mut self, py: Python<'_>, unit: usize, recompute: bool) -> PyResult<u64> {
        self.inner.forward_begins(unit, recompute).map(|c| c.0).map_err(|e| refused(py, e))
    }

    /// A forward of `unit` ended: the call whose backward comes, or `None`.
    fn forward_ends(&mut self, py: Python<'_>, unit: usize, recompute: bool) -> PyResult<Option<u64>> {
        self.inner.forward_ends(unit, recompute).map(|c| c.map(|c| c.0)).map_err(|e| refused(py, e))
    }

    /// `call`'s backward begins; `wait`: first at most this many buckets in
    /// their reduction (`buckets_in_flight`), once per call.
    #[pyo3(signature = (call, wait = None))]
    fn backward_begins(&mut self, py: Python<'_>, call: u64, wait: Option<usize>) -> PyResult<()> {
        self.inner.backward_begins(CallId(call), wait).map_err(|e| refused(py, e))
    }

    /// `call`'s backward ended.
    fn backward_ends(&mut self, call: u64) {
        self.inner.backward_ends(CallId(call));
    }

    /// The wrapper's forward returned.
    fn forward_ended(&mut self) {
        self.inner.forward_ended();
    }

    /// The wrapper's forward begins: the root unit whole.
    fn assemble(&mut self) {
        self.inner.assemble();
    }

    /// Every unit whole (`whole_parameters`).
    fn assemble_all(&mut self) {
        self.inner.assemble_all();
    }

    /// The driver released `unit`'s memory itself.
    fn released(&mut self, py: Python<'_>, unit: usize) -> PyResult<()> {
        self.inner.released(unit).map_err(|e| refused(py, e))
    }

    /// This rank's step (an evaluation, an abort) ended: serve the others.
    fn serve(&mut self) {
        self.inner.serve();
    }

    /// Serve the others' step whatever this rank's last step left (`join`).
    fn serve_again(&mut self) {
        self.inner.serve_again();
    }

    /// Every unit released; `step_ended`: the step's order is learned.
    fn reset(&mut self, step_ended: bool) {
        self.inner.reset(step_ended);
    }

    /// After a failed step's reset on every rank: nothing owed, nothing open.
    fn forget(&mut self) {
        self.inner.forget();
    }

    /// The members settled on a new lane of `world` ranks.
    fn settled(&mut self, world: usize) {
        self.inner.settled(world);
    }

    /// The next command, as a tuple (see the module docs), or `None`.
    fn next_command<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some(command) = self.inner.next_command().map_err(|e| refused(py, e))? else {
            return Ok(None);
        };
        let tuple = match command {
            Command::Release(u) => ("release", u).into_pyobject(py)?,
            Command::Post(words) => ("post", words).into_pyobject(py)?,
            Command::AwaitSum => ("await_sum",).into_pyobject(py)?,
            Command::AwaitSumOrReductions { most } => ("await_sum_or_reductions", most).into_pyobject(py)?,
            Command::AwaitReductions { most, patient } => ("await_reductions", most, patient).into_pyobject(py)?,
            Command::Gather { asked, keep } => ("gather", asked, keep).into_pyobject(py)?,
            Command::FinishGather { keep } => ("finish_gather", keep).into_pyobject(py)?,
            Command::Zeros { keep } => ("zeros", keep).into_pyobject(py)?,
        };
        Ok(Some(tuple))
    }

    /// The answer to the command that waits: `kind` names it (see the module
    /// docs); `value` is the sum of `"sum"`, the bool of `"settled"`.
    #[pyo3(signature = (kind, value = None))]
    fn answer(&mut self, py: Python<'_>, kind: &str, value: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let answer = match (kind, value) {
            ("sum", Some(v)) => Answer::Sum(v.extract()?),
            ("settled", Some(v)) => Answer::Settled(v.extract()?),
            ("started", None) => Answer::Started,
            ("gathered", None) => Answer::Gathered,
            ("out_of_memory", None) => Answer::OutOfMemory,
            ("lost", None) => Answer::Lost,
            (kind, value) => {
                let why = format!(
                    "answer {kind:?} with{} a value: the answers are \"sum\" and \"settled\" (with one), \
                     \"started\", \"gathered\", \"out_of_memory\", \"lost\"",
                    if value.is_some() { "" } else { "out" }
                );
                return Err(errors::raise::<errors::ConfigError>(py, why, &[]));
            }
        };
        self.inner.answer(answer).map_err(|e| refused(py, e))
    }

    /// Unit `unit`'s state: `"released"`, `"arriving"`, `"prefetched"` or `"whole"`.
    fn state(&self, py: Python<'_>, unit: usize) -> PyResult<&'static str> {
        Ok(match self.inner.state(unit).map_err(|e| refused(py, e))? {
            UnitState::Released => "released",
            UnitState::Arriving => "arriving",
            UnitState::Prefetched => "prefetched",
            UnitState::Whole => "whole",
        })
    }

    /// The units whole now, in index order.
    fn whole_units(&self) -> Vec<usize> {
        self.inner.whole_units()
    }

    /// Whether rounds make no collective in this epoch (a gather failed).
    #[getter]
    fn broken(&self) -> bool {
        self.inner.broken()
    }

    /// The order of units the next step prefetches by.
    #[getter]
    fn learned(&self) -> Vec<usize> {
        self.inner.learned().to_vec()
    }

    /// Whether the next unit is gathered while the current one computes.
    #[getter]
    fn prefetch(&self) -> bool {
        self.inner.prefetch()
    }

    /// Turn the prefetch on or off.
    fn set_prefetch(&mut self, on: bool) {
        self.inner.set_prefetch(on);
    }

    /// What the protocol did: `(rounds, gathers per unit, most_whole, prefetched, polls)`.
    fn counts(&self) -> (u64, Vec<u64>, usize, u64, u64) {
        let c = self.inner.counts();
        (c.rounds, c.gathers.clone(), c.most_whole, c.prefetched, c.polls)
    }
}
