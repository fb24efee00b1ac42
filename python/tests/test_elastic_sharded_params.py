"""Elastic jobs with sharded parameters (``--shard-params``: ZeRO-3, each
block of the example gathered for its forward and its backward on the
gather lane): a rank keeps its pieces of the parameters and its buddy's,
so a lost rank loses nothing. The same example and checks as
``test_elastic_sharded``: the survivors bitwise identical, equal to one
process replaying the applied steps, each step's gradient norm equal to
the replay's.

What differs from ``shard_gradients=True``: a member lost while the others
gather (their forward, their backward) fails those gathers; each survivor
runs its forward and backward to their end on zeros where a gather
failed, and the step's own collectives then fail and the members settle
as usual. A survivor that computed with such zeros cannot contribute the
step again, so under the partial policy a loss during the forward's
gathers skips the step (a loss late in backward, where a survivor only
served the others' rounds, does not). The optimizer step gathers nothing
under ZeRO-3: a loss there shows at the next boundary.
"""

import pytest
from test_elastic import PACED, exact, explain, launch, rank0, rejoined, reports, woken_after_a_freeze
from test_elastic import test_a_silent_rank_is_found_by_the_liveness_check_and_the_minority_leaves as _silent
from test_elastic_sharded import skipped

PARAMS = ("--shard-params",)

# (rank, phase, policy, steps the survivors may skip, extra arguments).
KILLS = [
    # Late in backward (the first block's gradient hook): the survivors'
    # rounds left were serving only, their gradients whole: reduced again.
    (1, "backward", "partial", 0, ("--adamw", "--clip", "0.5")),
    # Mid-forward: the survivors' gathers fail, they compute on zeros; skipped.
    (0, "forward", "skip", 1, ("--buffer",)),
]
SLOW_KILLS = [
    (0, "forward", "partial", 1),  # a survivor computed on zeros: nobody sums it again
    (2, "backward", "skip", 1),
    (0, "collective", "skip", 1),
    (2, "collective", "partial", 1),
    (2, "optimizer", "skip", 0),  # every survivor holds the averages: all step in the settlement
    (1, "optimizer", "partial", 0),
    (2, "gather", "skip", 1),  # (after its optimizer step: seen at the next boundary, as "between")
    (1, "between", "skip", 1),
    (0, "boundary", "partial", 1),
]


def _killed(tmp_path, rank, phase, policy, allowed, *extra):
    proc, found = launch(tmp_path, 3, "--steps", "10", *PARAMS, "--kill", f"{rank}@4:{phase}",
                         "--abort-policy", policy, *extra)
    first = exact(proc, found, {0, 1, 2} - {rank})
    assert skipped(first, 10) <= allowed, f"{skipped(first, 10)} steps skipped\n{explain(proc)}"
    assert [w for _, w, *_ in first["history"]][-1] == 2
    return proc


@pytest.mark.parametrize("rank,phase,policy,allowed,extra", KILLS)
def test_a_parameter_sharded_job_loses_nothing_when_a_rank_is_killed(tmp_path, rank, phase, policy, allowed, extra):
    proc = _killed(tmp_path, rank, phase, policy, allowed, *extra)
    assert f"members [{rank}] lost" in proc.stderr, explain(proc)


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase,policy,allowed", SLOW_KILLS)
def test_every_phase_of_a_parameter_sharded_job_keeps_the_survivors_exact(tmp_path, rank, phase, policy, allowed):
    _killed(tmp_path, rank, phase, policy, allowed, "--buffer")


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase,policy,allowed", [(0, "forward", "skip", 1), (1, "backward", "partial", 0),
                                                       (2, "optimizer", "skip", 0)])
def test_a_job_that_gathers_the_whole_model_once_per_step_loses_nothing(tmp_path, rank, phase, policy, allowed):
    """``shard_parameters=[]`` (one unit: the whole model gathered at the
    step's first forward, on the runtime's own communicator): a failed
    gather fails the step like a failed reduction."""
    proc, found = launch(tmp_path, 3, "--steps", "10", "--shard-params", "whole", "--kill", f"{rank}@4:{phase}",
                         "--abort-policy", policy, "--buffer")
    first = exact(proc, found, {0, 1, 2} - {rank})
    assert skipped(first, 10) <= allowed, f"{skipped(first, 10)} steps skipped\n{explain(proc)}"


def test_a_rank_and_its_buddy_lost_together_end_the_parameter_sharded_job_saying_the_shard_is_lost(tmp_path):
    """Ranks 1 and 2 of 4 die at once in forward: partition 2 of the
    parameters lived on both. The survivors stop with the ``shard_lost``
    error (which names the ranks and the way out) instead of gathering
    parameters nobody holds."""
    proc, _ = launch(tmp_path, 4, "--steps", "10", *PARAMS, "--kill", "1@4:forward", "--kill", "2@4:forward")
    assert proc.returncode == 1, explain(proc)
    assert "(shard_lost)" in proc.stderr and "ranks [1, 2] of the last membership" in proc.stderr, explain(proc)
    assert "restart it from the last sharded checkpoint" in proc.stderr, explain(proc)


@pytest.mark.slow
def test_after_a_lost_parameter_shard_the_job_restarts_from_its_checkpoint_exactly(tmp_path):
    """The way out: a job of 4 saves a sharded checkpoint after step 3,
    loses ranks 1 and 2 together at step 4 and stops; a job of the 2
    members left loads it and ends equal to the replay of the whole
    history (steps 0-3 at world 4, the rest at world 2)."""
    ckpt = str(tmp_path / "ckpt")
    proc, _ = launch(tmp_path, 4, "--steps", "10", *PARAMS, "--save-at", "3", "--checkpoint", ckpt,
                     "--kill", "1@4:forward", "--kill", "2@4:forward")
    assert proc.returncode == 1 and "(shard_lost)" in proc.stderr, explain(proc)
    again = tmp_path / "restart"
    again.mkdir()
    proc, found = launch(again, 2, "--steps", "10", *PARAMS, "--resume", ckpt, "--data-world", "4")
    first = exact(proc, found, {0, 1})
    assert [(s, w) for s, w, *_ in first["history"]] == [(s, 4) for s in range(4)] + [(s, 2) for s in range(4, 10)]


@pytest.mark.slow
def test_two_ranks_lost_that_are_not_buddies_lose_no_parameter(tmp_path):
    """Ranks 1 and 3 of 4 die at once: each one's pieces live on at the
    rank before it, and the two survivors go on exactly."""
    proc, found = launch(tmp_path, 4, "--steps", "10", *PARAMS, "--kill", "1@4:forward", "--kill", "3@4:forward")
    first = exact(proc, found, {0, 2})
    assert [w for _, w, *_ in first["history"]][-1] == 2


@pytest.mark.slow
def test_a_replacement_of_a_parameter_sharded_rank_receives_its_pieces(tmp_path):
    """Rank 1 of 3 killed; its replacement (which built the model whole,
    from its own initialization) is admitted, receives its pieces of the
    parameters and of the optimizer state and its buddy's, gathers like the
    others from its first step on, and the job ends with three bitwise
    identical members equal to the replay."""
    proc, found = launch(tmp_path, 3, "--steps", "300", *PACED, *PARAMS, "--kill", "1@3:backward", rejoin=True)
    rejoined(proc, found)


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase", [(1, "freeze"), (0, "stall")])
def test_a_silent_parameter_sharded_rank_is_found_and_its_pieces_move(tmp_path, rank, phase):
    """A rank frozen with SIGSTOP (its sockets open) while the others
    gather: the liveness monitor breaks the epoch, which cancels the
    gather lane's collectives too (the lane waits on the job's
    cancellation), and the survivors settle from the buddy copies."""
    _silent(tmp_path, rank, phase, ("--shard-params",))


@pytest.mark.parametrize("rank,phase,policy,allowed", [
    (2, "optimizer", "skip", 0),  # every survivor steps in the settlement, then averages
    pytest.param(1, "gather", "skip", 1, marks=pytest.mark.slow),  # rank 1 averaged step 4 in; the others too
    pytest.param(0, "forward", "partial", 1, marks=pytest.mark.slow),
])
def test_a_sharded_moving_average_loses_nothing_when_a_rank_is_killed(tmp_path, rank, phase, policy, allowed):
    """``--ema``: a ``ShardedAveragedModel`` (each member averages its
    pieces and its buddy's) through a kill: the averages of the lost
    member's pieces move with them, and the average rank 0 reads alone at
    the end equals torch's ``AveragedModel`` over the replay, with the
    same update count (elastic jobs refused it before)."""
    proc = _killed(tmp_path, rank, phase, policy, allowed, "--ema")
    first = rank0(reports(tmp_path))
    assert first["ema_counted"] and first["ema_diff"] <= 1e-6, explain(proc)


@pytest.mark.slow
def test_a_replacement_takes_its_pieces_of_the_moving_average(tmp_path):
    """``--ema`` with a replacement: it receives its pieces' averages with
    its pieces, and ``n_averaged`` and the averages of what is not sharded
    from a member that stayed; the average at the end is the replay's."""
    proc, found = launch(tmp_path, 3, "--steps", "300", *PACED, *PARAMS, "--ema", "--kill", "1@3:backward",
                         rejoin=True)
    first = rejoined(proc, found)
    assert first["ema_counted"] and first["ema_diff"] <= 1e-6, explain(proc)


def _read_alone_right(first, steps):
    """Rank 0's reads alone (``--read-alone``) were right: a norm log after
    every step equal to the replay's, the last equal to the gathered
    parameters', and the state dict read alone at the end equal to them,
    an evaluation through the wrapper alone equal to the gathered model's."""
    assert first["logged_steps"] == steps and first["logged_apart"] <= 1e-6, first
    assert first["logged_last"] == first["norm_now"] and first["read_alone_diff"] == 0.0, first
    assert first["evaluated_alone"] == first["evaluated"], first


def test_rank_zero_reads_the_model_alone_through_a_loss_from_the_buddy_copy(tmp_path):
    """``--read-alone``: after every step rank 0 alone logs the parameters'
    norms (each released parameter read from every member's piece server,
    while the others go on to their next forward) and at the end reads
    ``state_dict()`` alone. Rank 2 is killed after its step 4, and rank 0
    reads that step once it is gone: rank 2's pieces come from the buddy
    copy rank 1 serves of them; from step 5 on the servers are the new
    membership's. Every read is right (they were refused in elastic jobs)."""
    proc, found = launch(tmp_path, 3, "--steps", "10", *PARAMS, "--read-alone", "--kill", "2@4:between")
    first = exact(proc, found, {0, 1})
    assert "rank 2 was lost during a read alone; its pieces are read from its buddy copy" in proc.stderr, \
        explain(proc)
    _read_alone_right(first, 10)


@pytest.mark.slow
def test_rank_zero_reads_alone_from_a_replacement_once_it_joined(tmp_path):
    """Rank 1 killed mid-backward and replaced: the replacement serves its
    pieces from its first settlement on (not before: it holds none), and
    rank 0's reads alone stay right at every world (3, 2, 3)."""
    proc, found = launch(tmp_path, 3, "--steps", "300", *PACED, *PARAMS, "--read-alone", "--kill", "1@3:backward",
                         rejoin=True)
    _read_alone_right(rejoined(proc, found), 300)


@pytest.mark.slow
def test_a_read_alone_gives_up_on_a_silent_member_for_its_buddy_copy(tmp_path):
    """Rank 1 freezes (SIGSTOP) after its step 5's optimizer step, its
    sockets open, while rank 0 reads the model alone: the read waits for
    its server a second at a time until the liveness monitor broke the
    epoch, then takes rank 1's pieces from its own buddy copy of them (it
    would have waited out the collective timeout). Woken, rank 1 leaves at
    once (nobody is left for its server to wait for)."""
    proc, out, err, _ = woken_after_a_freeze(tmp_path, "--steps", "12", *PARAMS, "--read-alone", "--kill", "1@5:stall")
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    assert "rank 1 was lost during a read alone" in err, err[-3000:]
    first = next(r for r in reports(tmp_path).values() if r["rank"] == 0)
    assert first["ok"], f"{out[-2000:]}\n{err[-3000:]}"
    _read_alone_right(first, 12)
