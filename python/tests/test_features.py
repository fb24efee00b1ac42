"""What a DDP user relies on, and what gradsync adds: accumulation with
overlap, two wrapped models, gradient dtypes and layouts, the end of a
backward nested in checkpoints, reports, timeline and metrics."""

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


def test_a_model_inside_nested_checkpoints_ends_its_step_when_the_outermost_backward_ends(world2):
    for rank, out in enumerate(world2.run(features.nested_checkpoints)):
        assert out["ended"] == 0, f"rank {rank}: the step did not end with backward"
        assert out["late_finish"] is None, "finish_step() after it has nothing to end"
        assert out["max_diff"] < 1e-12, f"rank {rank}: off by {out['max_diff']}"
        assert out["auto_step"] == 1, "a top-level checkpoint of the model ends the step by itself"


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


def test_bfloat16_on_the_wire_stays_close_to_the_float32_average(world2):
    for rank, out in enumerate(world2.run(features.wire_types)):
        assert out["float32"] < 1e-5, f"rank {rank} float32: off by {out['float32']}"
        assert out["bfloat16"] < 5e-2, f"rank {rank} bfloat16: off by {out['bfloat16']}"


def test_held_gradients_receive_the_average_under_a_nested_backward(world2):
    for rank, out in enumerate(world2.run(features.held_gradients)):
        assert out["max_diff"] < 1e-5, f"rank {rank}: off by {out['max_diff']}"
        assert out["held_kept"], f"rank {rank}: a held .grad did not receive the average"
