"""Compiles gradsync's C++ modules (``shim/<name>.cpp`` and its parts) against the torch of
the interpreter that runs this script, into ``gradsync/torch/_<name><suffix>``
with ``_<name>_built.py`` naming that torch's version.

The one recipe for both ways a package is made:

* ``pip install ./python``: maturin runs python/build.rs, which runs this
  script with ``--cargo`` under the interpreter it builds for (its output is
  then cargo's directives: what to watch, warnings);
* a machine with torch and a C++ compiler but no Rust toolchain (the GPU
  machine; scripts/gpu/install): ``python shim/build.py [--out DIR]``.

A module that is newer than its sources and stamped with this torch's version
is left alone. Modules compile in parallel. Exit status 1 and the compiler's
errors on stderr (``--cargo``: as cargo warnings) if a module fails; 2 if this
interpreter has no usable torch.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

#: Each module's sources: ``_collectives`` is split by concern (host
#: collectives, the device plane, the membership store; collectives.cpp holds
#: the function table and the Python classes).
MODULES = {
    "collectives": ("collectives.cpp", "gloo.cpp", "plane.cpp", "store.cpp"),
    "arrivals": ("arrivals.cpp",),
}
HERE = Path(__file__).resolve().parent
# Headers the modules include besides torch's.
HEADERS = ("given.h", "shim.h")


def compile_command(source, obj, werror=True):
    """The compiler command line for ``source`` -> the object file ``obj``."""
    import torch
    import torch.utils.cpp_extension as ext

    cxx = os.environ.get("CXX", "c++")
    # gradsync's own code compiles with every common warning as an error, as
    # its Rust is held to `-D warnings`. torch's and Python's headers come in
    # as system headers (`-isystem`): the compiler does not warn about code
    # that is not ours (torch's headers trip -Wunused-parameter and
    # -Wmissing-field-initializers by the hundred), and a warning in a
    # template of theirs instantiated by our code is still reported.
    cmd = [cxx, "-O2", "-c", "-fPIC", "-std=c++20", "-fvisibility=hidden", "-Wall", "-Wextra"]
    if werror:
        cmd.append("-Werror")
    cmd.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    for include in [sysconfig.get_paths()["include"], *ext.include_paths()]:
        cmd += ["-isystem", include]
    return [*cmd, str(source), "-o", str(obj)]


def link_command(objects, target):
    """The linker command line for ``objects`` -> the module ``target``."""
    import torch.utils.cpp_extension as ext

    lib = ext.library_paths()[0]
    # torch's libraries are loaded by `import torch` before the shim; the
    # rpath finds them when the shim is loaded first.
    return [os.environ.get("CXX", "c++"), "-shared", *map(str, objects), f"-L{lib}", f"-Wl,-rpath,{lib}",
            "-ltorch_python", "-ltorch_cpu", "-lc10", "-o", str(target)]


def stamp_text(name):
    """What ``_<name>_built.py`` says of a module built against this torch."""
    import torch

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return (
        f"# Written by python/shim/build.py: the torch _{name}{suffix} was compiled against.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
    )


def paths(name, out):
    """``(sources, target, stamp)`` of module ``name`` built into ``out``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return [HERE / s for s in MODULES[name]], out / f"_{name}{suffix}", out / f"_{name}_built.py"


def up_to_date(name, out):
    """The module exists, is newer than its sources and was built against this torch."""
    sources, target, stamp = paths(name, out)
    if not target.exists() or not stamp.exists() or stamp.read_text() != stamp_text(name):
        return False
    newest = max(p.stat().st_mtime for p in [*sources, *(HERE / h for h in HEADERS)])
    return target.stat().st_mtime >= newest


def run(cmd):
    """Run a compiler command; its error text, or None."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return done.stderr or f"the compiler exited with status {done.returncode}"
    return None


def build(name, out, pool, werror=True):
    """Compile module ``name`` into ``out``, its sources in parallel on
    ``pool``; returns the error text, or None."""
    sources, target, stamp = paths(name, out)
    stamp.unlink(missing_ok=True)  # no stale stamp names a module that failed
    with tempfile.TemporaryDirectory(prefix=f"gradsync-{name}-") as tmp:
        objects = [Path(tmp) / f"{s.stem}.o" for s in sources]
        errors = [e for e in pool.map(lambda so: run(compile_command(*so, werror)), zip(sources, objects)) if e]
        if errors:
            return "\n".join(errors)
        error = run(link_command(objects, target))
    if error:
        return error
    stamp.write_text(stamp_text(name))
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "gradsync" / "torch", help="the package's torch folder")
    parser.add_argument("--cargo", action="store_true", help="speak to cargo (run by python/build.rs)")
    parser.add_argument("--warnings-allowed", action="store_true",
                        help="compile without -Werror (a compiler newer than the project's may warn)")
    parser.add_argument("names", nargs="*", default=list(MODULES), help=f"modules to build (default: {list(MODULES)})")
    args = parser.parse_args()

    def say(text):
        if args.cargo:
            for line in text.splitlines():
                print(f"cargo:warning={line}")
        else:
            print(text, file=sys.stderr)

    try:
        import torch
    except Exception as e:  # any import failure means: nothing to build against
        say(f"gradsync: {sys.executable} has no usable torch ({type(e).__name__}: {e})")
        sys.exit(2)
    if args.cargo:
        print(f"cargo:rerun-if-changed={Path(torch.__file__).with_name('version.py')}")
    todo = [n for n in args.names if not up_to_date(n, args.out)]
    # Every source of every module compiles at once (one compiler per core).
    sources = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
    with sources, concurrent.futures.ThreadPoolExecutor(max(len(todo), 1)) as modules:
        errors = dict(zip(todo, modules.map(lambda n: build(n, args.out, sources, not args.warnings_allowed), todo)))
    failed = {n: e for n, e in errors.items() if e is not None}
    for name, err in failed.items():
        lines = [line for line in err.splitlines() if "error" in line][:5] if args.cargo else [err]
        say(f"gradsync: C++ module _{name} failed to compile: " + "\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
