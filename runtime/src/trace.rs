//! Per-step timelines as Chrome trace JSON (opens in Perfetto and chrome://tracing).
//!
//! Turn on `GradSyncBuilder::record_timeline`, feed every rank's
//! [`crate::StepReport`] to a [`ChromeTrace`], and write it. Each
//! rank is a process (`pid` = rank) with three threads: backward (arrivals,
//! `finish_step`), scheduler (buckets filling), communicator (all-reduces,
//! control, corrections). Times are microseconds since the process's trace epoch.

use std::io::{self, Write};

use gradsync_actors::{Lane, StepReport, TimelineEvent};

/// Timeline events of many ranks and steps.
#[derive(Debug, Default, Clone)]
pub struct ChromeTrace {
    events: Vec<(usize, u64, TimelineEvent)>,
    ranks: std::collections::BTreeSet<usize>,
}

fn lane_tid(lane: Lane) -> u32 {
    match lane {
        Lane::Backward => 1,
        Lane::Scheduler => 2,
        Lane::Communicator => 3,
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
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

    /// Write `{"traceEvents": [...]}`.
    pub fn write_json(&self, mut out: impl Write) -> io::Result<()> {
        writeln!(out, "{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[")?;
        let mut first = true;
        let mut sep = |out: &mut dyn Write| -> io::Result<()> {
            if !std::mem::take(&mut first) {
                writeln!(out, ",")?;
            }
            Ok(())
        };
        for &rank in &self.ranks {
            sep(&mut out)?;
            write!(
                out,
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"args\":{{\"name\":\"rank {rank}\"}}}}"
            )?;
            for (lane, name) in
                [(Lane::Backward, "backward"), (Lane::Scheduler, "scheduler"), (Lane::Communicator, "communicator")]
            {
                sep(&mut out)?;
                write!(
                    out,
                    "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{},\"args\":{{\"name\":\"{name}\"}}}}",
                    lane_tid(lane)
                )?;
            }
        }
        for (rank, step, ev) in &self.events {
            sep(&mut out)?;
            let ts = ev.start.as_secs_f64() * 1e6;
            let (tid, name) = (lane_tid(ev.lane), json_str(&ev.name));
            match ev.duration {
                Some(d) => write!(
                    out,
                    "{{\"ph\":\"X\",\"name\":{name},\"pid\":{rank},\"tid\":{tid},\"ts\":{ts:.3},\"dur\":{:.3},\"args\":{{\"step\":{step}}}}}",
                    d.as_secs_f64() * 1e6
                )?,
                None => write!(
                    out,
                    "{{\"ph\":\"i\",\"s\":\"t\",\"name\":{name},\"pid\":{rank},\"tid\":{tid},\"ts\":{ts:.3},\"args\":{{\"step\":{step}}}}}"
                )?,
            }
        }
        writeln!(out, "\n]}}")
    }
}
