//! Builds gradsync's C++ modules against torch, when the package is built for
//! an interpreter that has torch:
//!
//! * `gradsync/torch/_collectives` (shim/collectives.cpp), the native path
//!   from gradsync's communicator thread to torch's collective engines, and
//!   the device plane's bucket operations;
//! * `gradsync/torch/_arrivals` (shim/arrivals.cpp), the gradient hooks that
//!   hand gradients to the runtime without Python.
//!
//! maturin (what `pip install ./python` runs) names the interpreter in
//! `PYO3_PYTHON`. This script runs `shim/build.py --cargo` under it: the one
//! compile recipe, also used where there is no Rust toolchain (the GPU
//! machine). It asks the interpreter's torch for headers and libraries,
//! compiles each module with the system C++ compiler (`CXX`, else `c++`) and
//! writes it, with `_<name>_built.py` naming the torch version it was built
//! against, next to the Python sources, where maturin packs them into the
//! wheel; its output is cargo directives.
//!
//! They are gradsync.torch's hook and collectives (as DDP's reducer is C++,
//! there is no Python path to fall back on): when the interpreter has torch
//! and the compiler fails, the build fails. Without `PYO3_PYTHON` (a plain
//! `cargo build`) or without torch (a Paddle-only install), nothing is built
//! and the build goes on with a warning; `gradsync.torch` then refuses to
//! wrap a model with a `ConfigError` that says how to reinstall.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    // Every source and header of the shim (a folder is watched whole).
    println!("cargo:rerun-if-changed={}", manifest.join("shim").display());
    // The outputs' folder: missing outputs (a fresh work tree over an old
    // target/) bring the script back; build.py leaves fresh modules alone.
    println!("cargo:rerun-if-changed={}", manifest.join("gradsync/torch").display());
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=CXX");
    let Ok(python) = env::var("PYO3_PYTHON") else { return };
    // build.py's standard output is this script's: cargo reads its directives.
    let status = Command::new(&python).arg(manifest.join("shim/build.py")).arg("--cargo").status();
    match status {
        Ok(s) if s.success() => {}
        // Exit status 2: this interpreter has no usable torch (a Paddle-only install).
        Ok(s) if s.code() == Some(2) => {
            println!("cargo:warning=no torch in {python}: gradsync.torch is not built (gradsync.paddle is)")
        }
        Ok(s) => panic!(
            "gradsync.torch's C++ modules failed to compile ({s}): see the errors above. They are its hook and \
             collectives; fix the compiler (CXX) or the torch installation and build again"
        ),
        Err(e) => panic!("cannot run {python} python/shim/build.py: {e}"),
    }
}
