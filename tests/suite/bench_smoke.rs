//! The benchmark binary keeps working: each `gradsync-bench` subcommand runs
//! once, small, and prints what it says it prints (a smoke run, never a
//! measurement: no number is asserted). Built with the `sim` feature, as
//! the binary is (`scripts/test` runs the workspace's tests with it).
#![cfg(feature = "sim")]

use std::process::Command;

/// Run `gradsync-bench args`: its standard output, or a failure with both streams.
fn bench(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gradsync-bench")).args(args).output().expect("start gradsync-bench");
    assert!(
        out.status.success(),
        "gradsync-bench {args:?} exited with {}:\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// The last line of `out` as a JSON object.
fn json(out: &str) -> serde_json::Value {
    let line = out.lines().last().expect("some output");
    let value: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    assert!(value.is_object(), "a JSON object: {line}");
    value
}

#[test]
fn overlap_emulates_a_step_per_policy() {
    let out = json(&bench(&["overlap", "--model", "resnet50", "--world", "2", "--steps", "1", "--json"]));
    assert_eq!(out["world"], 2, "{out}");
    assert!(out["policies"].as_object().is_some_and(|p| !p.is_empty()), "every policy's result: {out}");
}

#[test]
fn sim_scales_the_scheduler_on_a_virtual_clock() {
    let out = json(&bench(&["sim", "--model", "resnet50", "--ranks", "8,16", "--json"]));
    assert_eq!(out["simulated"], true, "its numbers are labelled as simulated: {out}");
}

#[test]
fn hooks_measures_arrivals_and_latency() {
    let out = bench(&["hooks"]);
    assert!(out.contains("M arrivals/s") && out.contains("hook-to-launch latency"), "{out}");
}

#[test]
fn allreduce_compares_with_memcpy() {
    let out = bench(&["allreduce", "--mib", "1", "--world", "2", "--rounds", "3"]);
    assert!(!out.trim().is_empty(), "it prints its table");
}

#[test]
fn membership_runs_real_members_on_one_store() {
    let out = json(&bench(&["membership", "--members", "8", "--latency-ms", "0.2", "--healthy-s", "0.5", "--json"]));
    let row = &out["rows"][0];
    assert_eq!(row["members"], 8, "{out}");
    assert_eq!(row["left_out"], 0, "{out}");
}
