"""Cases from PyTorch's ``distributed_test.py`` and ``test_c10d_gloo.py``:
several forwards before one backward, control flow that differs across
steps and ranks, globally and locally unused parameters, a parameter used
outside ``forward``. gradsync must match the reference in every case; DDP
runs with the flags a user would pass and its outcome goes into the table.
"""

import pytest

from cases import check, control_flow, describe, parameter_used_outside_forward, static_graph_multi_forward, unused_parameters


def test_static_graph_multi_forward(world2, side_by_side):
    ours = world2.run(static_graph_multi_forward, "gradsync")
    check(ours)
    theirs = world2.run(static_graph_multi_forward, "ddp", static_graph=True)
    side_by_side("two forwards before one backward, DDP static_graph", describe(theirs[0]), describe(ours[0]))
    plain = world2.run(static_graph_multi_forward, "ddp")
    side_by_side("two forwards before one backward, plain DDP", describe(plain[0]), describe(ours[0]))


@pytest.mark.parametrize("rank_dependent", [False, True], ids=["same-across-ranks", "different-across-ranks"])
def test_control_flow(world3, side_by_side, rank_dependent):
    ours = world3.run(control_flow, "gradsync", rank_dependent)
    check(ours)
    what = "control flow that differs across ranks" if rank_dependent else "control flow that changes every step"
    theirs = world3.run(control_flow, "ddp", rank_dependent)
    side_by_side(f"{what} (world 3), plain DDP", describe(theirs[0]), describe(ours[0]))
    found = world3.run(control_flow, "ddp", rank_dependent, find_unused_parameters=True)
    side_by_side(f"{what} (world 3), DDP find_unused_parameters", describe(found[0]), describe(ours[0]))


def test_globally_and_locally_unused_parameters(world3, side_by_side):
    ours = world3.run(unused_parameters, "gradsync")
    check(ours)
    theirs = world3.run(unused_parameters, "ddp", find_unused_parameters=True)
    side_by_side(
        "a parameter unused everywhere, one unused on even ranks (world 3), DDP find_unused_parameters",
        describe(theirs[0]),
        describe(ours[0]),
    )


def test_parameter_used_outside_forward(world2, side_by_side):
    ours = world2.run(parameter_used_outside_forward, "gradsync")
    check(ours)
    theirs = world2.run(parameter_used_outside_forward, "ddp", find_unused_parameters=True)
    side_by_side("a parameter used outside forward, DDP find_unused_parameters", describe(theirs[0]), describe(ours[0]))
