//! [`EtcdKv`]: a job's membership in etcd (v3), where a user runs one.
//!
//! ```text
//! Agreement / Monitor ── KvStore ──▶ EtcdKv ── POST /v3/kv/{range,put,txn,deleterange}, /v3/watch
//!                                        (JSON, keys and values base64) ──▶ etcd cluster
//! ```
//!
//! etcd serves its gRPC API as JSON over plain HTTP too (the gateway every
//! etcd 3.4+ server runs), so no gRPC stack is needed: one small blocking
//! HTTP client per store. Every key lives under the store's prefix.
//! Compare-and-set and add are etcd transactions (`add` retries while
//! another writer changes the key), so they are linearizable like the rest.
//! Several endpoints (the members of an etcd cluster) are tried in turn.
//!
//! What each protocol call costs etcd: a monitor's beat is one transaction
//! (its heartbeat's put, then the ranges it watches: one raft write); other
//! batched reads are read-only transactions, served from the member's own
//! state unless that is older than this client's last write (then
//! linearizably: a read never queues behind the cluster's writes, and never
//! shows a past the client wrote beyond); a ledger is a prefix
//! (`{key}/{name}` per entry: a check-in is one put, a tally one prefix
//! range); a wait is etcd's own watch, so a waiting member costs the
//! cluster nothing until the key appears.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

use super::store::{KvStore, StoreError};

/// How many times `add` retries a transaction another writer raced.
const ADD_ATTEMPTS: usize = 1000;

/// The most operations one transaction may carry (etcd's default `--max-txn-ops`).
const TXN_OPS: usize = 128;

/// A [`KvStore`] over an etcd cluster's v3 JSON gateway. Clones share the
/// HTTP connection pool.
#[derive(Clone)]
pub struct EtcdKv {
    /// `http://host:port` of each cluster member, tried in order.
    endpoints: Vec<String>,
    /// Prepended to every key (`{prefix}/{key}`).
    prefix: String,
    agent: ureq::Agent,
    /// The newest revision this client (and its clones) wrote: a batched
    /// read is served from an etcd member's own state (no raft round, so it
    /// never queues behind the cluster's writes), and read again through
    /// the leader only if that state is older than this (a lagging or cut
    /// off member): a client never reads a past it has written beyond.
    written: Arc<AtomicU64>,
}

impl std::fmt::Debug for EtcdKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdKv").field("endpoints", &self.endpoints).field("prefix", &self.prefix).finish()
    }
}

impl EtcdKv {
    /// A store on the etcd cluster at `endpoints` (`host:port` or
    /// `http://host:port`, comma-separated), keys under `prefix`; each
    /// request may take `timeout`.
    pub fn connect(endpoints: &str, prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let endpoints: Vec<String> = endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("etcd://").unwrap_or(e))
            .map(|e| if e.contains("://") { e.trim_end_matches('/').to_string() } else { format!("http://{e}") })
            .collect();
        if endpoints.is_empty() {
            return Err(StoreError("no etcd endpoint given: pass host:port (comma-separated for a cluster)".into()));
        }
        if let Some(tls) = endpoints.iter().find(|e| e.starts_with("https://")) {
            return Err(StoreError(format!("{tls}: only plain-HTTP etcd endpoints are supported (no TLS client)")));
        }
        let agent = ureq::AgentBuilder::new().timeout(timeout).build();
        let store =
            EtcdKv { endpoints, prefix: prefix.trim_end_matches('/').to_string(), agent, written: Arc::default() };
        // Fail now, naming the endpoints, rather than at the first protocol step.
        store.get("")?;
        Ok(store)
    }

    /// The endpoints, as `http://host:port`.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    fn key(&self, key: &str) -> String {
        B64.encode(format!("{}/{key}", self.prefix))
    }

    /// POST `body` to `path` on the first endpoint that answers.
    fn call(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        let mut failures = Vec::new();
        for endpoint in &self.endpoints {
            match self.agent.post(&format!("{endpoint}{path}")).send_string(&body.to_string()) {
                Ok(response) => {
                    let text = response.into_string().map_err(|e| StoreError(format!("etcd {endpoint}{path}: {e}")))?;
                    return serde_json::from_str(&text)
                        .map_err(|e| StoreError(format!("etcd {endpoint}{path}: not JSON ({e}): {text}")));
                }
                Err(ureq::Error::Status(code, response)) => {
                    let text = response.into_string().unwrap_or_default();
                    return Err(StoreError(format!("etcd {endpoint}{path} answered {code}: {text}")));
                }
                Err(e) => failures.push(format!("{endpoint}: {e}")),
            }
        }
        Err(StoreError(format!("no etcd endpoint answered ({}); is etcd running there?", failures.join("; "))))
    }

    /// [`EtcdKv::call`] for a request that writes: its revision is noted.
    fn write(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        let answer = self.call(path, body)?;
        self.written.fetch_max(count(&answer["header"]["revision"]), Ordering::AcqRel);
        Ok(answer)
    }

    /// A read-only transaction of `ranges`: served by the member's own
    /// state (serializable), again linearizably if that is older than what
    /// this client wrote (see [`EtcdKv::written`]).
    fn read_txn(&self, ranges: &[Value]) -> Result<Value, StoreError> {
        let local: Vec<Value> = ranges
            .iter()
            .map(|r| {
                let mut r = r.clone();
                r["request_range"]["serializable"] = json!(true);
                r
            })
            .collect();
        let answer = self.call("/v3/kv/txn", json!({ "compare": [], "success": local }))?;
        if count(&answer["header"]["revision"]) >= self.written.load(Ordering::Acquire) {
            return Ok(answer);
        }
        self.call("/v3/kv/txn", json!({ "compare": [], "success": ranges }))
    }

    /// The value and modification revision at `key`, if present.
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, String)>, StoreError> {
        let answer = self.call("/v3/kv/range", json!({ "key": self.key(key) }))?;
        first_kv(&answer["kvs"])
    }

    /// Delete `key`; whether it was there.
    pub fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let answer = self.write("/v3/kv/deleterange", json!({ "key": self.key(key) }))?;
        Ok(count(&answer["deleted"]) > 0)
    }

    /// How many keys the store holds under its prefix.
    pub fn count(&self) -> Result<u64, StoreError> {
        let (start, end) = prefix_range(&format!("{}/", self.prefix));
        let answer = self.call("/v3/kv/range", json!({ "key": start, "range_end": end, "count_only": true }))?;
        Ok(count(&answer["count"]))
    }

    /// Block until `key` exists or `within` passes: one range, then
    /// etcd's watch from the revision it was read at (no polling).
    fn watch_for(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        let deadline = std::time::Instant::now() + within;
        let answer = self.call("/v3/kv/range", json!({ "key": self.key(key), "keys_only": true }))?;
        if answer["kvs"].as_array().is_some_and(|kvs| !kvs.is_empty()) {
            return Ok(true);
        }
        let revision = count(&answer["header"]["revision"]);
        let body = json!({ "create_request": { "key": self.key(key), "start_revision": (revision + 1).to_string() } });
        let endpoint = &self.endpoints[0];
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let response =
            match self.agent.post(&format!("{endpoint}/v3/watch")).timeout(left).send_string(&body.to_string()) {
                Ok(response) => response,
                Err(ureq::Error::Transport(t)) if t.kind() == ureq::ErrorKind::Io => return Ok(false),
                Err(e) => return Err(StoreError(format!("etcd {endpoint}/v3/watch: {e}"))),
            };
        // The gateway streams one JSON object per line: `created`, then events.
        for line in std::io::BufRead::lines(std::io::BufReader::new(response.into_reader())) {
            let Ok(line) = line else { return Ok(false) }; // the deadline cut the stream
            let message: Value = serde_json::from_str(&line)
                .map_err(|e| StoreError(format!("etcd {endpoint}/v3/watch: not JSON ({e}): {line}")))?;
            if let Some(error) = message.get("error") {
                return Err(StoreError(format!("etcd {endpoint}/v3/watch: {error}")));
            }
            let events = message["result"]["events"].as_array();
            if events.is_some_and(|e| e.iter().any(|ev| ev["type"].as_str() != Some("DELETE"))) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Put `desired` if the transaction's `compare` holds; returns whether
    /// it did and, if not, what `key` holds.
    fn put_if(&self, key: &str, compare: Value, desired: &[u8]) -> Result<(bool, Option<Vec<u8>>), StoreError> {
        let k = self.key(key);
        let answer = self.write(
            "/v3/kv/txn",
            json!({
                "compare": [compare],
                "success": [{ "request_put": { "key": k, "value": B64.encode(desired) } }],
                "failure": [{ "request_range": { "key": k } }],
            }),
        )?;
        if answer["succeeded"].as_bool() == Some(true) {
            return Ok((true, None));
        }
        let current = first_kv(&answer["responses"][0]["response_range"]["kvs"])?.map(|(v, _)| v);
        Ok((false, current))
    }

    fn absent(&self, key: &str) -> Value {
        json!({ "key": self.key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0" })
    }
}

/// The range of keys under `prefix`, as etcd takes it (key and range end, base64).
fn prefix_range(prefix: &str) -> (String, String) {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().expect("a prefix is not empty") += 1;
    (B64.encode(prefix), B64.encode(end))
}

/// An int64 of the gateway's JSON (a string, or absent for 0).
fn count(v: &Value) -> u64 {
    v.as_str().and_then(|s| s.parse().ok()).or_else(|| v.as_u64()).unwrap_or(0)
}

/// The counter at `key`, as the `i`-th response of the transaction `answer`
/// (a range) found it.
fn range_counter(answer: &Value, i: usize, key: &str) -> Result<i64, StoreError> {
    let found = first_kv(&answer["responses"][i]["response_range"]["kvs"])?;
    super::store::counter_value(key, found.as_ref().map(|(v, _)| v.as_slice()))
}

/// The first key-value of a `kvs` list: its value and mod revision.
fn first_kv(kvs: &Value) -> Result<Option<(Vec<u8>, String)>, StoreError> {
    let Some(kv) = kvs.as_array().and_then(|a| a.first()) else { return Ok(None) };
    let value = match kv["value"].as_str() {
        Some(v) => B64.decode(v).map_err(|e| StoreError(format!("etcd sent a value that is not base64: {e}")))?,
        None => Vec::new(),
    };
    let revision = match &kv["mod_revision"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Ok(Some((value, revision)))
}

impl KvStore for EtcdKv {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        for _ in 0..ADD_ATTEMPTS {
            let (now, compare) = match self.read(key)? {
                None => (delta, self.absent(key)),
                Some((value, revision)) => {
                    let current = std::str::from_utf8(&value)
                        .ok()
                        .and_then(|s| s.trim().parse::<i64>().ok())
                        .ok_or_else(|| StoreError(format!("{key} does not hold an integer")))?;
                    let compare =
                        json!({ "key": self.key(key), "target": "MOD", "result": "EQUAL", "mod_revision": revision });
                    (current + delta, compare)
                }
            };
            if self.put_if(key, compare, now.to_string().as_bytes())?.0 {
                return Ok(now);
            }
        }
        Err(StoreError(format!("add to {key}: {ADD_ATTEMPTS} writers raced it; the store is overloaded")))
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.write("/v3/kv/put", json!({ "key": self.key(key), "value": B64.encode(value) }))?;
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.read(key)?.map(|(v, _)| v))
    }

    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError> {
        let mut values = Vec::with_capacity(keys.len());
        for batch in keys.chunks(TXN_OPS) {
            let ranges: Vec<Value> = batch.iter().map(|k| json!({ "request_range": { "key": self.key(k) } })).collect();
            // No compare, only ranges: a read-only transaction (no raft write).
            let answer = self.read_txn(&ranges)?;
            for (i, key) in batch.iter().enumerate() {
                values.push(range_counter(&answer, i, key)?);
            }
        }
        Ok(values)
    }

    fn set_and_count(&self, key: &str, value: &[u8], keys: &[String]) -> Result<Vec<i64>, StoreError> {
        if keys.len() >= TXN_OPS {
            self.set(key, value)?;
            return self.counters(keys);
        }
        // One transaction: the put, then the ranges (applied in order, so the reads see the put).
        let mut ops = vec![json!({ "request_put": { "key": self.key(key), "value": B64.encode(value) } })];
        ops.extend(keys.iter().map(|k| json!({ "request_range": { "key": self.key(k) } })));
        let answer = self.write("/v3/kv/txn", json!({ "compare": [], "success": ops }))?;
        keys.iter().enumerate().map(|(i, k)| range_counter(&answer, i + 1, k)).collect()
    }

    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
        self.set(&format!("{key}/{name}"), entry)
    }

    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let under = format!("{}/{key}/", self.prefix);
        let (start, end) = prefix_range(&under);
        let answer = self.call(
            "/v3/kv/range",
            json!({ "key": start, "range_end": end, "sort_order": "ASCEND", "sort_target": "CREATE" }),
        )?;
        let mut out = Vec::new();
        for kv in answer["kvs"].as_array().cloned().unwrap_or_default() {
            let full = B64.decode(kv["key"].as_str().unwrap_or_default()).unwrap_or_default();
            let name = String::from_utf8_lossy(&full[under.len().min(full.len())..]).into_owned();
            if let Some((value, _)) = first_kv(&json!([kv]))? {
                out.push((name, value));
            }
        }
        Ok(out)
    }

    fn lengths(&self, keys: &[String]) -> Result<Vec<u64>, StoreError> {
        let mut lengths = Vec::with_capacity(keys.len());
        for batch in keys.chunks(TXN_OPS) {
            let ranges: Vec<Value> = batch
                .iter()
                .map(|k| {
                    let (start, end) = prefix_range(&format!("{}/{k}/", self.prefix));
                    json!({ "request_range": { "key": start, "range_end": end, "count_only": true } })
                })
                .collect();
            let answer = self.read_txn(&ranges)?;
            let responses = answer["responses"].as_array().cloned().unwrap_or_default();
            lengths
                .extend((0..batch.len()).map(|i| responses.get(i).map_or(0, |r| count(&r["response_range"]["count"]))));
        }
        Ok(lengths)
    }

    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        self.watch_for(key, within)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        let compare = if expected.is_empty() {
            self.absent(key)
        } else {
            json!({ "key": self.key(key), "target": "VALUE", "result": "EQUAL", "value": B64.encode(expected) })
        };
        match self.put_if(key, compare, desired)? {
            (true, _) => Ok(desired.to_vec()),
            (false, current) => Ok(current.unwrap_or_default()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::membership::{Agreement, Timing};
    use std::net::TcpListener;
    use std::process::{Child, Command, Stdio};
    use std::time::Instant;

    /// An etcd server of this test's own on loopback (a fresh data
    /// directory), stopped when dropped; `None` (the test says why and
    /// returns) when no etcd binary is found: `GRADSYNC_ETCD`, or `etcd`
    /// on the PATH (`scripts/debian-binary.sh etcd-server etcd` unpacks Debian's).
    pub(crate) struct Etcd {
        child: Child,
        dir: std::path::PathBuf,
        pub(crate) endpoint: String,
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    pub(crate) fn etcd() -> Option<Etcd> {
        let binary = std::env::var("GRADSYNC_ETCD").unwrap_or_else(|_| "etcd".into());
        let (client, peer) = (port(), port());
        let dir = std::env::temp_dir().join(format!("gradsync-etcd-{}-{client}", std::process::id()));
        let (c, p) = (format!("http://127.0.0.1:{client}"), format!("http://127.0.0.1:{peer}"));
        let child = Command::new(&binary)
            .args(["--data-dir", dir.to_str().unwrap(), "--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
            .args(["--initial-cluster", &format!("default={p}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(child) = child else {
            eprintln!("SKIPPED: no etcd binary ({binary}); run scripts/test, which unpacks Debian's etcd-server");
            return None;
        };
        let etcd = Etcd { child, dir, endpoint: format!("127.0.0.1:{client}") };
        let deadline = Instant::now() + Duration::from_secs(20);
        while EtcdKv::connect(&etcd.endpoint, "probe", Duration::from_secs(1)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not start within 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(etcd)
    }

    #[test]
    fn etcd_keeps_the_store_semantics_the_protocol_needs() {
        let Some(etcd) = etcd() else { return };
        let s = EtcdKv::connect(&etcd.endpoint, "job", Duration::from_secs(5)).unwrap();
        assert_eq!(s.get("k").unwrap(), None);
        assert_eq!(s.compare_set("k", b"", b"a").unwrap(), b"a");
        assert_eq!(s.compare_set("k", b"", b"b").unwrap(), b"a", "the second proposal reads the winner");
        assert_eq!(s.compare_set("k", b"a", b"c").unwrap(), b"c");
        assert_eq!(s.compare_set("absent", b"x", b"y").unwrap(), b"", "an absent key is not an expected value");
        assert_eq!(s.add("n", 0).unwrap(), 0);
        assert_eq!(s.add("n", 3).unwrap(), 3);
        s.set("t", b"word").unwrap();
        assert!(s.add("t", 1).is_err());
        assert!(s.delete("t").unwrap() && !s.delete("t").unwrap());
        let other = EtcdKv::connect(&etcd.endpoint, "other-job", Duration::from_secs(5)).unwrap();
        assert_eq!(other.get("k").unwrap(), None, "prefixes keep jobs apart");
        assert_eq!(s.count().unwrap(), 2, "k and n (t was deleted; the connection probe writes nothing)");
        s.enter("l", "7", b"a").unwrap();
        s.enter("l", "3", b"").unwrap();
        s.enter("l", "7", b"b").unwrap();
        assert_eq!(s.entries("l").unwrap(), vec![("7".into(), b"b".to_vec()), ("3".into(), Vec::new())]);
        assert_eq!(s.lengths(&["l".into(), "none".into()]).unwrap(), vec![2, 0]);
        assert_eq!(s.counters(&["n".into(), "absent".into()]).unwrap(), vec![3, 0]);
        assert!(!s.wait("w", Duration::from_millis(200)).unwrap(), "nobody set it");
        let setter = std::thread::spawn({
            let s = s.clone();
            move || {
                std::thread::sleep(Duration::from_millis(100));
                s.set("w", b"1").unwrap();
            }
        });
        let began = Instant::now();
        assert!(s.wait("w", Duration::from_secs(30)).unwrap(), "woken by etcd's watch");
        assert!(began.elapsed() < Duration::from_secs(20));
        setter.join().unwrap();
    }

    #[test]
    fn concurrent_adds_are_linearizable() {
        let Some(etcd) = etcd() else { return };
        let s = EtcdKv::connect(&etcd.endpoint, "job", Duration::from_secs(5)).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || (0..25).map(|_| s.add("n", 1).unwrap()).collect::<Vec<_>>())
            })
            .collect();
        let mut seen: Vec<i64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (1..=100).collect::<Vec<_>>(), "every add saw a distinct value");
    }

    #[test]
    fn the_membership_protocol_runs_over_etcd() {
        let Some(etcd) = etcd() else { return };
        let store = || EtcdKv::connect(&etcd.endpoint, "", Duration::from_secs(5)).unwrap();
        let timing = Timing { suspect_grace: Duration::from_millis(50), ..Timing::default() };
        // 24 members start together (the first roster's digest, one put each), one is reaped, the
        // others agree at once: check-ins as puts, one tally of prefix ranges, waits on etcd's watch.
        let n = 24;
        let mut members: Vec<_> = (0..n).map(|m| Agreement::new(store(), "job", m, timing)).collect();
        std::thread::scope(|s| {
            for a in &mut members {
                s.spawn(move || a.start((0..n).collect(), vec![0; n as usize]).unwrap().clone());
            }
        });
        let gathered: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> =
                members.iter().map(|a| s.spawn(move || a.gather(Duration::from_secs(30)).unwrap())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(gathered.iter().all(|g| *g == crate::membership::Gathered::All), "{gathered:?}");
        Agreement::obituary(&store(), "job", 1).unwrap();
        let survivors: Vec<_> = members
            .into_iter()
            .filter(|a| a.me() != 1)
            .map(|mut a| std::thread::spawn(move || a.recover(&[1], &(), &()).cloned().unwrap()))
            .collect();
        let rosters: Vec<_> = survivors.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(rosters.iter().all(|r| *r == rosters[0]), "one roster for every survivor");
        let expected: Vec<u64> = (0..n).filter(|&m| m != 1).collect();
        assert_eq!((rosters[0].epoch, rosters[0].members.clone(), rosters[0].lost.clone()), (1, expected, vec![1]));
    }
}
