//! Rust errors as the Python exceptions of `gradsync._errors`.
//!
//! The classes are defined in Python (so they can also derive from built-in
//! exceptions such as `TimeoutError`); this module picks the class for each
//! error, keeps the Rust message verbatim and sets the attributes that name
//! ranks and steps.

use gradsync_runtime::backend::{CollectiveTag, CommError};
use gradsync_runtime::{BuildError, Rejection, SyncError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::BoundObject;

/// Make an instance of `gradsync._errors.<class>` with `message` and `attrs`.
pub fn raise(py: Python<'_>, class: &str, message: String, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let built = (|| -> PyResult<PyErr> {
        let cls = py.import("gradsync._errors")?.getattr(class)?;
        let err = cls.call1((message.clone(),))?;
        for (name, value) in attrs {
            err.setattr(*name, value)?;
        }
        Ok(PyErr::from_value(err))
    })();
    // If the error classes cannot be loaded, say so rather than lose the message.
    built.unwrap_or_else(|e| {
        pyo3::exceptions::PyRuntimeError::new_err(format!("{message} (and gradsync._errors failed to load: {e})"))
    })
}

fn obj<'py>(py: Python<'py>, value: impl IntoPyObject<'py>) -> Py<PyAny> {
    value.into_pyobject(py).map(|b| b.into_any().unbind()).unwrap_or_else(|_| py.None())
}

/// A failed or refused step.
pub fn sync_error(py: Python<'_>, e: &SyncError) -> PyErr {
    let message = e.to_string();
    match e {
        SyncError::Comm(c) => comm_error(py, c, message),
        SyncError::Desync { step, ranks, groups, majority, .. } => raise(
            py,
            "DesyncError",
            message,
            &[
                ("step", obj(py, *step)),
                ("ranks", obj(py, ranks.clone())),
                ("groups", obj(py, groups.clone())),
                ("majority", obj(py, *majority)),
            ],
        ),
        SyncError::Poisoned { step, .. } => raise(py, "PoisonedError", message, &[("step", obj(py, *step))]),
        SyncError::NotCurrentStep { .. } | SyncError::FinishPending { .. } | SyncError::Undelivered { .. } => {
            raise(py, "StepOrderError", message, &[])
        }
        SyncError::Closed => raise(py, "ClosedError", message, &[]),
        SyncError::Setting { .. } => raise(py, "ConfigError", message, &[]),
        SyncError::Alloc(_) | SyncError::Unresponsive { .. } => raise(py, "StepFailedError", message, &[]),
    }
}

fn tag_attrs(py: Python<'_>, tag: &CollectiveTag) -> [(&'static str, Py<PyAny>); 2] {
    [("step", obj(py, tag.step)), ("collective", obj(py, tag.to_string()))]
}

fn comm_error(py: Python<'_>, e: &CommError, message: String) -> PyErr {
    match e {
        CommError::Timeout { tag, missing, waited, .. } => {
            let [step, collective] = tag_attrs(py, tag);
            let attrs = [
                step,
                collective,
                ("missing_ranks", obj(py, missing.clone())),
                ("waited_s", obj(py, waited.as_secs_f64())),
            ];
            raise(py, "TimeoutError", message, &attrs)
        }
        CommError::PeerGone { tag, peer, .. } => {
            let [step, collective] = tag_attrs(py, tag);
            raise(py, "PeerGoneError", message, &[step, collective, ("peer", obj(py, *peer))])
        }
        CommError::Desync { tag, peer, .. } => {
            let [step, collective] = tag_attrs(py, tag);
            let attrs = [step, collective, ("ranks", obj(py, vec![*peer])), ("majority", obj(py, false))];
            raise(py, "DesyncError", message, &attrs)
        }
        CommError::Protocol { tag, .. }
        | CommError::Device { tag, .. }
        | CommError::Backend { tag, .. }
        | CommError::Panicked { tag, .. }
        | CommError::Cancelled { tag, .. } => raise(py, "CommunicationError", message, &tag_attrs(py, tag)),
    }
}

/// A registration or setting the runtime refuses.
pub fn build_error(py: Python<'_>, e: &BuildError) -> PyErr {
    raise(py, "ConfigError", e.to_string(), &[])
}

/// An arrival the hook refused.
pub fn rejection(py: Python<'_>, e: &Rejection) -> PyErr {
    if matches!(e, Rejection::Closed) {
        return raise(py, "ClosedError", e.to_string(), &[]);
    }
    raise(py, "RejectedError", e.to_string(), &[("reason", obj(py, e.label()))])
}

/// A dictionary from `(key, value)` pairs, for reports.
pub fn dict<'py>(py: Python<'py>, items: Vec<(&str, Py<PyAny>)>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in items {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Shorthand for building attribute and dictionary values.
pub fn value<'py>(py: Python<'py>, v: impl IntoPyObject<'py>) -> Py<PyAny> {
    obj(py, v)
}
