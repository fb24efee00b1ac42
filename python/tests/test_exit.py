"""A program that ends while gradsync holds gradients exits cleanly: the
runtime's threads must not touch the interpreter once it shuts down (Python
ends such a thread with a forced unwind, and the process aborts with
"terminate called without an active exception").

The two ranks are started as torchrun starts them (its environment
variables), without its agent process, and end as a user's program ends
(without the suite's fast exit, ``conftest.without_fastexit``)."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, without_fastexit
from world import free_port

SCRIPT = REPO / "python" / "tests" / "scripts" / "exit_unclosed.py"


def two_ranks(*args, timeout=120):
    """Run ``SCRIPT`` on two ranks; their exit statuses and output."""
    port = free_port()
    env = without_fastexit({**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], "".join(outs)


@pytest.mark.parametrize("wrapper", ["dropped", "alive"])
def test_a_program_that_never_closes_its_wrapper_exits_cleanly(wrapper):
    for attempt in range(3):  # the abort it guards against depended on thread timing
        codes, out = two_ranks("--wrapper", wrapper)
        assert codes == [0, 0] and "terminate called" not in out, f"attempt {attempt}: exit {codes}\n{out[-3000:]}"
        assert out.count("trained, leaving without close()") == 2, out[-3000:]
