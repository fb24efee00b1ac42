"""Fixtures: persistent worlds of 2 and 3 ranks, fresh worlds for fault
cases, and the side-by-side table against real DDP that the suite writes."""

import json
import os
import pathlib

import pytest

from world import World

REPO = pathlib.Path(__file__).resolve().parents[2]
TABLE_DIR = REPO / "target" / "pytest"
#: ``sitecustomize`` for the subprocesses the tests start (fastexit/sitecustomize.py).
FASTEXIT = str(pathlib.Path(__file__).resolve().parent / "fastexit")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FASTEXIT, os.environ.get("PYTHONPATH")) if p)


def without_exit_noise(text):
    """``text`` (a subprocess's output) without the leak report that triton's
    nanobind bindings print when a process skipped its last collection
    (the suite's fast exit): what is left is what the program said."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(("nanobind: ", " - leaked ", "See https://nanobind.")))


def without_fastexit(env):
    """``env`` for a subprocess whose end is what a test checks: without
    the suite's ``sitecustomize`` (it ends as a user's program ends)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != FASTEXIT]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}

# Rows of the side-by-side table, filled by the tests that run both DDP and gradsync.
ROWS = []
# Rows of the sharded (ZeRO-2) table: case -> gradsync's outcome.
SHARDED_ROWS = []


@pytest.fixture(scope="session")
def world2():
    w = World(2)
    yield w
    w.close()


@pytest.fixture(scope="session")
def world3():
    w = World(3)
    yield w
    w.close()


@pytest.fixture
def fresh_world():
    """A factory of worlds that are torn down after the test (for cases that
    kill a rank or leave a process group broken)."""
    made = []

    def make(size, pg_timeout_s=60):
        w = World(size, pg_timeout_s=pg_timeout_s)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture
def side_by_side():
    """Record a row of the table: ``record(case, ddp_outcome, gradsync_outcome)``."""

    def record(case, ddp, gradsync):
        ROWS.append({"case": case, "ddp": ddp, "gradsync": gradsync})

    return record


@pytest.fixture
def side_by_side_sharded():
    """Record a row of the sharded table: ``record(case, gradsync_outcome,
    params_outcome)`` (``shard_gradients=True``, ``shard_parameters=True``;
    a row run under the first only: "—")."""

    def record(case, gradsync, params="—"):
        SHARDED_ROWS.append({"case": case, "gradsync": gradsync, "params": params})

    return record


def render_table(rows):
    lines = [
        "| case | torch DDP | gradsync (max abs diff from the single-process reference) |",
        "|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['case']} | {row['ddp']} | {row['gradsync']} |")
    return "\n".join(lines) + "\n"


def render_sharded(rows):
    lines = [
        "| case (2 ranks) | gradsync, shard_gradients=True | gradsync, shard_parameters=True "
        "(max abs parameter diff from one process) |",
        "|---|---|---|",
    ]
    lines += [f"| {row['case']} | {row['gradsync']} | {row['params']} |" for row in rows]
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    if SHARDED_ROWS:
        TABLE_DIR.mkdir(parents=True, exist_ok=True)
        rows = sorted(SHARDED_ROWS, key=lambda r: r["case"])
        (TABLE_DIR / "sharded-side-by-side.md").write_text(render_sharded(rows))
        (TABLE_DIR / "sharded-side-by-side.json").write_text(json.dumps(rows, indent=1))
    if not ROWS:
        return
    TABLE_DIR.mkdir(parents=True, exist_ok=True)
    rows = sorted(ROWS, key=lambda r: r["case"])
    (TABLE_DIR / "ddp-side-by-side.json").write_text(json.dumps(rows, indent=1))
    (TABLE_DIR / "ddp-side-by-side.md").write_text(render_table(rows))
    if os.environ.get("GRADSYNC_PRINT_TABLE"):
        print("\n" + render_table(rows))


@pytest.fixture
def etcd_server(tmp_path):
    """An etcd server of the test's own on loopback: its ``host:port``.
    Skips, saying why, without an etcd binary (``GRADSYNC_ETCD``, or
    ``etcd`` on the PATH; scripts/test unpacks Debian's)."""
    import shutil
    import socket
    import subprocess
    import time

    binary = os.environ.get("GRADSYNC_ETCD") or shutil.which("etcd")
    if not binary:
        pytest.skip("no etcd binary: run scripts/test (it unpacks Debian's etcd-server) or set GRADSYNC_ETCD")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client, peer = (f"http://127.0.0.1:{p}" for p in ports)
    proc = subprocess.Popen(
        [binary, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", client, "--advertise-client-urls",
         client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster",
         f"default={peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    from gradsync._native import EtcdClient

    deadline = time.monotonic() + 20
    while True:
        try:
            EtcdClient(f"127.0.0.1:{ports[0]}", "probe", timeout_s=1.0)
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("etcd did not start within 20 s")
            time.sleep(0.05)
    yield f"127.0.0.1:{ports[0]}"
    proc.kill()
    proc.wait()
