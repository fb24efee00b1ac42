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
//! wheel; its output is cargo directives. Without `PYO3_PYTHON` (a plain
//! `cargo build`), without torch, or when the compiler fails, nothing is
//! built: `gradsync.torch` then runs its collectives through
//! `torch.distributed` and its hooks in Python, and says so (a warning, and
//! `DistributedDataParallel.path`). `GRADSYNC_REQUIRE_SHIM=1` turns those
//! warnings into build failures.

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
    println!("cargo:rerun-if-env-changed=GRADSYNC_REQUIRE_SHIM");
    let Ok(python) = env::var("PYO3_PYTHON") else { return };
    let required = env::var("GRADSYNC_REQUIRE_SHIM").is_ok_and(|v| v == "1");
    // build.py's standard output is this script's: cargo reads its directives.
    let status = Command::new(&python).arg(manifest.join("shim/build.py")).arg("--cargo").status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) if required => panic!("gradsync.torch's C++ modules were not built ({s}): see the warnings above"),
        Ok(_) => println!("cargo:warning=gradsync.torch will do without its C++ modules (see the warnings above)"),
        Err(e) if required => panic!("cannot run {python} python/shim/build.py: {e}"),
        Err(e) => println!("cargo:warning=gradsync.torch will do without its C++ modules: cannot run {python}: {e}"),
    }
}
