//! What the scheduler tells the outside world through the `metrics` facade.
//!
//! Nothing here runs on the hook path. Counters are added once per step (from
//! the counts the actors keep anyway), once per collective and once per
//! refusal, so a recorder costs a few dozen lookups per step. Without an
//! installed recorder the `metrics` macros do nothing. Every series carries a
//! `rank` label.
//!
//! [`METRICS`] is the one list of series: names, types, units, labels and help
//! text. The runtime describes the series from it and the README's table is
//! checked against it.

use std::time::Duration;

use metrics::Unit;

use crate::error::{CollectiveKind, CommError};
use crate::report::{Outcome, StepReport};

/// Metric names, as constants for the code that records them.
pub mod names {
    /// See [`super::METRICS`].
    pub const ARRIVALS: &str = "gradsync_arrivals_total";
    /// See [`super::METRICS`].
    pub const BUCKETS_LAUNCHED: &str = "gradsync_buckets_launched_total";
    /// See [`super::METRICS`].
    pub const ALLREDUCE_BYTES: &str = "gradsync_allreduce_bytes_total";
    /// See [`super::METRICS`].
    pub const ALLREDUCE_SECONDS: &str = "gradsync_allreduce_duration_seconds";
    /// See [`super::METRICS`].
    pub const EXPOSED_SECONDS: &str = "gradsync_exposed_comm_seconds";
    /// See [`super::METRICS`].
    pub const STEP_SECONDS: &str = "gradsync_step_duration_seconds";
    /// See [`super::METRICS`].
    pub const STEPS: &str = "gradsync_steps_total";
    /// See [`super::METRICS`].
    pub const CORRECTIONS: &str = "gradsync_corrections_total";
    /// See [`super::METRICS`].
    pub const CORRECTED_PARAMS: &str = "gradsync_corrected_params_total";
    /// See [`super::METRICS`].
    pub const ABORTS: &str = "gradsync_aborts_total";
    /// See [`super::METRICS`].
    pub const COLLECTIVE_FAILURES: &str = "gradsync_collective_failures_total";
    /// See [`super::METRICS`].
    pub const TIMEOUTS: &str = "gradsync_timeouts_total";
    /// See [`super::METRICS`].
    pub const PLAN_BUCKETS: &str = "gradsync_plan_buckets";
    /// See [`super::METRICS`].
    pub const PLAN_BYTES: &str = "gradsync_plan_bytes";
    /// See [`super::METRICS`].
    pub const BUCKET_MEMORY: &str = "gradsync_bucket_memory_bytes";
}

/// The type of a series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Monotonic count.
    Counter,
    /// Current value.
    Gauge,
    /// Distribution with fixed buckets ([`SECONDS_BUCKETS`]).
    Histogram,
}

impl MetricKind {
    /// Lowercase name, as Prometheus writes it.
    pub fn label(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One series gradsync records.
#[derive(Debug, Clone, Copy)]
pub struct MetricDef {
    /// Prometheus name.
    pub name: &'static str,
    /// Type.
    pub kind: MetricKind,
    /// Unit.
    pub unit: Unit,
    /// Labels besides `rank`, with their values where they are a closed set.
    pub labels: &'static str,
    /// Help text.
    pub help: &'static str,
}

/// Every series gradsync records.
pub const METRICS: &[MetricDef] = &[
    MetricDef {
        name: names::ARRIVALS,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "kind = first, late, duplicate, rejected",
        help: "Gradient hook deliveries by kind; first and late partition the distinct arrivals.",
    },
    MetricDef {
        name: names::BUCKETS_LAUNCHED,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "",
        help: "Data buckets handed to the communicator.",
    },
    MetricDef {
        name: names::ALLREDUCE_BYTES,
        kind: MetricKind::Counter,
        unit: Unit::Bytes,
        labels: "collective = plan, bucket, control, correction, reset",
        help: "Bytes this rank put into collectives.",
    },
    MetricDef {
        name: names::ALLREDUCE_SECONDS,
        kind: MetricKind::Histogram,
        unit: Unit::Seconds,
        labels: "collective",
        help: "Time inside one collective.",
    },
    MetricDef {
        name: names::EXPOSED_SECONDS,
        kind: MetricKind::Histogram,
        unit: Unit::Seconds,
        labels: "",
        help: "Communication per step that backward did not hide (finish_step to result).",
    },
    MetricDef {
        name: names::STEP_SECONDS,
        kind: MetricKind::Histogram,
        unit: Unit::Seconds,
        labels: "",
        help: "From a step's first gradient to its result.",
    },
    MetricDef {
        name: names::STEPS,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "outcome = applied, partial, skipped, all_joined",
        help: "Finished steps by outcome.",
    },
    MetricDef {
        name: names::CORRECTIONS,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "",
        help: "Correction all-reduces (late arrivals, retracted contributions).",
    },
    MetricDef {
        name: names::CORRECTED_PARAMS,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "",
        help: "Parameters corrected.",
    },
    MetricDef {
        name: names::ABORTS,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "aborting_rank, reason",
        help: "Aborting ranks seen in skipped or partial steps.",
    },
    MetricDef {
        name: names::COLLECTIVE_FAILURES,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "error = timeout, peer_gone, desync, protocol, device, backend, panicked, cancelled",
        help: "Failed collectives by error.",
    },
    MetricDef {
        name: names::TIMEOUTS,
        kind: MetricKind::Counter,
        unit: Unit::Count,
        labels: "",
        help: "Collectives failed because a rank missed the deadline.",
    },
    MetricDef {
        name: names::PLAN_BUCKETS,
        kind: MetricKind::Gauge,
        unit: Unit::Count,
        labels: "",
        help: "Buckets in the current plan.",
    },
    MetricDef {
        name: names::PLAN_BYTES,
        kind: MetricKind::Gauge,
        unit: Unit::Bytes,
        labels: "",
        help: "Bytes of one set of bucket buffers of the current plan.",
    },
    MetricDef {
        name: names::BUCKET_MEMORY,
        kind: MetricKind::Gauge,
        unit: Unit::Bytes,
        labels: "",
        help: "Bucket and partition memory the runtime holds, at the end of the last step.",
    },
];

/// Histogram boundaries (seconds) of every gradsync histogram: fixed, so the
/// series of all ranks and all jobs can be aggregated.
pub const SECONDS_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Record one finished collective.
pub(crate) fn collective(
    rank: &str,
    kind: &CollectiveKind,
    bytes: usize,
    took: Duration,
    result: &Result<(), CommError>,
) {
    let collective = kind.label();
    metrics::counter!(names::ALLREDUCE_BYTES, "rank" => rank.to_owned(), "collective" => collective)
        .increment(bytes as u64);
    metrics::histogram!(names::ALLREDUCE_SECONDS, "rank" => rank.to_owned(), "collective" => collective)
        .record(took.as_secs_f64());
    if let Err(e) = result {
        metrics::counter!(names::COLLECTIVE_FAILURES, "rank" => rank.to_owned(), "error" => e.label()).increment(1);
        if matches!(e, CommError::Timeout { .. }) {
            metrics::counter!(names::TIMEOUTS, "rank" => rank.to_owned()).increment(1);
        }
    }
}

/// Record the bucket memory held at a step's end.
pub(crate) fn memory(rank: &str, bytes: usize) {
    metrics::gauge!(names::BUCKET_MEMORY, "rank" => rank.to_owned()).set(bytes as f64);
}

/// Record the plan in force.
pub(crate) fn plan(rank: &str, buckets: usize, bytes: usize) {
    metrics::gauge!(names::PLAN_BUCKETS, "rank" => rank.to_owned()).set(buckets as f64);
    metrics::gauge!(names::PLAN_BYTES, "rank" => rank.to_owned()).set(bytes as f64);
}

/// Record one refused arrival.
pub(crate) fn rejected(rank: &str) {
    metrics::counter!(names::ARRIVALS, "rank" => rank.to_owned(), "kind" => "rejected").increment(1);
}

/// Record a finished step from its report.
pub(crate) fn step(rank: &str, r: &StepReport, step_time: Duration) {
    let arrivals = |kind: &'static str, n: u64| {
        metrics::counter!(names::ARRIVALS, "rank" => rank.to_owned(), "kind" => kind).increment(n);
    };
    arrivals("first", r.arrivals.saturating_sub(r.late_arrivals));
    arrivals("late", r.late_arrivals);
    arrivals("duplicate", r.duplicates);
    metrics::counter!(names::BUCKETS_LAUNCHED, "rank" => rank.to_owned()).increment(u64::from(r.buckets_launched));
    metrics::histogram!(names::EXPOSED_SECONDS, "rank" => rank.to_owned()).record(r.exposed_comm.as_secs_f64());
    metrics::histogram!(names::STEP_SECONDS, "rank" => rank.to_owned()).record(step_time.as_secs_f64());
    metrics::counter!(names::CORRECTIONS, "rank" => rank.to_owned()).increment(u64::from(r.corrections));
    metrics::counter!(names::CORRECTED_PARAMS, "rank" => rank.to_owned()).increment(r.corrected.len() as u64);
    metrics::counter!(names::STEPS, "rank" => rank.to_owned(), "outcome" => r.outcome.label()).increment(1);
    if let Outcome::Skipped { aborted } | Outcome::Partial { excluded: aborted } = &r.outcome {
        for (who, reason) in aborted {
            metrics::counter!(names::ABORTS, "rank" => rank.to_owned(), "aborting_rank" => who.to_string(),
                "reason" => reason.label())
            .increment(1);
        }
    }
}
