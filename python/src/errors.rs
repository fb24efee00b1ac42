//! Rust errors as the Python exceptions of `gradsync._errors`.
//!
//! The classes are defined in Python (so they can also derive from built-in
//! exceptions such as `TimeoutError`, and carry their docs there); each one
//! the runtime raises is a Rust type here (`import_exception!`: imported
//! once, checked by the compiler at every use). This module picks the class
//! for each error, keeps the Rust message verbatim and sets the attributes
//! that name ranks and steps.

use gradsync_runtime::backend::{CollectiveTag, CommError};
use gradsync_runtime::{BuildError, Rejection, SyncError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::{BoundObject, PyTypeInfo};

pyo3::import_exception!(gradsync._errors, ConfigError);
pyo3::import_exception!(gradsync._errors, RejectedError);
pyo3::import_exception!(gradsync._errors, StepOrderError);
pyo3::import_exception!(gradsync._errors, ClosedError);
pyo3::import_exception!(gradsync._errors, MembershipError);
pyo3::import_exception!(gradsync._errors, StepFailedError);
pyo3::import_exception!(gradsync._errors, TimeoutError);
pyo3::import_exception!(gradsync._errors, PeerGoneError);
pyo3::import_exception!(gradsync._errors, DesyncError);
pyo3::import_exception!(gradsync._errors, CommunicationError);
pyo3::import_exception!(gradsync._errors, PoisonedError);

/// An instance of the `gradsync._errors` class `E` with `message` and `attrs`.
pub fn raise<E: PyTypeInfo>(py: Python<'_>, message: String, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let built = (|| -> PyResult<PyErr> {
        let err = E::type_object(py).call1((message.clone(),))?;
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
        SyncError::Desync { step, ranks, groups, majority, .. } => raise::<DesyncError>(
            py,
            message,
            &[
                ("step", obj(py, *step)),
                ("ranks", obj(py, ranks.clone())),
                ("groups", obj(py, groups.clone())),
                ("majority", obj(py, *majority)),
            ],
        ),
        SyncError::Poisoned { step, .. } => raise::<PoisonedError>(py, message, &[("step", obj(py, *step))]),
        SyncError::NotCurrentStep { .. } | SyncError::FinishPending { .. } | SyncError::Undelivered { .. } => {
            raise::<StepOrderError>(py, message, &[])
        }
        SyncError::Closed => raise::<ClosedError>(py, message, &[]),
        SyncError::Setting { .. } => raise::<ConfigError>(py, message, &[]),
        SyncError::Alloc(_) | SyncError::Unresponsive { .. } => raise::<StepFailedError>(py, message, &[]),
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
            raise::<TimeoutError>(py, message, &attrs)
        }
        CommError::PeerGone { tag, peer, .. } => {
            let [step, collective] = tag_attrs(py, tag);
            raise::<PeerGoneError>(py, message, &[step, collective, ("peer", obj(py, *peer))])
        }
        CommError::Desync { tag, peer, .. } => {
            let [step, collective] = tag_attrs(py, tag);
            let attrs = [step, collective, ("ranks", obj(py, vec![*peer])), ("majority", obj(py, false))];
            raise::<DesyncError>(py, message, &attrs)
        }
        CommError::Protocol { tag, .. }
        | CommError::Device { tag, .. }
        | CommError::Backend { tag, .. }
        | CommError::Panicked { tag, .. }
        | CommError::Cancelled { tag, .. } => raise::<CommunicationError>(py, message, &tag_attrs(py, tag)),
    }
}

/// A registration or setting the runtime refuses.
pub fn build_error(py: Python<'_>, e: &BuildError) -> PyErr {
    raise::<ConfigError>(py, e.to_string(), &[])
}

/// An arrival the hook refused.
pub fn rejection(py: Python<'_>, e: &Rejection) -> PyErr {
    if matches!(e, Rejection::Closed) {
        return raise::<ClosedError>(py, e.to_string(), &[]);
    }
    raise::<RejectedError>(py, e.to_string(), &[("reason", obj(py, e.label()))])
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
