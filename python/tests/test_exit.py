"""A program that ends while gradsync holds gradients exits cleanly: the
runtime's threads must not touch the interpreter once it shuts down (Python
ends such a thread with a forced unwind, and the process aborts with
"terminate called without an active exception")."""

import pytest

from test_frameworks import REPO, torchrun


@pytest.mark.parametrize("wrapper", ["dropped", "alive"])
def test_a_program_that_never_closes_its_wrapper_exits_cleanly(wrapper):
    script = REPO / "python" / "tests" / "scripts" / "exit_unclosed.py"
    for attempt in range(3):  # the abort it guards against depended on thread timing
        code, out = torchrun(script, "--wrapper", wrapper, timeout=120)
        assert code == 0 and "terminate called" not in out, f"attempt {attempt}: exit {code}\n{out[-3000:]}"
        assert out.count("trained, leaving without close()") == 2, out[-3000:]
