//! `membership`: the membership protocol at a job's size, in this process.
//! Every member is a real [`Monitor`] (its own thread, beating every 0.1 s)
//! and a real [`Agreement`], all against one in-memory store whose every
//! call first waits the injected round trip (`--latency-ms`: a store on
//! another host). For each size and latency:
//!
//! * **store calls per beat**: every call the members make in a healthy
//!   second, per beat period (all members together, then per member);
//! * **beat period**: the median time between two heartbeats of a sample
//!   of members, read off the store;
//! * **detection**: from one member's heartbeat stopping (its monitor
//!   dropped: a host whose link is cut) to the first survivor's monitor
//!   breaking the epoch;
//! * **agreement**: from that detection to the last survivor holding the
//!   new roster;
//! * **calls per change**: the store calls of the change other than the
//!   beats (check-ins, the tally, the waits), per member.
//!
//! Numbers are this process's threads on this machine's cores: thousands
//! of members share two cores here, so a beat period above 0.1 s is this
//! machine's CPU, not the protocol (the calls per beat say what the store sees).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gradsync::membership::{Agreement, KvStore, MemoryKv, MeteredKv, Monitor, Roster, StoreOps, Timing};
use serde_json::json;

const PREFIX: &str = "bench";

/// Settings of `membership`.
#[derive(Debug, clap::Args)]
pub struct MembershipArgs {
    /// Job sizes (members), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [8usize, 64, 512, 4096])]
    members: Vec<usize>,
    /// Injected store round trips in milliseconds, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [0.2f64, 2.0])]
    latency_ms: Vec<f64>,
    /// Seconds of healthy running measured before the loss.
    #[arg(long, default_value_t = 3.0)]
    healthy_s: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One run's measurements.
struct Row {
    members: usize,
    latency_ms: f64,
    calls_per_beat: f64,
    keys_per_beat: f64,
    beat_period_s: f64,
    healthy_breaks: usize,
    detection_s: f64,
    /// From the detection to the last survivor's monitor breaking the epoch.
    news_s: f64,
    /// From the detection to the first survivor holding the new roster.
    first_roster_s: f64,
    agreement_s: f64,
    change_calls: StoreOps,
    left_out: usize,
}

type Store = MeteredKv<MemoryKv>;

/// `f` over `0..n` on a few threads at once (each call waits the store's round trips).
fn in_parallel<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = 64.min(n.max(1));
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    std::thread::scope(|s| {
        let chunks: Vec<_> = out.chunks_mut(n.div_ceil(threads).max(1)).enumerate().collect();
        let per = n.div_ceil(threads).max(1);
        for (c, chunk) in chunks {
            let f = &f;
            s.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    *slot = Some(f(c * per + i));
                }
            });
        }
    });
    out.into_iter().map(|v| v.expect("every slot filled")).collect()
}

fn beat_counts(store: &Store, ids: &[u64]) -> Vec<i64> {
    let keys: Vec<String> = ids.iter().map(|m| format!("{PREFIX}/beat/{m}")).collect();
    store.inner().counters(&keys).expect("an in-memory store answers")
}

fn run(members: usize, latency: Duration, healthy: Duration) -> Result<Row, String> {
    let store: Store = MeteredKv::new(MemoryKv::default()).with_latency(latency);
    let timing = Timing::default();
    let n = members as u64;
    let nodes: Vec<u64> = (0..n).map(|m| m / 8).collect();
    let mut agreements = in_parallel(members, |m| {
        let mut a = Agreement::new(store.clone(), PREFIX, m as u64, timing).on_node(m as u64 / 8);
        a.start((0..n).collect(), nodes.clone()).map_err(|e| e.to_string())?;
        Ok::<_, String>(a)
    })
    .into_iter()
    .collect::<Result<Vec<_>, _>>()?;
    let roster: Roster = agreements[0].roster().clone();
    let mut monitors: Vec<Option<Monitor>> = (0..n)
        .map(|m| {
            let monitor = Monitor::start(
                store.clone(),
                PREFIX,
                m,
                roster.clone(),
                timing,
                Box::new(|_| {}),
                Arc::new(AtomicBool::new(false)),
                Box::new(()),
            );
            monitor.map(Some).map_err(|e| format!("starting monitor {m}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    // Healthy: let every monitor find its peers beating, then measure.
    std::thread::sleep(4 * timing.liveness);
    let sample: Vec<u64> = (0..n).step_by((members / 16).max(1)).collect();
    let (counts, ops, began) = (beat_counts(&store, &sample), store.ops(), Instant::now());
    std::thread::sleep(healthy);
    let (after, elapsed) = (beat_counts(&store, &sample), began.elapsed());
    let healthy_ops = store.ops().since(&ops);
    let beats = elapsed.as_secs_f64() / timing.beat.as_secs_f64();
    let mut periods: Vec<f64> =
        counts.iter().zip(&after).map(|(a, b)| elapsed.as_secs_f64() / (b - a).max(1) as f64).collect();
    periods.sort_by(f64::total_cmp);
    let healthy_breaks = monitors.iter().flatten().filter(|m| m.broken().is_some()).count();
    // One member's heartbeat stops; every other member recovers once its monitor breaks the epoch.
    let silent = n / 3;
    let before_change = store.ops();
    monitors[silent as usize] = None;
    let lost_at = Instant::now();
    let mut seen: Vec<Option<Instant>> = vec![None; members];
    seen[silent as usize] = Some(lost_at);
    let outcomes: Vec<(usize, Result<Roster, String>, Instant)> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        let mut pending: Vec<(usize, Agreement<Store>)> =
            agreements.drain(..).enumerate().filter(|(m, _)| *m as u64 != silent).collect();
        let deadline = lost_at + Duration::from_secs(120);
        while !pending.is_empty() && Instant::now() < deadline {
            let now = Instant::now();
            let mut waiting = Vec::with_capacity(pending.len());
            for (m, mut agreement) in pending {
                let monitor = monitors[m].as_ref().expect("a survivor's monitor runs");
                if monitor.broken().is_some() {
                    seen[m] = Some(now);
                    handles.push(s.spawn(move || {
                        let result = agreement.recover(&[], monitor, &()).cloned().map_err(|e| e.to_string());
                        (m, result, Instant::now())
                    }));
                } else {
                    waiting.push((m, agreement));
                }
            }
            pending = waiting;
            std::thread::sleep(Duration::from_millis(1));
        }
        handles.into_iter().map(|h| h.join().expect("a recovery thread")).collect()
    });
    let change = store.ops().since(&before_change);
    let first = seen.iter().enumerate().filter(|(m, _)| *m as u64 != silent).filter_map(|(_, t)| *t).min();
    let last_roster = outcomes.iter().map(|(_, _, t)| *t).max();
    let first_roster = outcomes.iter().map(|(_, _, t)| *t).min();
    let last_news = seen.iter().enumerate().filter(|(m, _)| *m as u64 != silent).filter_map(|(_, t)| *t).max();
    let expected: Vec<u64> = (0..n).filter(|&m| m != silent).collect();
    let right = outcomes.iter().filter(|(_, r, _)| r.as_ref().is_ok_and(|r| r.members == expected)).count();
    if let Some((m, Err(e), _)) = outcomes.iter().find(|(_, r, _)| r.is_err()) {
        eprintln!("    member {m}: {e}");
    }
    drop(monitors);
    let (Some(first), Some(last), Some(first_roster), Some(last_news)) = (first, last_roster, first_roster, last_news)
    else {
        return Err(format!("{members} members: the loss was not agreed on within 120 s"));
    };
    Ok(Row {
        members,
        latency_ms: latency.as_secs_f64() * 1e3,
        calls_per_beat: healthy_ops.total() as f64 / beats,
        keys_per_beat: healthy_ops.counter_keys as f64 / beats,
        beat_period_s: periods[periods.len() / 2],
        healthy_breaks,
        detection_s: (first - lost_at).as_secs_f64(),
        news_s: (last_news - first).as_secs_f64(),
        first_roster_s: (first_roster - first).as_secs_f64(),
        agreement_s: (last - first).as_secs_f64(),
        change_calls: StoreOps { set_and_count: 0, counter_keys: 0, ..change },
        left_out: members - 1 - right,
    })
}

/// Run `membership` (see the module docs).
pub fn command(args: &MembershipArgs) -> Result<(), String> {
    let mut rows = Vec::new();
    for &latency_ms in &args.latency_ms {
        for &members in &args.members {
            let latency = Duration::from_secs_f64(latency_ms / 1e3);
            let row = run(members, latency, Duration::from_secs_f64(args.healthy_s))?;
            if !args.json {
                print_row(&row, rows.is_empty());
            }
            rows.push(row);
        }
    }
    if args.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "members": r.members, "latency_ms": r.latency_ms, "calls_per_beat": r.calls_per_beat,
                    "keys_per_beat": r.keys_per_beat, "beat_period_s": r.beat_period_s,
                    "healthy_breaks": r.healthy_breaks, "detection_s": r.detection_s, "news_s": r.news_s,
                    "first_roster_s": r.first_roster_s, "agreement_s": r.agreement_s,
                    "change_calls": r.change_calls.total(), "left_out": r.left_out,
                    "change_calls_by_kind": {
                        "add": r.change_calls.add, "set": r.change_calls.set, "get": r.change_calls.get,
                        "compare_set": r.change_calls.compare_set, "counters": r.change_calls.counters,
                        "enter": r.change_calls.enter, "entries": r.change_calls.entries,
                        "lengths": r.change_calls.lengths, "wait": r.change_calls.wait,
                    },
                })
            })
            .collect();
        println!("{}", json!({ "bench": "membership", "beat_s": Timing::default().beat.as_secs_f64(), "rows": rows }));
    }
    Ok(())
}

fn print_row(r: &Row, header: bool) {
    if header {
        println!(
            "{:>7} {:>8} {:>14} {:>16} {:>12} {:>10} {:>10} {:>12} {:>10} {:>16} {:>9}",
            "members",
            "latency",
            "calls/beat",
            "calls/beat/mbr",
            "beat period",
            "detection",
            "news",
            "1st roster",
            "agreement",
            "calls/change/mbr",
            "left out"
        );
    }
    println!(
        "{:>7} {:>6.1}ms {:>14.0} {:>16.2} {:>10.3} s {:>8.2} s {:>8.2} s {:>10.2} s {:>8.2} s {:>16.1} {:>9}",
        r.members,
        r.latency_ms,
        r.calls_per_beat,
        r.calls_per_beat / r.members as f64,
        r.beat_period_s,
        r.detection_s,
        r.news_s,
        r.first_roster_s,
        r.agreement_s,
        r.change_calls.total() as f64 / r.members as f64,
        r.left_out + r.healthy_breaks
    );
}
