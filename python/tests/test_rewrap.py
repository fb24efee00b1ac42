"""A DDP model copied, pickled, saved and wrapped again, and ``model.reducer``
as libraries call it: each case under torch's DDP and under gradsync, side
by side (``rewrap``). gradsync must be exact wherever DDP runs."""

import pytest

import rewrap
from cases import describe
from dropin import TOL


def check(outcomes, tol=TOL):
    for rank, outcome in enumerate(outcomes):
        assert outcome["status"] == "ok", f"rank {rank}: {outcome}"
        assert outcome["max_diff"] <= tol, f"rank {rank}: off by {outcome['max_diff']}"


CASES = {
    "module_checkpoints": "torch.save / pickle / deepcopy(...).half() of ddp.module between steps (whole-module checkpoints)",
    "wrap_a_copy": "DDP(copy.deepcopy(ddp.module)) while the first wrapper lives (restart from the best weights)",
    "copy_the_wrapper": "copy.deepcopy(ddp) and torch.save(ddp) / torch.load: working wrappers of their own",
    "wrap_a_copy_sharded": "the same with shard_parameters=True, the copy read alone between steps (gradsync; DDP "
                           "beside it unsharded)",
    "wrap_again": "ddp = DDP(model) again after unfreezing a layer, no close()",
    "wrap_again_sharded": "the same with shard_parameters=True (gradsync; DDP beside it unsharded)",
}


@pytest.mark.parametrize("case", list(CASES))
def test_copies_and_wrapping_again(world2, side_by_side, case):
    fn = getattr(rewrap, case)
    ours = world2.run(fn, "gradsync")
    check(ours)
    theirs = world2.run(fn, "ddp")
    if case.startswith("wrap_again"):
        for rank, o in enumerate(ours):
            assert o["retired"] and "retired" in o["retired"] and "newer" in o["retired"], f"rank {rank}: {o}"
    side_by_side(CASES[case], describe(theirs[0], TOL), describe(ours[0], TOL))


def test_reducer_calls_of_lightning_and_accelerate(world2, side_by_side):
    ours = world2.run(rewrap.reducer_calls, "gradsync")
    check(ours)
    theirs = world2.run(rewrap.reducer_calls, "ddp")
    for rank, o in enumerate(ours):
        assert o["hasattr"] is False, f"rank {rank}: an unsupported reducer call must read as absent to hasattr"
        message = o["unsupported"]
        assert "_get_local_used_map" in message and "prepare_for_backward" in message, message
    side_by_side(
        "model.reducer.prepare_for_backward after a no_sync forward; two prepared backward passes of one forward",
        describe(theirs[0], TOL),
        describe(ours[0], TOL),
    )


def test_manual_backward_finalization(world2):
    for rank, o in enumerate(world2.run(rewrap.manual_finalization)):
        assert o["max_diff"] <= TOL, f"rank {rank}: off by {o['max_diff']}"
        assert o["refused"] and "finalize_backward" in o["refused"], f"rank {rank}: {o}"
