"""Sharded gradients (ZeRO-2, ``shard_gradients=True``): every side-by-side
pattern trains to the same parameters as one process on the whole batch,
with the optimizer stepping only each rank's partition (uneven inputs too);
the runtime keeps partitions, not whole buckets; the full optimizer state
consolidates to the unsharded optimizer's and loads back on another world
size; misuse is refused with a clear error."""

import re

import pytest

import sharded
from sharded import CASES, case, check


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_training_matches_one_process(world2, side_by_side_sharded, name):
    # Gradients and optimizer state sharded (ZeRO-2), then the parameters too (ZeRO-3).
    ours = world2.run(case, "gradsync", name)
    check(ours)
    params = world2.run(case, "gradsync-params", name)
    check(params)
    side_by_side_sharded(sharded.label(name), sharded.describe(ours[0]), sharded.describe(params[0]))


@pytest.mark.parametrize("name", ["checkpoint_twice_reentrant", "rank_dependent_control_flow"])
def test_reduce_scattered_on_gloo_too(world2, name):
    # Sharded wrappers all-reduce on gloo by default (cheaper there) and
    # keep their partition; the reduce-scatter path must be as exact.
    check(world2.run(case, "gradsync", name, scatter=True))


@pytest.mark.parametrize("options", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_torchs_multi_tensor_and_fused_optimizers_step_the_pieces_exactly(world2, options):
    # The pieces are a list of tensors (views of the parameters, cut where a
    # partition meets one), so AdamW's foreach and fused kernels take them
    # as they are; unused parameters must still be skipped.
    check(world2.run(case, "gradsync", "unused_parameters", optim=options))


@pytest.mark.parametrize("scatter", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_device_plane_buckets_on_cpu_tensors(world2, scatter):
    # The device plane's code (buckets as torch tensors, partitions copied
    # out by the shim) on CPU tensors: what runs on a GPU, less NCCL.
    check(world2.run(case, "gradsync", "rank_dependent_control_flow", buckets="device", scatter=scatter))


@pytest.mark.parametrize("scatter", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_unused_parameters_on_three_ranks(world3, scatter):
    # `never` is unused everywhere (AdamW must skip it), `odd` only on rank 1.
    check(world3.run(case, "gradsync", "unused_parameters", scatter=scatter))


@pytest.mark.parametrize("policy", ["skip", "partial"])
def test_an_out_of_memory_rank_is_exact_under_either_policy(world2, policy):
    # Rank 1 aborts step 1: skipped on every rank, or applied as the average of rank 0 alone.
    check(world2.run(case, "gradsync", "checkpoint_twice_reentrant", aborts=[(1, 1)], policy=policy))


def test_no_sync_accumulation_is_exact(world2):
    check(world2.run(case, "gradsync", "shared_weight_between_segments", micro=2))


def test_clip_grad_norm_is_the_global_norm(world2):
    # torch.nn.utils.clip_grad_norm_(model.parameters(), ...) on the sharded
    # wrapper returns the norm of the whole gradients (asserted against the
    # reference's inside the case) and clips by it.
    check(world2.run(case, "gradsync", "checkpoint_twice_reentrant", clip=0.05))


@pytest.mark.parametrize("scatter", [False, True], ids=["all-reduce", "reduce-scatter"])
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_partitions_equal_unsharded_gradients_bit_for_bit(world2, wire, scatter):
    # A half wire type rounds the sum; the partition holds the same rounding.
    assert world2.run(sharded.same_as_unsharded, wire_dtype=wire, scatter=scatter) == [0.0, 0.0]


@pytest.mark.parametrize("immediate", [False, True], ids=["join-context", "join_now"])
def test_uneven_inputs_a_rank_out_of_data_steps_its_partition_for_the_others(world3, immediate):
    for rank, got in enumerate(world3.run(sharded.uneven_inputs, immediate=immediate)):
        assert got["diff"] <= sharded.ATOL, f"rank {rank}: parameters off by {got['diff']}"


@pytest.mark.parametrize("how", ["explicit", "automatic"])
def test_an_optimizer_built_before_wrapping_is_taken_over_with_its_schedule(world2, how):
    # "automatic": the script is torch's DDP script with one changed line
    # (shard_gradients=True); the LR scheduler built over the optimizer
    # keeps scheduling it once it steps sharded.
    for rank, diff in enumerate(world2.run(sharded.take_over, how)):
        assert diff <= sharded.ATOL, f"rank {rank}: parameters off by {diff}"


def test_a_sharded_step_is_lent_only_while_no_earlier_step_is_on_loan(world2):
    # The C++ write-back's one loan guard, as unsharded: step 1's gradients
    # kept alive past zero_grad keep its memory on loan, so step 2's
    # averages are copies (never two steps' partitions lent at once); once
    # dropped, step 3 is lent again. Exact throughout.
    for rank, out in enumerate(world2.run(sharded.loans)):
        assert out["lent"] == [True, True, False, True], f"rank {rank}: {out}"
        assert out["diff"] <= sharded.ATOL, f"rank {rank}: {out}"


def test_the_runtime_keeps_partitions_not_whole_buckets(world2):
    # Unsharded, a whole set of buckets (two while a step's gradients are on
    # loan); sharded, the partitions (the plan's bytes / world) and one
    # whole buffer kept for the next bucket (partition.rs), plus metadata.
    for rank, m in enumerate(world2.run(sharded.runtime_memory)):
        assert m["whole"] >= m["plan"], m
        assert m["sharded"] <= m["plan"] / 2 + m["bucket"] + 4096, f"rank {rank}: {m}"
        assert m["sharded"] < 0.8 * m["whole"], f"rank {rank}: {m}"


def test_full_optimizer_state_consolidates_and_loads_on_any_world(world3):
    for result in world3.run(sharded.full_state):
        assert result["state_diff"] < 1e-15, result
        assert result["param_diff"] < sharded.ATOL, result


def test_a_dcp_checkpoint_of_two_ranks_loads_on_three(world2, world3, tmp_path):
    path = str(tmp_path / "ckpt")
    runs = world2.run(sharded.dcp_save, path)
    # The keys and step counts every rank saves are agreed without a word
    # per rank (O(world) a member at 10,000 ranks): none of those collectives.
    assert [run["grown"] for run in runs] == [0, 0]
    saved = runs[0]
    for rank, got in enumerate(world3.run(sharded.dcp_load, path, saved)):
        assert got["keys"] and got["steps"], f"rank {rank}: {got}"
        assert got["params"] == 0.0 and got["state"] == 0.0, f"rank {rank}: {got}"
        assert got["lr"] == [sharded.LR], "the groups' options come from the checkpoint"
    for message in world2.run(sharded.dcp_load_other_model, path):
        assert message.startswith("ConfigError") and "another model" in message, message


def test_step_counts_that_differ_by_parameter_are_saved_and_loaded_as_they_are(world2, world3, tmp_path):
    """One parameter a step ahead of the others: its scalars differ, so the
    save takes every rank's (the general path), and both the consolidated
    state and a load at another world keep each parameter's own count."""
    path = str(tmp_path / "ckpt")
    runs = world2.run(sharded.dcp_save, path, skew=True)
    saved = runs[0]
    steps = {n: float(values["step"]) for n, values in saved["optimizer"]["state"].items()}
    assert steps[0] == 4.0 and set(steps.values()) == {3.0, 4.0}, steps
    assert all(run["grown"] > 0 for run in runs), "the scalars differ: every rank's are gathered"
    for rank, got in enumerate(world3.run(sharded.dcp_load, path, saved)):
        assert got["keys"] and got["steps"], f"rank {rank}: {got}"
        assert got["params"] == 0.0 and got["state"] == 0.0, f"rank {rank}: {got}"


def test_a_dcp_checkpoint_of_a_process_group_subset_loads_on_another_world(world2, world3, tmp_path):
    """Processes 1 and 2 of 3 train on a ``process_group`` of their own
    (ranks 0 and 1 there): each writes the pieces of its rank in that group,
    and two processes of another job read them back, exact."""
    path = str(tmp_path / "ckpt")
    saved = world3.run(sharded.dcp_save, path, 3, [1, 2])[1]
    for rank, got in enumerate(world2.run(sharded.dcp_load, path, saved)):
        assert got["keys"] and got["steps"], f"rank {rank}: {got}"
        assert got["params"] == 0.0 and got["state"] == 0.0, f"rank {rank}: {got}"


def test_the_gather_and_the_clip_norm_are_the_runtimes_collectives(world2, tmp_path):
    """The parameter gather and the clip's norm run on the runtime's
    communicator (on its timeline, beside the buckets), not on a group of
    their own in Python."""
    for rank, names in enumerate(world2.run(sharded.runtime_collectives, str(tmp_path))):
        assert "gradient norm" in names and "all-gather bucket 0" in names, f"rank {rank}: {names}"


def test_misuse_is_refused_with_what_to_do(world2):
    errors = world2.run(sharded.bad_input)
    for rank, by_case in enumerate(errors):
        missing = [name for name, message in by_case.items() if message is None]
        assert not missing, f"rank {rank}: not refused: {missing}"
        assert "gradsync.torch.elementwise" in by_case["not_elementwise"]
        assert "not one the wrapper synchronizes" in by_case["mixed_optimizer"]
        assert "one optimizer per wrapper" in by_case["mixed_optimizer"], "the siamese pair is told what to do"
        assert "shard_gradients=True" in by_case["unsharded"]
    assert "ranks [1]" in errors[0]["groups_differ"]


def test_sparse_sharding_is_refused_before_anything_starts():
    import gradsync
    from gradsync.torch.sharding.settings import refuse

    with pytest.raises(gradsync.ConfigError, match="sparse=False") as refused:
        refuse({"shard_gradients": True}, ["emb.weight"])
    assert "shard_gradients=True" in str(refused.value)
    # A program that set shard_parameters is told about the setting it set.
    with pytest.raises(gradsync.ConfigError, match="sparse=False") as refused:
        refuse({"shard_parameters": True}, ["emb.weight"])
    assert "shard_parameters=True" in str(refused.value) and "shard_gradients" not in str(refused.value)


@pytest.mark.parametrize("settings", [{"shard_gradients": True}, {"shard_parameters": True}],
                         ids=["gradients", "parameters"])
def test_a_new_optimizer_each_step_is_refused_not_applied_twice(world2, settings):
    # Before, the second step applied the first step's averages again,
    # silently (0.06 off after three steps).
    for rank, o in enumerate(world2.run(sharded.fresh_optimizer_each_step, settings)):
        assert o["refused"] and "model.zero_grad()" in o["refused"], (rank, o)
        assert re.search(r"parameters \['\d\.(weight|bias)'", o["refused"]), f"rank {rank}: names no parameter: {o}"
        assert o["max_diff"] <= 1e-6, f"rank {rank}: cleared through the wrapper, still off by {o['max_diff']}"
