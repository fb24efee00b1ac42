"""The failures that motivate gradsync, reproduced on real DDP side by side:
a weight shared between reentrant segments, two forwards of a reentrant-
checkpointed module before one backward, ``static_graph`` with a graph that
changes after the first step, and a rank that runs out of memory in backward.
"""

from cases import (
    ATOL,
    changing_graph,
    check,
    describe,
    oom_on_one_rank,
    shared_weight_between_segments,
    two_forwards_reentrant,
)


def test_weight_shared_between_reentrant_segments(world2, side_by_side):
    ours = world2.run(shared_weight_between_segments, "gradsync")
    check(ours)
    for flags, label in (({}, "plain DDP"), ({"find_unused_parameters": True}, "DDP find_unused_parameters")):
        theirs = world2.run(shared_weight_between_segments, "ddp", **flags)
        side_by_side(f"weight shared by two reentrant segments, {label}", describe(theirs[0]), describe(ours[0]))


def test_two_forwards_of_a_reentrant_checkpointed_module(world2, side_by_side):
    ours = world2.run(two_forwards_reentrant, "gradsync")
    check(ours)
    theirs = world2.run(two_forwards_reentrant, "ddp")
    side_by_side("two forwards of a reentrant-checkpointed module, plain DDP", describe(theirs[0]), describe(ours[0]))


def test_graph_that_changes_after_the_first_step(world2, side_by_side):
    ours = world2.run(changing_graph, "gradsync")
    check(ours)
    theirs = world2.run(changing_graph, "ddp", static_graph=True)
    side_by_side("a block skipped on odd steps, DDP static_graph", describe(theirs[0]), describe(ours[0]))


def test_out_of_memory_on_one_rank(fresh_world, side_by_side):
    """Rank 1 runs out of memory in backward at step 1 and skips the step.
    gradsync: every rank learns at once that the step was skipped and by whom
    (nobody applies it), and steps 0 and 2 are exact. DDP: the other rank
    blocks in backward until the process group's timeout."""
    world = fresh_world(2)
    ours = world.run(oom_on_one_rank, "gradsync", timeout=60)
    for rank, outcome in enumerate(ours):
        steps = outcome["steps"]
        assert [s["outcome"] for s in steps] == ["applied", "skipped", "applied"], f"rank {rank}: {steps}"
        assert steps[1]["seconds"] < 5, f"rank {rank} waited {steps[1]['seconds']:.1f} s for the skipped step"
        assert steps[1]["grads_none"], "a skipped step leaves no gradient to apply"
        for s in (steps[0], steps[2]):
            assert s["max_diff"] <= ATOL, f"rank {rank} step {s['step']}: off by {s['max_diff']}"
    world.close()
    # DDP, in a world of its own: its group is broken afterwards.
    timeout_s = 5
    world = fresh_world(2)
    theirs = world.run(oom_on_one_rank, "ddp", group_timeout_s=timeout_s, timeout=120)
    healthy = theirs[0]
    blocked = healthy.get("seconds") or max(s["seconds"] for s in healthy["steps"])
    detail = (
        f"rank 0 blocked in backward {blocked:.1f} s (the group's timeout, {timeout_s} s here, 30 min by default), "
        f"then `{healthy.get('error', 'no error')}`"
    )
    side_by_side(
        "one rank out of memory in backward, skips the step",
        detail,
        f"skipped on every rank in {max(o['steps'][1]['seconds'] for o in ours):.2f} s (abort_step); "
        f"next step exact ({max(o['steps'][2]['max_diff'] for o in ours):.1e})",
    )
