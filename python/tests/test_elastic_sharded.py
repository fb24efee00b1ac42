"""Elastic jobs with sharded gradients and optimizer state (``--shard``):
each partition lives on its rank and on the rank before it (its buddy), so a
lost rank loses nothing. The same example and checks as ``test_elastic``:
the survivors bitwise identical, equal to one process replaying the applied
steps, and (partial policy) no step skipped that the survivors could finish.
"""

import pytest
from test_elastic import PACED, exact, explain, launch, rejoined
from test_elastic import test_a_silent_rank_is_found_by_the_liveness_check_and_the_minority_leaves as _silent


def skipped(first, steps):
    return steps - len(first["history"])


# (rank, phase, policy, steps the survivors may skip). Under the partial
# policy nothing is skipped: a loss mid-backward is reduced again among the
# survivors (in the new layout); a loss after backward (before the
# optimizer step, or inside it: after some ranks stepped their partitions,
# before the parameters' all-gather) is stepped by every survivor, from the
# buddy copies where the lost rank's partition is concerned.
KILLS = [
    # AdamW (its step count is per-parameter state that moves too), clipped by the global norm.
    (0, "gather", "partial", 0, ("--adamw", "--clip", "0.5")),
]
# The rest of the matrix: -m slow (every one with --buffer).
SLOW_KILLS = [
    (1, "backward", "partial", 0),  # reduced again among the survivors, in the new layout
    (2, "optimizer", "skip", 0),  # every survivor holds the averages: all step in the settlement
    (0, "forward", "skip", 1),
    (1, "backward", "skip", 1),
    (0, "collective", "skip", 1),
    (2, "collective", "partial", 1),  # one survivor may apply the step first: dropped then
    (1, "optimizer", "partial", 0),
    (2, "gather", "skip", 0),
    (1, "between", "skip", 1),
    (0, "boundary", "partial", 1),
]


def _killed(tmp_path, rank, phase, policy, allowed, *extra):
    proc, found = launch(tmp_path, 3, "--steps", "10", "--shard", "--kill", f"{rank}@4:{phase}",
                         "--abort-policy", policy, *extra)
    first = exact(proc, found, {0, 1, 2} - {rank})
    assert skipped(first, 10) <= allowed, f"{skipped(first, 10)} steps skipped\n{explain(proc)}"
    assert [w for _, w, *_ in first["history"]][-1] == 2


@pytest.mark.parametrize("rank,phase,policy,allowed,extra", KILLS)
def test_a_sharded_job_loses_nothing_when_a_rank_is_killed(tmp_path, rank, phase, policy, allowed, extra):
    _killed(tmp_path, rank, phase, policy, allowed, *extra)


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase,policy,allowed", SLOW_KILLS)
def test_every_phase_of_a_sharded_job_keeps_the_survivors_exact(tmp_path, rank, phase, policy, allowed):
    _killed(tmp_path, rank, phase, policy, allowed, "--buffer")


def test_a_rank_and_its_buddy_lost_together_end_the_job_saying_the_shard_is_lost(tmp_path):
    """Ranks 1 and 2 of 4 die at once: partition 2 lived on both (its own
    rank and its buddy, rank 1): the survivors stop with a ``shard_lost``
    error that says which ranks and what to do, instead of training on
    with state missing."""
    proc, _ = launch(tmp_path, 4, "--steps", "10", "--shard", "--kill", "1@4:forward", "--kill", "2@4:forward")
    assert proc.returncode == 1, explain(proc)
    assert "(shard_lost)" in proc.stderr and "ranks [1, 2] of the last membership" in proc.stderr, explain(proc)
    assert "restart it from the last sharded checkpoint" in proc.stderr, explain(proc)


def test_after_a_lost_shard_the_job_restarts_from_its_checkpoint_on_fewer_members_exactly(tmp_path):
    """The way out the ``shard_lost`` error names: a job of 4 saves a sharded
    checkpoint after step 3 (on its elastic membership: no torch default
    group of its own), loses ranks 1 and 2 together at step 4 and stops;
    a job of the 2 members left loads the checkpoint, goes on at step 4 and
    ends equal to one process replaying the whole history (steps 0-3 at
    world 4, the rest at world 2)."""
    ckpt = str(tmp_path / "ckpt")
    proc, _ = launch(tmp_path, 4, "--steps", "10", "--shard", "--save-at", "3", "--checkpoint", ckpt,
                     "--kill", "1@4:forward", "--kill", "2@4:forward")
    assert proc.returncode == 1 and "(shard_lost)" in proc.stderr, explain(proc)
    again = tmp_path / "restart"
    again.mkdir()
    proc, found = launch(again, 2, "--steps", "10", "--shard", "--resume", ckpt, "--data-world", "4")
    first = exact(proc, found, {0, 1})
    assert [(s, w) for s, w, *_ in first["history"]] == [(s, 4) for s in range(4)] + [(s, 2) for s in range(4, 10)]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout, explain(proc)


@pytest.mark.slow
def test_two_ranks_lost_that_are_not_buddies_lose_nothing(tmp_path):
    """Ranks 1 and 3 of 4 die at once: each one's partition lives on at the
    rank before it (0 and 2), and the two survivors go on exactly."""
    proc, found = launch(tmp_path, 4, "--steps", "10", "--shard", "--kill", "1@4:forward", "--kill", "3@4:forward")
    first = exact(proc, found, {0, 2})
    assert [w for _, w, *_ in first["history"]][-1] == 2


@pytest.mark.slow
def test_a_replacement_of_a_sharded_rank_receives_its_partitions(tmp_path):
    """Rank 1 of 3 killed; its replacement is admitted, receives its new
    partition and its buddy's (state moved from the members), and the job
    ends with three bitwise identical members equal to the replay."""
    proc, found = launch(tmp_path, 3, "--steps", "300", *PACED, "--shard", "--kill", "1@3:backward", rejoin=True)
    rejoined(proc, found)


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase", [(1, "freeze"), (0, "stall")])
def test_a_silent_sharded_rank_is_found_and_its_partition_moves(tmp_path, rank, phase):
    """``test_elastic``'s silent rank (SIGSTOP: its sockets stay open), sharded:
    the liveness monitor breaks the epoch, the survivors settle from the
    buddy copies and go on; the frozen process leaves when it wakes."""
    _silent(tmp_path, rank, phase, ("--shard",))
