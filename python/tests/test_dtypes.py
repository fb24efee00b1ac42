"""float64 gradients reduced in float64, float32 and float64 side by side,
sparse gradients: exact against the one-process replay, side by side with
torch's DDP (the cases are in ``dtypes.py``)."""

import pytest

import dtypes


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant_checkpointing"])
def test_float64_is_reduced_in_float64(world2, side_by_side, reentrant):
    ours = world2.run(dtypes.float64_training, "gradsync", reentrant)
    theirs = world2.run(dtypes.float64_training, "ddp", reentrant)
    for rank, o in enumerate(ours):
        assert o["status"] == "ok", o
        assert o["grad_types"] == ["torch.float64"], o
        # Averaging in float32 lands about 1e-8 away; float64 all the way, about 1e-16.
        assert o["max_diff"] <= dtypes.F64_TOL, f"rank {rank}: parameters {o['max_diff']:.1e} from the replay"
    what = "reentrant checkpointing" if reentrant else "plain"
    side_by_side(f"dtypes: float64 model, 4 SGD steps ({what})", f"{theirs[0]['max_diff']:.1e}", f"{ours[0]['max_diff']:.1e}")


def test_float32_and_float64_parameters_in_one_model(world2, side_by_side):
    """Buckets hold one type each; a late float64 gradient (a weight shared
    by two reentrant segments) is corrected in float64."""
    ours = world2.run(dtypes.mixed_types, "gradsync")
    theirs = world2.run(dtypes.mixed_types, "ddp")
    for rank, o in enumerate(ours):
        assert o["status"] == "ok", o
        assert o["worst"]["float64"] <= dtypes.F64_TOL, f"rank {rank}: {o['worst']}"
        assert o["worst"]["float32"] <= 1e-6, f"rank {rank}: {o['worst']}"
        assert o["corrections"][0] >= 1, f"rank {rank}: the shared weight's second gradient was not late: {o}"
    side_by_side(
        "dtypes: float32 and float64 parameters, a shared float64 weight under reentrant checkpointing",
        f"{theirs[0]['max_diff']:.1e}" if theirs[0]["status"] == "ok" else theirs[0]["error"],
        f"{ours[0]['worst']['float64']:.1e} (float64), {ours[0]['worst']['float32']:.1e} (float32)",
    )


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant_checkpointing"])
@pytest.mark.parametrize("which", ["sparse_adam", "sgd"])
def test_sparse_embedding_gradients(world2, side_by_side, which, reentrant):
    """A sparse embedding's gradient is averaged as DDP averages it (the sum
    of every rank's rows, divided), stays sparse for SparseAdam, and counts
    a lookup recomputed by checkpointing once."""
    ours = world2.run(dtypes.sparse_training, "gradsync", which, reentrant)
    theirs = world2.run(dtypes.sparse_training, "ddp", which, reentrant)
    for rank, o in enumerate(ours):
        assert o["status"] == "ok", o
        assert o["sparse_grads"], f"rank {rank}: the table's gradient became dense"
        assert o["max_diff"] <= dtypes.F64_TOL, f"rank {rank}: parameters {o['max_diff']:.1e} from the replay"
    assert ours[0]["table"].equal(ours[1]["table"]), "the ranks' tables differ"
    what = f"sparse embedding, {'SparseAdam' if which == 'sparse_adam' else 'SGD'}" + (
        ", reentrant checkpointing" if reentrant else ""
    )
    ddp = f"{theirs[0]['max_diff']:.1e}" if theirs[0]["status"] == "ok" else theirs[0]["error"]
    if theirs[0]["status"] == "ok" and theirs[0]["table"].equal(ours[0]["table"]):
        ddp += " (the same table, bit for bit)"
    side_by_side(f"dtypes: {what}", ddp, f"{ours[0]['max_diff']:.1e}")
