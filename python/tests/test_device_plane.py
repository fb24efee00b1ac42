"""The device plane on the CPU: buckets as torch tensors, every bucket
operation a torch op, the collectives on the plane's data group: the code a
GPU runs (``buckets="device"``) except the stream and event calls, which
have nothing to do on the CPU (python/shim/collectives.cpp names those
lines; ``test_gpu.py`` runs them on a GPU).

Each case is one the host buckets pass, run unchanged with the setting
flipped (``cases.on_device_plane``), and held to the same bar: exact against
one process, the runtime's semantics unchanged (recompute, shared weights,
unused parameters, accumulation, join, an aborted step, complex values, the
wire type).
"""

import pytest

import cases
import dropin
from test_dropin import check as check_dropin


def run(world, case, *args, **kwargs):
    """``case`` on every rank on the device plane (CPU tensors); its results by rank."""
    return cases.device_plane_results(world, case, *args, **kwargs)


@pytest.mark.parametrize("model", ["once", "twice", "twice_weight_sharing", "dynamic_weight_sharing"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointing(world2, model, use_reentrant):
    dynamic = model.startswith("dynamic")
    cases.check(run(world2, cases.checkpointing, model, "gradsync", use_reentrant, allow_none_grads=dynamic))


def test_shared_weights_and_two_forwards(world2):
    cases.check(run(world2, cases.shared_weight_between_segments, "gradsync"))
    cases.check(run(world2, cases.two_forwards_reentrant, "gradsync"))
    cases.check(run(world2, cases.changing_graph, "gradsync"))


def test_unused_and_rank_dependent_parameters(world3):
    cases.check(run(world3, cases.unused_parameters, "gradsync"))
    cases.check(run(world3, cases.control_flow, "gradsync", True))


def test_an_aborted_step_is_skipped_everywhere(world2):
    for rank, outcome in enumerate(run(world2, cases.oom_on_one_rank, "gradsync")):
        steps = outcome["steps"]
        assert [s["outcome"] for s in steps] == ["applied", "skipped", "applied"], f"rank {rank}: {steps}"
        assert steps[1]["grads_none"], "a skipped step leaves no gradient to apply"
        for s in (steps[0], steps[2]):
            assert s["max_diff"] <= cases.ATOL, f"rank {rank} step {s['step']}: off by {s['max_diff']}"


@pytest.mark.parametrize("mode", dropin.GRAD_MODES)
def test_grad_between_steps(world2, mode):
    ours = run(world2, dropin.grad_semantics, "gradsync", mode)
    check_dropin(ours)
    if mode == "zero_in_place":
        assert all(o["identity_kept"] for o in ours), ".grad must stay the same tensor, as with DDP"
    if mode == "own_tensor":
        assert all(o["own_is_grad"] for o in ours), "the caller's tensor must receive the average, as with DDP"


@pytest.mark.parametrize("num_iters", [2, 3])
def test_accumulation_under_no_sync(world2, num_iters):
    check_dropin(run(world2, dropin.accumulate_no_sync, "gradsync", num_iters, "plain"))
    check_dropin(run(world2, dropin.accumulation_early_branch, "gradsync"))


def test_join_with_uneven_inputs(world2):
    check_dropin(run(world2, dropin.uneven_inputs, "gradsync", (3, 5), True))


def test_complex_parameters(world2):
    check_dropin(run(world2, dropin.complex_parameters, "gradsync"))


def test_bfloat16_on_the_wire(world2):
    outcomes = world2.run(cases.on_device_plane, dropin.grad_semantics, "gradsync", "set_to_none",
                          settings={"wire_dtype": "bfloat16"})
    for rank, (outcome, paths) in enumerate(outcomes):
        assert paths == ["device"]
        # bfloat16 keeps 8 bits of mantissa: the sum is close, not exact.
        assert outcome["status"] == "ok" and 0 < outcome["max_diff"] <= 2e-2, f"rank {rank}: {outcome}"
