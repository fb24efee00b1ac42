//! Builds gradsync's C++ modules against torch, when the package is built for
//! an interpreter that has torch:
//!
//! * `gradsync/torch/_collectives` (shim/collectives.cpp), the native path
//!   from gradsync's communicator thread to torch's gloo engine;
//! * `gradsync/torch/_arrivals` (shim/arrivals.cpp), the gradient hooks that
//!   hand gradients to the runtime without Python.
//!
//! maturin (what `pip install ./python` runs) names the interpreter in
//! `PYO3_PYTHON`. The script asks that interpreter where torch's headers and
//! libraries are, compiles each module with the system C++ compiler (`CXX`,
//! else `c++`) and writes it, with `_<name>_built.py` naming the torch version
//! it was built against, next to the Python sources, where maturin packs them
//! into the wheel. Without `PYO3_PYTHON` (a plain `cargo build`), without torch,
//! or when the compiler fails, nothing is built: `gradsync.torch` then runs its
//! collectives through `torch.distributed` and its hooks in Python, and says
//! so (a warning, and `DistributedDataParallel.path`).
//! `GRADSYNC_REQUIRE_SHIM=1` turns those warnings into build failures.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Printed by the interpreter: one fact per line.
const PROBE: &str = r#"
import sysconfig, torch, torch.utils.cpp_extension as ext
print(torch.__version__)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(sysconfig.get_paths()["include"])
print(sysconfig.get_config_var("EXT_SUFFIX"))
print(ext.library_paths()[0])
print(torch.version.__file__)
for p in ext.include_paths():
    print(p)
"#;

/// What the build needs to know about the interpreter's torch.
struct Torch {
    version: String,
    cxx11_abi: String,
    python_include: String,
    ext_suffix: String,
    lib_dir: String,
    version_file: String,
    includes: Vec<String>,
}

/// The C++ modules, by name: `shim/<name>.cpp` becomes `gradsync/torch/_<name>`.
const MODULES: [&str; 2] = ["collectives", "arrivals"];

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = manifest.join("gradsync/torch");
    for name in MODULES {
        println!("cargo:rerun-if-changed={}", manifest.join(format!("shim/{name}.cpp")).display());
    }
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=GRADSYNC_REQUIRE_SHIM");
    // The outputs' folder: missing outputs (a fresh work tree over an old
    // target/) bring the script back; `up_to_date` keeps it from recompiling.
    println!("cargo:rerun-if-changed={}", out_dir.display());
    let stamps = MODULES.map(|name| out_dir.join(format!("_{name}_built.py")));
    let Ok(python) = env::var("PYO3_PYTHON") else { return };
    let torch = match probe(&python) {
        Ok(torch) => torch,
        Err(why) => {
            let why = format!("{python} has no usable torch ({why})");
            return MODULES.iter().zip(&stamps).for_each(|(name, stamp)| skip(name, stamp, &why));
        }
    };
    println!("cargo:rerun-if-changed={}", torch.version_file);
    for (name, stamp) in MODULES.iter().zip(&stamps) {
        let source = manifest.join(format!("shim/{name}.cpp"));
        let target = out_dir.join(format!("_{name}{}", torch.ext_suffix));
        let text = format!(
            "# Written by python/build.rs: the torch _{name}{} was compiled against.\nTORCH_VERSION = {:?}\n",
            torch.ext_suffix, torch.version
        );
        if up_to_date(&source, &target, stamp, &text) {
            continue;
        }
        match compile(&source, &target, &torch) {
            Ok(()) => std::fs::write(stamp, text).expect("write the build stamp"),
            Err(why) => skip(name, stamp, &why),
        }
    }
}

/// The shim exists, is newer than its source and was built against this torch.
fn up_to_date(source: &Path, target: &Path, stamp: &Path, text: &str) -> bool {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let fresh = matches!((modified(source), modified(target)), (Some(s), Some(t)) if t >= s);
    fresh && std::fs::read_to_string(stamp).is_ok_and(|s| s == text)
}

/// Say why the shim is not built (or fail, when it is required), and remove
/// a stamp from an earlier build so no stale shim is loaded.
fn skip(name: &str, stamp: &Path, why: &str) {
    let _ = std::fs::remove_file(stamp);
    if env::var("GRADSYNC_REQUIRE_SHIM").is_ok_and(|v| v == "1") {
        panic!("gradsync.torch's C++ module _{name} was not built: {why}");
    }
    println!("cargo:warning=gradsync.torch will do without its C++ module _{name}: {why}");
}

fn probe(python: &str) -> Result<Torch, String> {
    let out = Command::new(python).args(["-c", PROBE]).output().map_err(|e| format!("cannot run it: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("import torch failed").to_string());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines().map(str::to_string);
    let mut next = || lines.next().ok_or_else(|| "torch's answer was cut short".to_string());
    Ok(Torch {
        version: next()?,
        cxx11_abi: next()?,
        python_include: next()?,
        ext_suffix: next()?,
        lib_dir: next()?,
        version_file: next()?,
        includes: lines.collect(),
    })
}

fn compile(source: &Path, target: &Path, torch: &Torch) -> Result<(), String> {
    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut cmd = Command::new(&cxx);
    // gradsync's own code compiles with every common warning as an error, as
    // its Rust is held to `-D warnings`. torch's and Python's headers come in
    // as system headers (`-isystem`): the compiler does not warn about code
    // that is not ours (torch's headers trip -Wunused-parameter and
    // -Wmissing-field-initializers by the hundred), and a warning in a
    // template of theirs instantiated by our code is still reported.
    cmd.args(["-O2", "-shared", "-fPIC", "-std=c++20", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-D_GLIBCXX_USE_CXX11_ABI={}", torch.cxx11_abi))
        .arg("-isystem")
        .arg(&torch.python_include);
    for include in &torch.includes {
        cmd.arg("-isystem").arg(include);
    }
    // torch's libraries are loaded by `import torch` before the shim; the
    // rpath finds them when the shim is loaded first.
    cmd.arg(source)
        .arg(format!("-L{}", torch.lib_dir))
        .arg(format!("-Wl,-rpath,{}", torch.lib_dir))
        .args(["-ltorch_python", "-ltorch_cpu", "-lc10", "-o"])
        .arg(target);
    let out = cmd.output().map_err(|e| format!("cannot run the C++ compiler {cxx:?}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = err.lines().filter(|l| l.contains("error")).take(5).collect();
    Err(format!("{cxx} failed to compile {}: {}", source.display(), tail.join(" | ")))
}
