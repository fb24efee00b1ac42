"""The benchmarks keep working: every script under ``benches/torch`` runs in
a smoke mode (a step or two, the smallest world and model it takes), and
the run against torch's DDP (``vs_ddp.py``) must train the same parameters
as its peers. Timings are printed for people, never asserted. (The Rust
benchmark binary's smoke runs are ``tests/bench_smoke.rs``; the criterion
suites run once each under ``cargo test --benches``.)"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHES = REPO / "benches" / "torch"


def bench(script, *args, timeout=300):
    """Run ``benches/torch/script`` with ``args`` from the repository root;
    its standard output (a failure shows both streams)."""
    run = subprocess.run([sys.executable, str(BENCHES / script), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, f"{script} exited {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


def test_vs_ddp_runs_and_its_synchronized_policies_agree_exactly():
    out = bench("vs_ddp.py", "--tiny-params", "40", "--steps", "4", "--warmup", "1", "--policies",
                "gradsync,ddp,no_sync,local", "--hook-samples", "512", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["hook_call_us_median"] > 0, "the Python hook call was timed"
    assert set(result["policies"]) == {"gradsync", "ddp", "no_sync", "local"}
    for name, policy in result["policies"].items():
        assert policy["step_s_median"] > 0, f"{name}: {policy}"
    # gradsync and DDP against the no_sync workaround: the same averaged steps, exactly.
    assert result["agree"] == {"gradsync": 0.0, "ddp": 0.0}, result["agree"]
    gradsync = result["policies"]["gradsync"]
    # Steps 2-4 are measured (one of warm-up).
    assert gradsync["bucket_memory_bytes"][-1] > 0 and len(gradsync["buckets_overlapped"]) == 3
    # Four policies take turns: no step of one follows its own previous step.
    assert gradsync["after_own_step"] == [False] * 3, gradsync["after_own_step"]
    assert all(p["page_faults_median"] >= 0 and p["kernel_s_median"] >= 0 for p in result["policies"].values())
    # Every rank computes in every step: the ranks' summed CPU time is never 0.
    assert all(p["cpu_s_median"] > 0 for p in result["policies"].values()), result["policies"]
    assert result["kept_freed_memory"] is False, "glibc's defaults unless asked"
    # Three rounds are too few for a confidence interval; local is no comparison.
    assert result["paired"] == {"ddp": None, "no_sync": None}, result["paired"]


def test_vs_ddp_runs_each_policy_on_its_own_and_compares_their_losses():
    out = bench("vs_ddp.py", "--tiny-params", "40", "--steps", "3", "--warmup", "1", "--policies", "gradsync,no_sync",
                "--separate", "2", "--keep-freed-memory", "--no-hook-timing", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rounds"] == 2
    gradsync = result["policies"]["gradsync"]
    # Two rounds of steps 2-3, each following the policy's own previous step.
    assert gradsync["after_own_step"] == [True] * 4, gradsync["after_own_step"]
    # In processes of its own, gradsync computed the workaround's losses exactly.
    assert result["agree_losses"] == {"gradsync": 0.0}, result["agree_losses"]
    # Every rank process started with glibc told to keep freed memory.
    assert result["kept_freed_memory"] is True


def _step_stats():
    spec = importlib.util.spec_from_file_location("step_stats", REPO / "benches" / "torch" / "step_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_medians_are_taken_over_whole_rotations_of_the_policy_order():
    bench = _step_stats()
    # 10 steps, 3 of warm-up, 2 policies: 7 left, the last one dropped so each
    # policy is measured 3 times first and 3 times second.
    assert bench.measured_window(10, 3, 2) == (3, 9)
    assert bench.measured_window(30, 3, 6) == (3, 27)
    assert bench.measured_window(13, 3, 5) == (3, 13)
    # Fewer steps than policies: everything after the warm-up.
    assert bench.measured_window(4, 1, 4) == (1, 4)
    assert bench.split_by_predecessor([1.0, 2.0, 3.0, 4.0], [True, False, True, False]) == (2.0, 3.0)
    assert bench.split_by_predecessor([1.0, 2.0], [False, False]) is None


def test_paired_difference_names_a_faster_policy_only_when_its_interval_leaves_out_zero():
    bench = _step_stats()
    # Five rounds cannot give a 95% interval: even all-equal signs happen 1 time in 16.
    assert bench.paired_difference([1.0] * 5, [2.0] * 5) is None
    # Six rounds: the interval runs from the smallest difference to the largest.
    d = bench.paired_difference([1, 2, 3, 4, 5, 6], [2, 2.5, 3.5, 4.2, 5.1, 6.6])
    assert d["rounds"] == 6 and d["verdict"] == "faster", d
    assert (d["low_s"], d["median_s"], d["high_s"]) == pytest.approx((-1.0, -0.5, -0.1))
    # Twenty rounds: P(Binomial(20, 1/2) <= 5) = 0.021, <= 6: 0.058, so the 6th
    # smallest and the 6th largest difference bound it.
    d = bench.paired_difference([float(x) for x in range(1, 21)], [0.0] * 20)
    assert (d["low_s"], d["high_s"], d["verdict"]) == (6.0, 15.0, "slower"), d
    # Differences either side of zero: no verdict.
    d = bench.paired_difference([0.0] * 10, [float(x) for x in range(-5, 5)])
    assert d["low_s"] < 0 < d["high_s"] and d["verdict"] == "within noise", d


# ---- every other bench, in a smoke mode -------------------------------------------------------


def test_record_drives_each_docs_run(tmp_path):
    bench("record.py", "--smoke", "--out", tmp_path, "tiny")
    (written,) = tmp_path.glob("*.json")
    assert json.loads(written.read_text())["command"].endswith("--steps 3 --warmup 1 --json")


def test_host_profile_on_cpu(tmp_path):
    bench("host_profile.py", "--device", "cpu", "--model", "tiny", "--tiny-params", "20", "--steps", "3",
          "--warmup", "1", "--json", tmp_path / "host.json")
    assert json.loads((tmp_path / "host.json").read_text())


def test_gpu_overhead_needs_a_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("gpu_overhead.py measures on a CUDA device and there is none: the GPU suite runs it "
                    "(scripts/gpu/run)")
    bench("gpu_overhead.py", "--model", "resnet18", "--images-per-rank", "2", "--image-size", "32", "--steps", "3",
          "--warmup", "1")


def test_sharded_memory_counts_each_kind_of_implementation(tmp_path):
    # One of each way of holding memory (the step bench below builds every configuration, each
    # process spawn here costs seconds): sharded gradients, sharded parameters by units, ZeRO-1's
    # optimizer, FSDP2's buffers.
    impls = {"gradsync-sharded", "gradsync-params", "gradsync-params-1", "zero1", "fsdp2"}
    bench("sharded_memory.py", "--worlds", "2", "--layers", "2", "--width", "32", "--tokens", "8", "--steps", "2",
          "--impls", *sorted(impls), "--json", tmp_path / "memory.json")
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == impls
    assert not [r for r in rows if r["impl"].startswith("gradsync") and "error" in r], rows
    by = {r["impl"]: r for r in rows}
    # After a step a parameter-sharded rank holds its pieces only (no whole parameters, no gather buffers).
    assert by["gradsync-params"]["params"] < by["gradsync-sharded"]["params"] / 2, rows
    for r in rows:
        if "error" not in r:
            assert r["peak"] >= r["params"] + r["grads"] + r["optimizer"], r


def test_sharded_step_interleaved_with_the_gathers_share(tmp_path):
    bench("sharded_step.py", "--worlds", "2", "--layers", "2", "--width", "32", "--tokens", "8", "--steps", "2",
          "--warmup", "1", "--json", tmp_path / "steps.json")
    rows = json.loads((tmp_path / "steps.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"gradsync-sharded", "gradsync-sharded-at-once", "gradsync-params",
                                         "gradsync-params-1", "gradsync-params-unpaced", "gradsync-params-lean",
                                         "gradsync-params-bf16", "gradsync", "ddp", "fsdp2", "fsdp2-bf16"}
    for row in rows:
        assert row["step_s"] > 0, row
        if row["impl"].startswith(("gradsync-sharded", "gradsync-params")):
            # The gather and the optimizer step are parts of the step.
            assert 0 < row["gather_s"] + row["optimizer_s"] < row["step_s"], row


def test_sharded_side_by_side_one_case(tmp_path):
    bench("sharded_side_by_side.py", "--cases", "checkpoint_once", "--deadline", "60", "--json", tmp_path / "p.json")
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert set(row) == {"case", "fsdp2", "zero1"}, row


def test_sharded_elastic_memory_and_a_kill(tmp_path):
    bench("sharded_elastic.py", "--worlds", "3", "--width", "16", "--steps", "6", "--json", tmp_path / "e.json",
          timeout=420)
    run = json.loads((tmp_path / "e.json").read_text())
    held = {r["mode"]: r["parameter_bytes"] for r in run["memory"]}
    # Sharded parameters with a buddy copy: 2 of 3 partitions' pieces, not the whole model.
    assert held["parameters"] < held["gradients"] == held["unsharded"], held
    assert {(k["mode"], k["phase"]) for k in run["kills"]} >= {("parameters", "forward"), ("parameters", "optimizer")}


def test_meta_init_builds_on_both_devices(tmp_path):
    bench("meta_init.py", "--worlds", "2", "--layers", "2", "--width", "64", "--vocab", "256", "--json",
          tmp_path / "m.json", timeout=300)
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert [r["built_on"] for r in rows] == ["cpu", "meta"], rows
    assert rows[0]["pieces"] == rows[1]["pieces"] and rows[0]["pieces"] < rows[0]["whole"], rows


def test_sharded_checkpoint_saves_and_loads_at_another_world(tmp_path):
    bench("sharded_checkpoint.py", "--save-world", "2", "--load-world", "3", "--layers", "2", "--width", "64",
          "--vocab", "256", "--ways", "pieces", "--json", tmp_path / "c.json", timeout=300)
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(r["what"], r["world"]) for r in rows] == [("save", 2), ("load", 3)], rows
    assert all(r["pieces"] < r["whole"] for r in rows), rows


def test_read_alone_reads_on_rank_zero_and_inside_whole_parameters(tmp_path):
    bench("read_alone.py", "--worlds", "2", "--layers", "2", "--width", "64", "--vocab", "256", "--repeat", "1",
          "--json", str(tmp_path / "reads.json"))
    rows = json.loads((tmp_path / "reads.json").read_text())["rows"]
    assert [r["way"] for r in rows] == ["state_dict", "norms", "deepcopy", "whole"]
    assert all(r["seconds"] > 0 and r["whole"] > r["pieces"] > 0 for r in rows), rows


def test_averaged_holds_each_ranks_pieces_beside_a_whole_copy(tmp_path):
    bench("averaged.py", "--worlds", "2", "--layers", "2", "--width", "64", "--vocab", "256", "--steps", "2",
          "--json", str(tmp_path / "averaged.json"))
    rows = {r["kind"]: r for r in json.loads((tmp_path / "averaged.json").read_text())["rows"]}
    assert rows["sharded"]["bytes"] < 0.6 * rows["whole"]["bytes"], rows
    assert rows["whole"]["bytes"] == rows["whole"]["model"], rows
    assert all(r["update_s"] > 0 and r["evaluate_s"] > 0 for r in rows.values()), rows


def test_reshard_scale_moves_a_members_share_not_the_model(tmp_path):
    bench("reshard_scale.py", "--worlds", "16", "64", "--model-mib", "64", "--bucket-mib", "8",
          "--json", str(tmp_path / "reshard.json"))
    rows = json.loads((tmp_path / "reshard.json").read_text())["rows"]
    for r in rows:  # (a member's new partitions: 2 / (world - 1) of the model's values and states)
        assert r["received"] <= 2 * r["model"] * 6 / (r["world"] - 1) < r["broadcast_received"], r
        assert r["peers"] <= 8, r
    assert rows[1]["received"] < rows[0]["received"], "a larger world moves less per member"


def test_gloo_groups_connect_a_member_to_a_few_peers_not_to_every_member(tmp_path):
    bench("gloo_groups.py", "--worlds", "16", "--json", str(tmp_path / "groups.json"))
    rows = {r["way"]: r for r in json.loads((tmp_path / "groups.json").read_text())["rows"]}
    counts = ("made", "all_reduce", "broadcast", "all_gather")
    assert all(rows["torch"][k] >= 16 for k in counts), rows  # (every pair, when the group is made)
    # gradsync's: a handful when made, then O(log world) peers (ring neighbours, a broadcast's tree).
    assert rows["gradsync"]["made"] <= 3, rows
    assert all(rows["gradsync"][k] <= 2 + 2 * 4 for k in counts), rows


def test_elastic_recovery_its_parts(tmp_path):
    # ("partial" and "loaded" are "recovery" with another policy and with busy loops: the same code.)
    parts = ["recovery", "torchrun", "liveness"]
    bench("elastic_recovery.py", "--worlds", "2", "--kill-step", "3", "--rank-steps", "24", "--torchrun-steps", "8",
          "--liveness-steps", "14", "--liveness-rounds", "1", "--parts", *parts, "--json", tmp_path / "r.json",
          timeout=600)
    run = json.loads((tmp_path / "r.json").read_text())
    assert set(run["commands"]) == set(parts), run["commands"]
