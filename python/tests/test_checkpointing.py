"""PyTorch's own DDP checkpointing tests (``_test_ddp_checkpointing`` in
``test/distributed/test_c10d_common.py``), ported: checkpoint once, twice,
twice with weight sharing, the dynamic module and its weight-sharing variant,
the weight-sharing ``Sequential`` checkpointed whole, and unused parameters,
each with ``use_reentrant`` True and False.

For gradsync every gradient must equal the single-process model's (PyTorch's
tolerances) in every variant. The same case runs under real DDP with the flag
a user would try; DDP's outcome goes into the side-by-side table, and its
failures are results, not test failures.
"""

import pytest

from cases import ATOL, checkpointing, describe

# (table name, model, options of both runs, DDP's flags)
PORTED = [
    ("checkpoint once", "once", {}, {}),
    ("checkpoint once, DDP static_graph", "once", {}, {"static_graph": True}),
    ("checkpoint twice", "twice", {}, {}),
    ("checkpoint twice, DDP find_unused_parameters", "twice", {}, {"find_unused_parameters": True}),
    ("checkpoint twice, DDP static_graph", "twice", {}, {"static_graph": True}),
    ("checkpoint twice + weight sharing, DDP static_graph", "twice_weight_sharing", {}, {"static_graph": True}),
    ("dynamic module, DDP find_unused_parameters", "dynamic", {"allow_none_grads": True}, {"find_unused_parameters": True}),
    (
        "dynamic module + weight sharing, DDP find_unused_parameters",
        "dynamic_weight_sharing",
        {"allow_none_grads": True},
        {"find_unused_parameters": True},
    ),
    ("weight-sharing Sequential checkpointed whole", "weight_sharing_sequential", {"run_checkpoint": True}, {}),
    ("unused parameters, DDP find_unused_parameters", "once", {}, {"find_unused_parameters": True}),
]


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("case", PORTED, ids=[c[0] for c in PORTED])
def test_ddp_checkpointing(world2, side_by_side, case, use_reentrant):
    name, model, options, ddp_flags = case
    ours = world2.run(checkpointing, model, "gradsync", use_reentrant=use_reentrant, **options)
    for rank, outcome in enumerate(ours):
        assert outcome["status"] == "ok"
        assert outcome["max_diff"] <= ATOL, f"rank {rank}: gradients off by {outcome['max_diff']}"
    theirs = world2.run(checkpointing, model, "ddp", use_reentrant=use_reentrant, **options, **ddp_flags)
    side_by_side(f"{name}, use_reentrant={use_reentrant}", describe(theirs[0]), describe(ours[0]))
