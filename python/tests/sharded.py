"""Sharded (ZeRO-2) training cases that run on every rank of a test world.

Each case trains a model wrapped with ``shard_gradients=True`` and stepped by
``model.shard_optimizer(AdamW)`` on this rank's batch, next to a reference:
the same model in this process, each rank's batch run through it in turn
(its loss divided by the world size, as DDP averages), stepped by a plain
``AdamW`` over the whole model. After every step the parameters must agree:
that checks the reduce-scatter, the partition's gradients (including the
``None`` of a parameter no rank used, which AdamW then skips), the sharded
step and the all-gather together. Float64 throughout, so the reference is
exact up to rounding.

``impl`` may also be ``"fsdp2"`` (torch's ``fully_shard`` on gloo) or
``"zero1"`` (torch's ``ZeroRedundancyOptimizer`` over DDP), for the
side-by-side table: their failures are results (``Outcome``), gradsync's
propagate.
"""

import copy
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from cases import FLOAT64_ROUNDING, MODELS, ControlFlowModel, Outcome, SharedBetweenSegments, SkipsOddSteps, UnusedModel
from cases import first_line  # noqa: F401  (the side-by-side bench reports peers' errors with it)
from gradsync.torch import DistributedDataParallel as GradsyncDDP

LR = 1e-2
#: Parameters after AdamW steps agree this closely (float64; Adam divides by
#: sqrt(v), which magnifies rounding of tiny gradients a little).
ATOL = 1e-9


def _raw(model):
    return getattr(model, "module", model)


def _diff(reference, wrapped):
    """Largest |reference - wrapped| over the parameters (full tensors)."""
    worst = 0.0
    for a, b in zip(reference.parameters(), _raw(wrapped).parameters()):
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        worst = max(worst, (a.detach() - b.detach()).abs().max().item())
    return worst


class scatter_on_gloo:
    """Within the block, sharded wrappers reduce-scatter on gloo too (by
    default they all-reduce there and keep their partition: faster on
    gloo), so that the tests cover both collectives."""

    def __init__(self, on=True):
        self.on = on

    def __enter__(self):
        from gradsync.torch.sharding import settings as _sharding

        self.before, _sharding.GLOO_REDUCE_SCATTER = _sharding.GLOO_REDUCE_SCATTER, self.on
        return self

    def __exit__(self, *exc):
        from gradsync.torch.sharding import settings as _sharding

        _sharding.GLOO_REDUCE_SCATTER = self.before
        return False


#: gradsync's sharded settings by ``impl``: gradients and optimizer state
#: (ZeRO-2), or the parameters too (ZeRO-3).
SETTINGS = {"gradsync": {"shard_gradients": True}, "gradsync-params": {"shard_parameters": True},
            # Paced for the least memory, each child with parameters a unit (as FSDP2 is applied below).
            "gradsync-params-lean": {"buckets_in_flight": 0, "prefetch_units": False}}


def _units(model):
    """The children of ``model`` that hold parameters (the units FSDP2 gets here)."""
    return [child for child in model.children() if any(True for _ in child.parameters())]


def _build(impl, model, world, optim=None, **kwargs):
    """``model`` under ``impl`` and its optimizer (AdamW, with the options ``optim``)."""
    if impl in SETTINGS:
        settings = dict(SETTINGS[impl])
        if impl == "gradsync-params-lean":
            settings["shard_parameters"] = _units(model)
        wrapped = GradsyncDDP(model, **settings, bucket_cap_mb=kwargs.pop("bucket_cap_mb", 0.001), **kwargs)
        return wrapped, wrapped.shard_optimizer(torch.optim.AdamW, lr=LR, **(optim or {}))
    if impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        # Per block, as models are sharded: every child with parameters, then the root.
        for child in _units(model):
            fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)
    if impl == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        group = dist.new_group(backend="gloo")
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=group, **kwargs)
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                                process_group=group)
    raise ValueError(impl)


def train(rank, world, impl, make, forward, batch, steps=4, aborts=(), policy="skip", micro=1, clip=None,
          optim=None, **wrap_kwargs):
    """Train ``make()`` for ``steps`` steps under ``impl`` on this rank's
    slice of a seeded batch and the reference on every rank's; returns an
    outcome with the largest parameter difference seen.

    ``forward(model, rank, step, x)`` is the loss of rank ``rank``'s batch
    ``x`` (``model`` is the raw module for the reference, the wrapper for
    the run); ``aborts``: ``(rank, step)`` pairs where that rank aborts its
    step (an out-of-memory error) under ``policy``; ``micro``: micro-batches
    per step (all but the last under ``no_sync``); ``clip``: a max norm for
    ``torch.nn.utils.clip_grad_norm_`` (both sides clip by it); ``optim``:
    options of both sides' AdamW (``foreach``, ``fused``)."""
    torch.manual_seed(1234)
    base = make().double()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, **(optim or {}))
    if impl in SETTINGS and policy != "skip":
        wrap_kwargs["abort_policy"] = policy
    if optim:
        wrap_kwargs["optim"] = optim
    wrapped, opt = _build(impl, copy.deepcopy(base), world, **wrap_kwargs)
    data = torch.randn(steps, micro, world * batch, *make.shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(99))
    with Outcome("gradsync" if impl in SETTINGS else "ddp", wrapped) as outcome:
        for step in range(steps):
            aborting = {r for r, s in aborts if s == step}
            counted = [r for r in range(world) if r not in aborting]
            # The reference: every rank's loss on its batch, averaged as the wrapper averages.
            ref_opt.zero_grad()
            if not (aborting and policy == "skip"):
                for r in counted:
                    for m in range(micro):
                        # Reentrant checkpoints need an input that requires grad.
                        x = data[step, m, r * batch : (r + 1) * batch].clone().requires_grad_()
                        (forward(reference, r, step, x) / len(counted)).backward()
                if clip is not None:
                    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
                ref_opt.step()
            # The run.
            opt.zero_grad()
            mine = [data[step, m, rank * batch : (rank + 1) * batch].clone().requires_grad_() for m in range(micro)]
            for m, x in enumerate(mine):
                if rank in aborting and m == micro - 1:
                    wrapped.abort_step("out_of_memory")
                    break
                last = m == micro - 1
                with (wrapped.no_sync() if not last and hasattr(wrapped, "no_sync") else _nothing()):
                    forward(wrapped, rank, step, x).backward()
            if clip is not None and not (aborting and policy == "skip"):
                norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), clip)
                assert abs(float(norm) - float(ref_norm)) <= 1e-9 * max(1.0, float(ref_norm)), (norm, ref_norm)
            opt.step()
            with _whole(wrapped):
                outcome.record(_diff(reference, wrapped))
    return outcome.result


def _whole(wrapped):
    """A block where ``wrapped``'s parameters are whole (every rank enters it)."""
    return wrapped.whole_parameters() if hasattr(wrapped, "whole_parameters") else _nothing()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _plain(model, rank, step, x):
    return nn.functional.mse_loss(model(x), torch.zeros_like(x))


def _with_rank(model, rank, step, x):
    """A model whose forward depends on its rank (``ControlFlowModel``, ``UnusedModel``)."""
    _raw(model).rank = rank
    return model(x).pow(2).sum()


def _dynamic(model, rank, step, x):
    """``DynamicCheckpointTwiceModule``: which layer is checkpointed follows the step."""
    _raw(model).count = step
    return _plain(model, rank, step, x)


def _control(model, rank, step, x):
    """Control flow: the second layer runs on all-ones input (odd steps)."""
    return _with_rank(model, rank, step, torch.ones_like(x) if step % 2 else x)


def _factory(make, shape):
    make.shape = shape
    return make


def _skips_odd_steps(model, rank, step, x):
    """``SkipsOddSteps``: its middle block runs on even steps only."""
    _raw(model).count = step
    return model(x).pow(2).sum()


#: GPT-2's vocabulary in the real-code case (small, so tokens repeat).
VOCAB = 64


def _gpt2():
    """HF ``transformers``' GPT-2 (2 layers, tied head) with reentrant
    gradient checkpointing and no dropout, as a fine-tuning script builds it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


def _lm(model, rank, step, x):
    """A language-model loss on tokens drawn from the batch ``x``."""
    tokens = (x.detach().abs() * 1000).long() % VOCAB
    return model(input_ids=tokens, labels=tokens).loss


#: name -> (model factory with .shape, forward)
CASES = {
    "checkpoint_twice_reentrant": (_factory(lambda: MODELS["twice"](True), (20,)), _plain),
    "checkpoint_twice_weight_sharing": (_factory(lambda: MODELS["twice_weight_sharing"](True), (20,)), _plain),
    "dynamic_checkpoint": (_factory(lambda: MODELS["dynamic"](True), (20,)), _dynamic),
    "shared_weight_between_segments": (_factory(SharedBetweenSegments, (12,)), _plain),
    "unused_parameters": (_factory(lambda: UnusedModel(0), (8,)), _with_rank),
    "rank_dependent_control_flow": (_factory(lambda: ControlFlowModel(0, True), (10,)), _control),
    "checkpoint_once": (_factory(lambda: MODELS["once"](True), (20,)), _plain),
    "checkpoint_twice_non_reentrant": (_factory(lambda: MODELS["twice"](False), (20,)), _plain),
    "dynamic_checkpoint_weight_sharing": (_factory(lambda: MODELS["dynamic_weight_sharing"](True), (20,)), _dynamic),
    "weight_sharing_sequential": (_factory(lambda: MODELS["weight_sharing_sequential"](True), (20,)), _plain),
    "control_flow_across_steps": (_factory(lambda: ControlFlowModel(0, False), (10,)), _control),
    "a_block_skipped_on_odd_steps": (_factory(SkipsOddSteps, (8,)), _skips_odd_steps),
    "hf_gpt2_reentrant_checkpointing_tied_head": (_factory(_gpt2, (12,)), _lm),
}


#: Row labels of the side-by-side table, where the case's name does not read well.
LABELS = {"hf_gpt2_reentrant_checkpointing_tied_head": "HF GPT-2 (transformers), reentrant gradient checkpointing, "
                                                       "tied head"}


def label(name):
    """Case ``name``'s row in the side-by-side table."""
    return LABELS.get(name, name.replace("_", " ")) + " (world 2)"


def case(rank, world, impl, name, scatter=False, **kwargs):
    """Run case ``name`` (see :data:`CASES`); ``scatter``: reduce-scatter on gloo too."""
    make, forward = CASES[name]
    with scatter_on_gloo(scatter):
        return train(rank, world, impl, make, forward, batch=4, **kwargs)


def check(outcomes):
    """Every rank of a gradsync run is ok and within :data:`ATOL`."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["status"] == "ok", outcome
        assert outcome["max_diff"] <= ATOL, f"rank {rank}: parameters off by {outcome['max_diff']}"


def describe(outcome):
    """An outcome as a table cell."""
    if outcome["status"] == "ok":
        d = outcome["max_diff"]
        if d < FLOAT64_ROUNDING:
            return f"ok, < {FLOAT64_ROUNDING:.0e}"
        return f"ok, {d:.0e}" if d <= ATOL else f"**wrong**: off by {d:.2g}"
    return f"raises `{outcome['error']}`"


def same_as_unsharded(rank, world, steps=3, scatter=False, **settings):
    """The partition's gradients equal the same slices of an unsharded
    wrapper's ``.grad``, bit for bit, under ``settings`` (a wire type
    rounds both alike): returns the largest difference seen. A model
    without recompute, so that no gradient arrives late (whether one does
    depends on timing, and a correction travels exactly, not rounded)."""
    forward = _plain
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(20, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 20)).double()
    whole = GradsyncDDP(copy.deepcopy(base), bucket_cap_mb=0.001, **settings)
    with scatter_on_gloo(scatter):
        parted = GradsyncDDP(copy.deepcopy(base), bucket_cap_mb=0.001, shard_gradients=True, **settings)
    opt = parted.shard_optimizer(torch.optim.SGD, lr=0.1)
    worst = 0.0
    try:
        for step in range(steps):
            x = torch.randn(4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
            whole.zero_grad()
            opt.zero_grad()
            forward(whole, rank, step, x.clone().requires_grad_()).backward()
            forward(parted, rank, step, x.clone().requires_grad_()).backward()
            for piece in parted._partition.pieces:
                want = whole._params[piece.param].grad.reshape(-1)[piece.offset : piece.offset + piece.length]
                worst = max(worst, (piece.tensor.grad - want).abs().max().item())
    finally:
        whole.close()
        parted.close()
    return worst


def runtime_memory(rank, world, steps=3, cap_mb=0.01):
    """Bytes of bucket memory the runtime holds after ``steps`` steps of a
    16-layer model in many small buckets, sharded and not, with the plan's
    bytes and its largest bucket's: ``{"sharded", "whole", "plan", "bucket"}``."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(32, 32) for _ in range(16)]).double()
    out = {}
    for name, settings in (("whole", {}), ("sharded", {"shard_gradients": True})):
        model = GradsyncDDP(copy.deepcopy(base), bucket_cap_mb=cap_mb, **settings)
        if settings:
            opt = model.shard_optimizer(torch.optim.SGD, lr=0.1)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for step in range(steps):
                opt.zero_grad()
                x = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
                model(x).pow(2).sum().backward()
                opt.step()
            out[name] = model.memory_bytes
            plan = model._sync.session.plan()
            out["plan"] = sum(numel for numel, _ in plan) * 8
            out["bucket"] = max(numel for numel, _ in plan) * 8
        finally:
            model.close()
    return out


def loans(rank, world, steps=4):
    """Which steps' piece gradients are views of the runtime's memory (a
    loan) when a program keeps step 1's gradients alive past its
    ``zero_grad()`` (as a logger holding them would), and the largest
    difference from one process. Returns ``{"lent": [per step], "diff"}``."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = GradsyncDDP(copy.deepcopy(base), shard_gradients=True, bucket_cap_mb=0.0001)
    opt = model.shard_optimizer(torch.optim.SGD, lr=0.1)
    lent, kept, worst = [], None, 0.0
    try:
        for step in range(steps):
            data = torch.randn(world * 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            ref_opt.zero_grad()
            reference(data).pow(2).mean().backward()
            ref_opt.step()
            opt.zero_grad()
            model(data[rank * 2 : (rank + 1) * 2]).pow(2).mean().backward()
            grads = [t.grad for g in opt.param_groups for t in g["params"] if t.grad is not None]
            lent.append(any(getattr(g._base, "_gradsync_step", None) is not None for g in grads))
            if step == 1:
                kept = grads  # alive past the next zero_grad: step 1's memory stays on loan
            if step == 2:
                kept = None
            grads = None  # (this step's own references gone before the next write-back)
            opt.step()
            worst = max(worst, _diff(reference, model))
    finally:
        model.close()
    return {"lent": lent, "diff": worst}


def uneven_inputs(rank, world, immediate=False, micro=1, **settings):
    """Rank ``r`` has ``2 + 2 * (world - 1 - r)`` batches (rank 0 the most).
    Under ``with model.join()`` (DDP's divisor: the world size) or with
    ``model.join_now()`` at the end of each rank's data (divisor: the ranks
    that contributed), a rank out of data keeps stepping its partition for
    the others (and, with sharded parameters, serves their gathers).
    ``micro``: micro-batches per step, all but the last under ``no_sync``;
    ``settings``: the wrapper's (default ``shard_gradients=True``). Returns
    the largest parameter difference from the reference."""
    torch.manual_seed(21)
    base = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 12)).double()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapped = GradsyncDDP(copy.deepcopy(base), bucket_cap_mb=0.001, **(settings or {"shard_gradients": True}))
    opt = wrapped.shard_optimizer(torch.optim.AdamW, lr=LR)
    counts = [2 + 2 * (world - 1 - r) for r in range(world)]
    data = torch.randn(max(counts), world, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    try:
        def train(batches):
            for x in batches:
                opt.zero_grad()
                for m, chunk in enumerate(x.chunk(micro)):
                    with (wrapped.no_sync() if m < micro - 1 else _nothing()):
                        (_plain(wrapped, rank, 0, chunk) / micro).backward()
                opt.step()

        mine = [data[s, rank] for s in range(counts[rank])]
        if immediate:
            train(mine)
            wrapped.join_now()
        else:
            with wrapped.join():
                train(mine)
        for s in range(max(counts)):
            training = [r for r in range(world) if s < counts[r]]
            ref_opt.zero_grad()
            for r in training:
                for chunk in data[s, r].chunk(micro):
                    (_plain(reference, r, 0, chunk) / micro / (len(training) if immediate else world)).backward()
            ref_opt.step()
        with wrapped.whole_parameters():
            return {"diff": _diff(reference, wrapped)}
    finally:
        wrapped.close()


def runtime_collectives(rank, world, trace_dir):
    """Two sharded steps with a clip by the global norm, the timeline
    recorded: the names of its events (the first step's norm and gathers
    are on the second step's communicator lane)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    wrapped = GradsyncDDP(model, shard_gradients=True, bucket_cap_mb=0.0005, record_timeline=True)
    opt = wrapped.shard_optimizer(torch.optim.SGD, lr=0.1)
    try:
        for step in range(2):
            opt.zero_grad()
            x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
            wrapped(x).sum().backward()
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5)
            opt.step()
        path = f"{trace_dir}/timeline-{rank}.json"
        wrapped.write_timeline(path)
        with open(path) as f:
            return sorted({event["name"] for event in json.load(f)["traceEvents"]})
    finally:
        wrapped.close()


class _GrowingCollectives:
    """Counts the state group's collectives whose size grows with the world
    (every rank's objects, a word per rank) while it is entered."""

    def __enter__(self):
        from gradsync.torch._states import StateBroadcast

        self.calls, self._class = 0, StateBroadcast
        self._kept = {name: getattr(StateBroadcast, name) for name in ("all_gather_objects", "everyones")}
        for name, method in self._kept.items():
            setattr(StateBroadcast, name, self._counted(method))
        return self

    def _counted(self, method):
        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, method in self._kept.items():
            setattr(self._class, name, method)


def dcp_save(rank, world, path, steps=3, members=None, impl="gradsync", skew=False):
    """Train the twice-checkpointed model ``steps`` steps sharded, save it
    with ``gradsync.torch.checkpoint`` to ``path``, and return (the
    wrapper's rank 0) the consolidated optimizer state and the parameters
    it saved; and, on every rank, ``grown``: the state group's collectives
    of a size that grows with the world the save made. ``members``: the
    processes of a ``process_group`` to wrap on (the others only make the
    group); ``impl``: which sharding (:data:`SETTINGS`); ``skew``: the
    first parameter's step count made one more than the others' before the
    save (their scalars differ)."""
    from gradsync.torch import checkpoint

    make, forward = CASES["checkpoint_twice_reentrant"]
    torch.manual_seed(5)
    group = dist.new_group(members, backend="gloo") if members is not None else None
    if members is not None:
        if rank not in members:
            return None
        rank = members.index(rank)
    wrapped = GradsyncDDP(make().double(), **SETTINGS[impl], bucket_cap_mb=0.001, process_group=group)
    opt = wrapped.shard_optimizer(torch.optim.AdamW, lr=LR)
    try:
        for step in range(steps):
            x = torch.randn(4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            forward(wrapped, rank, step, x.requires_grad_()).backward()
            opt.step()
        if skew:
            for piece in wrapped._partition.of_param.get(0, ()):
                opt.inner.state[piece.tensor]["step"] += 1
        with _GrowingCollectives() as growing:
            checkpoint.save(path, wrapped, opt)
        opt.consolidate_state_dict(to=0)
        with wrapped.whole_parameters():
            params = [p.detach().clone() for p in wrapped.parameters()]
        if rank != 0:
            return {"grown": growing.calls}
        return {"optimizer": opt.state_dict(), "params": params, "grown": growing.calls}
    finally:
        wrapped.close()


def dcp_load(rank, world, path, saved, impl="gradsync"):
    """Load ``path`` into a fresh sharded wrapper (``impl``: which sharding)
    on this world size and compare with what was ``saved``: returns the
    largest difference of the parameters and of the consolidated optimizer
    state, and whether the step counts and groups match."""
    from gradsync.torch import checkpoint

    make, _ = CASES["checkpoint_twice_reentrant"]
    torch.manual_seed(77)  # other initial values: the load must replace them
    wrapped = GradsyncDDP(make().double(), **SETTINGS[impl], bucket_cap_mb=0.001)
    opt = wrapped.shard_optimizer(torch.optim.AdamW, lr=0.5)
    try:
        if impl == "gradsync-params":
            # Released parameters (after a step's end, as a resumed job's are) take the loaded values too.
            wrapped._partition.residence.release()
        checkpoint.load(path, wrapped, opt)
        opt.consolidate_state_dict(to=-1)
        got, want = opt.state_dict(), saved["optimizer"]
        with wrapped.whole_parameters():
            params = max((a - b).abs().max().item() for a, b in zip(wrapped.parameters(), saved["params"]))
        state = 0.0
        same_keys = sorted(got["state"]) == sorted(want["state"])
        steps_equal = True
        for n, values in want["state"].items():
            for key, value in values.items():
                if value.dim() == 0:
                    steps_equal = steps_equal and float(got["state"][n][key]) == float(value)
                else:
                    state = max(state, (got["state"][n][key] - value).abs().max().item())
        lr = [g["lr"] for g in got["param_groups"]]
        return {"params": params, "state": state, "keys": same_keys, "steps": steps_equal, "lr": lr}
    finally:
        wrapped.close()


def dcp_load_other_model(rank, world, path):
    """Load ``path`` into a sharded wrapper of another model: the error's text."""
    from gradsync.torch import checkpoint

    torch.manual_seed(0)
    wrapped = GradsyncDDP(SharedBetweenSegments().double(), shard_gradients=True, bucket_cap_mb=0.001)
    opt = wrapped.shard_optimizer(torch.optim.AdamW, lr=LR)
    try:
        checkpoint.load(path, wrapped, opt)
    except Exception as e:  # what the user reads
        return f"{type(e).__name__}: {e}"
    finally:
        wrapped.close()
    return None


def take_over(rank, world, how, steps=4):
    """An AdamW built the usual way before wrapping (two groups with their
    own options) and an LR scheduler over it, then stepped sharded:
    ``how="explicit"``: ``optimizer = model.shard_optimizer(optimizer)``;
    ``"automatic"``: no second line (the optimizer is converted at its first
    step, as under HF ``Trainer`` or Lightning). Trains as the reference
    does with the same optimizer and schedule. Returns the largest
    parameter difference."""
    torch.manual_seed(4)
    base = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 12)).double()
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)

    def adamw(m):
        opt = torch.optim.AdamW([{"params": m[0].parameters(), "lr": 0.02}, {"params": m[2].parameters()}],
                                lr=LR, weight_decay=0.05, betas=(0.8, 0.95))
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    ref_opt, ref_schedule = adamw(reference)
    optimizer, schedule = adamw(model)
    wrapped = GradsyncDDP(model, shard_gradients=True, bucket_cap_mb=0.001)
    if how == "explicit":
        optimizer = wrapped.shard_optimizer(optimizer)
    data = torch.randn(steps, world, 4, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    try:
        for s in range(steps):
            ref_opt.zero_grad()
            for r in range(world):
                (_plain(reference, r, s, data[s, r]) / world).backward()
            ref_opt.step()
            ref_schedule.step()
            optimizer.zero_grad()
            _plain(wrapped, rank, s, data[s, rank]).backward()
            optimizer.step()
            schedule.step()
        assert all(p.grad is None for p in wrapped.parameters()), ".grad stays None when sharded"
        return _diff(reference, wrapped)
    finally:
        wrapped.close()


# ---- bad input ------------------------------------------------------------------------------


def bad_input(rank, world):
    """The sharded wrapper's refusals, each a ConfigError that says what to do."""
    import gradsync

    torch.manual_seed(0)
    errors = {}
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    wrapped = GradsyncDDP(model, shard_gradients=True)
    try:
        for name, call in {
            "not_elementwise": lambda: wrapped.shard_optimizer(torch.optim.LBFGS, lr=1.0),
            "foreign_param": lambda: wrapped.shard_optimizer(torch.optim.AdamW, params=[nn.Parameter(torch.ones(2))]),
            "groups_differ": lambda: wrapped.shard_optimizer(
                torch.optim.AdamW, params=[{"params": list(model.parameters()), "lr": 0.1 * (rank + 1)}]
            ),
        }.items():
            try:
                call()
                errors[name] = None
            except gradsync.ConfigError as e:
                errors[name] = str(e)
        other = nn.Parameter(torch.ones(2))
        mixed = torch.optim.SGD([*wrapped.parameters(), other], lr=0.1)
        wrapped(torch.randn(3, 6)).sum().backward()
        try:
            mixed.step()
            errors["mixed_optimizer"] = None
        except gradsync.ConfigError as e:
            errors["mixed_optimizer"] = str(e)
        assert all(p.grad is None for p in wrapped.parameters()), ".grad stays None when sharded"
    finally:
        wrapped.close()
    unsharded = GradsyncDDP(nn.Linear(3, 3))
    try:
        unsharded.shard_optimizer(torch.optim.AdamW)
        errors["unsharded"] = None
    except gradsync.ConfigError as e:
        errors["unsharded"] = str(e)
    finally:
        unsharded.close()
    return errors


def full_state(rank, world, steps=3):
    """The consolidated optimizer state equals the unsharded optimizer's, and
    an unsharded state loads into a sharded optimizer on this world size."""
    make, forward = CASES["checkpoint_twice_reentrant"]
    torch.manual_seed(5)
    base = make().double()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapped = GradsyncDDP(copy.deepcopy(base), shard_gradients=True, bucket_cap_mb=0.001)
    opt = wrapped.shard_optimizer(torch.optim.AdamW, lr=LR)
    try:
        x = torch.randn(world * 4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        x.requires_grad_()

        def one_step(sharded_opt):
            ref_opt.zero_grad()
            for r in range(world):
                (forward(reference, r, 0, x[4 * r : 4 * r + 4]) / world).backward()
            ref_opt.step()
            sharded_opt.zero_grad()
            forward(wrapped, rank, 0, x[4 * rank : 4 * rank + 4]).backward()
            sharded_opt.step()

        for _ in range(steps):
            one_step(opt)
        opt.consolidate_state_dict(to=-1)
        got, want = opt.state_dict(), ref_opt.state_dict()
        assert sorted(got["state"]) == sorted(want["state"]), (sorted(got["state"]), sorted(want["state"]))
        worst = 0.0
        for n, values in want["state"].items():
            for key, value in values.items():
                worst = max(worst, (got["state"][n][key].double() - value.double()).abs().max().item())
        assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
        # A full state (the unsharded optimizer's) into a fresh sharded optimizer: the next step agrees.
        fresh = wrapped.shard_optimizer(torch.optim.AdamW, lr=LR)
        fresh.load_state_dict(ref_opt.state_dict())
        one_step(fresh)
        return {"state_diff": worst, "param_diff": _diff(reference, wrapped)}
    finally:
        wrapped.close()


def fresh_optimizer_each_step(rank, world, settings):
    """A plain torch optimizer built anew every step (``opt = SGD(...)``
    inside the loop, its ``zero_grad()`` before the backward) over a sharded
    wrapper: the new optimizer's ``zero_grad()`` cannot reach the pieces,
    where the averages live, so its first step would apply the previous
    step's gradients again. Returns what the second step raised, then the
    largest difference from one process over three steps when the loop
    clears the gradients through the wrapper (``model.zero_grad()``), as the
    error says to."""
    import gradsync
    from dropin import batch, mlp, reference_grads

    def run(clear_through_wrapper):
        model = mlp()
        reference = copy.deepcopy(model)
        wrapped = GradsyncDDP(model, **settings)
        worst = 0.0
        try:
            for step in range(3):
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                (wrapped if clear_through_wrapper else opt).zero_grad()
                wrapped(batch(step, rank)).square().sum().backward()
                opt.step()
                want = reference_grads(reference, world, step)
                with torch.no_grad():
                    for p, g in zip(reference.parameters(), want):
                        p.sub_(0.05 * g)
                with wrapped.whole_parameters():
                    worst = max(worst, max((a.detach() - b).abs().max().item()
                                           for a, b in zip(model.parameters(), reference.parameters())))
        finally:
            wrapped.close()
        return worst

    try:
        run(clear_through_wrapper=False)
        refused = None
    except gradsync.ConfigError as error:
        refused = str(error)
    return {"refused": refused, "max_diff": run(clear_through_wrapper=True)}
