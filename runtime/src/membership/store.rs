//! The store that holds an elastic job's membership: what the protocol needs
//! of it, and an in-memory one for tests and single-process jobs.
//!
//! The protocol's cost is counted in these calls, so each is one round trip
//! on every store that can do it in one: a heartbeat is one `set`, a
//! monitor's look at its peers one [`KvStore::counters`], a check-in one
//! [`KvStore::enter`], a tally one [`KvStore::entries`] per ledger, and a
//! member waiting for the next roster blocks in [`KvStore::wait`] (the
//! store answers when the key appears; nobody polls).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A failed store operation (the store's own words).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StoreError(pub String);

/// A linearizable key-value store shared by every process of a job (torch's
/// `TCPStore`, etcd). Every call may come from any thread.
pub trait KvStore: Send + Sync + 'static {
    /// Add `delta` to the integer at `key` (absent: 0); return the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Set `key` to `value`.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// The value at `key`, or `None`; never waits for the key to appear.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Set `key` to `desired` if it holds `expected` (or is absent and
    /// `expected` is empty); return what it holds afterwards.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError>;
    /// The integers at `keys` (absent: 0; each written by [`KvStore::add`]
    /// or as decimal text by [`KvStore::set`]), read in one batch: a
    /// monitor's look at the heartbeats it watches is one call.
    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError>;
    /// Set `key` to `value`, then read the integers at `keys` as
    /// [`KvStore::counters`] does: a monitor's beat. One round trip where
    /// the store can do both at once (an etcd transaction); two otherwise.
    fn set_and_count(&self, key: &str, value: &[u8], keys: &[String]) -> Result<Vec<i64>, StoreError> {
        self.set(key, value)?;
        self.counters(keys)
    }
    /// Add `entry` under `name` to the ledger at `key` (a later entry of
    /// the same name replaces it): how each member checks in once, without
    /// anyone reading a key per member.
    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError>;
    /// Every entry of the ledger at `key`, `(name, entry)`, the latest of
    /// each name, in the order first entered: one read, whoever wrote them.
    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError>;
    /// How many entries each ledger at `keys` holds, read in one batch: at
    /// least its distinct names (a name entered again may count again).
    /// Cheap to poll. By default the counters at [`length_key`] beside each
    /// ledger, which such a store's [`KvStore::enter`] adds to (an atomic
    /// add on the store's server); a store that counts a ledger itself
    /// (etcd: a prefix count, where an add is a transaction retried per
    /// concurrent writer) says so here.
    fn lengths(&self, keys: &[String]) -> Result<Vec<u64>, StoreError> {
        let counts = self.counters(&keys.iter().map(|k| length_key(k)).collect::<Vec<_>>())?;
        Ok(counts.into_iter().map(|n| n.max(0) as u64).collect())
    }
    /// Block until `key` exists (`true`), or `within` passes (`false`).
    /// The store answers when the key is set: a waiting member costs it
    /// nothing meanwhile.
    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError>;
}

/// One ledger entry as a store without ledgers keeps it: appended to the
/// ledger's one value (torch's `TCPStore` appends atomically), each entry
/// `name length, name, entry length, entry` (lengths as u32, little-endian).
pub fn frame_entry(name: &str, entry: &[u8]) -> Vec<u8> {
    let mut framed = Vec::with_capacity(8 + name.len() + entry.len());
    framed.extend_from_slice(&(name.len() as u32).to_le_bytes());
    framed.extend_from_slice(name.as_bytes());
    framed.extend_from_slice(&(entry.len() as u32).to_le_bytes());
    framed.extend_from_slice(entry);
    framed
}

/// The entries of a ledger kept as framed entries (see [`frame_entry`]):
/// the latest of each name, in the order names first appear.
pub fn unframe_entries(key: &str, mut bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    let bad = || StoreError(format!("{key} holds a malformed ledger; is another gradsync version using this store?"));
    let mut order: Vec<String> = Vec::new();
    let mut latest: HashMap<String, Vec<u8>> = HashMap::new();
    let take = |bytes: &mut &[u8]| -> Result<Vec<u8>, StoreError> {
        let (len, rest) = bytes.split_first_chunk::<4>().ok_or_else(bad)?;
        let len = u32::from_le_bytes(*len) as usize;
        let (field, rest) = rest.split_at_checked(len).ok_or_else(bad)?;
        *bytes = rest;
        Ok(field.to_vec())
    };
    while !bytes.is_empty() {
        let name = String::from_utf8(take(&mut bytes)?).map_err(|_| bad())?;
        let entry = take(&mut bytes)?;
        if latest.insert(name.clone(), entry).is_none() {
            order.push(name);
        }
    }
    Ok(order.into_iter().map(|name| (name.clone(), latest.remove(&name).unwrap_or_default())).collect())
}

/// Where a store without ledgers keeps a ledger's length (beside it: etcd
/// keeps a ledger's entries under `{key}/`).
pub fn length_key(ledger: &str) -> String {
    format!("{ledger}.length")
}

/// The integer a counter key holds (decimal text; absent: 0).
pub fn counter_value(key: &str, value: Option<&[u8]>) -> Result<i64, StoreError> {
    match value {
        None => Ok(0),
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .ok_or_else(|| StoreError(format!("{key} does not hold an integer"))),
    }
}

/// A store in this process's memory (clones share it): for tests, the
/// scale benchmark, and ranks that are threads of one process.
#[derive(Debug, Clone, Default)]
pub struct MemoryKv {
    shared: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
    /// A condition per key someone waits for, signalled when the key is
    /// written (only its waiters wake, however many wait on other keys).
    waiting: HashMap<String, Arc<Condvar>>,
}

impl MemoryKv {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Write through `f`, waking whoever waits for `key`.
    fn with<T>(&self, key: &str, f: impl FnOnce(&mut HashMap<String, Vec<u8>>) -> T) -> T {
        let mut state = self.lock();
        let out = f(&mut state.values);
        if let Some(written) = state.waiting.remove(key) {
            written.notify_all();
        }
        out
    }

    fn read<T>(&self, f: impl FnOnce(&HashMap<String, Vec<u8>>) -> T) -> T {
        f(&self.lock().values)
    }
}

impl KvStore for MemoryKv {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.with(key, |m| {
            let now = counter_value(key, m.get(key).map(Vec::as_slice))? + delta;
            m.insert(key.to_string(), now.to_string().into_bytes());
            Ok(now)
        })
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.with(key, |m| m.insert(key.to_string(), value.to_vec()));
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.read(|m| m.get(key).cloned()))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        Ok(self.with(key, |m| match m.get(key) {
            None if expected.is_empty() => {
                m.insert(key.to_string(), desired.to_vec());
                desired.to_vec()
            }
            Some(current) if current == expected => {
                m.insert(key.to_string(), desired.to_vec());
                desired.to_vec()
            }
            Some(current) => current.clone(),
            None => Vec::new(),
        }))
    }

    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError> {
        self.read(|m| keys.iter().map(|k| counter_value(k, m.get(k).map(Vec::as_slice))).collect())
    }

    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
        self.with(key, |m| m.entry(key.to_string()).or_default().extend_from_slice(&frame_entry(name, entry)));
        self.add(&length_key(key), 1)?;
        Ok(())
    }

    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let bytes = self.read(|m| m.get(key).cloned()).unwrap_or_default();
        unframe_entries(key, &bytes)
    }

    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        let deadline = Instant::now() + within;
        let mut state = self.lock();
        loop {
            if state.values.contains_key(key) {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            let written = Arc::clone(state.waiting.entry(key.to_string()).or_default());
            state = written.wait_timeout(state, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_set_lets_exactly_the_first_writer_win() {
        let s = MemoryKv::default();
        assert_eq!(s.compare_set("k", b"", b"a").unwrap(), b"a");
        assert_eq!(s.compare_set("k", b"", b"b").unwrap(), b"a", "the second proposal reads the winner");
        assert_eq!(s.compare_set("k", b"a", b"c").unwrap(), b"c");
        assert_eq!(s.compare_set("absent", b"x", b"y").unwrap(), b"", "an absent key is not an expected value");
    }

    #[test]
    fn add_counts_from_zero_and_refuses_text() {
        let s = MemoryKv::default();
        assert_eq!(s.add("n", 0).unwrap(), 0);
        assert_eq!(s.add("n", 3).unwrap(), 3);
        s.set("t", b"word").unwrap();
        assert!(s.add("t", 1).is_err());
    }

    #[test]
    fn counters_read_adds_and_decimal_sets_and_absent_keys_as_zero() {
        let s = MemoryKv::default();
        s.add("a", 4).unwrap();
        s.set("b", b"17").unwrap();
        let keys = ["a", "b", "absent"].map(String::from);
        assert_eq!(s.counters(&keys).unwrap(), vec![4, 17, 0]);
        s.set("c", b"word").unwrap();
        assert!(s.counters(&["c".to_string()]).is_err(), "a non-integer is named, not read as 0");
    }

    #[test]
    fn a_ledger_keeps_each_name_once_with_its_latest_entry_in_first_order() {
        let s = MemoryKv::default();
        assert!(s.entries("l").unwrap().is_empty());
        s.enter("l", "7", b"first").unwrap();
        s.enter("l", "3", b"").unwrap();
        s.enter("l", "7", b"again").unwrap();
        assert_eq!(s.entries("l").unwrap(), vec![("7".into(), b"again".to_vec()), ("3".into(), Vec::new())]);
        assert_eq!(s.lengths(&["l".into(), "none".into()]).unwrap(), vec![3, 0], "entries counted, names or not");
        let e = unframe_entries("job/l", &[1, 0, 0]).unwrap_err();
        assert!(e.0.contains("job/l"), "{e}");
    }

    #[test]
    fn a_wait_returns_when_the_key_is_set_or_after_its_time() {
        let s = MemoryKv::default();
        assert!(!s.wait("k", Duration::from_millis(10)).unwrap(), "nobody set it");
        let setter = std::thread::spawn({
            let s = s.clone();
            move || {
                std::thread::sleep(Duration::from_millis(20));
                s.set("k", b"v").unwrap();
            }
        });
        assert!(s.wait("k", Duration::from_secs(60)).unwrap(), "woken by the write, long before 60 s");
        setter.join().unwrap();
        assert!(s.wait("k", Duration::ZERO).unwrap(), "already there");
    }
}
