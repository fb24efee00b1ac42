//! [`MeteredKv`]: any [`KvStore`] with its calls counted and, optionally, a
//! round-trip latency added to each: how the scale tests assert that the
//! protocol's store traffic is O(N), and how the scale benchmark measures it
//! against a store as far away as a real one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{KvStore, StoreError};

/// How many calls of each kind a [`MeteredKv`] has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreOps {
    /// `add` calls.
    pub add: u64,
    /// `set` calls.
    pub set: u64,
    /// `get` calls.
    pub get: u64,
    /// `compare_set` calls.
    pub compare_set: u64,
    /// `counters` calls (each one batched read).
    pub counters: u64,
    /// `set_and_count` calls (a beat: a write and a batched read).
    pub set_and_count: u64,
    /// Keys read by those `counters` and `set_and_count` calls together.
    pub counter_keys: u64,
    /// `enter` calls.
    pub enter: u64,
    /// `entries` calls.
    pub entries: u64,
    /// `lengths` calls (each one batched read).
    pub lengths: u64,
    /// `wait` calls.
    pub wait: u64,
}

impl StoreOps {
    /// Every call, whatever its kind (a batched read counts once).
    pub fn total(&self) -> u64 {
        self.add
            + self.set
            + self.get
            + self.compare_set
            + self.counters
            + self.set_and_count
            + self.enter
            + self.entries
            + self.lengths
            + self.wait
    }

    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &StoreOps) -> StoreOps {
        StoreOps {
            add: self.add - earlier.add,
            set: self.set - earlier.set,
            get: self.get - earlier.get,
            compare_set: self.compare_set - earlier.compare_set,
            counters: self.counters - earlier.counters,
            set_and_count: self.set_and_count - earlier.set_and_count,
            counter_keys: self.counter_keys - earlier.counter_keys,
            enter: self.enter - earlier.enter,
            entries: self.entries - earlier.entries,
            lengths: self.lengths - earlier.lengths,
            wait: self.wait - earlier.wait,
        }
    }
}

#[derive(Debug, Default)]
struct Counts([AtomicU64; 11]);

/// Indexes into [`Counts`].
const ADD: usize = 0;
const SET: usize = 1;
const GET: usize = 2;
const CAS: usize = 3;
const COUNTERS: usize = 4;
const COUNTER_KEYS: usize = 5;
const ENTER: usize = 6;
const ENTRIES: usize = 7;
const WAIT: usize = 8;
const LENGTHS: usize = 9;
const SET_AND_COUNT: usize = 10;

/// `inner` with its calls counted (clones share the counts) and each call
/// delayed by `latency` first (the round trip to a store on another host;
/// the delay is the caller's, as a network's is, so callers overlap).
#[derive(Debug, Clone)]
pub struct MeteredKv<S: KvStore> {
    inner: S,
    latency: Duration,
    counts: Arc<Counts>,
}

impl<S: KvStore> MeteredKv<S> {
    /// Count `inner`'s calls; no added latency.
    pub fn new(inner: S) -> Self {
        MeteredKv { inner, latency: Duration::ZERO, counts: Arc::default() }
    }

    /// Delay every call by `latency` before it reaches the store.
    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// The calls so far.
    pub fn ops(&self) -> StoreOps {
        let c = |i: usize| self.counts.0[i].load(Ordering::Relaxed);
        StoreOps {
            add: c(ADD),
            set: c(SET),
            get: c(GET),
            compare_set: c(CAS),
            counters: c(COUNTERS),
            set_and_count: c(SET_AND_COUNT),
            counter_keys: c(COUNTER_KEYS),
            enter: c(ENTER),
            entries: c(ENTRIES),
            lengths: c(LENGTHS),
            wait: c(WAIT),
        }
    }

    /// The store underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn call(&self, kind: usize) {
        self.counts.0[kind].fetch_add(1, Ordering::Relaxed);
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
    }
}

impl<S: KvStore> KvStore for MeteredKv<S> {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.call(ADD);
        self.inner.add(key, delta)
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.call(SET);
        self.inner.set(key, value)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.call(GET);
        self.inner.get(key)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        self.call(CAS);
        self.inner.compare_set(key, expected, desired)
    }

    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError> {
        self.counts.0[COUNTER_KEYS].fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.call(COUNTERS);
        self.inner.counters(keys)
    }

    fn set_and_count(&self, key: &str, value: &[u8], keys: &[String]) -> Result<Vec<i64>, StoreError> {
        self.counts.0[COUNTER_KEYS].fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.call(SET_AND_COUNT);
        self.inner.set_and_count(key, value, keys)
    }

    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
        self.call(ENTER);
        self.inner.enter(key, name, entry)
    }

    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.call(ENTRIES);
        self.inner.entries(key)
    }

    fn lengths(&self, keys: &[String]) -> Result<Vec<u64>, StoreError> {
        self.call(LENGTHS);
        self.inner.lengths(keys)
    }

    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        self.call(WAIT);
        self.inner.wait(key, within)
    }
}

#[cfg(test)]
mod tests {
    use super::super::MemoryKv;
    use super::*;

    #[test]
    fn every_kind_of_call_is_counted_and_a_batch_once() {
        let s = MeteredKv::new(MemoryKv::default());
        s.set("a", b"1").unwrap();
        s.add("a", 1).unwrap();
        s.counters(&["a".into(), "b".into(), "c".into()]).unwrap();
        s.enter("l", "1", b"").unwrap();
        s.entries("l").unwrap();
        let before = s.ops();
        s.get("a").unwrap();
        assert_eq!(before.total(), 5);
        assert_eq!((before.counters, before.counter_keys), (1, 3));
        assert_eq!(s.ops().since(&before), StoreOps { get: 1, ..StoreOps::default() });
    }
}
