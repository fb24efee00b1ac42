//! Dropping GradSync instances, even in the middle of a collective that waits
//! for a rank that never comes, returns promptly and leaves no thread behind.
//! (Its own test binary: it counts the process's threads.)

mod common;

use std::time::{Duration, Instant};

use common::{build_world, Sent};

/// Threads of this process named by gradsync (`gradsync-actors-rN`, `gradsync-comm-rN`).
fn gradsync_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("gradsync-"))
        .count()
}

#[test]
fn dropping_mid_collective_is_prompt_and_leaks_no_thread() {
    if !std::path::Path::new("/proc/self/task").exists() {
        eprintln!("skipping: /proc/self/task is not available to count threads");
        return;
    }
    assert_eq!(gradsync_threads(), 0);
    let syncs = build_world(3, &[16, 16], |b| {
        b.bucket_cap_bytes(64).collective_timeout(Duration::from_secs(120));
    });
    // A thread names itself as it starts: give the six a moment to appear.
    let t = Instant::now();
    while gradsync_threads() < 6 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(gradsync_threads(), 6, "two threads per rank");
    // Rank 0 launches bucket 0; ranks 1 and 2 never join: its communicator
    // is blocked in a collective with a two-minute deadline.
    Sent::inc(1, 0, vec![1.0; 16]).deliver(&syncs[0], 0);
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    drop(syncs);
    assert!(t0.elapsed() < Duration::from_secs(5), "drop waited {:?}", t0.elapsed());
    assert_eq!(gradsync_threads(), 0, "threads left behind");
}
