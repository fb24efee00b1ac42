//! Prometheus metrics, opt-in.
//!
//! gradsync always *emits* through the `metrics` facade (a no-op until a
//! recorder exists) and never installs a global recorder on its own. Either
//! call [`install_prometheus`] to serve `/metrics` over HTTP (loopback by
//! default), or install your own recorder, set [`SECONDS_BUCKETS`] as the
//! histogram boundaries of the `*_seconds` series, and call [`describe`] so
//! every series has its help text. Install before building GradSync instances
//! so the plan gauges are recorded too.

use std::net::SocketAddr;

use metrics::{describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub use gradsync_actors::telemetry::{names, MetricDef, MetricKind, METRICS, SECONDS_BUCKETS};

/// The Prometheus endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The listener address is not a loopback address and `allow_remote` was not set.
    #[error("refusing to serve metrics on {addr}: not a loopback address; pass allow_remote = true to expose it")]
    NotLoopback {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// The exporter failed (address in use, a recorder already installed).
    #[error("could not start the Prometheus exporter: {0}; is another recorder installed or the port in use?")]
    Exporter(String),
}

/// Help text and units of every gradsync series ([`METRICS`]), for the installed recorder.
pub fn describe() {
    for m in METRICS {
        match m.kind {
            MetricKind::Counter => describe_counter!(m.name, m.unit, m.help),
            MetricKind::Gauge => describe_gauge!(m.name, m.unit, m.help),
            MetricKind::Histogram => describe_histogram!(m.name, m.unit, m.help),
        }
    }
}

/// The README's metrics table, rendered from [`METRICS`] (a test keeps the
/// README equal to it).
pub fn markdown_table() -> String {
    let mut out = String::from("| metric | type | labels (besides `rank`) | meaning |\n|---|---|---|---|\n");
    for m in METRICS {
        out += &format!("| `{}` | {} | {} | {} |\n", m.name, m.kind.label(), m.labels, m.help);
    }
    out
}

/// Install a Prometheus recorder as the process's global recorder and serve
/// it at `http://addr/metrics`. Only loopback addresses unless `allow_remote`.
/// Returns the handle (its `render()` gives the same text as the endpoint).
pub fn install_prometheus(addr: SocketAddr, allow_remote: bool) -> Result<PrometheusHandle, MetricsError> {
    if !allow_remote && !addr.ip().is_loopback() {
        return Err(MetricsError::NotLoopback { addr });
    }
    let err = |e: metrics_exporter_prometheus::BuildError| MetricsError::Exporter(e.to_string());
    let builder = PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .map_err(err)?;
    // The exporter binds its listener while being built, inside a runtime;
    // that runtime then serves HTTP on its own thread.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| MetricsError::Exporter(e.to_string()))?;
    let (recorder, exporter) = {
        let _inside = rt.enter();
        builder.build().map_err(err)?
    };
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| MetricsError::Exporter(e.to_string()))?;
    std::thread::Builder::new()
        .name("gradsync-metrics".into())
        .spawn(move || {
            if let Err(e) = rt.block_on(exporter) {
                tracing::error!(error = ?e, "gradsync metrics endpoint stopped");
            }
        })
        .map_err(|e| MetricsError::Exporter(e.to_string()))?;
    describe();
    Ok(handle)
}
