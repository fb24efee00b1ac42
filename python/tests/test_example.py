"""The example trains under torchrun and ends with a passing equivalence line."""

import pathlib
import subprocess
import sys

from world import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_train_lm_under_torchrun_matches_one_process():
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "examples" / "torch" / "train_lm.py"), "--steps", "30", "--log-every", "10"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    out = run.stdout
    assert run.returncode == 0, f"exit {run.returncode}\n{out}\n{run.stderr[-3000:]}"
    assert "equivalence: max |param - reference|" in out and out.rstrip().endswith("OK"), out
    assert "replicas: max |param_r - param_0| = 0.0e+00" in out, out
