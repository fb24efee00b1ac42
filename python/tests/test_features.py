"""What a DDP user relies on, and what gradsync adds: accumulation with
overlap, two wrapped models, gradient dtypes and layouts, explicit ends of
steps where backward's end is invisible, reports, timeline and metrics."""

import torch

import features
from world import free_port


def test_accumulation_with_no_sync_keeps_overlap(world2):
    for rank, out in enumerate(world2.run(features.accumulation)):
        assert out["max_diff"] < 1e-5, f"rank {rank}: off by {out['max_diff']}"
        assert out["buckets"] >= 3
        # From the second step on (learned arrival counts), buckets are
        # reduced while the last micro-batch's backward runs.
        assert min(out["overlapped"][1:]) >= 1, f"rank {rank}: no overlap {out['overlapped']}"


def test_buckets_follow_backward_when_registration_order_is_its_reverse(world2):
    for rank, out in enumerate(world2.run(features.declared_backwards)):
        assert out["max_diff"] < 1e-5, f"rank {rank}: off by {out['max_diff']}"
        # Once the plan follows backward, the two buckets of the head's and
        # middle's gradients are reduced during the 30 ms before the first
        # layer's (with reverse registration, none is: bucket 0 waits for it).
        assert min(out["overlapped"][1:]) >= 2, f"rank {rank}: overlap per step {out['overlapped']}"


def test_two_wrapped_models_in_one_program(world2):
    for rank, out in enumerate(world2.run(features.two_models)):
        assert out["max_diff"] < 1e-5, f"rank {rank}: off by {out['max_diff']}"
        assert out["steps"] == (2, 2)


def test_gradient_dtypes_are_converted_and_layouts_copied(world2):
    for rank, out in enumerate(world2.run(features.dtypes)):
        for dtype, (grad_dtype, diff) in ((k, v) for k, v in out.items() if k != "non_contiguous"):
            assert grad_dtype == dtype, f"rank {rank}: {dtype} gradient came back as {grad_dtype}"
            assert diff <= (1e-6 if dtype == "torch.float32" else 1e-2), f"rank {rank} {dtype}: off by {diff}"
        contiguous, diff = out["non_contiguous"]
        assert not contiguous, "the gradient keeps the parameter's layout"
        assert diff < 1e-6, f"rank {rank}: non-contiguous gradient off by {diff}"


def test_an_invisible_end_of_backward_needs_finish_step_and_forgetting_it_raises(world2):
    for rank, out in enumerate(world2.run(features.explicit_finish)):
        assert len(out["errors"]) == 2, f"rank {rank}: forward and optimizer.step() must raise: {out['errors']}"
        assert all("finish_step()" in e for e in out["errors"])
        assert out["report_step"] == 0
        assert out["max_diff"] < 1e-5, f"rank {rank}: off by {out['max_diff']}"
        assert out["auto_step"] == 1, "a top-level checkpoint of the model ends the step by itself"
        assert out["again"] is None


def test_report_timeline_and_metrics_from_python(world2, tmp_path):
    port = free_port()
    out = world2.run(features.observability, str(tmp_path), port)
    for rank, o in enumerate(out):
        r = o["report"]
        assert (r["step"], r["rank"], r["outcome"], r["contributors"]) == (2, rank, "applied", 2)
        assert r["buckets_launched"] >= 3 and r["bytes_launched"] > 0
        assert o["events"] > 0 and o["trace_events"] > o["events"] // 2
        assert o["memory"] > 0
        assert "closed" in o["closed"]
    text = out[0]["scraped"]
    assert 'gradsync_steps_total{rank="0",outcome="applied"} 3' in text
    assert "# HELP gradsync_arrivals_total" in text


def test_training_keeps_replicas_identical(world3):
    out = world3.run(features.training_converges)
    for rank, o in enumerate(out):
        assert torch.equal(o["params"], out[0]["params"]), f"rank {rank} diverged from rank 0"
        assert o["last"] < 0.7 * o["first"], f"the loss must fall: {o['first']} -> {o['last']}"


def test_native_and_python_collectives_agree_bit_for_bit(world2):
    for rank, out in enumerate(world2.run(features.collective_paths)):
        for wire, tol in (("float32", 1e-5), ("bfloat16", 5e-2)):
            # The package's own build compiles the native path: a CI without
            # it would silently measure and test the slow one.
            assert out[f"{wire}/native"]["native"], f"rank {rank}: native collectives were not built"
            assert not out[f"{wire}/python"]["native"], f"rank {rank}: a build without _collectives still ran them natively"
            for path in ("native", "python"):
                diff = out[f"{wire}/{path}"]["max_diff"]
                assert diff < tol, f"rank {rank} {wire} {path}: off by {diff}"
            assert out[f"{wire}/identical"], f"rank {rank} {wire}: the two paths' gradients differ"


def test_native_and_python_hooks_agree_bit_for_bit(world2):
    for rank, out in enumerate(world2.run(features.hook_paths)):
        # pip builds the C++ hooks; a CI without them would test the slow path only.
        assert out["native"]["native"], f"rank {rank}: the native hooks were not built"
        assert not out["python"]["native"], f"rank {rank}: a build without _arrivals still ran native hooks"
        for path in ("native", "python"):
            assert out[path]["max_diff"] < 1e-5, f"rank {rank} {path}: off by {out[path]['max_diff']}"
            assert out[path]["held_kept"], f"rank {rank} {path}: a held .grad did not receive the average"
        assert out["identical"], f"rank {rank}: the two hook paths' gradients differ"
