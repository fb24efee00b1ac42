"""Training loops as libraries write them (``recipes.py``), side by side
with torch's DDP."""

import pytest

import recipes


@pytest.mark.parametrize("sharded", [False, True], ids=["", "sharded"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant_checkpointing"])
def test_timm_style_loop_leaves_what_ddp_leaves(world2, side_by_side, side_by_side_sharded, reentrant, sharded):
    """BatchNorm, no_sync accumulation, an EMA and eval forwards through the
    wrapper: every parameter, running statistic and EMA value equals DDP's
    bit for bit after every step (buffers are broadcast exactly when DDP
    broadcasts them). Sharded (``shard_gradients=True``, nothing else
    changed: the optimizer is converted at its first step): the same, bit
    for bit."""
    ours = world2.run(recipes.timm_loop, "gradsync", reentrant, sharded=sharded)
    theirs = world2.run(recipes.timm_loop, "ddp", reentrant)
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["status"] == "ok" and t["status"] == "ok", (o.get("error"), t.get("error"))
        for step, (mine, ddp) in enumerate(zip(o["states"], t["states"])):
            odd = [k for k in mine if not mine[k].equal(ddp[k])]
            assert not odd, f"rank {rank} step {step}: {odd} differ from DDP's"
    what = ", reentrant checkpointing" if reentrant else ""
    if sharded:
        side_by_side_sharded(f"timm-style loop: BatchNorm, no_sync, EMA, eval forwards{what}, "
                             "only shard_gradients=True added",
                             "ok, every state bit for bit unsharded DDP's")
    else:
        side_by_side(f"timm-style loop: BatchNorm, no_sync, EMA, eval forwards{what}", "ok",
                     "ok, every state bit for bit DDP's")


@pytest.mark.parametrize("sharded", [False, True], ids=["", "sharded"])
@pytest.mark.parametrize("first_out", [0, 1])
def test_uneven_inputs_with_buffers_end_as_ddp_ends(world2, side_by_side, side_by_side_sharded, first_out, sharded):
    """``with model.join():`` on a BatchNorm model, one rank out of data
    after 2 steps of 4: no hang, and every parameter and running statistic
    equals DDP's bit for bit (rank 0 out first: the buffers must come from a
    rank still training); sharded too (the rank out of data steps its
    partition for the others)."""
    ours = world2.run(recipes.uneven_with_buffers, "gradsync", first_out, sharded=sharded)
    theirs = world2.run(recipes.uneven_with_buffers, "ddp", first_out)
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["status"] == "ok" and t["status"] == "ok", (o.get("error"), t.get("error"))
        odd = [k for k in o["state"] if not o["state"][k].equal(t["state"][k])]
        assert not odd, f"rank {rank}: {odd} differ from DDP's"
    if sharded:
        side_by_side_sharded(f"uneven inputs with BatchNorm, rank {first_out} out of data first",
                             "ok, the same state bit for bit as unsharded DDP")
    else:
        side_by_side(f"uneven inputs with BatchNorm, rank {first_out} out of data first", "ok",
                     "ok, the same state bit for bit")
