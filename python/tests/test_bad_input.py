"""Bad input gets a clear exception, never a crash or a hang."""

import pytest
import torch

import bad_input
import gradsync
from gradsync.torch import DistributedDataParallel as DDP


def test_misuse_is_refused_with_a_clear_message(world2):
    for rank, seen in enumerate(world2.run(bad_input.misuse)):
        assert "sparse" in seen["sparse"] and "'weight'" in seen["sparse"], seen["sparse"]
        assert "sparse=True" in seen["sparse"], seen["sparse"]
        assert "at least one dense parameter" in seen["only_sparse"], seen["only_sparse"]
        assert "'0.weight'" in seen["tied"] and "tied" in seen["tied"], seen["tied"]
        assert "several devices" in seen["devices"], seen["devices"]
        assert "already" in seen["wrapper"] and ".module" in seen["wrapper"], seen["wrapper"]
        assert "retired" in seen["retired_forward"] and "'weight'" in seen["retired_forward"], seen["retired_forward"]
        for key in ("closed_forward", "closed_finish", "closed_abort"):
            assert "closed" in seen[key], seen[key]
        assert seen["rewrapped_step"] == 0 and seen["wrapped_after_drop"] == 0
        assert "'weight'" in seen["fp8"] and "float8_e4m3fn" in seen["fp8"] and "ignore" in seen["fp8"], seen["fp8"]
        assert "nothing to synchronize" in seen["frozen"]
        assert "sometimes" in seen["policy"]
        assert "'weight'" in seen["converted"] and "float64" in seen["converted"], seen["converted"]


def test_native_session_refuses_bad_registrations(world2):
    seen = world2.run(bad_input.native_misuse)[0]
    assert "one entry per parameter" in seen["lengths"]
    assert "registered twice" in seen["duplicate"]
    assert "int8" in seen["dtype"]
    assert "must be positive" in seen["timeout"]
    assert "invalid world" in seen["world"]
    assert "average" in seen["divisor"] and "contributors" in seen["divisor"], seen["divisor"]
    assert "int8" in seen["wire"] and "bfloat16" in seen["wire"], seen["wire"]


def test_an_unknown_abort_reason_is_refused_and_the_step_still_aborts(world2):
    for seen in world2.run(bad_input.unknown_abort_reason):
        assert "disk_full" in seen["refused"] and "out_of_memory" in seen["refused"], seen["refused"]
        assert seen["outcome"] == "skipped" and sorted(r for r, _ in seen["aborted"]) == [0, 1], seen


@pytest.mark.parametrize("how", ["constructor", "comm_hook"])
def test_ranks_with_different_wire_types_get_a_desync_naming_the_odd_rank(world2, how):
    for rank, seen in enumerate(world2.run(bad_input.wire_types_that_differ, how)):
        assert seen is not None, f"rank {rank}: no DesyncError"
        assert "wire type" in seen["message"], seen["message"]


def test_wrapping_without_a_process_group_says_what_to_do():
    with pytest.raises(gradsync.ConfigError, match="init_process_group"):
        DDP(torch.nn.Linear(2, 2))


def test_exceptions_form_one_hierarchy():
    assert issubclass(gradsync.TimeoutError, gradsync.StepFailedError)
    assert issubclass(gradsync.TimeoutError, TimeoutError)
    assert issubclass(gradsync.DesyncError, gradsync.StepFailedError)
    assert issubclass(gradsync.ConfigError, ValueError)
    assert all(issubclass(e, gradsync.GradsyncError) for e in (gradsync.ClosedError, gradsync.UnfinishedStepError))


def test_a_wrapper_closed_mid_step_does_not_wait_for_peers_that_never_come(world2):
    """Closing gives up a collective still waiting (here for a rank that
    never ran the step) instead of holding the close for its timeout (120 s),
    and freeing the wrapper then does not wait for gloo's own (360 s): the
    group whose collective is still waiting is left to the process."""
    seen = world2.run(bad_input.closed_mid_step)
    for rank, s in enumerate(seen):
        assert s["close_s"] < 30, f"rank {rank}: close took {s['close_s']:.1f} s"
        assert s["free_s"] < 30, f"rank {rank}: close and free took {s['free_s']:.1f} s"
