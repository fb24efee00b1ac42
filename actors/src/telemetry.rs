//! What the scheduler tells the outside world: Prometheus metrics through the
//! `metrics` facade, and an optional per-step timeline.
//!
//! Nothing here runs on the hook path. Counters are added once per step (from
//! the counts the actors keep anyway) and once per collective, so a recorder
//! costs a few dozen lookups per step. Without an installed recorder the
//! `metrics` macros do nothing. Every series carries a `rank` label.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{CollectiveKind, CommError};
use crate::report::{AbortReason, Outcome, StepReport};

/// Metric names, one place, so the exporter, the docs and the tests agree.
pub mod names {
    /// Counter `{rank, kind="first|duplicate|late|rejected"}`: hook deliveries.
    pub const ARRIVALS: &str = "gradsync_arrivals_total";
    /// Counter `{rank}`: data buckets handed to the communicator.
    pub const BUCKETS_LAUNCHED: &str = "gradsync_buckets_launched_total";
    /// Counter `{rank, collective="bucket|control|correction|reset"}`: bytes all-reduced.
    pub const ALLREDUCE_BYTES: &str = "gradsync_allreduce_bytes_total";
    /// Histogram `{rank, collective}`: time inside one all-reduce.
    pub const ALLREDUCE_SECONDS: &str = "gradsync_allreduce_duration_seconds";
    /// Histogram `{rank}`: communication not hidden by backward, per step.
    pub const EXPOSED_SECONDS: &str = "gradsync_exposed_comm_seconds";
    /// Histogram `{rank}`: from a step's first message to its result.
    pub const STEP_SECONDS: &str = "gradsync_step_duration_seconds";
    /// Counter `{rank, outcome="applied|skipped"}`: finished steps.
    pub const STEPS: &str = "gradsync_steps_total";
    /// Counter `{rank}`: correction all-reduces.
    pub const CORRECTIONS: &str = "gradsync_corrections_total";
    /// Counter `{rank}`: parameters corrected after a late arrival.
    pub const CORRECTED_PARAMS: &str = "gradsync_corrected_params_total";
    /// Counter `{rank, aborting_rank, reason}`: ranks that aborted a step, as seen here.
    pub const ABORTS: &str = "gradsync_aborts_total";
    /// Counter `{rank, error="timeout|peer_gone|desync|device|panicked|cancelled"}`: failed collectives.
    pub const COLLECTIVE_FAILURES: &str = "gradsync_collective_failures_total";
    /// Counter `{rank}`: collectives that failed because a rank missed the deadline.
    pub const TIMEOUTS: &str = "gradsync_timeouts_total";
    /// Gauge `{rank}`: buckets in the current plan.
    pub const PLAN_BUCKETS: &str = "gradsync_plan_buckets";
    /// Gauge `{rank}`: bytes of bucket storage of the current plan.
    pub const PLAN_BYTES: &str = "gradsync_plan_bytes";
}

/// Histogram boundaries (seconds) of every gradsync histogram: fixed, so the
/// series of all ranks and all jobs can be aggregated.
pub const SECONDS_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

fn collective_label(kind: &CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::Bucket { .. } => "bucket",
        CollectiveKind::Control { .. } => "control",
        CollectiveKind::Correction { .. } => "correction",
        CollectiveKind::Reset { .. } => "reset",
    }
}

fn reason_label(reason: AbortReason) -> String {
    match reason {
        AbortReason::OutOfMemory => "out_of_memory".into(),
        AbortReason::BadBatch => "bad_batch".into(),
        AbortReason::NonFinite => "non_finite".into(),
        AbortReason::Other(c) => format!("other_{c}"),
    }
}

/// Record one finished collective.
pub(crate) fn collective(
    rank: &str,
    kind: &CollectiveKind,
    bytes: usize,
    took: Duration,
    result: &Result<(), CommError>,
) {
    let collective = collective_label(kind);
    metrics::counter!(names::ALLREDUCE_BYTES, "rank" => rank.to_owned(), "collective" => collective)
        .increment(bytes as u64);
    metrics::histogram!(names::ALLREDUCE_SECONDS, "rank" => rank.to_owned(), "collective" => collective)
        .record(took.as_secs_f64());
    if let Err(e) = result {
        let error = match e {
            CommError::Timeout { .. } => "timeout",
            CommError::PeerGone { .. } => "peer_gone",
            CommError::Desync { .. } => "desync",
            CommError::Cancelled { .. } => "cancelled",
            CommError::Device { .. } => "device",
            CommError::Panicked { .. } => "panicked",
        };
        metrics::counter!(names::COLLECTIVE_FAILURES, "rank" => rank.to_owned(), "error" => error).increment(1);
        if matches!(e, CommError::Timeout { .. }) {
            metrics::counter!(names::TIMEOUTS, "rank" => rank.to_owned()).increment(1);
        }
    }
}

/// Record the plan in force.
pub(crate) fn plan(rank: &str, buckets: usize, bytes: usize) {
    metrics::gauge!(names::PLAN_BUCKETS, "rank" => rank.to_owned()).set(buckets as f64);
    metrics::gauge!(names::PLAN_BYTES, "rank" => rank.to_owned()).set(bytes as f64);
}

/// Record a finished step from its report.
pub(crate) fn step(rank: &str, r: &StepReport, step_time: Duration) {
    let arrivals = |kind: &'static str, n: u64| {
        metrics::counter!(names::ARRIVALS, "rank" => rank.to_owned(), "kind" => kind).increment(n);
    };
    arrivals("first", r.arrivals.saturating_sub(r.late_arrivals));
    arrivals("late", r.late_arrivals);
    arrivals("duplicate", r.duplicates);
    arrivals("rejected", r.rejected);
    metrics::counter!(names::BUCKETS_LAUNCHED, "rank" => rank.to_owned()).increment(u64::from(r.buckets_launched));
    metrics::histogram!(names::EXPOSED_SECONDS, "rank" => rank.to_owned()).record(r.exposed_comm.as_secs_f64());
    metrics::histogram!(names::STEP_SECONDS, "rank" => rank.to_owned()).record(step_time.as_secs_f64());
    metrics::counter!(names::CORRECTIONS, "rank" => rank.to_owned()).increment(u64::from(r.corrections));
    metrics::counter!(names::CORRECTED_PARAMS, "rank" => rank.to_owned()).increment(r.corrected.len() as u64);
    let outcome = if r.outcome.is_applied() { "applied" } else { "skipped" };
    metrics::counter!(names::STEPS, "rank" => rank.to_owned(), "outcome" => outcome).increment(1);
    if let Outcome::Skipped { aborted } = &r.outcome {
        for (who, reason) in aborted {
            metrics::counter!(names::ABORTS, "rank" => rank.to_owned(), "aborting_rank" => who.to_string(),
                "reason" => reason_label(*reason))
            .increment(1);
        }
    }
}

/// The instant all timelines of this process are measured from.
pub fn trace_epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Which lane of a rank's timeline an event belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The caller's backward: arrivals, finish.
    Backward,
    /// The scheduler: buckets filling.
    Scheduler,
    /// The communicator thread: collectives.
    Communicator,
}

/// One event of a rank's step timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct TimelineEvent {
    /// Short label (`"ready p3"`, `"all-reduce bucket 0"`, `"finish_step"`).
    pub name: String,
    /// Lane.
    pub lane: Lane,
    /// Start, since [`trace_epoch`].
    pub start: Duration,
    /// Length; `None` for an instant.
    pub duration: Option<Duration>,
}

impl TimelineEvent {
    pub(crate) fn instant(name: String, lane: Lane, at: Instant) -> Self {
        TimelineEvent { name, lane, start: at.saturating_duration_since(trace_epoch()), duration: None }
    }

    pub(crate) fn span(name: String, lane: Lane, from: Instant, to: Instant) -> Self {
        TimelineEvent {
            name,
            lane,
            start: from.saturating_duration_since(trace_epoch()),
            duration: Some(to.saturating_duration_since(from)),
        }
    }
}
