"""The GPU suite: gradsync's device plane on CUDA (buckets on the GPU, NCCL
on gradsync's stream), at world N where N GPUs exist (one rank per GPU; one
GPU: world 1), or at ``GRADSYNC_GPU_WORLD`` ranks (``scripts/gpu/run
--worlds 1,2,4``): more ranks than GPUs share them, NCCL then going over
sockets with each process its own ``NCCL_HOSTID`` (correct, not fast).
Without a CUDA device every test here is skipped, with that reason; on a
GPU machine ``scripts/gpu/run`` runs it.

* the side-by-side cases (checkpointing, shared weights, unused and
  rank-dependent parameters, an aborted step, join), exact against one
  process, unchanged from the CPU suite with their tensors on the GPU;
* stream ordering: gradients produced late, on the default stream and on a
  side stream, with ``optimizer.step()`` queued right after ``backward()``
  (no host synchronization anywhere): bitwise equal to plain training;
* sharded gradients and optimizer state (``shard_gradients=True``), and
  sharded parameters (``shard_parameters=True``): the sharded side-by-side
  cases, exact against one process, their buckets reduce-scattered and
  their parameters all-gathered by NCCL, a rank's out-of-memory abort too;
* memory: peak and held allocated memory against torch DDP's, with and
  without ``gradient_as_bucket_view``, written to
  ``target/pytest/gpu-memory.json`` (gradsync holds what DDP's bucket view
  holds, and peaks up to one parameter-sized set higher during a step).
"""

import json
import os

import pytest
import torch

import cases
import dropin
import gpu_cases
import sharded
from conftest import TABLE_DIR
from test_dropin import check as check_dropin
from world import World

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
#: Ranks of the suite's worlds (see the module docs).
WORLD = int(os.environ.get("GRADSYNC_GPU_WORLD") or GPUS)
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: the GPU suite runs on a GPU machine "
                                "(scripts/gpu/run); the device plane's CPU-runnable code is test_device_plane.py")


@pytest.fixture(scope="module")
def gpus():
    w = World(WORLD)
    yield w
    w.close()


def on_gpu(world, case, *args, **kwargs):
    """``case`` on every rank on the device plane, its tensors on the rank's GPU."""
    return cases.device_plane_results(world, case, *args, device="cuda", timeout=300, **kwargs)


@pytest.mark.parametrize("model", ["once", "twice", "twice_weight_sharing", "dynamic_weight_sharing"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing(gpus, model, use_reentrant):
    dynamic = model.startswith("dynamic")
    cases.check(on_gpu(gpus, cases.checkpointing, model, "gradsync", use_reentrant, allow_none_grads=dynamic))


def test_shared_weights_unused_and_changing_parameters(gpus):
    for case in (cases.shared_weight_between_segments, cases.two_forwards_reentrant, cases.changing_graph,
                 cases.unused_parameters):
        cases.check(on_gpu(gpus, case, "gradsync"))
    cases.check(on_gpu(gpus, cases.control_flow, "gradsync", True))


def test_an_aborted_step_is_skipped(gpus):
    for rank, outcome in enumerate(on_gpu(gpus, cases.oom_on_one_rank, "gradsync", oom_rank=WORLD - 1)):
        steps = outcome["steps"]
        assert [s["outcome"] for s in steps] == ["applied", "skipped", "applied"], f"rank {rank}: {steps}"
        for s in (steps[0], steps[2]):
            assert s["max_diff"] <= cases.ATOL, f"rank {rank} step {s['step']}: off by {s['max_diff']}"


def test_grad_semantics_accumulation_and_join(gpus):
    for mode in dropin.GRAD_MODES:
        check_dropin(on_gpu(gpus, dropin.grad_semantics, "gradsync", mode))
    check_dropin(on_gpu(gpus, dropin.accumulate_no_sync, "gradsync", 3, "plain"))
    check_dropin(on_gpu(gpus, dropin.uneven_inputs, "gradsync", tuple(3 + r for r in range(WORLD)), True))
    check_dropin(on_gpu(gpus, dropin.complex_parameters, "gradsync"))


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_optimizer_step_right_after_backward_sees_the_average(gpus, side_stream):
    for rank, out in enumerate(gpus.run(gpu_cases.stream_order, side_stream, timeout=300)):
        assert (out["buckets"], out["why"]) == ("device", None), out
        if WORLD == 1:
            assert out["identical"], f"rank {rank}: parameters differ from plain training by {out['max_diff']}"
        else:
            assert out["max_diff"] <= 1e-6, f"rank {rank}: off by {out['max_diff']}"


# (The HF GPT-2 case needs transformers, which the GPU machine may lack.)
@pytest.mark.parametrize("name", [name for name in sharded.CASES if not name.startswith("hf_")])
@pytest.mark.parametrize("impl", ["gradsync", "gradsync-params"], ids=["shard_gradients", "shard_parameters"])
def test_sharded_cases(gpus, impl, name):
    """Sharded gradients and optimizer state (and parameters) on the device plane, exact against one process."""
    sharded.check(on_gpu(gpus, sharded.case, impl, name))


@pytest.mark.parametrize("policy", ["skip", "partial"])
def test_sharded_parameters_survive_an_out_of_memory_rank(gpus, policy):
    """A rank that aborts before its forward still takes part in the step's gather (NCCL would hang otherwise)."""
    sharded.check(on_gpu(gpus, sharded.case, "gradsync-params", "checkpoint_twice_reentrant",
                         aborts=[(WORLD - 1, 1)], policy=policy))


def test_peak_memory_against_ddp():
    """Each policy in a fresh world (a process's allocator state carries over)."""
    out = {"device": torch.cuda.get_device_name(0)}
    for policy in ("local", "ddp", "ddp_bucket_view", "gradsync"):
        world = World(GPUS)
        try:
            out[policy] = world.run(gpu_cases.peak_of, policy, timeout=300)[0]
        finally:
            world.close()
    TABLE_DIR.mkdir(parents=True, exist_ok=True)
    (TABLE_DIR / "gpu-memory.json").write_text(json.dumps(out, indent=1))
    params = out["local"]["param_bytes"]
    # gradsync's .grad are bucket views (as DDP's with gradient_as_bucket_view)
    # but it keeps each step's handed-over gradients until the step ends (for
    # corrections): at most one parameter-sized set more than DDP's bucket view.
    assert out["gradsync"]["peak"] <= out["ddp_bucket_view"]["peak"] + params * 1.05, out
    assert out["gradsync"]["held"] <= out["ddp_bucket_view"]["held"] + params * 0.05, out
