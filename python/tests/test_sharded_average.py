"""ShardedAveragedModel: an EMA or SWA of a parameter-sharded model, each
rank averaging its pieces, equal to AveragedModel's of a replay."""

import pytest
import sharded_average


@pytest.mark.parametrize("kind,use_buffers", [("ema", False), ("swa", True)], ids=["ema", "swa-buffers"])
@pytest.mark.parametrize("units", [True, []], ids=["by-blocks", "whole-model"])
def test_an_average_of_sharded_parameters_equals_averaged_models_of_a_replay(world2, kind, use_buffers, units):
    # AveragedModel(model) of a sharded model copied it whole onto every rank, which a model sharded
    # because it does not fit one rank cannot afford. Each rank now averages its pieces only; inside
    # applied() the model is the average: evaluated on every rank, read alone by rank 0, its norms read.
    for rank, seen in enumerate(world2.run(sharded_average.averaged_training, kind=kind, use_buffers=use_buffers,
                                           units=units)):
        # (float64: the replay's loss over the whole batch rounds apart from the ranks' averaged halves')
        for what in ("evaluated", "norms", "trained_back", "after_more") + (("state_dict",) if rank == 0 else ()):
            assert seen[what] < 1e-12, f"rank {rank}, {what}: {seen}"
        assert seen["n_averaged"] is True, seen
        if rank == 0:  # (of the sharded model's own values, element for element)
            assert seen["beside"] == 0.0, seen
        assert "optimizer.step() inside ShardedAveragedModel.applied()" in seen["step_inside"], seen
        assert "inside its own applied()" in seen["update_inside"], seen
    # Each rank keeps its half of the average, not a whole copy.
    sizes = [seen["pieces_bytes"] for seen in world2.run(sharded_average.averaged_training, steps=1)]
    whole = sum(p.numel() * 8 for p in sharded_average.Normed().parameters())
    assert sum(sizes) == whole and max(sizes) < 0.6 * whole, (sizes, whole)


def test_an_average_saved_on_two_ranks_loads_on_three_and_its_state_round_trips(world2, world3, tmp_path):
    path = str(tmp_path / "average")
    saved = world2.run(sharded_average.averaged_saved, path=path)
    for rank, seen in enumerate(saved):
        assert seen["kept"] is True, f"rank {rank}: {seen}"
        assert "of another layout" in seen["other_rank"], f"rank {rank}: {seen}"
    for rank, got in enumerate(world3.run(sharded_average.averaged_loaded, path=path)):
        assert (got - saved[0]["want"]).abs().max().item() == 0.0, f"rank {rank}"


def test_an_average_of_a_model_that_is_not_parameter_sharded_or_mid_step_is_refused(world2):
    for rank, seen in enumerate(world2.run(sharded_average.refusals)):
        assert "AveragedModel(model)" in seen["unsharded"] and "AveragedModel(model)" in seen["zero2"], seen
        assert "between steps only" in seen["mid_forward"], f"rank {rank}: {seen}"
        assert "after optimizer.step()" in seen["mid_step"], f"rank {rank}: {seen}"



def test_a_member_whose_step_came_in_a_settlement_averages_it_there_once(world2):
    # A loss inside optimizer.step() can leave members that stepped and averaged the step in
    # beside members that take the step in the settlement: those average it in there (their
    # pieces hold the step by then), and the loop's update_parameters() after it adds nothing.
    for rank, seen in enumerate(world2.run(sharded_average.taken_early)):
        assert seen["early"] == seen["after"] == seen["want"] == 4, f"rank {rank}: {seen}"
        assert seen["apart"] < 1e-12 and not seen["key_left"], f"rank {rank}: {seen}"
