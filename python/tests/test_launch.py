"""``python -m gradsync.launch`` starts its workers forked from a warm
interpreter (gradsync/_warm_start.py); each must see its process as
``python -u script.py args`` would: its arguments, the script's directory
first on the path, ``__main__``, its own environment (Python's and the C
one), unbuffered output, and the interpreter's ending (``sys.exit``'s
status, an uncaught exception's traceback and status 1, atexit handlers);
the supervisor reports each end as it does for a new process."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, without_exit_noise, without_fastexit
from world import free_port

PROBE = REPO / "python" / "tests" / "scripts" / "launch_probe.py"


@pytest.mark.parametrize("fresh", [False, True], ids=["warm", "fresh"])
def test_a_worker_sees_its_process_as_a_new_interpreter_would(tmp_path, fresh):
    cmd = [sys.executable, "-m", "gradsync.launch", "--nproc", "3", "--port", str(free_port()),
           *(["--fresh-interpreters"] if fresh else []), str(PROBE), "ok", "exit5", "raise"]
    env = without_fastexit({**os.environ, "PROBE_VALUE": "from-the-launch"})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    out, err = without_exit_noise(proc.stdout), without_exit_noise(proc.stderr)
    # (The supervisor's own status is the job's: these workers are no elastic members.)
    # (Three processes share the pipe, unbuffered: one's report may follow another's text on its line.)
    seen = {r["member"]: r for r in (json.loads(m) for m in re.findall(r'\{"member"[^{}]*\}', out))}
    assert sorted(seen) == [0, 1, 2], out
    for member, r in seen.items():
        assert r["argv"] == [str(PROBE), "ok", "exit5", "raise"], r
        assert r["path0"] == str(PROBE.parent) and r["helper"] == "probe_helper", r
        assert r["env"] == r["c_env"] == "from-the-launch", r
        assert r["main_file"] == str(PROBE), r
        assert f"member {member}: unbuffered" in out
    assert len({r["pid"] for r in seen.values()}) == 3
    # Every ending an interpreter has, reported by the supervisor as for a new process.
    assert "member 0: atexit ran" in out and "member 1: atexit ran" in out and "member 2: atexit ran" in out, out
    assert f"member 1 (pid {seen[1]['pid']}) exit status 5" in err, err
    assert "RuntimeError: member 2 raised" in err and f"member 2 (pid {seen[2]['pid']}) exit status 1" in err, err
