"""Parameter sharding by units (``shard_parameters=True`` on a model with
blocks): each block is gathered for its forward and again for its backward
and released in between, never twice needlessly under either
checkpointing; a block some ranks never run is gathered by the others'
rounds without a hang; units that differ across ranks, or that nest, or
are not the model's, are refused. Blocks compiled before wrapping, one
rank alone, and ``param_dtype`` (a bfloat16 copy gathered for each step,
float32 pieces) train exactly. ``buckets_in_flight`` bounds the reductions
a block's backward starts behind, and its wait runs out rather than hang a
rank whose peer needs it in a round."""

import json
import math

import pytest
import torch
import torch.nn as nn

import sharded
import sharded_units
from gradsync import ConfigError
from gradsync.torch.export import export
from gradsync.torch.sharding.model_state import blocks
from gradsync.torch.sharding.unit_modules import choose
from gradsync.torch.sharding.settings import BUCKETS_IN_FLIGHT, pacing_of, param_dtype_of
from world import World


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("recompute", [None, "reentrant", "non_reentrant"])
def test_each_block_is_gathered_for_its_forward_and_its_backward_only(world2, recompute, prefetch):
    steps = 3
    for rank, seen in enumerate(world2.run(sharded_units.training, recompute=recompute, steps=steps,
                                           prefetch=prefetch)):
        assert seen["names"] == ["(root)", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], seen["names"]
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
        # Forward, then backward (the recomputation inside it reuses the backward's gather,
        # or, reentrant, is the gather its backward uses), each step after the first (the
        # model is whole as built until the first step ends).
        assert seen["gathers"][1:5] == [2 * (steps - 1)] * 4, f"rank {rank}: {seen['gathers']}"
        # The block running, and (prefetched) the next one.
        assert seen["most_whole"] == (2 if prefetch else 1), f"rank {rank}: {seen['most_whole']} blocks whole"
        # Once a whole step's order is known (the first runs whole as built, the second
        # learns it), every block is gathered ahead: four in forward (the first while
        # the root computes), three in backward (the last block is still whole).
        assert seen["prefetched"] == (7 * (steps - 2) if prefetch else 0), f"rank {rank}: {seen['prefetched']}"
        assert seen["between"] == 0, f"rank {rank}: the blocks held values between forward and backward"


def test_one_gradient_passes_at_most_15_gradsync_files(world2):
    # Issue 72's bound on the path of one ZeRO-3 gradient (backward and optimizer step): it was about
    # 38 files, then 18; each file more is a seam the protocol leaks through.
    for rank, files in enumerate(world2.run(sharded_units.files_on_the_gradient_path)):
        assert "torch/sharding/units.py" in files, files  # (the trace sees the path at all)
        assert len(files) <= 15, f"rank {rank}: {len(files)} files: {files}"


def test_a_block_one_rank_never_runs_is_gathered_by_the_others_rounds(world2):
    seen = world2.run(sharded_units.extra_on_one_rank)
    for rank, got in enumerate(seen):
        assert got["worst"] <= sharded.ATOL, f"rank {rank}: off by {got['worst']}"
    # Rank 0 kept the extra block twice a step (after the first); rank 1 only served those gathers.
    assert [got["extra_gathers"] for got in seen] == [4, 0], seen


@pytest.mark.parametrize("in_flight", [0, 1])
def test_buckets_in_flight_bounds_the_reductions_a_blocks_backward_starts_behind(world2, in_flight):
    steps = 3
    for rank, seen in enumerate(world2.run(sharded_units.training, steps=steps, in_flight=in_flight)):
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
        # One wait per block's backward, each step after the first (which runs whole as built).
        assert len(seen["left_in_flight"]) == 4 * (steps - 1), f"rank {rank}: {seen}"
        assert max(seen["left_in_flight"]) <= in_flight, f"rank {rank}: {seen['left_in_flight']} in flight"


def test_buckets_in_flight_never_hangs_a_rank_whose_peer_needs_its_rounds_first(world2):
    # The extra block's bucket (used by rank 0 only) holds up the buckets after it in plan
    # order until rank 1's step ends, and each rank gets there only through rounds the
    # other joins: the waiting rank polls (joins the other's rounds while it waits), so no
    # wait needs a timer to end, the wait stays on for the job, and every step is exact.
    # (The protocol's own specification, actors/src/residency/tests/, drives this case
    # to a deadlock when polling is taken out.)
    seen = world2.run(sharded_units.extra_on_one_rank, in_flight=0)
    for rank, got in enumerate(seen):
        assert got["worst"] <= sharded.ATOL, f"rank {rank}: off by {got['worst']}"
        assert got["in_flight_after"] == 0, f"rank {rank}: the wait was switched off: {got}"
    assert [got["extra_gathers"] for got in seen] == [4, 0], seen


@pytest.mark.parametrize("settings,says", [
    ({"buckets_in_flight": -1}, "0 or more"), ({"buckets_in_flight": True}, "whole number"),
    ({"buckets_in_flight": 1.5}, "whole number"), ({"buckets_in_flight": "0"}, "whole number"),
    ({"prefetch_units": "no"}, "True .* or False"), ({"prefetch_units": 0}, "True .* or False"),
])
def test_pacing_settings_of_the_wrong_kind_are_refused(settings, says):
    with pytest.raises(ConfigError, match=says):
        pacing_of(settings, ([0, 1], ["(root)", "b"], [None]))


@pytest.mark.parametrize("settings", [{"buckets_in_flight": 0}, {"prefetch_units": False}])
def test_pacing_settings_without_units_are_refused(settings):
    name = next(iter(settings))
    for units in (None, ([0], ["(root)"], [])):
        with pytest.raises(ConfigError, match=f"{name} paces .* shard_parameters=True on a model with blocks"):
            pacing_of(settings, units)
    # Unset, they ask for nothing without blocks; None asks for nothing anywhere.
    assert pacing_of({}, None) == (None, True)
    assert pacing_of({"buckets_in_flight": None, "prefetch_units": True}, None) == (None, True)
    # With blocks, unless set: as FSDP2 bounds its reduce-scatters, one bucket may still reduce
    # while a block's backward begins on a CUDA device (a stream to overlap on), none on the CPU.
    blocks = ([0, 1], ["(root)", "b"], [None])
    assert pacing_of({}, blocks) == (0, True) and pacing_of({}, blocks, "cpu") == (0, True)
    assert pacing_of({}, blocks, "cuda") == (BUCKETS_IN_FLIGHT["cuda"], True) == (1, True)
    assert pacing_of({"buckets_in_flight": None}, blocks, "cuda") == (None, True)
    assert pacing_of(settings, blocks) == (settings.get("buckets_in_flight", 0), settings.get("prefetch_units", True))


def test_units_that_differ_across_ranks_are_refused_on_every_rank_when_wrapping(world2):
    errors = world2.run(sharded_units.units_differ)
    for rank, error in enumerate(errors):
        assert error is not None and "different units" in error and f"rank {rank}" in error, f"rank {rank}: {error}"


def test_units_must_be_the_models_modules_and_must_not_nest():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    params = list(model.parameters())
    # The largest list by parameters: the model itself, here.
    units, names, _ = choose(model, params, True)
    assert names == ["(root)", "0", "1"] and units == [1, 1, 2, 2, 2, 2], (names, units)
    units, names, _ = choose(model, params, list(model[1]))
    assert names == ["(root)", "1.0", "1.1"] and units == [0, 0, 1, 1, 2, 2], (names, units)
    assert choose(model, params, [])[1] == ["(root)"]
    with pytest.raises(ConfigError, match="nest"):
        choose(model, params, [model[1], model[1][0]])
    with pytest.raises(ConfigError, match="not a submodule"):
        choose(model, params, [nn.Linear(2, 2)])
    with pytest.raises(ConfigError, match="give True"):
        choose(model, params, "blocks")
    # A weight two units hold belongs to the first.
    shared = nn.Linear(2, 2)
    tied = nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared, nn.Linear(2, 2))])
    units, names, _ = choose(tied, list(tied.parameters()), True)
    assert units == [1, 1, 2, 2], units


@pytest.mark.parametrize("recompute", [None, "reentrant", "non_reentrant"])
def test_blocks_compiled_before_wrapping_are_units_gathered_as_eager_ones(world2, recompute):
    # torchtitan's order: each block torch.compile'd, then the model wrapped. The hooks run around the
    # compiled frames; a released parameter's storage regrown before backward is what the compiled
    # backward's saved tensors read.
    steps = 3
    for rank, seen in enumerate(world2.run(sharded_units.training, recompute=recompute, steps=steps, compiled=True,
                                           timeout=240)):
        assert seen["names"] == ["(root)", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], seen["names"]
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
        assert seen["gathers"][1:5] == [2 * (steps - 1)] * 4, f"rank {rank}: {seen['gathers']}"
        assert seen["between"] == 0, f"rank {rank}: the blocks held values between forward and backward"
        assert seen["graphs"] >= 1, f"rank {rank}: no block was compiled"


@pytest.mark.parametrize("recompute", [None, "non_reentrant"])
def test_blocks_compiled_after_wrapping_compile_no_more_graphs_than_unsharded(world2, recompute):
    # torchtitan compiles each layer after fully_shard: the units' hooks then run inside the compiled
    # frames. Dynamo leaves them out (they call into the runtime), so each block compiles to the same
    # graphs as unsharded, with no recompile (before: 35 graphs, recompile_limit hit in the hooks).
    steps = 3
    for rank, seen in enumerate(world2.run(sharded_units.training, recompute=recompute, steps=steps,
                                           compiled="after", timeout=240)):
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
        assert seen["gathers"][1:5] == [2 * (steps - 1)] * 4, f"rank {rank}: {seen['gathers']}"
        assert 1 <= seen["graphs"] <= seen["unsharded_graphs"], f"rank {rank}: {seen['graphs']} graphs, " \
            f"{seen['unsharded_graphs']} unsharded"
        assert seen["recompile_limits"] == 0, f"rank {rank}: dynamo hit its recompile limit"


@pytest.mark.parametrize("units,recompute,width,buckets", [
    (True, None, 11, None),  # odd chunks: each rank's padded to whole words
    ([], None, sharded_units.WIDTH, None),
    (True, "reentrant", sharded_units.WIDTH, None),
    (True, "non_reentrant", sharded_units.WIDTH, "device"),
], ids=["units-odd-chunks", "one-gather", "reentrant", "non-reentrant-device-plane"])
def test_param_dtype_computes_in_bfloat16_and_steps_the_float32_pieces_exactly(world2, units, recompute, width,
                                                                                buckets):
    settings = {} if buckets is None else {"buckets": buckets}
    for rank, seen in enumerate(world2.run(sharded_units.mixed_precision, units=units, recompute=recompute,
                                           width=width, **settings)):
        # Bitwise the reference's: a bfloat16 copy of float32 masters, the gradients summed in float32.
        assert seen["worst"] == 0.0, f"rank {rank}: off by {seen['worst']}"
        assert seen["from_plain"] > 1e-4, f"rank {rank}: bfloat16 changed nothing ({seen['from_plain']})"
        assert seen["forward"] == ["torch.bfloat16"] and seen["between"] == ["torch.bfloat16"], seen
        # Whole in float32 where a program reads or saves them; the steps after still get their gradients.
        assert seen["whole"] == ["torch.float32"] and seen["state"] == ["torch.float32"], seen
        assert seen["carried"] > 0, f"rank {rank}: no gather carried bfloat16"
        if width % 2:
            assert seen["padded"] > 0, f"rank {rank}: no odd chunk was carried"


def test_param_dtype_without_sharded_parameters_or_of_another_type_is_refused():
    with pytest.raises(ConfigError, match="needs shard_parameters=True"):
        param_dtype_of({"param_dtype": torch.bfloat16, "shard_gradients": True})
    with pytest.raises(ConfigError, match="use torch.bfloat16 or torch.float16"):
        param_dtype_of({"param_dtype": torch.float64, "shard_parameters": True})
    assert param_dtype_of({"param_dtype": "bfloat16", "shard_parameters": []}) is torch.bfloat16


def test_one_rank_alone_trains_exactly():
    # A job started with one process (a GPU of its own, a debugging run): every piece is this rank's.
    world = World(1)
    try:
        for recompute in (None, "reentrant"):
            seen = world.run(sharded_units.training, recompute=recompute)[0]
            assert seen["worst"] <= sharded.ATOL, f"{recompute}: off by {seen['worst']}"
            assert seen["between"] == 0, f"{recompute}: the blocks held values between forward and backward"
        for units in (True, []):
            seen = world.run(sharded_units.mixed_precision, units=units)[0]
            assert seen["worst"] == 0.0 and seen["forward"] == ["torch.bfloat16"], seen
    finally:
        world.close()


@pytest.mark.parametrize("units", [True, []], ids=["by-blocks", "whole-model"])
def test_a_failed_gather_in_an_elastic_job_never_spreads_zeros(world2, units):
    # What an elastic job's members do when one is lost while the others gather (the whole job:
    # test_elastic_sharded_params): forward and backward run to their end without the lane, the step
    # is ended with an abort (never summed, nor summed again), the pieces keep their values, and
    # whole_parameters() refuses rather than hand out zeros to a checkpoint.
    for rank, seen in enumerate(world2.run(sharded_units.lost_gathers, units=units)):
        if units is True:
            assert seen["served_only"] == ("applied", True, False), f"rank {rank}: {seen}"
        assert seen["evaluated"] == (3, 4) and seen["finite"] and seen["spoiled"], f"rank {rank}: {seen}"
        assert seen["backward"].startswith("broken: step "), f"rank {rank}: {seen}"
        assert "a parameter gather failed (emulated: a member was lost (forward))" in seen["backward"], seen
        assert not any(seen["grads"]), f"rank {rank}: a spoiled step left gradients"
        assert seen["pieces_kept"], f"rank {rank}: the pieces read back zeros"
        assert seen["whole"].startswith("refused: the parameters could not be gathered whole"), f"rank {rank}"


@pytest.mark.parametrize("units,default_init", [(True, False), ([], False), (True, True)],
                         ids=["by-blocks", "whole-model", "by-blocks-reset-parameters"])
def test_a_model_built_on_the_meta_device_is_materialized_a_unit_at_a_time(world2, units, default_init):
    # No rank ever holds the model whole (by blocks): the most parameter bytes whole at once, seen at every
    # module's initialization, is one unit's (the root first, then each block); every rank starts from rank
    # 0's values (the ranks seed differently); training from there is exact.
    seen_by_rank = world2.run(sharded_units.meta_init, units=units, default_init=default_init)
    if not default_init:
        assert seen_by_rank[0]["recorded"] != seen_by_rank[1]["recorded"], "the ranks' own draws differ"
    for rank, seen in enumerate(seen_by_rank):
        if not default_init:
            assert seen["start"] == pytest.approx(seen_by_rank[0]["recorded"], rel=1e-12, abs=1e-12), f"rank {rank}"
        assert seen["released"], f"rank {rank}: {seen}"
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
        if units is True and not default_init:
            assert seen["most_whole"] <= max(seen["unit_bytes"], seen["root_bytes"]) < seen["model_bytes"], seen


@pytest.mark.parametrize("shape", [(), (7,), (4, 5), (3, 4, 5), (2, 1, 3, 2)])
def test_a_pieces_run_is_cut_into_blocks_that_tile_it_in_order(shape):
    # What a sharded checkpoint writes a piece as: rectangular blocks of the parameter's own shape that hold
    # exactly the piece's run of flat values, in order, few of them (at most two per dimension but one).
    numel = math.prod(shape)
    flat = torch.arange(numel).reshape(shape)
    for lo in range(numel):
        for hi in range(lo + 1, numel + 1):
            cut = blocks(shape, lo, hi)
            held = [flat[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1) for offsets, sizes in cut]
            assert torch.cat(held).tolist() == list(range(lo, hi)), (shape, lo, hi, cut)
            assert len(cut) <= max(1, 2 * len(shape) - 1), (shape, lo, hi, cut)


def test_a_meta_model_is_saved_on_two_ranks_loaded_on_three_and_exported_without_any_gather(world2, world3,
                                                                                          tmp_path):
    # gradsync.torch.checkpoint used to gather the whole model on every rank to save it, so a model built on
    # the meta device because it fits no rank trained and could not be saved. Each rank now writes its pieces'
    # blocks and reads back those of its pieces under the new world: no gather, every parameter stays
    # released, and the loaded job (other initial values, AdamW's moments and step from the checkpoint)
    # trains on exactly as one process that ran every step.
    path = str(tmp_path / "ckpt")
    saved = world2.run(sharded_units.meta_save, path)
    for rank, seen in enumerate(saved):
        assert seen["gathers"] == [0] * len(seen["gathers"]) and seen["released"], f"rank {rank}: {seen}"
    for rank, seen in enumerate(world3.run(sharded_units.meta_load, path, saved[0]["start"], 2)):
        assert seen["gathers"] == [0] * len(seen["gathers"]) and seen["released"], f"rank {rank}: {seen}"
        assert seen["worst"] <= sharded.ATOL, f"rank {rank}: off by {seen['worst']}"
    # Exported whole by one process, a file of at most 2 kB at a time (a larger tensor alone): the saved values.
    from safetensors.torch import load_file

    out = tmp_path / "exported"
    files, others = export(path, out, max_shard_bytes=2000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert others == [] and len(files) == len(set(index["weight_map"].values())) + 1 > 3, files
    exported = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 2000, name
        exported.update(tensors)
    want = saved[0]["saved"]
    assert sorted(exported) == sorted(want) == sorted(index["weight_map"])
    assert all(torch.equal(exported[key], want[key]) for key in want), "the exported values are the saved ones"


def test_a_meta_model_is_refused_where_it_cannot_be_materialized(world2):
    for rank, message in enumerate(world2.run(sharded_units.meta_refusals)):
        assert message == ["shard_parameters=True, which materializes it", "no reset_parameters()",
                           "param_init initializes a model built on the meta device",
                           "several devices"], f"rank {rank}: {message}"


@pytest.mark.parametrize("units", [True, []], ids=["by-blocks", "whole-model"])
def test_a_released_parameters_values_are_read_alone_right_or_refused(world2, units):
    # A logging callback's weight norms after optimizer.step() got 0.0 for every weight, and an L2
    # penalty over model.parameters() after the forward died inside autograd. Now, between steps, a
    # read under no_grad is served alone (this rank reads every rank's pieces) and exact; an EMA copy
    # and torch.save of the module are whole plain modules. What cannot be right is refused, naming the
    # parameter: a read autograd would record, a write, and a read between backward and
    # optimizer.step() (another rank may have stepped already), which used to race.
    for rank, seen in enumerate(world2.run(sharded_units.reads_between_steps, units=units)):
        first = seen["named"][0]

        def refused(what, fragment):
            kind, name, message = seen[what]
            assert kind == "ReleasedParameterError" and fragment in message, f"rank {rank}, {what}: {seen[what]}"
            return name

        assert seen["norms"] == seen["whole_norms"] and all(n > 0 for n in seen["norms"]), f"rank {rank}: {seen}"
        assert seen["detached"] == seen["whole_norms"], f"rank {rank}: {seen['detached']}"
        # Inside a closure's forward (optimizer.step(closure)), before its backward: read alone, not a hang.
        assert seen["in_closure"] == seen["before_closure"] != seen["norms"], f"rank {rank}: {seen}"
        # p.data of a released parameter reads as p does (it read 0.0), and is not written silently.
        assert seen["data_norms"] == seen["whole_norms"] and seen["ema_by_data_off"] == 0.0, f"rank {rank}: {seen}"
        assert refused("data_written", "writes parameter") == first
        assert refused("graphed", "torch.no_grad()") == first
        assert refused("written", "writes parameter") == first
        assert refused("copy_written", "writes parameter") == first
        assert refused("pending", "optimizer.step()") == first
        assert seen["moved"] == {"ReleasedParameter"}, "module.to() where the module is changes nothing"
        assert refused("cast", "setting .data") == first and seen["dtypes"] == {torch.float64}
        if units is True:  # (one unit is whole from the forward to the step's end: the penalty reads another)
            assert refused("penalty", "autograd on").startswith("blocks.")
        assert seen["repr"] == repr(torch.nn.Parameter(seen["whole_first"])), seen["repr"]
        # Copies made whole (EMA, torch.save of the module): exact, plain, and without the wrapper's hooks
        # (a copy of the module used to copy the wrapper and fail with "no attribute '_parameters'").
        assert seen["copies_off"] == 0.0 and seen["copy_hooks_inert"], f"rank {rank}: {seen}"
        assert seen["copies_plain"] == {"Parameter"}, seen["copies_plain"]
        assert seen["grad_of_released"] == len(seen["named"]), "the .grad of a sharded parameter reads as None"
        # A parameter count (HF's num_parameters(), Lightning's summary) used to read 0 between steps.
        assert seen["count"][0] == seen["count"][1] and seen["held"] == 0, f"rank {rank}: {seen['count']}"
        assert seen["shapes"][0] == seen["shapes"][1], f"rank {rank}: {seen['shapes']}"
