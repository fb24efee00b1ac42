//! Per-step timelines as Chrome trace JSON (opens in Perfetto and chrome://tracing).
//!
//! Turn on `GradSyncBuilder::record_timeline`, feed every rank's
//! [`crate::StepReport`] to a [`ChromeTrace`], and write it. Each rank is a
//! process (`pid` = rank) with one thread per [`Lane`]: backward (arrivals,
//! `finish_step`), scheduler (buckets filling), communicator (all-reduces,
//! control, corrections). Times are microseconds since [`trace_epoch`].

use std::collections::BTreeSet;
use std::io::{self, Write};

pub use gradsync_actors::timeline::{trace_epoch, Lane, TimelineEvent};
use gradsync_actors::StepReport;
use serde_json::{json, Value};

/// Timeline events of many ranks and steps.
#[derive(Debug, Default, Clone)]
pub struct ChromeTrace {
    events: Vec<(usize, u64, TimelineEvent)>,
    ranks: BTreeSet<usize>,
}

fn lane_tid(lane: Lane) -> u32 {
    match lane {
        Lane::Backward => 1,
        Lane::Scheduler => 2,
        Lane::Communicator => 3,
    }
}

impl ChromeTrace {
    /// An empty trace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one rank's step (its report's timeline).
    pub fn add(&mut self, report: &StepReport) {
        self.ranks.insert(report.rank);
        for ev in &report.timeline {
            self.events.push((report.rank, report.step, ev.clone()));
        }
    }

    /// Number of events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no event was added.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The trace as a JSON value: `{"displayTimeUnit": "ms", "traceEvents": [...]}`.
    pub fn to_json(&self) -> Value {
        let mut events = Vec::with_capacity(self.events.len() + 4 * self.ranks.len());
        for &rank in &self.ranks {
            events.push(
                json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": format!("rank {rank}")}}),
            );
            for lane in Lane::ALL {
                events.push(json!({
                    "ph": "M", "name": "thread_name", "pid": rank, "tid": lane_tid(lane), "args": {"name": lane.label()}
                }));
            }
        }
        for (rank, step, ev) in &self.events {
            let ts = ev.start.as_secs_f64() * 1e6;
            let mut e = json!({
                "name": ev.name, "pid": rank, "tid": lane_tid(ev.lane), "ts": ts, "args": {"step": step}
            });
            match ev.duration {
                Some(d) => {
                    e["ph"] = json!("X");
                    e["dur"] = json!(d.as_secs_f64() * 1e6);
                }
                None => {
                    e["ph"] = json!("i");
                    e["s"] = json!("t");
                }
            }
            events.push(e);
        }
        json!({"displayTimeUnit": "ms", "traceEvents": events})
    }

    /// Write the trace as JSON.
    pub fn write_json(&self, out: impl Write) -> io::Result<()> {
        serde_json::to_writer(out, &self.to_json()).map_err(io::Error::other)
    }
}
