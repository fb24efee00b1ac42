"""Libraries that build torch's DDP themselves get gradsync, each launched
by torchrun as their users launch them: HF ``Trainer`` (through Accelerate)
with reentrant gradient checkpointing and ``ddp_find_unused_parameters=True``,
and Lightning's ``ddp`` strategy (torch's DDP refuses both: "Expected to mark
a variable ready only once"); Lightning's manual optimization and
Accelerate's ``trigger_sync_in_backward``, which drive torch's
``model.reducer`` themselves. torch's DDP runs each too; its outcome goes
into the side-by-side table, and gradsync must train exactly."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from conftest import without_exit_noise
from world import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")


def torchrun(script, *args, timeout=240):
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return run.returncode, without_exit_noise(run.stdout + run.stderr)


def failure(output):
    """The first sentence of the error a script printed ("... failed: Error: ...")."""
    found = re.search(r"failed: (\w+: .*)", output)
    if not found:
        return "raises (see log)"
    text = found.group(1)
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(?=\s|$|rank \d)", text)
    return f"raises `{text[: end.end()] if end else text}`"


def reference_run(script, *args):
    """Run ``script`` with torch's DDP, which must succeed: its exit code
    and output. Rarely (once in the CI runs on record) one of torch's gloo
    worker threads aborts a rank at its very end ("terminate called without
    an active exception", pytorch/pytorch PR 179291), after the report was
    printed; such a run is made once more, and the second must be clean."""
    code, out = torchrun(script, *args)
    if code != 0 and "reference: " in out and "terminate called without an active exception" in out:
        code, out = torchrun(script, *args)
    return code, out


def run_ok(script, *args):
    """Run ``script`` under torchrun, check a gradsync run's output (the
    wrapper, equal replicas) and return its distance from the replay."""
    code, out = torchrun(script, *args)
    assert code == 0, out[-4000:]
    assert "wrapper: gradsync.torch.ddp.DistributedDataParallel" in out, out[-3000:]
    assert "replicas: 0.0e+00" in out, out[-3000:]
    return float(re.search(r"reference: (\S+)", out).group(1))


def test_hf_trainer_with_reentrant_checkpointing(side_by_side):
    pytest.importorskip("transformers")
    example = REPO / "examples" / "torch" / "hf_trainer.py"
    code, out = torchrun(example, "--steps", "8")
    assert code == 0, out[-4000:]
    assert "Trainer wrapped the model in gradsync.torch.ddp.DistributedDataParallel" in out, out[-3000:]
    assert "replicas: max |param_r - param_0| = 0.0e+00" in out, out[-3000:]
    diff = float(re.search(r"equivalence: max \|param - reference\| = (\S+)", out).group(1))
    assert diff <= 1e-4 and "MISMATCH" not in out, out[-3000:]
    code, theirs = torchrun(example, "--steps", "8", "--impl", "ddp")
    assert code != 0, "torch's DDP was expected to refuse reentrant checkpointing with find_unused_parameters"
    side_by_side(
        "HF Trainer, GPT-2, reentrant gradient checkpointing, ddp_find_unused_parameters=True",
        failure(theirs),
        f"ok, {diff:.1e} (one-process replay)",
    )


def test_hf_trainer_sharded_by_one_setting(side_by_side_sharded):
    """``replace_ddp(shard_gradients=True)``, then ``shard_parameters=True``
    (its saves read the parameters and the optimizer's state on the saving
    rank alone, from every rank's pieces; the model's weights in the
    checkpoint are whole): the Trainer's own AdamW (built
    before Accelerate wraps the model) is converted at its first step,
    Accelerate's clipping takes the global norm, the Trainer's
    ``model.zero_grad()`` clears the partitions; its checkpoints (one half
    way, at HF's default cadence of saving while training goes on, and one
    at the end) hold the whole optimizer state with nothing added (a save
    raised a ConfigError asking for a callback). Parameters and saved state
    equal the one-process replay's."""
    pytest.importorskip("transformers")
    cells = []
    for setting in ("--shard", "--shard-parameters"):
        code, out = torchrun(REPO / "examples" / "torch" / "hf_trainer.py", "--steps", "8", setting, "--adamw",
                             "--save")
        assert code == 0, out[-4000:]
        assert "replicas: max |param_r - param_0| = 0.0e+00" in out, out[-3000:]
        diff = float(re.search(r"equivalence: max \|param - reference\| = (\S+)", out).group(1))
        state = float(re.search(r"checkpointed optimizer state: \d+ parameters, max \|state - reference\| = (\S+)",
                                out).group(1))
        # The checkpoint's weights are whole (shard_parameters: the saving rank reads them alone).
        assert "max |saved - param| = 0.0e+00" in out, out[-3000:]
        assert diff <= 1e-4 and state <= 1e-4 and "MISMATCH" not in out, out[-3000:]
        cells.append(f"ok, {diff:.1e} (one-process replay), checkpointed state {state:.1e}")
    side_by_side_sharded("HF Trainer, GPT-2, reentrant gradient checkpointing, clipping, AdamW, a checkpoint, "
                         "replace_ddp(shard_gradients=True) or replace_ddp(shard_parameters=True)", *cells)


def test_fabric_sharded_clips_by_the_global_norm_with_accumulation(side_by_side_sharded):
    """Lightning Fabric's loop (``no_backward_sync`` accumulation,
    ``fabric.clip_gradients(model, optimizer, ...)``) with
    ``replace_ddp(shard_gradients=True)``: the norms Fabric returns and the
    parameters equal the replay's (the norms were 23% off, rank-local)."""
    pytest.importorskip("lightning")
    code, out = torchrun(REPO / "python" / "tests" / "scripts" / "fabric_accumulate.py", "--impl", "gradsync",
                         "--shard")
    assert code == 0, out[-4000:]
    assert "wrapper: gradsync.torch.ddp.DistributedDataParallel" in out and "replicas: 0.0e+00" in out, out[-3000:]
    diff = float(re.search(r"reference: (\S+)", out).group(1))
    norms, clipped = re.search(r"clip norms: (\S+) from the replay's \(relative\), (\d+) of", out).groups()
    assert diff <= 1e-5 and float(norms) <= 1e-5 and int(clipped) > 0, out[-3000:]
    side_by_side_sharded("Lightning Fabric: no_backward_sync accumulation, fabric.clip_gradients, AdamW, "
                         "replace_ddp(shard_gradients=True)", f"ok, {diff:.1e} (one-process replay)")


@pytest.mark.parametrize("impl", [pytest.param("replace", marks=pytest.mark.slow), "strategy"])
def test_lightning_sharded_with_a_checkpoint(side_by_side_sharded, impl):
    """Lightning, gradsync sharded (``replace_ddp(shard_gradients=True)``
    or ``GradsyncDDPStrategy(shard_gradients=True)``): the optimizer
    ``configure_optimizers`` returns is stepped with Lightning's closure,
    sharded, with ``gradient_clip_val`` and ``accumulate_grad_batches=2``
    (Lightning clips the optimizer's parameters, this rank's pieces: the
    norm must be the global one; it was each rank's own, silently 1.5e-3
    off the replay); ``trainer.save_checkpoint`` writes the whole optimizer
    state (Lightning consolidates optimizers that can), equal to the
    replay's. Then with ``shard_parameters=True``: the checkpoint's weights
    are whole, and the module holds the trained weights after ``fit``."""
    pytest.importorskip("lightning")
    cells = []
    for setting in ("--shard", "--shard-parameters"):
        code, out = torchrun(REPO / "python" / "tests" / "scripts" / "lightning_ddp.py", "--impl", impl, setting,
                             "--clip")
        assert code == 0, out[-4000:]
        assert "replicas: 0.0e+00" in out, out[-3000:]
        diff = float(re.search(r"reference: (\S+)", out).group(1))
        state = float(re.search(r"checkpointed optimizer state: (\S+)", out).group(1))
        # The checkpoint's weights are the trained parameters (shard_parameters: gathered for it).
        assert "checkpointed weights: 0.0e+00" in out, out[-3000:]
        assert diff <= 1e-5 and state <= 1e-5, out[-3000:]
        cells.append(f"ok, {diff:.1e} (one-process replay), checkpointed state {state:.1e}")
    if impl == "strategy":
        side_by_side_sharded("Lightning, GradsyncDDPStrategy(shard_gradients=True or shard_parameters=True), a "
                             "block checkpointed twice (reentrant), gradient_clip_val, accumulate_grad_batches=2, "
                             "save_checkpoint", *cells)


@pytest.mark.parametrize("impl", ["replace", "strategy"])
def test_lightning_ddp_strategy(side_by_side, impl):
    pytest.importorskip("lightning")
    script = REPO / "python" / "tests" / "scripts" / "lightning_ddp.py"
    code, out = torchrun(script, "--impl", impl)
    assert code == 0, out[-4000:]
    assert "wrapper: gradsync.torch.ddp.DistributedDataParallel" in out, out[-3000:]
    assert "replicas: 0.0e+00" in out, out[-3000:]
    diff = float(re.search(r"reference: (\S+)", out).group(1))
    assert diff <= 1e-5, out[-3000:]
    if impl == "replace":
        code, theirs = torchrun(script, "--impl", "ddp")
        assert code != 0, "torch's DDP was expected to refuse a block checkpointed twice"
        side_by_side(
            'Lightning Trainer(strategy="ddp"), one block checkpointed twice (reentrant)',
            failure(theirs),
            f"ok, {diff:.1e} (one-process replay)",
        )


LIGHTNING_MANUAL = REPO / "python" / "tests" / "scripts" / "lightning_manual.py"


def reference_of(output):
    return float(re.search(r"reference: (\S+)", output).group(1))


@pytest.mark.slow
def test_lightning_manual_optimization_sharded(side_by_side_sharded):
    """The GAN recipe sharded: two optimizers over one sharded wrapper (each
    converted at its first step, each gathering after its step), two
    ``manual_backward`` a step."""
    pytest.importorskip("lightning")
    diff = run_ok(LIGHTNING_MANUAL, "--impl", "strategy", "--shard")
    assert diff <= 1e-5
    side_by_side_sharded("Lightning manual optimization (GAN recipe: two optimizers), "
                         "GradsyncDDPStrategy(shard_gradients=True)", f"ok, {diff:.1e} (one-process replay)")


def test_lightning_manual_optimization_with_sharded_parameters(side_by_side_sharded):
    """The GAN recipe under ZeRO-3: each step ends inside the wrapper's
    forward (``manual_backward`` and ``optimizer.step()`` in
    ``training_step``), releasing the root unit (the discriminator) that the
    generator's loss runs through next: its modules gather it again there,
    with the values just stepped (it failed with ``addmm: mat2 must be a
    matrix``)."""
    pytest.importorskip("lightning")
    diff = run_ok(LIGHTNING_MANUAL, "--impl", "strategy", "--shard-parameters")
    assert diff <= 1e-5
    side_by_side_sharded("Lightning manual optimization (GAN recipe: two optimizers), "
                         "GradsyncDDPStrategy(shard_parameters=True)", f"ok, {diff:.1e} (one-process replay)")


@pytest.mark.parametrize(
    "options",
    [("--impl", "replace"), ("--impl", "strategy", "--static-graph")],
    ids=["replace_ddp", "strategy_static_graph"],
)
def test_lightning_manual_optimization(side_by_side, options):
    """Lightning's GAN recipe: Lightning calls ``model.reducer`` before each
    ``manual_backward`` (and ``_delay_all_reduce`` after the first under
    ``static_graph``). torch's DDP needs ``find_unused_parameters=True`` for
    it and refuses ``static_graph``; gradsync needs nothing, whichever way it
    is turned on."""
    pytest.importorskip("lightning")
    static = "--static-graph" in options
    diff = run_ok(LIGHTNING_MANUAL, *options)
    assert diff <= 1e-5
    code, theirs = torchrun(LIGHTNING_MANUAL, "--impl", "ddp", *options[2:])
    assert code != 0, "torch's DDP was expected to refuse this run"
    ddp = failure(theirs)
    if not static:
        code, found = reference_run(LIGHTNING_MANUAL, "--impl", "ddp", "--find-unused")
        assert code == 0, found[-3000:]
        ddp += f" (with find_unused_parameters=True: ok, {reference_of(found):.1e})"
    case = "Lightning manual optimization (GAN recipe: two optimizers, two manual_backward a step), "
    how = "GradsyncDDPStrategy" if static else "replace_ddp, nothing to set"
    side_by_side(
        case + ("DDPStrategy(static_graph=True)" if static else 'strategy="ddp"'),
        ddp,
        f"ok, {diff:.1e} (one-process replay; {how})",
    )


def test_accelerate_trigger_sync_in_backward(side_by_side):
    pytest.importorskip("accelerate")
    script = REPO / "python" / "tests" / "scripts" / "accelerate_sync.py"
    diff = run_ok(script, "--impl", "gradsync")
    assert diff <= 1e-5
    code, out = reference_run(script, "--impl", "ddp")
    assert code == 0, out[-3000:]
    side_by_side(
        "Accelerate: two forwards under no_sync, the second backward in trigger_sync_in_backward",
        f"ok, {reference_of(out):.1e}",
        f"ok, {diff:.1e} (one-process replay)",
    )


def test_the_ddp_tutorials_rank_zero_checkpoint_with_sharded_parameters():
    # The tutorial's save and load with only shard_parameters=True added: rank 0 alone saves
    # ddp_model.state_dict() (the other rank's runtime serves its pieces while it waits in a
    # barrier), every rank loads it, training goes on exactly.
    script = REPO / "python" / "tests" / "scripts" / "ddp_tutorial_checkpoint.py"
    assert run_ok(script, "--impl", "gradsync") <= 1e-6


def test_lightnings_swa_callback_and_a_norm_log_inside_training_step_with_sharded_parameters(tmp_path):
    # Lightning runs training_step inside optimizer.step(closure): a norm log there is read alone while
    # every rank is inside its step (it hung: each rank's step held its pieces for writing before the
    # closure), and the SWA callback's transfer of the averaged weights writes every rank's pieces. With
    # only replace_ddp(shard_parameters=True) added, the norms and the trained weights equal torch's DDP's.
    pytest.importorskip("lightning")
    script = REPO / "python" / "tests" / "scripts" / "lightning_swa.py"
    runs = {}
    for impl in ("ddp", "gradsync"):
        out = tmp_path / f"{impl}.pt"
        code, log = reference_run(script, "--impl", impl, "--out", str(out)) if impl == "ddp" else \
            torchrun(script, "--impl", impl, "--out", str(out))
        assert code == 0 and f"{impl}: saved" in log, log[-3000:]
        runs[impl] = torch.load(out, weights_only=True)
    ours, theirs = runs["gradsync"], runs["ddp"]
    assert len(ours["norms"]) == len(theirs["norms"]) > 0
    assert max(abs(a - b) for a, b in zip(ours["norms"], theirs["norms"])) <= 1e-5, (ours["norms"], theirs["norms"])
    assert max((a - b).abs().max().item() for a, b in zip(ours["params"], theirs["params"])) <= 1e-6


def test_averaged_copies_of_a_sharded_model_torchvisions_ema_and_torchs_swa():
    # torchvision's EMA of model.module and PyTorch's AveragedModel(ddp_model) with SWALR, updated
    # between steps from the released parameters, a norm log, rank 0 alone evaluating the SWA model
    # and saving all three: with only shard_parameters=True added, each is exact against a one-process
    # replay. The EMA's update used to raise ("detach of parameter '0.weight', which is released").
    script = REPO / "python" / "tests" / "scripts" / "averaged_copies.py"
    code, out = torchrun(script, "--impl", "gradsync")
    assert code == 0 and "wrapper: gradsync.torch.ddp.DistributedDataParallel" in out, out[-3000:]
    for what in ("reference", "checkpoint", "evaluated"):
        assert float(re.search(rf"{what}: (\S+)", out).group(1)) <= 1e-6, out[-2000:]


@pytest.mark.parametrize("library", ["accelerate", "fabric"])
def test_a_libraries_rank_zero_save_with_sharded_parameters(library):
    # Accelerate's unwrap_model(model).state_dict() on the main process and Fabric's
    # fabric.save (model and optimizer) with only replace_ddp(shard_parameters=True) added:
    # the state is read on rank 0 alone from every rank's pieces.
    pytest.importorskip("accelerate" if library == "accelerate" else "lightning")
    script = REPO / "python" / "tests" / "scripts" / "rank_zero_saves.py"
    code, out = torchrun(script, "--library", library)
    assert code == 0, out[-3000:]
    assert float(re.search(r"model: (\S+)", out).group(1)) <= 1e-6, out[-2000:]
    if library == "fabric":
        assert float(re.search(r"optimizer: (\S+)", out).group(1)) <= 1e-6, out[-2000:]
