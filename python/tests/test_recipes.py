"""Training loops as libraries write them (``recipes.py``), side by side
with torch's DDP."""

import recipes


def test_timm_style_loop_leaves_what_ddp_leaves(world2, side_by_side):
    """BatchNorm, no_sync accumulation, an EMA and eval forwards through the
    wrapper: every parameter, running statistic and EMA value equals DDP's
    bit for bit after every step (buffers are broadcast exactly when DDP
    broadcasts them)."""
    ours = world2.run(recipes.timm_loop, "gradsync")
    theirs = world2.run(recipes.timm_loop, "ddp")
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["status"] == "ok" and t["status"] == "ok", (o.get("error"), t.get("error"))
        for step, (mine, ddp) in enumerate(zip(o["states"], t["states"])):
            odd = [k for k in mine if not mine[k].equal(ddp[k])]
            assert not odd, f"rank {rank} step {step}: {odd} differ from DDP's"
    side_by_side("timm-style loop: BatchNorm, no_sync, EMA, eval forwards", "ok", "ok, every state bit for bit DDP's")
