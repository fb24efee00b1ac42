//! A rank's per-step timeline: what happened when, on which lane.
//!
//! Recorded only when asked for (`record_timeline`): the scheduler pushes an
//! event per arrival, bucket fill, collective and finish into the step's
//! report, and the runtime's Chrome-trace writer turns reports into a file
//! Perfetto opens.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

impl Lane {
    /// Every lane, in display order.
    pub const ALL: [Lane; 3] = [Lane::Backward, Lane::Scheduler, Lane::Communicator];

    /// Short lowercase name (`"backward"`, …).
    pub fn label(self) -> &'static str {
        match self {
            Lane::Backward => "backward",
            Lane::Scheduler => "scheduler",
            Lane::Communicator => "communicator",
        }
    }
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
