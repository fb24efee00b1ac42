//! The per-step timeline of a 4-rank run, written as Chrome trace JSON, parses
//! as the Chrome trace event format and shows, for every rank, all-reduces
//! that start before that rank's `finish_step` (overlap with backward).

use crate::common;

use common::{build_world, on_ranks, wait_for, Sent};
use gradsync::ChromeTrace;

#[test]
fn four_rank_trace_shows_allreduces_before_finish_on_every_rank() {
    let syncs = build_world(4, &[8, 8, 8], |b| {
        b.bucket_cap_bytes(32).record_timeline(true);
    });
    let reports = on_ranks(syncs, |rank, mut sync| {
        let mut reports = Vec::new();
        for step in 0..2 {
            Sent::inc(2, 0, vec![rank as f32; 8]).deliver(&sync, step);
            // Backward goes on; bucket 0 is all-reduced meanwhile.
            wait_for(&mut sync, "bucket 0 done", |p| p.buckets_done >= 1);
            Sent::inc(1, 0, vec![1.0; 8]).deliver(&sync, step);
            Sent::inc(0, 0, vec![1.0; 8]).deliver(&sync, step);
            reports.push(sync.finish_step(step).unwrap().report);
        }
        reports
    });
    let mut trace = ChromeTrace::new();
    for r in reports.iter().flatten() {
        trace.add(r);
    }
    let mut json = Vec::new();
    trace.write_json(&mut json).unwrap();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/timeline-test.json");
    std::fs::write(&path, &json).unwrap();

    let doc: serde_json::Value = serde_json::from_slice(&json).expect("valid JSON");
    let events = doc["traceEvents"].as_array().expect("a traceEvents array");
    for e in events {
        let ph = e["ph"].as_str().expect("every event has a phase");
        assert!(matches!(ph, "X" | "i" | "M"), "unexpected phase {ph}");
        assert!(e["pid"].is_u64() && e["name"].is_string());
        if ph != "M" {
            assert!(e["ts"].is_number() && e["tid"].is_u64());
        }
        if ph == "X" {
            assert!(e["dur"].as_f64().expect("complete events have a duration") >= 0.0);
        }
    }
    for rank in 0..4u64 {
        for step in 0..2u64 {
            let of = |name_prefix: &str| -> Vec<f64> {
                events
                    .iter()
                    .filter(|e| e["pid"] == rank && e["args"]["step"] == step)
                    .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with(name_prefix)))
                    .map(|e| e["ts"].as_f64().unwrap())
                    .collect()
            };
            let finish = of("finish_step");
            assert_eq!(finish.len(), 1, "rank {rank} step {step}: one finish_step");
            let allreduces = of("all-reduce bucket");
            assert_eq!(allreduces.len(), 3, "rank {rank} step {step}: one all-reduce per bucket");
            assert!(
                allreduces.iter().any(|&ts| ts < finish[0]),
                "rank {rank} step {step}: no all-reduce started before finish_step"
            );
            assert!(!of("ready p").is_empty() && !of("fill bucket").is_empty() && !of("control").is_empty());
        }
    }
}
