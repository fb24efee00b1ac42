//! [`Membership`]: the runtime's membership protocol (`gradsync_runtime::membership`)
//! for one process of an elastic job, over torch's store or an etcd cluster
//! ([`EtcdClient`]).
//!
//! ```text
//! gradsync.torch.elastic ── Membership(table, store clients, cancel, prefix, me)
//!   .start / .request_join / .recover / .admit   (interpreter released; the protocol is Rust's)
//!        │ ShimStore ── the shim's store_* functions ──▶ c10d Store (no interpreter)
//!   Monitor thread ── its own store client ── beats, silence, check-ins
//!        └─ breaks an epoch ── cancel_epoch(Cancel) ──▶ that epoch's endpoints fail their waits
//! ```
//!
//! The store clients and the `Cancel` are Python objects of the shim, held
//! here for as long as their addresses are used (the monitor stops first).

use std::ffi::c_char;
use std::time::Duration;

use gradsync_runtime::membership::{
    frame_entry, length_key, unframe_entries, Agreement, Canceller, EtcdKv, Gathered, KvStore, MemberId,
    MembershipError, Monitor, NodeId, Probe, Reach, Roster, StoreError, TcpReach, Timing,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::collectives::{error_text, message, Table};
use crate::errors;
use crate::etcd::EtcdClient;

/// The least time a probe of a peer may take before it counts as unreachable.
const PROBE_FLOOR: Duration = Duration::from_millis(200);

/// Bytes read back from the store per value before retrying with the full length.
const VALUE_BYTES: usize = 4096;

/// A c10d store through the shim's functions (the address of a Python-owned
/// `_collectives.StoreClient`, alive while the [`Membership`] lives).
#[derive(Clone, Copy)]
struct ShimStore {
    table: &'static Table,
    client: usize,
}

impl ShimStore {
    fn call(&self, call: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), StoreError> {
        let mut err = error_text();
        if call(err.as_mut_ptr(), err.len()) != 0 {
            return Err(StoreError(message(&err)));
        }
        Ok(())
    }

    fn ptr(&self) -> *mut std::ffi::c_void {
        self.client as *mut std::ffi::c_void
    }

    /// Read a value with `read(buffer, capacity, &mut len)`, growing the
    /// buffer while the value is longer (a ledger can grow between two reads).
    fn read(
        &self,
        mut read: impl FnMut(*mut u8, usize, &mut usize, *mut c_char, usize) -> i32,
    ) -> Result<Vec<u8>, StoreError> {
        let mut buf = vec![0u8; VALUE_BYTES];
        loop {
            let mut len = 0usize;
            self.call(|err, err_len| read(buf.as_mut_ptr(), buf.len(), &mut len, err, err_len))?;
            if len <= buf.len() {
                buf.truncate(len);
                return Ok(buf);
            }
            buf = vec![0u8; len + len / 2];
        }
    }
}

impl KvStore for ShimStore {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let mut out = 0i64;
        // SAFETY: the client is alive (see the type's docs); key, out and the
        // error buffer outlive the call.
        self.call(|err, err_len| unsafe {
            (self.table.store_add)(self.ptr(), key.as_ptr().cast(), key.len(), delta, &mut out, err, err_len)
        })?;
        Ok(out)
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        // SAFETY: as in `add`; `value` outlives the call.
        self.call(|err, err_len| unsafe {
            (self.table.store_set)(
                self.ptr(),
                key.as_ptr().cast(),
                key.len(),
                value.as_ptr(),
                value.len(),
                err,
                err_len,
            )
        })
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut found = 0i32;
        let value = self.read(|out, cap, len, err, err_len| {
            // SAFETY: as in `add`; `out` holds `cap` bytes.
            unsafe {
                (self.table.store_get)(
                    self.ptr(),
                    key.as_ptr().cast(),
                    key.len(),
                    &mut found,
                    out,
                    cap,
                    len,
                    err,
                    err_len,
                )
            }
        })?;
        Ok((found != 0).then_some(value))
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        let mut buf = vec![0u8; VALUE_BYTES];
        let mut len = 0usize;
        // SAFETY: as in `add`; `expected` and `desired` outlive the call and `buf` holds its length.
        self.call(|err, err_len| unsafe {
            (self.table.store_compare_set)(
                self.ptr(),
                key.as_ptr().cast(),
                key.len(),
                expected.as_ptr(),
                expected.len(),
                desired.as_ptr(),
                desired.len(),
                buf.as_mut_ptr(),
                buf.len(),
                &mut len,
                err,
                err_len,
            )
        })?;
        if len > buf.len() {
            // Applied once already: read the (longer) value back instead of setting it again.
            return Ok(self.get(key)?.unwrap_or_default());
        }
        buf.truncate(len);
        Ok(buf)
    }

    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError> {
        let joined: String = keys.concat();
        let lens: Vec<usize> = keys.iter().map(String::len).collect();
        let mut out = vec![0i64; keys.len()];
        // SAFETY: as in `add`; `joined` holds the keys `lens` measure, `out` one slot per key.
        self.call(|err, err_len| unsafe {
            (self.table.store_counters)(
                self.ptr(),
                joined.as_ptr().cast(),
                lens.as_ptr(),
                keys.len(),
                out.as_mut_ptr(),
                err,
                err_len,
            )
        })?;
        Ok(out)
    }

    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
        let framed = frame_entry(name, entry);
        // SAFETY: as in `add`; `framed` outlives the call.
        self.call(|err, err_len| unsafe {
            (self.table.store_append)(
                self.ptr(),
                key.as_ptr().cast(),
                key.len(),
                framed.as_ptr(),
                framed.len(),
                err,
                err_len,
            )
        })?;
        // The TCPStore's add is atomic on its server: a count all members share costs it nothing more.
        self.add(&length_key(key), 1).map(|_| ())
    }

    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        unframe_entries(key, &self.get(key)?.unwrap_or_default())
    }

    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        let mut found = 0i32;
        let ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX).max(1);
        // SAFETY: as in `add`.
        self.call(|err, err_len| unsafe {
            (self.table.store_wait)(self.ptr(), key.as_ptr().cast(), key.len(), ms, &mut found, err, err_len)
        })?;
        Ok(found != 0)
    }
}

/// The job's store: torch's (through the shim) or an etcd cluster.
#[derive(Clone)]
enum JobStore {
    Shim(ShimStore),
    Etcd(EtcdKv),
}

impl JobStore {
    /// `client`: an [`EtcdClient`], or a `_collectives.StoreClient` (used through `table`).
    fn of(py: Python<'_>, table: &'static Table, client: &Py<PyAny>) -> PyResult<Self> {
        if let Ok(etcd) = client.bind(py).cast::<EtcdClient>() {
            return Ok(JobStore::Etcd(etcd.get().store.clone()));
        }
        Ok(JobStore::Shim(ShimStore { table, client: address(py, client)? }))
    }
}

impl KvStore for JobStore {
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match self {
            JobStore::Shim(s) => s.add(key, delta),
            JobStore::Etcd(s) => s.add(key, delta),
        }
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        match self {
            JobStore::Shim(s) => s.set(key, value),
            JobStore::Etcd(s) => s.set(key, value),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self {
            JobStore::Shim(s) => s.get(key),
            JobStore::Etcd(s) => s.get(key),
        }
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, StoreError> {
        match self {
            JobStore::Shim(s) => s.compare_set(key, expected, desired),
            JobStore::Etcd(s) => s.compare_set(key, expected, desired),
        }
    }

    fn counters(&self, keys: &[String]) -> Result<Vec<i64>, StoreError> {
        match self {
            JobStore::Shim(s) => s.counters(keys),
            JobStore::Etcd(s) => s.counters(keys),
        }
    }

    fn enter(&self, key: &str, name: &str, entry: &[u8]) -> Result<(), StoreError> {
        match self {
            JobStore::Shim(s) => s.enter(key, name, entry),
            JobStore::Etcd(s) => s.enter(key, name, entry),
        }
    }

    fn entries(&self, key: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        match self {
            JobStore::Shim(s) => s.entries(key),
            JobStore::Etcd(s) => s.entries(key),
        }
    }

    fn set_and_count(&self, key: &str, value: &[u8], keys: &[String]) -> Result<Vec<i64>, StoreError> {
        match self {
            JobStore::Shim(s) => s.set_and_count(key, value, keys),
            JobStore::Etcd(s) => s.set_and_count(key, value, keys),
        }
    }

    fn lengths(&self, keys: &[String]) -> Result<Vec<u64>, StoreError> {
        match self {
            JobStore::Shim(s) => s.lengths(keys),
            JobStore::Etcd(s) => s.lengths(keys),
        }
    }

    fn wait(&self, key: &str, within: Duration) -> Result<bool, StoreError> {
        match self {
            JobStore::Shim(s) => s.wait(key, within),
            JobStore::Etcd(s) => s.wait(key, within),
        }
    }
}

/// One process's membership in an elastic job (see the module docs). Built
/// by `gradsync.torch.elastic`; its methods release the interpreter while
/// they wait on the store.
#[pyclass(module = "gradsync._native")]
pub struct Membership {
    // Dropped first: the monitor's thread uses `monitor_client` and `cancel`.
    monitor: Option<Monitor>,
    agreement: Agreement<JobStore>,
    /// Where the peers probe this process (`None`: it is not probed, and
    /// does not probe them).
    probe: Option<Probe>,
    table: &'static Table,
    prefix: String,
    /// Raised by the monitor while a process waits to join; read by the
    /// Session's control votes (exists before the monitor starts).
    joiner_waiting: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Kept alive for their addresses: the protocol's store client, the
    /// monitor's own, and the shim's `Cancel`.
    _client: Py<PyAny>,
    monitor_client: Py<PyAny>,
    cancel: Py<PyAny>,
}

fn membership_error(py: Python<'_>, e: &MembershipError) -> PyErr {
    let kind = match e {
        MembershipError::Store(_) => "store",
        MembershipError::NoQuorum { .. } => "no_quorum",
        MembershipError::LeftOut { .. } => "left_out",
        MembershipError::Refused { .. } => "refused",
        MembershipError::Ended { .. } => "ended",
        MembershipError::NoMembers { .. } => "no_members",
        MembershipError::Deadline { .. } => "deadline",
        MembershipError::Malformed { .. } => "malformed",
    };
    let kind = kind.into_pyobject(py).map(|k| k.into_any().unbind()).unwrap_or_else(|_| py.None());
    errors::raise::<errors::MembershipError>(py, e.to_string(), &[("kind", kind)])
}

/// The job's store through `client`, for a supervisor's one-off records
/// (`table`: the shim's table, as for [`Membership::new`]).
fn job_store(py: Python<'_>, table: usize, client: &Py<PyAny>) -> PyResult<JobStore> {
    // SAFETY: `table` comes from `_collectives.table()` (the caller's contract, as for collectives).
    let table = unsafe { Table::at(table) }.map_err(|why| errors::raise::<errors::ConfigError>(py, why, &[]))?;
    JobStore::of(py, table, client)
}

fn address(py: Python<'_>, object: &Py<PyAny>) -> PyResult<usize> {
    object.bind(py).getattr("address")?.extract()
}

/// A roster as a dict: `epoch`, `members`, `nodes`, `lost`, `joined`,
/// `joiners_seen`, and `buddy_stride` (where a sharded job keeps each
/// partition's buddy copy: [`Roster::buddy_stride`]).
fn roster_dict<'py>(py: Python<'py>, r: &Roster) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("epoch", r.epoch)?;
    d.set_item("members", r.members.clone())?;
    d.set_item("nodes", r.nodes.clone())?;
    d.set_item("buddy_stride", r.buddy_stride())?;
    d.set_item("lost", r.lost.clone())?;
    d.set_item("joined", r.joined.clone())?;
    d.set_item("joiners_seen", r.joiners_seen)?;
    Ok(d)
}

impl Membership {
    /// How this process probes its peers when it checks in (`None`: it does not).
    fn tcp_reach(&self) -> Option<TcpReach> {
        self.probe.as_ref().map(|_| TcpReach { deadline: (self.agreement.timing().liveness / 2).max(PROBE_FLOOR) })
    }

    /// [`Membership::tcp_reach`] for the monitor's thread.
    fn reach(&self) -> Box<dyn Reach + Send> {
        match self.tcp_reach() {
            Some(reach) => Box::new(reach),
            None => Box::new(()),
        }
    }

    /// Watch the adopted roster (starting the monitor on the first one).
    fn follow(&mut self, py: Python<'_>) -> PyResult<()> {
        let roster = self.agreement.roster().clone();
        if let Some(m) = &self.monitor {
            m.follow(roster);
            return Ok(());
        }
        let store = JobStore::of(py, self.table, &self.monitor_client)?;
        let (table, cancel) = (self.table, address(py, &self.cancel)?);
        // SAFETY: `cancel` is the address of the shim's `Cancel`, alive while
        // this Membership (which stops the monitor first) holds it.
        let cancel: Canceller = Box::new(move |epoch| unsafe { (table.cancel_epoch)(cancel as *mut _, epoch as i64) });
        let me = self.agreement.me();
        let monitor = Monitor::start(
            store,
            self.prefix.clone(),
            me,
            roster,
            self.agreement.timing(),
            cancel,
            std::sync::Arc::clone(&self.joiner_waiting),
            self.reach(),
        )
        .map_err(|e| {
            errors::raise::<errors::MembershipError>(py, format!("starting the liveness monitor: {e}"), &[])
        })?;
        self.monitor = Some(monitor);
        Ok(())
    }

    fn adopted<'py>(
        &mut self,
        py: Python<'py>,
        result: Result<Roster, MembershipError>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let roster = result.map_err(|e| membership_error(py, &e))?;
        self.follow(py)?;
        roster_dict(py, &roster)
    }

    /// The flag a Session's control votes read.
    pub fn joiner_flag(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        std::sync::Arc::clone(&self.joiner_waiting)
    }
}

#[pymethods]
impl Membership {
    /// Member `me` of the job whose records are under `prefix` in the store
    /// of `client` (a `_collectives.StoreClient`, or an `EtcdClient`); `monitor_client` is a
    /// second connection for the liveness monitor, `cancel` the shim's
    /// `Cancel` its endpoints were built with, `table` the shim's table.
    /// A member is lost when silent for `liveness_s` (its heartbeat checked
    /// every `beat_s`), or `suspect_grace_s` after a failure named it; a
    /// joiner waits `admission_s` at most. After a loss the job goes on
    /// with at least `min_members`. This process runs on `node` (its
    /// supervisor's number); with `probe_host`, it listens there for its
    /// peers' probes and probes them when it checks in to an agreement.
    #[new]
    #[pyo3(signature = (table, client, monitor_client, cancel, prefix, me, *, liveness_s = 1.0, beat_s = 0.1,
                        suspect_grace_s = 0.25, admission_s = 300.0, min_members = 1, node = 0,
                        probe_host = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        table: usize,
        client: Py<PyAny>,
        monitor_client: Py<PyAny>,
        cancel: Py<PyAny>,
        prefix: String,
        me: MemberId,
        liveness_s: f64,
        beat_s: f64,
        suspect_grace_s: f64,
        admission_s: f64,
        min_members: usize,
        node: NodeId,
        probe_host: Option<String>,
    ) -> PyResult<Self> {
        if min_members == 0 {
            return Err(errors::raise::<errors::ConfigError>(
                py,
                "min_members=0: a job goes on with at least one member; use 1 or more".into(),
                &[],
            ));
        }
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(errors::raise::<errors::ConfigError>(
                    py,
                    format!("{name}={v}: use a positive number of seconds"),
                    &[],
                ))
            }
        };
        let timing = Timing {
            beat: positive("beat_s", beat_s)?,
            liveness: positive("liveness_s", liveness_s)?,
            suspect_grace: positive("suspect_grace_s", suspect_grace_s)?,
            admission: positive("admission_s", admission_s)?,
            ..Timing::default()
        };
        // SAFETY: `table` comes from `_collectives.table()` (the caller's contract, as for collectives).
        let table = unsafe { Table::at(table) }.map_err(|why| errors::raise::<errors::ConfigError>(py, why, &[]))?;
        let store = JobStore::of(py, table, &client)?;
        let agreement = Agreement::new(store, prefix.clone(), me, timing).with_minimum(min_members).on_node(node);
        let probe = match probe_host {
            Some(host) => {
                let probe = Probe::listen(&host, me).map_err(|e| {
                    errors::raise::<errors::ConfigError>(
                        py,
                        format!("member {me} cannot listen for its peers' probes on {host}: {e}; is that this machine's address?"),
                        &[],
                    )
                })?;
                py.detach(|| agreement.publish_probe(&probe.address())).map_err(|e| membership_error(py, &e))?;
                Some(probe)
            }
            None => None,
        };
        Ok(Membership {
            monitor: None,
            agreement,
            probe,
            table,
            prefix,
            joiner_waiting: Default::default(),
            _client: client,
            monitor_client,
            cancel,
        })
    }

    /// Start as one of the job's first members (`initial`, in rank order;
    /// member `i` runs on `nodes[i]`); returns the roster (a dict).
    fn start<'py>(
        &mut self,
        py: Python<'py>,
        initial: Vec<MemberId>,
        nodes: Vec<NodeId>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let agreement = &mut self.agreement;
        let result = py.detach(|| agreement.start(initial, nodes).cloned());
        self.adopted(py, result)
    }

    /// Ask to join with this process's model/optimizer `fingerprint`; waits
    /// until admitted (returns the roster) or refused (`MembershipError`).
    fn request_join<'py>(&mut self, py: Python<'py>, fingerprint: &str) -> PyResult<Bound<'py, PyDict>> {
        let agreement = &mut self.agreement;
        let result = py.detach(|| agreement.request_join(fingerprint).cloned());
        self.adopted(py, result)
    }

    /// Before the current epoch's groups are built: say this process
    /// arrived, and wait (on the store, up to `within_s`) until every member
    /// has or the epoch broke. Returns `("all", [])`, `("broken", [])`, or
    /// `("missing", members)`: those that had not arrived when the time ran out.
    fn gather(&self, py: Python<'_>, within_s: f64) -> PyResult<(&'static str, Vec<MemberId>)> {
        let within = Duration::from_secs_f64(within_s.max(0.0));
        let agreement = &self.agreement;
        match py.detach(|| agreement.gather(within)).map_err(|e| membership_error(py, &e))? {
            Gathered::All => Ok(("all", Vec::new())),
            Gathered::Broken => Ok(("broken", Vec::new())),
            Gathered::Missing(missing) => Ok(("missing", missing)),
        }
    }

    /// The current epoch lost members: agree on the next roster with the
    /// survivors (`suspects`: members the failure named).
    fn recover<'py>(&mut self, py: Python<'py>, suspects: Vec<MemberId>) -> PyResult<Bound<'py, PyDict>> {
        let reach = self.tcp_reach();
        let (agreement, monitor) = (&mut self.agreement, &self.monitor);
        let result = py.detach(|| {
            let reach: &dyn Reach = match &reach {
                Some(tcp) => tcp,
                None => &(),
            };
            match monitor {
                Some(watch) => agreement.recover(&suspects, watch, reach),
                None => agreement.recover(&suspects, &(), reach),
            }
            .cloned()
        });
        self.adopted(py, result)
    }

    /// Admit the waiting joiners whose `fingerprint` matches (every member,
    /// at the same step boundary); returns the roster.
    fn admit<'py>(&mut self, py: Python<'py>, fingerprint: &str) -> PyResult<Bound<'py, PyDict>> {
        let agreement = &mut self.agreement;
        let result = py.detach(|| agreement.admit(fingerprint).cloned());
        self.adopted(py, result)
    }

    /// Every member after the same step failed with a desync right after a
    /// change of members: go on without `odd` (member ids); a process among
    /// them gets `MembershipError(kind="refused")` with `why`. Returns the roster.
    fn expel<'py>(&mut self, py: Python<'py>, odd: Vec<MemberId>, why: &str) -> PyResult<Bound<'py, PyDict>> {
        let agreement = &mut self.agreement;
        let result = py.detach(|| agreement.expel(&odd, why).cloned());
        self.adopted(py, result)
    }

    /// The training loop ended: processes waiting to join are told so.
    fn end(&self, py: Python<'_>) -> PyResult<()> {
        let agreement = &self.agreement;
        py.detach(|| agreement.end()).map_err(|e| membership_error(py, &e))
    }

    /// The roster this process belongs to (a dict).
    #[getter]
    fn roster<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        roster_dict(py, self.agreement.roster())
    }

    /// This process's member id.
    #[getter]
    fn me(&self) -> MemberId {
        self.agreement.me()
    }

    /// The highest epoch the monitor saw broken (`None`: none).
    #[getter]
    fn broken(&self) -> Option<u64> {
        self.monitor.as_ref().and_then(Monitor::broken)
    }

    /// Members whose heartbeats stopped.
    fn silent(&self, py: Python<'_>) -> Vec<MemberId> {
        let monitor = &self.monitor;
        py.detach(|| monitor.as_ref().map(Monitor::silent).unwrap_or_default())
    }

    /// Stop the liveness monitor and the probe listener (the process leaves
    /// the job: its peers find it silent, and nothing answers for it).
    fn close(&mut self, py: Python<'_>) {
        let (monitor, probe) = (self.monitor.take(), self.probe.take());
        py.detach(move || drop((monitor, probe)));
    }

    /// The members of the job's newest roster that no obituary names (read
    /// by a supervisor from the store of `client`).
    #[staticmethod]
    fn members_left(py: Python<'_>, table: usize, client: Py<PyAny>, prefix: &str) -> PyResult<Vec<MemberId>> {
        let store = job_store(py, table, &client)?;
        py.detach(|| Agreement::members_left(&store, prefix)).map_err(|e| membership_error(py, &e))
    }

    /// No member is left: processes waiting to join give up
    /// (`MembershipError(kind="no_members")` with `why`).
    #[staticmethod]
    fn give_up(py: Python<'_>, table: usize, client: Py<PyAny>, prefix: &str, why: &str) -> PyResult<()> {
        let store = job_store(py, table, &client)?;
        py.detach(|| Agreement::give_up(&store, prefix, why)).map_err(|e| membership_error(py, &e))
    }

    /// The supervisor reaped `member`: record it in the store of `client`
    /// (survivors then need not wait to see it silent).
    #[staticmethod]
    fn obituary(py: Python<'_>, table: usize, client: Py<PyAny>, prefix: &str, member: MemberId) -> PyResult<()> {
        let store = job_store(py, table, &client)?;
        py.detach(|| Agreement::obituary(&store, prefix, member)).map_err(|e| membership_error(py, &e))
    }
}
