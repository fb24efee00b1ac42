"""Programs written the way people write them (``programs.py``), with
``shard_gradients=True`` as the only change, against a one-process replay:
clipping through a reference to torch's function taken at import, a
GradScaler loop, an out-of-memory rank that goes on to its next batch, a
frozen layer in the optimizer, a ``channels_last`` model, a sharded
checkpoint of a small model (one bucket) on the same and another world
size. Each failed before the fix that made it pass (issue 53). The same
programs run with ``shard_parameters=True`` too."""

import pytest
import torch

import programs

SHARDED = {"shard_gradients": True}


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad_scaler"])
def test_nanogpt_loop_clips_by_the_global_norm_through_an_early_import(world2, scaler):
    for rank, got in enumerate(world2.run(programs.nanogpt, scaler=scaler, **SHARDED)):
        assert got["clipped"] == got["steps"], f"the replay must clip every step: {got}"
        assert got["norms"] < 1e-5, f"rank {rank}: clip norms off the replay's by {got['norms']:.2e}"
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"


def test_nanogpt_loop_clips_on_three_ranks(world3):
    for rank, got in enumerate(world3.run(programs.nanogpt, **SHARDED)):
        assert got["norms"] < 1e-5 and got["params"] < programs.ATOL32, f"rank {rank}: {got}"


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("sharding", [{}, SHARDED], ids=["unsharded", "sharded"])
def test_an_out_of_memory_rank_that_goes_on_skips_the_step_everywhere(world2, sharding, scaler):
    # Rank 1 aborts step 2 and `continue`s; rank 0 clips and steps: a no-op
    # on both, no collective waits for rank 1 (it hung until the timeout).
    # With a GradScaler, rank 0's scaler.step after the skipped step is the
    # optimizer's empty step (torch's "No inf checks were recorded" before).
    results = world2.run(programs.out_of_memory, timeout=60, scaler=scaler, **sharding)
    for rank, got in enumerate(results):
        assert got["outcomes"] == ["applied", "applied", "skipped", "applied", "applied"], got
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"


def test_partial_policy_an_aborting_rank_that_does_not_step_is_told_what_to_do(fresh_world):
    world = fresh_world(2, pg_timeout_s=20)
    errors = world.run(programs.out_of_memory_partial_without_step, timeout=90, **SHARDED)
    assert errors[1].startswith("ConfigError") and "rank 1 aborted step 2" in errors[1], errors[1]
    assert "Call optimizer.step() after abort_step" in errors[1], errors[1]
    assert errors[0] is not None, "rank 0 waits for rank 1's partition in vain: its gather fails"


@pytest.mark.parametrize("sharding", [{}, SHARDED], ids=["unsharded", "sharded"])
def test_a_frozen_layer_in_the_optimizer_is_skipped_as_torch_skips_it(world2, sharding):
    for rank, got in enumerate(world2.run(programs.frozen_layer, **sharding)):
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"
        assert got["state_as_torch"], f"rank {rank}: the saved optimizer state is not torch's numbering"


def test_channels_last_parameters_are_sharded_in_their_format(world2):
    for rank, got in enumerate(world2.run(programs.channels_last, **SHARDED)):
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"
        assert got["channels_last"], "the parameters keep the memory format the user chose"


def test_a_sharded_checkpoint_of_one_bucket_loads_on_the_same_and_another_world(world2, world3, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = world2.run(programs.checkpoint_save, path)[0]
    for world in (world2, world3):
        for rank, got in enumerate(world.run(programs.checkpoint_load, path, saved)):
            assert got["params"] == 0.0 and got["state"] == 0.0, f"world {world.size}, rank {rank}: {got}"
            assert got["lr"] == [1e-3, 1e-3], "the groups' options come from the checkpoint"
    # A checkpoint whose data is gone: an ordinary exception (torch's is a BaseException) naming the ranks.
    for data in (tmp_path / "ckpt").glob("*.distcp"):
        data.unlink()
    for message in world2.run(programs.checkpoint_load_error, path):
        assert message.startswith("CheckpointError: ranks [0, 1]: reading the sharded checkpoint"), message


def test_a_checkpoint_of_whole_parameters_loads_into_sharded_ones_and_back(world2, world3, tmp_path):
    # Under shard_parameters=True each rank writes and reads its pieces as blocks of the parameters' own
    # shapes (the head tied to the embedding among them), so the checkpoint is the one a job holding the
    # parameters whole writes: either loads into the other, at another world size, exactly.
    ways = [("whole", {"shard_gradients": True}, world2, {"shard_parameters": True}, world3),
            ("pieces", {"shard_parameters": True}, world3, {"shard_gradients": True}, world2)]
    for name, saving, saver, loading, loader in ways:
        path = str(tmp_path / name)
        saved = saver.run(programs.checkpoint_save, path, sharding=saving)[0]
        for rank, got in enumerate(loader.run(programs.checkpoint_load, path, saved, sharding=loading)):
            assert got["params"] == 0.0 and got["state"] == 0.0, f"saved {saving}, loaded {loading}, rank {rank}: {got}"


def test_nanogpts_master_process_evaluates_and_checkpoints_alone_with_sharded_parameters(world2, tmp_path):
    # nanoGPT with only shard_parameters=True added: estimate_loss() and torch.save of the
    # model's and the optimizer's state_dict() on the master process alone, then its resume.
    seen = world2.run(programs.nanogpt_master_checkpoint, str(tmp_path / "ckpt.pt"))
    assert seen[0]["eval"] <= 1e-6, f"the master's evaluation is off by {seen[0]['eval']}"
    for rank, s in enumerate(seen):
        assert s["resumed"] <= 1e-6, f"rank {rank}: the resumed run is off by {s['resumed']}"


def test_an_hf_model_trained_sharded_is_exported_for_from_pretrained(world2, tmp_path):
    # A model built on the meta device (it need not fit one rank), its checkpoint exported whole by one
    # process a file at a time: HF's from_pretrained reads the files, the trained values in every parameter.
    from transformers import GPT2LMHeadModel

    from gradsync.torch.export import export

    saved = world2.run(programs.hf_sharded_save, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "exported"
    export(str(tmp_path / "ckpt"), str(out), max_shard_bytes=20_000)
    programs.hf_gpt2_config().save_pretrained(out)
    loaded = GPT2LMHeadModel.from_pretrained(out)
    got = loaded.state_dict()
    assert all(torch.equal(got[key], value) for key, value in saved.items() if key in got), "the trained values"
    assert {key for key, _ in loaded.named_parameters()} <= set(saved)
    assert len(list(out.glob("model-*.safetensors"))) > 1, "files of at most the size asked"


PARAMETERS = {"shard_parameters": True}
#: Parameter sharding paced for the least memory: no bucket still reducing when a block's
#: backward begins, no block gathered ahead.
LEAN = {**PARAMETERS, "buckets_in_flight": 0, "prefetch_units": False}


def test_the_programs_train_exactly_with_sharded_parameters_paced_for_memory(world2):
    for rank, got in enumerate(world2.run(programs.nanogpt, **LEAN)):
        assert got["norms"] < 1e-5 and got["params"] < programs.ATOL32, f"rank {rank}: {got}"
    # A rank out of memory mid-step: its abort and the other rank's waits for buckets in flight end together.
    for rank, got in enumerate(world2.run(programs.out_of_memory, timeout=60, **LEAN)):
        assert got["outcomes"] == ["applied", "applied", "skipped", "applied", "applied"], got
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad_scaler"])
def test_the_programs_train_exactly_with_sharded_parameters(world2, scaler):
    # The same programs with shard_parameters=True as the only change (they read
    # the parameters after training inside whole_parameters()).
    for rank, got in enumerate(world2.run(programs.nanogpt, scaler=scaler, **PARAMETERS)):
        assert got["norms"] < 1e-5 and got["params"] < programs.ATOL32, f"rank {rank}: {got}"
    for rank, got in enumerate(world2.run(programs.out_of_memory, timeout=60, scaler=scaler, **PARAMETERS)):
        assert got["outcomes"] == ["applied", "applied", "skipped", "applied", "applied"], got
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"
    if scaler:
        return
    for rank, got in enumerate(world2.run(programs.frozen_layer, **PARAMETERS)):
        assert got["params"] < programs.ATOL32 and got["state_as_torch"], f"rank {rank}: {got}"
    for rank, got in enumerate(world2.run(programs.channels_last, **PARAMETERS)):
        assert got["params"] < programs.ATOL32, f"rank {rank}: parameters off by {got['params']:.2e}"
        assert got["channels_last"], "the parameters gathered again keep the memory format the user chose"
