"""Libraries that build torch's DDP themselves get gradsync: HF ``Trainer``
(through Accelerate) with reentrant gradient checkpointing and
``ddp_find_unused_parameters=True``, and Lightning's ``ddp`` strategy, each
launched by torchrun as their users launch them. torch's DDP refuses both
runs ("Expected to mark a variable ready only once"); its error goes into the
side-by-side table, and gradsync must train exactly."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from world import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")


def torchrun(script, *args, timeout=240):
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return run.returncode, run.stdout + run.stderr


def failure(output):
    found = re.search(r"failed: (\w+: .*?\.)", output)
    return f"raises `{found.group(1)}`" if found else "raises (see log)"


def test_hf_trainer_with_reentrant_checkpointing(side_by_side):
    pytest.importorskip("transformers")
    example = REPO / "examples" / "torch" / "hf_trainer.py"
    code, out = torchrun(example, "--steps", "8")
    assert code == 0, out[-4000:]
    assert "Trainer wrapped the model in gradsync.torch.ddp.DistributedDataParallel" in out, out[-3000:]
    assert "replicas: max |param_r - param_0| = 0.0e+00" in out, out[-3000:]
    diff = float(re.search(r"equivalence: max \|param - reference\| = (\S+)", out).group(1))
    assert diff <= 1e-4 and "MISMATCH" not in out, out[-3000:]
    code, theirs = torchrun(example, "--steps", "8", "--impl", "ddp")
    assert code != 0, "torch's DDP was expected to refuse reentrant checkpointing with find_unused_parameters"
    side_by_side(
        "HF Trainer, GPT-2, reentrant gradient checkpointing, ddp_find_unused_parameters=True",
        failure(theirs),
        f"ok, {diff:.1e} (one-process replay)",
    )


@pytest.mark.parametrize("impl", ["replace", "strategy"])
def test_lightning_ddp_strategy(side_by_side, impl):
    pytest.importorskip("lightning")
    script = REPO / "python" / "tests" / "scripts" / "lightning_ddp.py"
    code, out = torchrun(script, "--impl", impl)
    assert code == 0, out[-4000:]
    assert "wrapper: gradsync.torch.ddp.DistributedDataParallel" in out, out[-3000:]
    assert "replicas: 0.0e+00" in out, out[-3000:]
    diff = float(re.search(r"reference: (\S+)", out).group(1))
    assert diff <= 1e-5, out[-3000:]
    if impl == "replace":
        code, theirs = torchrun(script, "--impl", "ddp")
        assert code != 0, "torch's DDP was expected to refuse a block checkpointed twice"
        side_by_side(
            'Lightning Trainer(strategy="ddp"), one block checkpointed twice (reentrant)',
            failure(theirs),
            f"ok, {diff:.1e} (one-process replay)",
        )
