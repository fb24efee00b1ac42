//! The settings Python passes by name, parsed into the runtime's types. An
//! unknown name is a `ConfigError` that lists the known ones: never a silent
//! fallback to a default.

use gradsync_runtime::{AbortPolicy, AbortReason, Divisor, Wire};
use pyo3::prelude::*;

use crate::errors;

fn config_error(py: Python<'_>, why: String) -> PyErr {
    errors::raise::<errors::ConfigError>(py, why, &[])
}

/// `"skip"` or `"partial"`.
pub fn policy(py: Python<'_>, name: &str) -> PyResult<AbortPolicy> {
    match name {
        "skip" => Ok(AbortPolicy::Skip),
        "partial" => Ok(AbortPolicy::Partial),
        other => Err(config_error(py, format!("abort_policy {other:?}: use \"skip\" or \"partial\""))),
    }
}

/// `"contributors"` (the average over the ranks that contributed),
/// `"world"` (joined ranks count), `"sum"`, or a positive integer.
pub fn divisor(py: Python<'_>, divisor: &Bound<'_, PyAny>) -> PyResult<Divisor> {
    if let Ok(n) = divisor.extract::<u32>() {
        if n == 0 {
            return Err(config_error(py, "divisor 0: division by zero".into()));
        }
        return Ok(Divisor::Fixed(n));
    }
    let name: String = divisor.extract().map_err(|_| {
        config_error(py, format!("divisor {divisor}: use \"contributors\", \"world\", \"sum\" or a positive integer"))
    })?;
    match name.as_str() {
        "contributors" => Ok(Divisor::Contributors),
        "world" => Ok(Divisor::World),
        "sum" => Ok(Divisor::Sum),
        other => Err(config_error(
            py,
            format!(
                "divisor {other:?}: use \"contributors\" (average over the ranks that contributed), \"world\" \
                 (ranks that joined count too), \"sum\" or a positive integer"
            ),
        )),
    }
}

/// `"out_of_memory"` (or `"oom"`), `"bad_batch"`, `"non_finite"`, or an
/// integer code of the caller's own.
pub fn abort_reason(py: Python<'_>, reason: &Bound<'_, PyAny>) -> PyResult<AbortReason> {
    if let Ok(code) = reason.extract::<u32>() {
        return Ok(AbortReason::Other(code));
    }
    let name: String = reason
        .extract()
        .map_err(|_| config_error(py, format!("abort reason {reason}: use a name or a non-negative integer code")))?;
    match name.as_str() {
        "out_of_memory" | "oom" => Ok(AbortReason::OutOfMemory),
        "bad_batch" => Ok(AbortReason::BadBatch),
        "non_finite" => Ok(AbortReason::NonFinite),
        other => Err(config_error(
            py,
            format!(
                "abort reason {other:?}: use \"out_of_memory\", \"bad_batch\", \"non_finite\" or an integer code \
                 of your own"
            ),
        )),
    }
}

/// `"float32"`, `"bfloat16"` or `"float16"`.
pub fn wire(py: Python<'_>, name: &str) -> PyResult<Wire> {
    Wire::parse(name)
        .ok_or_else(|| config_error(py, format!("wire_dtype {name:?}: use \"float32\", \"bfloat16\" or \"float16\"")))
}
