"""Faults from Python: aborts under both policies, a rank that stops
answering (named within the deadline + 20%), a rank that dies, ranks whose
models differ, and uneven inputs."""

import pytest

import faults


def test_out_of_memory_on_one_rank_under_the_partial_policy(world3):
    for rank, out in enumerate(world3.run(faults.partial_abort)):
        assert out["outcome"] == "partial", f"rank {rank}: {out}"
        assert out["aborted"] == [(2, "out_of_memory")]
        assert out["contributors"] == 2
        assert out["max_diff"] < 1e-5, f"rank {rank}: off by {out['max_diff']} (the aborting rank's 1000s must be retracted)"


@pytest.mark.parametrize("setting", ["shard_gradients", "shard_parameters"])
def test_a_sharded_job_recovers_from_a_failed_step_with_reset(fresh_world, setting):
    # The reset dropped a sharded scheduler's partitions: the next step lent whole buckets
    # and the wrapper stopped on "a sharded step's buckets are not its plan's".
    out = fresh_world(2).run(faults.stalled_rank_sharded, 2.0, setting, timeout=90)
    for rank, o in enumerate(out):
        assert o["error"] in ("TimeoutError", "CommunicationError"), o
        assert o["max_diff"] < 1e-9, f"rank {rank}: after reset, off by {o['max_diff']}"


def test_a_stalled_rank_is_named_within_the_deadline_and_reset_recovers(fresh_world):
    timeout_s = 2.0
    world = fresh_world(2)
    out = world.run(faults.stalled_rank, timeout_s, timeout=90)
    healthy, stalled = out
    assert healthy["error"] == "TimeoutError", healthy["message"]
    assert healthy["missing"] == [1], healthy["message"]
    assert healthy["waited"] <= timeout_s * 1.2, f"rank 0 waited {healthy['waited']:.2f} s for a {timeout_s} s deadline"
    assert "rank" in healthy["message"] and "reset()" in healthy["message"]
    assert stalled["error"] in ("TimeoutError", "CommunicationError"), stalled["message"]
    assert healthy["restart"] == stalled["restart"]
    for o in out:
        assert o["max_diff"] < 1e-5, f"after reset, off by {o['max_diff']}"


def test_ranks_with_different_models_get_a_desync_naming_the_odd_rank(world3):
    for rank, out in enumerate(world3.run(faults.desync)):
        assert out is not None, f"rank {rank}: no desync raised"
        assert (out["ranks"], out["majority"]) == ([2], True), out["message"]


def test_a_rank_that_dies_is_named_within_the_deadline(fresh_world):
    timeout_s = 3.0
    world = fresh_world(2)
    out = world.run(faults.killed_rank, timeout_s, timeout=60, allow_dead=(1,))
    survivor = out[0]
    assert survivor is not None
    assert survivor["waited"] <= timeout_s * 1.2, f"waited {survivor['waited']:.2f} s"
    named = survivor["named"] if isinstance(survivor["named"], list) else [survivor["named"]]
    assert named == [1], survivor["message"]


def test_uneven_inputs_join(world3):
    out = world3.run(faults.uneven_inputs)
    for rank, o in enumerate(out):
        assert o["max_diff"] < 1e-5, f"rank {rank}: off by {o['max_diff']}"
    assert out[0]["contributors"] == [3, 3, 2, 1]
    assert out[1]["joined"]["first_step"] == 2 and out[0]["joined"]["first_step"] == 4
    assert {o["joined"]["first_step"] + o["joined"]["steps"] for o in out} == {5}
