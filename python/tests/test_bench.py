"""The benchmark against torch's DDP keeps working: a short run of
``benches/torch/vs_ddp.py`` whose policies must train the same parameters
(its timings are printed for people, never asserted)."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_vs_ddp_runs_and_its_synchronized_policies_agree_exactly():
    cmd = [sys.executable, str(REPO / "benches" / "torch" / "vs_ddp.py"), "--tiny-params", "40", "--steps", "4",
           "--warmup", "1", "--policies", "gradsync,ddp,no_sync,local", "--no-hook-timing", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["policies"]) == {"gradsync", "ddp", "no_sync", "local"}
    for name, policy in result["policies"].items():
        assert policy["step_s_median"] > 0, f"{name}: {policy}"
    # gradsync and DDP against the no_sync workaround: the same averaged steps, exactly.
    assert result["agree"] == {"gradsync": 0.0, "ddp": 0.0}, result["agree"]
    gradsync = result["policies"]["gradsync"]
    assert gradsync["bucket_memory_bytes"][-1] > 0 and len(gradsync["buckets_overlapped"]) == 4
