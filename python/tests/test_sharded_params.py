"""Parameter sharding (``shard_parameters=True``, ZeRO-3): a unit's
parameters are whole while its forward or backward runs (or, gathered once
per step, from a forward to the step's end) and released between steps,
each rank holding its pieces only; training stays exact through
aborts, accumulation and clipping; what a program writes into whole
parameters is kept; a state dict between steps is read whole, on one rank alone too, and a load reaches every rank's pieces; uneven
inputs (``join``) are exact. Every case of the sharded table runs under it too
(``test_sharded.py``), and here paced for memory (``buckets_in_flight=0,
prefetch_units=False``, each child a unit)."""

import pytest

import sharded
import sharded_params
from gradsync import ConfigError
from gradsync.torch.sharding.settings import refuse
from sharded import case, check


@pytest.mark.parametrize("name", list(sharded.CASES))
def test_every_case_trains_exactly_paced_for_memory(world2, name):
    # Each child with parameters a unit (as FSDP2 gets them), no bucket still reducing
    # when a unit's backward begins, no unit gathered ahead.
    check(world2.run(case, "gradsync-params-lean", name))


@pytest.mark.parametrize("units", [True, []], ids=["units", "one-gather"])
def test_one_rank_alone_saves_the_whole_state_dict_while_the_others_train_on(world3, units):
    # Rank 1 saves (not rank 0) the model's and the optimizer's state dicts; the others'
    # runtimes serve their pieces and the optimizer's state of them, the saver's read waits
    # for a rank still before its optimizer step, nothing is gathered.
    seen = world3.run(sharded_params.saved_by_one_rank, units=units, saver=1)
    saver = seen[1]
    assert saver["keys"] == [f"module.{n}" for n in ("0.bias", "0.weight", "2.bias", "2.weight", "4.bias",
                                                     "4.weight")], saver["keys"]
    assert max(saver["saved"]) <= sharded.ATOL, f"the saved state is off by {saver['saved']}"
    assert saver["after"] == [0, 0, 0], f"the saver's parameters stayed whole: {saver['after']}"
    assert saver["optimizer"] <= sharded.ATOL, f"the optimizer's state, read alone, is off by {saver['optimizer']}"
    for rank, s in enumerate(seen):
        assert s["final"] <= sharded.ATOL, f"rank {rank}: off by {s['final']}"


def test_a_load_every_rank_must_make_names_the_rank_that_never_made_it(world2):
    # Each rank loads its own pieces, so a load waits until every rank is through the reads of the
    # version it replaces: now by a counter and one gate key (it waited on every rank's key, O(world)
    # store operations for each rank); the rank that never comes is still named.
    seen = world2.run(sharded_params.a_rank_never_loads)[0]
    assert "ranks [1] did not come to it within 3 s" in seen["error"], seen
    assert 2.5 < seen["waited"] < 30, seen


@pytest.mark.parametrize("units", [True, []], ids=["units", "one-gather"])
def test_one_rank_alone_evaluates_between_steps_while_the_others_train_on(world3, units):
    # nanoGPT's estimate_loss() on the master process only: its units are read from the
    # others' piece servers, no round is asked of them, and they are released after.
    seen = world3.run(sharded_params.evaluated_by_one_rank, units=units)
    assert seen[0]["eval"] <= sharded.ATOL, f"the evaluation is off by {seen[0]['eval']}"
    assert seen[0]["after"] == [0, 0, 0], f"the evaluation left parameters whole: {seen[0]['after']}"
    for rank, s in enumerate(seen):
        assert s["final"] <= sharded.ATOL, f"rank {rank}: off by {s['final']}"


def test_a_layer_shared_by_two_checkpointed_segments_under_autocast_is_exact(world2):
    # Backward inside the autocast region: the shared weight's bfloat16 copy is cast once and
    # cached, so its gradient arrives after its unit was released (it once failed in
    # AccumulateGrad: "The size of tensor a (0) must match the size of tensor b (16)").
    for rank, diff in enumerate(world2.run(sharded_params.shared_layer_under_autocast)):
        assert diff <= 1e-6, f"rank {rank}: off by {diff}"


@pytest.mark.parametrize("units", [True, []], ids=["units", "one-gather"])
def test_parameters_are_released_between_steps_and_whole_in_forward(world2, units):
    for rank, seen in enumerate(world2.run(sharded_params.residence, units=units)):
        assert seen["between"] == (0 if units else 24), f"rank {rank}: a unit's bias held {seen['between']} values"
        assert seen["after_backward"] == [0, 0, 0], f"rank {rank}: parameters not released at the step's end"
        assert seen["after_step"] == [0, 0, 0], f"rank {rank}: the optimizer step gathered the parameters"
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
        assert seen["eval"] <= 1e-12, f"rank {rank}: the evaluation forward read other values ({seen['eval']})"
        assert seen["after_eval"] == 0, f"rank {rank}: the evaluation forward left the parameters whole"
        assert not seen["gathered_again"], f"rank {rank}: a forward inside the step gathered again"
        assert seen["state_diff"] <= sharded.ATOL, f"rank {rank}: whole_parameters() state dict off"
        assert seen["after_writes"] <= sharded.ATOL, f"rank {rank}: a write into whole parameters was lost"
        assert seen["state_dict"] <= sharded.ATOL, f"rank {rank}: the state dict between steps is off"
        assert seen["after_state_dicts"] == 0, f"rank {rank}: a state dict or a load left the parameters whole"
    held = [seen["held"] for seen in world2.run(sharded_params.residence, steps=1, units=units)]
    # Each rank holds its partition: together, every parameter once.
    assert sum(held) == seen["whole"] and max(held) <= seen["whole"] // 2 + 64, held


def test_complex_half_transposed_frozen_and_unused_parameters_come_back_as_they_were(world2):
    for rank, seen in enumerate(world2.run(sharded_params.mixed_parameters)):
        for name, got in seen.items():
            assert got["diff"] == 0.0, f"rank {rank}: {name} off by {got['diff']}"
            assert (got["dtype"], got["stride"]) == got["want"], f"rank {rank}: {name} came back as {got}"
            # A frozen parameter is not synchronized: it stays whole.
            assert (got["between"] > 0) == (name == "frozen"), f"rank {rank}: {name}: {got['between']} between steps"


@pytest.mark.parametrize("policy", ["skip", "partial"])
def test_an_out_of_memory_rank_is_exact_under_either_policy(world2, policy):
    check(world2.run(case, "gradsync-params", "checkpoint_twice_reentrant", aborts=[(1, 1)], policy=policy))


def test_an_out_of_memory_error_while_the_parameters_are_allocated_skips_the_step(world2):
    # Rank 1's gather is under way when it runs out of memory: every gather completes, the
    # step is skipped everywhere, training goes on exactly; a retried forward is told to abort.
    results = world2.run(sharded_params.out_of_memory_while_gathering, timeout=60)
    for rank, seen in enumerate(results):
        assert seen["outcomes"] == ["applied", "applied", "skipped", "applied"], f"rank {rank}: {seen}"
        assert seen["params"] <= sharded.ATOL, f"rank {rank}: parameters off by {seen['params']}"
    assert results[1]["retry"] is not None and "abort_step" in results[1]["retry"], results[1]


def test_no_sync_accumulation_and_clipping_are_exact(world2):
    check(world2.run(case, "gradsync-params", "shared_weight_between_segments", micro=2))
    check(world2.run(case, "gradsync-params", "checkpoint_twice_reentrant", clip=0.05))


def test_reduce_scattered_on_gloo_too(world2):
    check(world2.run(case, "gradsync-params", "rank_dependent_control_flow", scatter=True))


@pytest.mark.parametrize("units", [True, []], ids=["units", "one-gather"])
def test_the_module_evaluated_directly_gathers_and_a_direct_training_call_is_refused(world2, units):
    # HF Trainer evaluates the bare module (its DDP wrapper is for training only): under no_grad it gathers
    # as the wrapper's forward does and releases after; with gradients on it says to call the wrapper.
    for rank, seen in enumerate(world2.run(sharded_params.direct_evaluation, units=units)):
        assert seen["eval"] <= sharded.ATOL, f"rank {rank}: the evaluation is off by {seen['eval']}"
        assert seen["after"] == [0, 0], f"rank {rank}: the evaluation left parameters whole: {seen['after']}"
        assert seen["with_grad"] is not None and "call the wrapper" in seen["with_grad"], seen["with_grad"]


@pytest.mark.parametrize("units", [True, []], ids=["units", "one-gather"])
@pytest.mark.parametrize("immediate,micro", [(False, 1), (True, 1), (False, 2)],
                         ids=["join-context", "join_now", "join-context-no_sync"])
def test_uneven_inputs_a_rank_out_of_data_serves_the_gathers_and_steps_its_partition(world3, units, immediate,
                                                                                       micro):
    # Rank 2 runs out after 2 steps, rank 1 after 4, rank 0 trains 6: the joined ranks take part in the
    # others' gathers (asking for nothing) and step their pieces; with no_sync micro-batches every one of
    # them gathers, so the joined ranks are told at a step's first forward. Exact, no hang; and a
    # joined rank's zeros go out before it serves, so no unit's backward waits for them.
    results = world3.run(sharded.uneven_inputs, immediate=immediate, micro=micro, shard_parameters=units, timeout=90)
    for rank, got in enumerate(results):
        assert got["diff"] <= sharded.ATOL, f"rank {rank}: parameters off by {got['diff']}"


def test_param_dtype_in_an_elastic_job_is_refused_with_what_to_do():
    # (shard_parameters=True itself is elastic: test_elastic_sharded_params.)
    refuse({"shard_parameters": True, "elastic": object()}, [])
    with pytest.raises(ConfigError, match="param_dtype in an elastic job.*torch.autocast"):
        refuse({"shard_parameters": True, "param_dtype": "bfloat16", "elastic": object()}, [])


@pytest.mark.parametrize("scatter", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_device_plane_buckets_on_cpu_tensors(world2, scatter):
    # What runs on a GPU, less NCCL: the gathers into the plane's buffers, the parameters allocated again.
    check(world2.run(case, "gradsync-params", "checkpoint_twice_weight_sharing", buckets="device", scatter=scatter))


def test_a_dcp_checkpoint_of_two_ranks_loads_on_three(world2, world3, tmp_path):
    # gradsync.torch.checkpoint gathers the parameters whole to save them, and each rank's pieces take the
    # loaded values (its parameters released before the load, as a resumed job's are after a step).
    path = str(tmp_path / "ckpt")
    saved = world2.run(sharded.dcp_save, path, impl="gradsync-params")[0]
    for rank, got in enumerate(world3.run(sharded.dcp_load, path, saved, impl="gradsync-params")):
        assert got["keys"] and got["steps"], f"rank {rank}: {got}"
        assert got["params"] == 0.0 and got["state"] == 0.0, f"rank {rank}: {got}"
