"""Compiles gradsync's C++ modules (``shim/<name>.cpp``) against the torch of
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
from pathlib import Path

MODULES = ("collectives", "arrivals")
HERE = Path(__file__).resolve().parent
# Headers the modules include besides torch's.
HEADERS = ("given.h",)


def command(source, target, werror=True):
    """The compiler command line for ``source`` -> ``target``."""
    import torch
    import torch.utils.cpp_extension as ext

    cxx = os.environ.get("CXX", "c++")
    # gradsync's own code compiles with every common warning as an error, as
    # its Rust is held to `-D warnings`. torch's and Python's headers come in
    # as system headers (`-isystem`): the compiler does not warn about code
    # that is not ours (torch's headers trip -Wunused-parameter and
    # -Wmissing-field-initializers by the hundred), and a warning in a
    # template of theirs instantiated by our code is still reported.
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++20", "-fvisibility=hidden", "-Wall", "-Wextra"]
    if werror:
        cmd.append("-Werror")
    cmd.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    for include in [sysconfig.get_paths()["include"], *ext.include_paths()]:
        cmd += ["-isystem", include]
    lib = ext.library_paths()[0]
    # torch's libraries are loaded by `import torch` before the shim; the
    # rpath finds them when the shim is loaded first.
    cmd += [str(source), f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_python", "-ltorch_cpu", "-lc10", "-o", str(target)]
    return cmd


def stamp_text(name):
    """What ``_<name>_built.py`` says of a module built against this torch."""
    import torch

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return (
        f"# Written by python/shim/build.py: the torch _{name}{suffix} was compiled against.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
    )


def paths(name, out):
    """``(source, target, stamp)`` of module ``name`` built into ``out``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return HERE / f"{name}.cpp", out / f"_{name}{suffix}", out / f"_{name}_built.py"


def up_to_date(name, out):
    """The module exists, is newer than its sources and was built against this torch."""
    source, target, stamp = paths(name, out)
    if not target.exists() or not stamp.exists() or stamp.read_text() != stamp_text(name):
        return False
    newest = max(p.stat().st_mtime for p in [source, *(HERE / h for h in HEADERS)])
    return target.stat().st_mtime >= newest


def build(name, out, werror=True):
    """Compile module ``name`` into ``out``; returns the error text, or None."""
    source, target, stamp = paths(name, out)
    stamp.unlink(missing_ok=True)  # no stale stamp names a module that failed
    done = subprocess.run(command(source, target, werror), capture_output=True, text=True)
    if done.returncode != 0:
        return done.stderr or f"the compiler exited with status {done.returncode}"
    stamp.write_text(stamp_text(name))
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "gradsync" / "torch", help="the package's torch folder")
    parser.add_argument("--cargo", action="store_true", help="speak to cargo (run by python/build.rs)")
    parser.add_argument("--warnings-allowed", action="store_true",
                        help="compile without -Werror (a compiler newer than the project's may warn)")
    parser.add_argument("names", nargs="*", default=list(MODULES), help=f"modules to build (default: {MODULES})")
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
    with concurrent.futures.ThreadPoolExecutor(max(len(todo), 1)) as pool:
        errors = dict(zip(todo, pool.map(lambda n: build(n, args.out, not args.warnings_allowed), todo)))
    failed = {n: e for n, e in errors.items() if e is not None}
    for name, err in failed.items():
        lines = [line for line in err.splitlines() if "error" in line][:5] if args.cargo else [err]
        say(f"gradsync: C++ module _{name} failed to compile: " + "\n".join(lines))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
