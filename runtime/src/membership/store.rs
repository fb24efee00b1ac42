//! The store that holds an elastic job's membership: what the protocol needs
//! of it, and an in-memory one for tests and single-process jobs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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
}

/// A store in this process's memory (clones share it): for tests, and for
/// ranks that are threads of one process.
#[derive(Debug, Clone, Default)]
pub struct MemoryKv {
    map: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl MemoryKv {
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Vec<u8>>) -> T) -> T {
        f(&mut self.map.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

impl KvStore for MemoryKv {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.with(|m| {
            let now = m.get(key).map_or(Ok(0), |v| {
                std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| StoreError(format!("{key} does not hold an integer")))
            })? + delta;
            m.insert(key.to_string(), now.to_string().into_bytes());
            Ok(now)
        })
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.with(|m| m.insert(key.to_string(), value.to_vec()));
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.with(|m| m.get(key).cloned()))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        Ok(self.with(|m| match m.get(key) {
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
}
