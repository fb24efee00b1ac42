//! What the binding knows about each registered parameter: its id in the
//! runtime, its element count and the element type of its gradient memory.

use gradsync_runtime::ParamId;
use pyo3::prelude::*;

use crate::memory::{Elem, Raw};

/// Every registered parameter, by the index the wrapper registered it at.
#[derive(Debug)]
pub struct Params {
    pub ids: Vec<ParamId>,
    pub numel: Vec<usize>,
    pub elem: Vec<Elem>,
    /// Whether gradients are handed over as tensors for the device plane
    /// (else their memory is read into host buckets).
    pub device_plane: bool,
}

impl Params {
    /// Parameter `param`'s gradient memory at `addr`, checked: the index in
    /// range, the address not null.
    pub fn raw(&self, param: usize, addr: usize) -> PyResult<Raw> {
        if param >= self.ids.len() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "parameter index {param} out of range: {} parameters are registered",
                self.ids.len()
            )));
        }
        if addr == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("null address"));
        }
        Ok(self.at(param, addr))
    }

    /// As [`Params::raw`], unchecked: for callers that registered `param`
    /// themselves (the shim's hooks).
    pub fn at(&self, param: usize, addr: usize) -> Raw {
        Raw { addr, numel: self.numel[param], elem: self.elem[param] }
    }
}
