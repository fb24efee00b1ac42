//! [`PieceServer`] and [`PieceReader`]: the runtime's piece reads
//! (`gradsync_runtime::pieces`) as a parameter-sharded wrapper drives them,
//! so one rank reads the whole model alone.
//!
//! ```text
//! every rank:  PieceServer(host).register([(param, offset, address, bytes, tag)…])   its pieces' host memory
//!              .writing() … optimizer.step() … .written(steps)                       the step gate
//! the reader:  PieceReader([address or None per rank]).read(steps, params, tagged, timeout_s)
//!              ─▶ [(rank, param, offset, tag, bytes)…] from every other rank's server (interpreter released)
//! ```

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use gradsync_runtime::pieces::{self, PieceAt, PieceReadError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors;

/// A read error as the `gradsync._errors` class a caller acts on: a rank
/// gone or silent is `PeerGoneError` (with `.ranks`); ranks out of step
/// (with `.ahead`, the rank ahead of the reader), or a server closed, a
/// `ConfigError`.
fn read_error(py: Python<'_>, e: PieceReadError) -> PyErr {
    match &e {
        PieceReadError::Connect { rank, .. } | PieceReadError::Io { rank, .. } => {
            let ranks = vec![*rank].into_pyobject(py).expect("a list").into_any().unbind();
            errors::raise::<errors::PeerGoneError>(py, e.to_string(), &[("ranks", ranks)])
        }
        PieceReadError::Ahead { rank, .. } => {
            let ahead = rank.into_pyobject(py).expect("an int").into_any().unbind();
            errors::raise::<errors::ConfigError>(py, e.to_string(), &[("ahead", ahead)])
        }
        _ => errors::raise::<errors::ConfigError>(py, e.to_string(), &[]),
    }
}

/// One rank's server of its pieces (see the module docs). The caller keeps
/// every registered piece's tensor alive until it registers others or closes.
#[pyclass(module = "gradsync._native")]
pub struct PieceServer {
    /// `None` once closed.
    server: Option<pieces::PieceServer>,
}

impl PieceServer {
    fn server(&self, py: Python<'_>) -> PyResult<&pieces::PieceServer> {
        self.server
            .as_ref()
            .ok_or_else(|| errors::raise::<errors::ClosedError>(py, "this piece server is closed".into(), &[]))
    }
}

#[pymethods]
impl PieceServer {
    /// A server listening on `host` (an IP address; an ephemeral port),
    /// serving nothing yet, at step 0.
    #[new]
    fn new(py: Python<'_>, host: &str) -> PyResult<PieceServer> {
        let ip: IpAddr = host.parse().map_err(|e| {
            errors::raise::<errors::ConfigError>(
                py,
                format!("piece server host {host:?}: {e}; give an IP address"),
                &[],
            )
        })?;
        let server = pieces::PieceServer::bind(ip).map_err(|e| {
            errors::raise::<errors::ConfigError>(py, format!("the piece server could not listen on {ip}: {e}"), &[])
        })?;
        Ok(PieceServer { server: Some(server) })
    }

    /// `host:port`, where readers reach it.
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.server(py)?.addr().to_string())
    }

    /// Serve these pieces from now on: `(parameter index, offset in its
    /// flat values, host address, byte length, tag)` each (the tag empty
    /// for the parameter's values, else the state it is). Their memory must
    /// stay allocated until the next call or :meth:`close`, and be written
    /// only between :meth:`writing` and :meth:`written`.
    fn register(&self, py: Python<'_>, pieces: Vec<(u32, u64, usize, usize, String)>) -> PyResult<()> {
        let pieces =
            pieces.into_iter().map(|(param, offset, addr, bytes, tag)| PieceAt { param, offset, addr, bytes, tag });
        // SAFETY: the documented contract of this method, which the wrapper
        // keeps (sharding.pieces: the piece tensors are held with the
        // registration, and every write of them is inside the step gate).
        unsafe { self.server(py)?.register(pieces.collect()) };
        Ok(())
    }

    /// The pieces are about to be written: returns once no copy of them runs.
    fn writing(&self, py: Python<'_>) -> PyResult<()> {
        let server = self.server(py)?;
        py.detach(|| server.writing());
        Ok(())
    }

    /// They were written and are at step `steps` (optimizer steps taken).
    fn written(&self, py: Python<'_>, steps: u64) -> PyResult<()> {
        self.server(py)?.written(steps);
        Ok(())
    }

    /// Stop serving (reads waiting are told so). Idempotent.
    fn close(&mut self, py: Python<'_>) {
        if let Some(mut server) = self.server.take() {
            py.detach(move || server.close());
        }
    }
}

/// One piece read, as Python gets it: `(rank, parameter, offset, tag, bytes)`.
type Read<'py> = (usize, u32, u64, String, Bound<'py, PyBytes>);

/// One rank's reader of the other ranks' pieces (see the module docs).
#[pyclass(module = "gradsync._native")]
pub struct PieceReader {
    reader: pieces::PieceReader,
}

#[pymethods]
impl PieceReader {
    /// A reader of `servers`: per rank its server's `host:port`, or `None`
    /// for the reader's own rank.
    #[new]
    fn new(py: Python<'_>, servers: Vec<Option<String>>) -> PyResult<PieceReader> {
        let servers = servers
            .into_iter()
            .map(|s| {
                s.map(|text| {
                    text.parse::<SocketAddr>().map_err(|e| {
                        errors::raise::<errors::ConfigError>(py, format!("piece server address {text:?}: {e}"), &[])
                    })
                })
                .transpose()
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PieceReader { reader: pieces::PieceReader::new(servers) })
    }

    /// Every other rank's pieces of `params` at step `steps` (`tagged`:
    /// their tagged pieces, else their values): `(rank, parameter, offset,
    /// tag, bytes)` each; each server may take `timeout_s`.
    fn read<'py>(
        &mut self,
        py: Python<'py>,
        steps: u64,
        params: Vec<u32>,
        tagged: bool,
        timeout_s: f64,
    ) -> PyResult<Vec<Read<'py>>> {
        let deadline = Duration::from_secs_f64(timeout_s.max(0.001));
        let reader = &mut self.reader;
        let read = py.detach(|| reader.read(steps, &params, tagged, deadline)).map_err(|e| read_error(py, e))?;
        Ok(read.into_iter().map(|p| (p.rank, p.param, p.offset, p.tag, PyBytes::new(py, &p.bytes))).collect())
    }
}
