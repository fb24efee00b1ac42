//! The Prometheus endpoint of a live 2-rank job, scraped over HTTP while steps
//! run: counters move as the job does (duplicates, late arrivals, bytes equal
//! to the plan's). The last scrape is saved to `target/metrics-scrape.prom`;
//! when `PROMTOOL` names a promtool binary (`.ci/run` fetches one) it must pass
//! `promtool check metrics`. Its own test binary: the recorder is process-global.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{build_world, on_ranks, Sent};

fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("metrics endpoint reachable");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // HTTP/1.0: the answer is not chunked and the connection closes after it.
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.") && head.contains(" 200"), "bad response: {head}");
    body.to_string()
}

/// The value of the series `name` whose labels include every pair of `labels`.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let (series, v) = line.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        if n != name {
            return None;
        }
        let found: HashMap<&str, &str> = rest
            .trim_end_matches('}')
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k, v.trim_matches('"')))
            .collect();
        labels.iter().all(|(k, v)| found.get(k) == Some(v)).then(|| v.parse().ok())?
    })
}

#[test]
fn endpoint_counts_what_the_job_does() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    gradsync::metrics::install_prometheus(addr, false).unwrap();
    assert!(matches!(
        gradsync::metrics::install_prometheus("0.0.0.0:9".parse().unwrap(), false),
        Err(gradsync::metrics::MetricsError::NotLoopback { .. })
    ));

    let numels = [16, 16, 32];
    let syncs = build_world(2, &numels, |b| {
        b.bucket_cap_bytes(64);
    });
    let plan_bytes = syncs[0].plan().bucket_bytes() as f64;
    let buckets = syncs[0].plan().num_buckets() as f64;
    let steps = 20u64;
    let running = AtomicBool::new(true);
    let scrapes_during = std::thread::scope(|s| {
        let scraper = s.spawn(|| {
            let mut n = 0;
            while running.load(Ordering::Relaxed) {
                assert!(scrape(addr).contains("gradsync_plan_buckets"));
                n += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            n
        });
        on_ranks(syncs, |rank, mut sync| {
            for step in 0..steps {
                // p2 (bucket 0) arrives, the bucket launches, then p2 again: late in step 0.
                Sent::inc(2, 0, vec![1.0; 32]).deliver(&sync, step);
                sync.progress().unwrap();
                Sent::inc(2, 1, vec![1.0; 32]).deliver(&sync, step);
                Sent::inc(1, 0, vec![rank as f32; 16]).deliver(&sync, step);
                Sent::inc(1, 0, vec![rank as f32; 16]).deliver(&sync, step); // duplicate
                Sent::inc(0, 0, vec![1.0; 16]).deliver(&sync, step);
                drop(sync.finish_step(step).unwrap());
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        running.store(false, Ordering::Relaxed);
        scraper.join().unwrap()
    });
    assert!(scrapes_during > 0, "no scrape happened while steps ran");

    let text = scrape(addr);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/metrics-scrape.prom");
    std::fs::write(&path, &text).unwrap();
    for rank in ["0", "1"] {
        let v = |name, extra: &[(&str, &str)]| {
            let mut labels = vec![("rank", rank)];
            labels.extend_from_slice(extra);
            value(&text, name, &labels).unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"))
        };
        assert_eq!(v("gradsync_steps_total", &[("outcome", "applied")]), steps as f64);
        assert_eq!(v("gradsync_arrivals_total", &[("kind", "duplicate")]), steps as f64);
        assert!(v("gradsync_arrivals_total", &[("kind", "late")]) >= 1.0, "the late arrival of step 0");
        assert!(v("gradsync_corrections_total", &[]) >= 1.0);
        assert_eq!(v("gradsync_allreduce_bytes_total", &[("collective", "bucket")]), steps as f64 * plan_bytes);
        assert_eq!(v("gradsync_buckets_launched_total", &[]), steps as f64 * buckets);
        assert_eq!(v("gradsync_plan_bytes", &[]), plan_bytes);
        // At least the set the steps packed into; at most one more (a result still held).
        let held = v("gradsync_bucket_memory_bytes", &[]);
        assert!(held >= plan_bytes && held <= 2.0 * plan_bytes, "bucket memory {held}, plan {plan_bytes}");
        assert_eq!(v("gradsync_exposed_comm_seconds_count", &[]), steps as f64);
    }
    assert!(text.contains("# HELP gradsync_arrivals_total"), "series are described");
    assert!(text.contains("gradsync_allreduce_duration_seconds_bucket"), "histograms, not summaries");

    match std::env::var("PROMTOOL") {
        Ok(promtool) => {
            let out = std::process::Command::new(&promtool)
                .args(["check", "metrics"])
                .stdin(std::fs::File::open(&path).unwrap())
                .output()
                .expect("run promtool");
            assert!(
                out.status.success(),
                "promtool check metrics failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!("promtool check metrics: OK on {} lines", text.lines().count());
        }
        Err(_) => eprintln!("PROMTOOL not set: skipping promtool check metrics (.ci/run sets it)"),
    }
}
