//! [`StepReport`]: what one rank learned about one step, as Python reads it.

use gradsync_runtime::{Outcome, StepReport as RustReport};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{dict, value};

/// What one rank learned about one step (identical outcome on every rank).
#[pyclass(module = "gradsync._native", frozen, get_all)]
pub struct StepReport {
    /// The step.
    step: u64,
    /// This rank.
    rank: usize,
    /// `"applied"`, `"partial"`, `"skipped"` or `"all_joined"`.
    outcome: String,
    /// Ranks that aborted, with their reasons (skipped or partial steps).
    aborted: Vec<(usize, String)>,
    /// Ranks whose gradients are in the result.
    contributors: u32,
    /// Ranks that had joined (run out of data).
    joined: Vec<usize>,
    /// Distinct arrivals accepted on this rank.
    arrivals: u64,
    /// Re-deliveries ignored.
    duplicates: u64,
    /// Refused arrivals that named this step.
    rejected: u64,
    /// The first refusals, as messages.
    rejections: Vec<String>,
    /// Arrivals after their bucket was launched.
    late_arrivals: u64,
    /// Indices of the parameters corrected after the data buckets.
    corrected: Vec<usize>,
    /// What the step's sum was divided by (1 for a step that does not apply).
    divisor: u32,
    /// Correction collectives issued (0, or 1 per element type corrected).
    corrections: u32,
    /// Parameters with no arrival on this rank.
    unused_local: u32,
    /// Indices of the parameters with no arrival on any rank (no gradient).
    unused_everywhere: Vec<usize>,
    /// Data buckets all-reduced.
    buckets_launched: u32,
    /// Buckets launched before the end of backward.
    buckets_launched_before_finish: u32,
    /// Buckets reduced before the end of backward (overlap).
    buckets_done_before_finish: u32,
    /// Bytes this rank put into collectives.
    bytes_launched: u64,
    /// Seconds from the end of backward to the result (communication not hidden).
    exposed_comm_s: f64,
    /// Seconds the communicator spent in collectives.
    comm_busy_s: f64,
    /// A process waits to join (an elastic job): every rank admits it at
    /// this step boundary.
    admit: bool,
}

impl StepReport {
    pub fn new(r: &RustReport) -> StepReport {
        let aborted = match &r.outcome {
            Outcome::Skipped { aborted } | Outcome::Partial { excluded: aborted } => {
                aborted.iter().map(|(rank, why)| (*rank, why.label().into_owned())).collect()
            }
            Outcome::Applied | Outcome::AllJoined => Vec::new(),
        };
        StepReport {
            step: r.step,
            rank: r.rank,
            outcome: r.outcome.label().to_string(),
            aborted,
            contributors: r.contributors,
            joined: r.joined.clone(),
            arrivals: r.arrivals,
            duplicates: r.duplicates,
            rejected: r.rejected,
            rejections: r.rejections.iter().map(|x| x.to_string()).collect(),
            late_arrivals: r.late_arrivals,
            corrected: r.corrected.iter().map(|p| p.index()).collect(),
            divisor: r.divisor,
            corrections: r.corrections,
            unused_local: r.unused_local,
            unused_everywhere: r.unused_everywhere.iter().map(|p| p.index()).collect(),
            buckets_launched: r.buckets_launched,
            buckets_launched_before_finish: r.buckets_launched_before_finish,
            buckets_done_before_finish: r.buckets_done_before_finish,
            bytes_launched: r.bytes_launched,
            exposed_comm_s: r.exposed_comm.as_secs_f64(),
            comm_busy_s: r.comm_busy.as_secs_f64(),
            admit: r.admit,
        }
    }
}

#[pymethods]
impl StepReport {
    /// The report as a dictionary.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        dict(
            py,
            vec![
                ("step", value(py, self.step)),
                ("rank", value(py, self.rank)),
                ("outcome", value(py, self.outcome.clone())),
                ("aborted", value(py, self.aborted.clone())),
                ("contributors", value(py, self.contributors)),
                ("joined", value(py, self.joined.clone())),
                ("arrivals", value(py, self.arrivals)),
                ("duplicates", value(py, self.duplicates)),
                ("rejected", value(py, self.rejected)),
                ("rejections", value(py, self.rejections.clone())),
                ("late_arrivals", value(py, self.late_arrivals)),
                ("corrected", value(py, self.corrected.clone())),
                ("divisor", value(py, self.divisor)),
                ("corrections", value(py, self.corrections)),
                ("unused_local", value(py, self.unused_local)),
                ("unused_everywhere", value(py, self.unused_everywhere.clone())),
                ("buckets_launched", value(py, self.buckets_launched)),
                ("buckets_launched_before_finish", value(py, self.buckets_launched_before_finish)),
                ("buckets_done_before_finish", value(py, self.buckets_done_before_finish)),
                ("bytes_launched", value(py, self.bytes_launched)),
                ("exposed_comm_s", value(py, self.exposed_comm_s)),
                ("comm_busy_s", value(py, self.comm_busy_s)),
                ("admit", value(py, self.admit)),
            ],
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "StepReport(step={}, rank={}, outcome={:?}, contributors={}, late_arrivals={}, corrected={:?}, \
             exposed_comm_s={:.6})",
            self.step,
            self.rank,
            self.outcome,
            self.contributors,
            self.late_arrivals,
            self.corrected,
            self.exposed_comm_s
        )
    }
}
