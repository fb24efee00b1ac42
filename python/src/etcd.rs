//! [`EtcdClient`]: an etcd cluster as an elastic job's store, for Python.
//!
//! ```text
//! gradsync.torch.etcd.EtcdStore (a torch.distributed.Store: gloo's rendezvous, the wrapper's groups)
//!     └─▶ EtcdClient (this) ── gradsync_runtime::membership::EtcdKv ── HTTP/JSON ──▶ etcd
//! Membership(client=EtcdClient) ── the same EtcdKv, on the monitor's thread too (no interpreter)
//! ```
//!
//! Every method releases the interpreter while it talks to etcd.

use std::time::{Duration, Instant};

use gradsync_runtime::membership::{EtcdKv, KvStore, StoreError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors;

/// A client of the etcd cluster at `endpoints` (`host:port`, comma-separated;
/// `etcd://` optional), every key under `prefix`; each request may take
/// `timeout_s`.
#[pyclass(module = "gradsync._native", frozen)]
pub struct EtcdClient {
    pub(crate) store: EtcdKv,
}

fn store_error(py: Python<'_>, e: StoreError) -> PyErr {
    errors::raise::<errors::MembershipError>(py, format!("etcd: {e}"), &[])
}

#[pymethods]
impl EtcdClient {
    #[new]
    #[pyo3(signature = (endpoints, prefix = "", timeout_s = 30.0))]
    fn new(py: Python<'_>, endpoints: &str, prefix: &str, timeout_s: f64) -> PyResult<Self> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(errors::raise::<errors::ConfigError>(
                py,
                format!("timeout_s={timeout_s}: use a positive number"),
                &[],
            ));
        }
        let timeout = Duration::from_secs_f64(timeout_s);
        let store = py.detach(|| EtcdKv::connect(endpoints, prefix, timeout)).map_err(|e| store_error(py, e))?;
        Ok(EtcdClient { store })
    }

    /// Set `key` to `value`.
    fn set(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        py.detach(|| self.store.set(key, value)).map_err(|e| store_error(py, e))
    }

    /// The value at `key`, or `None` (never waits).
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let value = py.detach(|| self.store.get(key)).map_err(|e| store_error(py, e))?;
        Ok(value.map(|v| PyBytes::new(py, &v)))
    }

    /// Add `delta` to the integer at `key` (absent: 0); the new value.
    fn add(&self, py: Python<'_>, key: &str, delta: i64) -> PyResult<i64> {
        py.detach(|| self.store.add(key, delta)).map_err(|e| store_error(py, e))
    }

    /// Set `key` to `desired` if it holds `expected` (empty: absent); what it holds afterwards.
    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let value = py.detach(|| self.store.compare_set(key, expected, desired)).map_err(|e| store_error(py, e))?;
        Ok(PyBytes::new(py, &value))
    }

    /// Delete `key`; whether it was there.
    fn delete(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        py.detach(|| self.store.delete(key)).map_err(|e| store_error(py, e))
    }

    /// How many keys are under this client's prefix.
    fn count(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| self.store.count()).map_err(|e| store_error(py, e))
    }

    /// Wait until every key in `keys` exists (etcd's watch: nothing polls);
    /// `False` if `timeout_s` passed first.
    fn wait(&self, py: Python<'_>, keys: Vec<String>, timeout_s: f64) -> PyResult<bool> {
        let deadline = Instant::now() + Duration::from_secs_f64(timeout_s.max(0.0));
        py.detach(|| -> Result<bool, StoreError> {
            for key in &keys {
                if !self.store.wait(key, deadline.saturating_duration_since(Instant::now()))? {
                    return Ok(false);
                }
            }
            Ok(true)
        })
        .map_err(|e| store_error(py, e))
    }

    /// The endpoints, comma-separated, as given to etcd's clients.
    #[getter]
    fn endpoints(&self) -> String {
        self.store.endpoints().join(",")
    }
}
