"""Training programs written the way people write them, run on every rank
of a test world with nothing of gradsync but the wrapper and its sharding
setting, each next to a one-process replay: the same program in plain
torch, every rank's batch run through one model (its loss divided by the
world size, as DDP averages).

This module imports torch's ``clip_grad_norm_`` by name at its top, as many
scripts do, before any gradsync wrapper exists in the process: a sharded
run must still clip by the global norm through that reference.
"""

import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_

from gradsync.torch import DistributedDataParallel as DDP

#: Float32 programs agree with their replay this closely (AdamW over a few steps
#: magnifies the rounding of the all-reduce's other summation order: up to 3e-6 seen).
ATOL32 = 1e-5


def _diff(a, b):
    """Largest parameter difference of two modules (a wrapper or not; one
    whose parameters are sharded gathers them: every rank calls it)."""
    whole = getattr(a, "whole_parameters", contextlib.nullcontext)
    with whole():
        a, b = getattr(a, "module", a), getattr(b, "module", b)
        return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


class TinyGPT(nn.Module):
    """nanoGPT's shape, small: token and position embeddings, the head tied
    to the token embedding, blocks of attention-sized and MLP-sized linear
    layers with LayerNorm."""

    def __init__(self, vocab=64, dim=32, blocks=2, context=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(dim), "attn": nn.Linear(dim, dim), "mlp": nn.Linear(dim, 4 * dim),
                           "proj": nn.Linear(4 * dim, dim)})
            for _ in range(blocks)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            h = b["ln"](x)
            x = x + b["attn"](h)
            x = x + b["proj"](F.gelu(b["mlp"](h)))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _nanogpt_optimizer(model, lr):
    """nanoGPT's ``configure_optimizers``: weight decay on the matrices only, two groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def _lr_at(step, warmup=2, total=8, top=6e-3):
    """nanoGPT's schedule: linear warmup, then cosine."""
    if step < warmup:
        return top * (step + 1) / warmup
    return top * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def nanogpt(rank, world, steps=6, clip=0.05, scaler=False, **wrap):
    """nanoGPT's training loop: the learning rate set at the top of each
    step, ``scaler.scale(loss).backward()``, ``scaler.unscale_``, torch's
    ``clip_grad_norm_`` through the name imported at this module's top,
    ``scaler.step``, ``scaler.update``. ``scaler``: a ``torch.amp.GradScaler``
    (on CPU) that is enabled. Returns the largest parameter difference from
    the replay and the largest relative difference of the clip norms."""
    torch.manual_seed(0)
    base = TinyGPT()
    data = torch.randint(0, 64, (steps, world * 2, 17), generator=torch.Generator().manual_seed(5))
    runs = {}
    for impl in ("replay", "gradsync"):
        model = copy.deepcopy(base)
        if impl == "gradsync":
            model = DDP(model, **wrap)
        optimizer = _nanogpt_optimizer(model, _lr_at(0))
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaler)
        norms = []
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step)
            batches = range(world) if impl == "replay" else [rank]
            for r in batches:
                x, y = data[step, 2 * r : 2 * r + 2, :-1], data[step, 2 * r : 2 * r + 2, 1:]
                loss = model(x, y) / (world if impl == "replay" else 1)
                grad_scaler.scale(loss).backward()
            if clip is not None:
                grad_scaler.unscale_(optimizer)
                norms.append(float(clip_grad_norm_(model.parameters(), clip)))
            grad_scaler.step(optimizer)
            grad_scaler.update()
            optimizer.zero_grad(set_to_none=True)
        runs[impl] = (model, norms)
    (ours, our_norms), (replayed, their_norms) = runs["gradsync"], runs["replay"]
    try:
        norms_off = max((abs(a - b) / b for a, b in zip(our_norms, their_norms)), default=0.0)
        clipped = sum(b > clip for b in their_norms) if clip is not None else 0
        return {"params": _diff(ours, replayed), "norms": norms_off, "clipped": clipped, "steps": steps}
    finally:
        ours.close()


class OutOfMemoryOn:
    """A backward hook that raises ``torch.OutOfMemoryError`` on ``rank`` at
    ``step``, mid-backward (as an allocation in backward would)."""

    def __init__(self, module, rank, step):
        self.rank, self.step, self.now = rank, step, None
        module.register_full_backward_hook(self._hook)

    def _hook(self, module, grad_input, grad_output):
        if self.now == (self.rank, self.step):
            raise torch.OutOfMemoryError("CPU out of memory (a test's)")


def out_of_memory(rank, world, steps=5, oom=(1, 2), scaler=False, **wrap):
    """A loop that survives an out-of-memory error as the docs say: the
    rank that hits it calls ``model.abort_step("out_of_memory")`` and goes
    on to its next batch (``continue``); every other rank clips and steps
    as usual (``scaler``: through an enabled ``torch.amp.GradScaler``, whose
    scale is a power of two: the replay needs none). The step is skipped on
    every rank, so the replay skips it. Returns the largest parameter
    difference from the replay and what each step's report said."""
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    data = torch.randn(steps, world, 6, 12, generator=torch.Generator().manual_seed(2))
    model = DDP(copy.deepcopy(base), **wrap)
    failing = OutOfMemoryOn(model.module[2], *oom)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaler)
    outcomes = []
    try:
        for step in range(steps):
            optimizer.zero_grad()
            failing.now = (rank, step)
            try:
                grad_scaler.scale(model(data[step, rank]).square().mean()).backward()
            except torch.OutOfMemoryError:
                outcomes.append(model.abort_step("out_of_memory").outcome)
                continue
            outcomes.append(model.last_report.outcome)
            grad_scaler.unscale_(optimizer)
            clip_grad_norm_(model.parameters(), 1.0)
            grad_scaler.step(optimizer)
            grad_scaler.update()
        reference = copy.deepcopy(base)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(steps):
            if step == oom[1]:
                continue  # skipped on every rank
            ref_opt.zero_grad()
            for r in range(world):
                (reference(data[step, r]).square().mean() / world).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
        return {"params": _diff(model, reference), "outcomes": outcomes}
    finally:
        model.close()


def out_of_memory_partial_without_step(rank, world, **wrap):
    """The partial policy applies an aborted step on every rank, the aborting
    one too; a sharded rank that aborts and goes on without
    ``optimizer.step()`` is told so at its next forward. Returns the error
    each rank saw (the others' gather then fails: the aborting rank never
    joins it)."""
    try:
        out_of_memory(rank, world, abort_policy="partial", timeout=5, **wrap)
    except Exception as e:  # what each rank reads
        return f"{type(e).__name__}: {e}"
    return None


def frozen_layer(rank, world, steps=4, **wrap):
    """Fine-tuning: the embedding frozen, ``AdamW(model.parameters())`` over
    every parameter (the frozen one too, as most scripts build it), a
    checkpoint of the optimizer consolidated in torch's format. Returns the
    largest parameter difference from the replay and whether the saved
    state is numbered as torch numbers it."""
    torch.manual_seed(3)
    base = nn.Sequential(nn.Embedding(32, 16), nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 2))
    base[0].weight.requires_grad_(False)
    data = torch.randint(0, 32, (steps, world, 5, 4), generator=torch.Generator().manual_seed(4))
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = DDP(copy.deepcopy(base), **wrap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for step in range(steps):
            optimizer.zero_grad()
            model(data[step, rank]).square().mean().backward()
            optimizer.step()
            ref_opt.zero_grad()
            for r in range(world):
                (reference(data[step, r]).square().mean() / world).backward()
            ref_opt.step()
        saved = optimizer.state_dict() if not hasattr(optimizer, "consolidate_state_dict") else None
        if saved is None:
            optimizer.consolidate_state_dict(to=0)
            saved = optimizer.state_dict() if rank == 0 else None
        want = ref_opt.state_dict()
        same = saved is None or (
            saved["param_groups"][0]["params"] == want["param_groups"][0]["params"]
            and sorted(saved["state"]) == sorted(want["state"])
            and max((saved["state"][n][k] - v).abs().max().item()
                    for n in want["state"] for k, v in want["state"][n].items() if v.dim() > 0) < 1e-6
        )
        return {"params": _diff(model, reference), "state_as_torch": same}
    finally:
        model.close()


def channels_last(rank, world, steps=3, **wrap):
    """timm's loop: a convolutional model in ``channels_last`` memory format
    (inputs too), AdamW. Returns the largest parameter difference from the
    replay and whether the parameters kept their memory format."""
    torch.manual_seed(6)
    base = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    base = base.to(memory_format=torch.channels_last)
    data = torch.randn(steps, world, 4, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = DDP(copy.deepcopy(base), broadcast_buffers=False, **wrap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        for step in range(steps):
            optimizer.zero_grad()
            x = data[step, rank].contiguous(memory_format=torch.channels_last)
            model(x).square().mean().backward()
            optimizer.step()
            ref_opt.zero_grad()
            for r in range(world):
                # (BatchNorm: each rank's batch by itself, as each rank's module sees it.)
                (reference(data[step, r].contiguous(memory_format=torch.channels_last)).square().mean()
                 / world).backward()
            ref_opt.step()
        with getattr(model, "whole_parameters", contextlib.nullcontext)():
            kept = model.module[0].weight.is_contiguous(memory_format=torch.channels_last)
        return {"params": _diff(model, reference), "channels_last": kept}
    finally:
        model.close()


def checkpoint_save(rank, world, path, steps=4, sharding=None):
    """nanoGPT's model at the default bucket size (one bucket: with two ranks
    rank 0 holds no piece of the embeddings), AdamW in two groups, saved
    with ``gradsync.torch.checkpoint`` after ``steps`` steps. Returns (rank
    0) the consolidated optimizer state and the parameters saved.
    ``sharding``: the wrapper's setting (default ``shard_gradients=True``)."""
    from gradsync.torch import checkpoint

    torch.manual_seed(0)
    model = DDP(TinyGPT(), **(sharding or {"shard_gradients": True}))
    optimizer = _nanogpt_optimizer(model, 1e-3)
    data = torch.randint(0, 64, (steps, world * 2, 17), generator=torch.Generator().manual_seed(5))
    try:
        for step in range(steps):
            optimizer.zero_grad()
            x = data[step, 2 * rank : 2 * rank + 2]
            model(x[:, :-1], x[:, 1:]).backward()
            optimizer.step()
        checkpoint.save(path, model, optimizer)
        optimizer.consolidate_state_dict(to=0)
        with model.whole_parameters():
            params = [p.detach().clone() for p in model.parameters()]
        return {"optimizer": optimizer.state_dict(), "params": params} if rank == 0 else None
    finally:
        model.close()


def checkpoint_load(rank, world, path, saved, sharding=None):
    """:func:`checkpoint_save`'s checkpoint loaded into a fresh wrapper on
    this world size (``sharding``: its setting, default
    ``shard_gradients=True``; sharded parameters are released first, as a
    resumed job's are after a step): the largest difference of the
    parameters and of the consolidated optimizer state from what was saved."""
    from gradsync.torch import checkpoint

    torch.manual_seed(9)  # other initial values: the load must replace them
    model = DDP(TinyGPT(), **(sharding or {"shard_gradients": True}))
    optimizer = _nanogpt_optimizer(model, 0.5)
    try:
        if model._partition.residence is not None:
            model._partition.residence.release()
        checkpoint.load(path, model, optimizer)
        optimizer.consolidate_state_dict(to=-1)
        got, want = optimizer.state_dict(), saved["optimizer"]
        state = max(((got["state"][n][k].double() - v.double()).abs().max().item()
                     for n in want["state"] for k, v in want["state"][n].items()), default=float("inf"))
        with model.whole_parameters():
            params = max((a - b).abs().max().item() for a, b in zip(model.parameters(), saved["params"]))
        return {
            "params": params,
            "state": state if sorted(got["state"]) == sorted(want["state"]) else float("inf"),
            "lr": [g["lr"] for g in got["param_groups"]],
        }
    finally:
        model.close()


def checkpoint_load_error(rank, world, path):
    """Load ``path`` (whose data files were removed): the error each rank
    reads (an ordinary exception, naming the ranks that failed)."""
    try:
        checkpoint_load(rank, world, path, None)
    except Exception as e:  # (torch's CheckpointException is a BaseException: it would pass through)
        return f"{type(e).__name__}: ranks {getattr(e, 'ranks', None)}: {e}"
    return None


def hf_gpt2_config():
    """A small HF GPT-2 configuration (tied head, as GPT-2 is)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)


def hf_sharded_save(rank, world, path, steps=2):
    """An HF GPT-2 built on the meta device with ``shard_parameters=True``
    (initialized by its own ``_init_weights``), trained ``steps`` steps and
    saved with ``gradsync.torch.checkpoint``: (rank 0) its whole state dict
    as saved."""
    from transformers import GPT2LMHeadModel

    from gradsync.torch import checkpoint

    torch.manual_seed(0)
    with torch.device("meta"):
        base = GPT2LMHeadModel(hf_gpt2_config())
    model = DDP(base, shard_parameters=True, param_init=base._init_weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 96, (steps, world * 2, 12), generator=torch.Generator().manual_seed(3))
    try:
        for step in range(steps):
            optimizer.zero_grad()
            x = ids[step, 2 * rank : 2 * rank + 2]
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
        checkpoint.save(path, model, optimizer)
        with model.whole_parameters():
            saved = {n: t.detach().clone() for n, t in model.module.state_dict().items()}
        return saved if rank == 0 else None
    finally:
        model.close()


def nanogpt_master_checkpoint(rank, world, path, steps=6, interval=2):
    """nanoGPT's evaluation and checkpoint under ``shard_parameters=True``:
    at the top of every ``interval``-th iteration the master process
    alone runs ``estimate_loss()`` (eval mode, no gradients, three
    batches) and saves ``{"model": raw_model.state_dict(), "optimizer":
    optimizer.state_dict(), "iter_num": ...}`` with ``torch.save``, while
    the other ranks go on to the iteration's forward. Then every rank
    resumes as nanoGPT does from the last checkpoint (the module and the
    optimizer loaded before wrapping) and trains to the end. Returns, on
    rank 0, the largest difference of its evaluation losses from the
    replay's; on every rank the resumed model's largest difference from
    the replay's at the end."""
    torch.manual_seed(0)
    base = TinyGPT()
    data = torch.randint(0, 64, (steps, world * 2, 17), generator=torch.Generator().manual_seed(5))
    held_out = torch.randint(0, 64, (3, 4, 17), generator=torch.Generator().manual_seed(6))

    def estimate_loss(model):
        model.eval()
        with torch.no_grad():
            losses = [float(model(x[:, :-1], x[:, 1:])) for x in held_out]
        model.train()
        return losses

    def train(model, optimizer, step, ranks):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step)
        for r in ranks:
            x, y = data[step, 2 * r : 2 * r + 2, :-1], data[step, 2 * r : 2 * r + 2, 1:]
            (model(x, y) / len(ranks)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    replay = copy.deepcopy(base)
    replay_opt = _nanogpt_optimizer(replay, _lr_at(0))
    replay_losses = {}
    for step in range(steps):
        if step % interval == 0:
            replay_losses[step] = estimate_loss(replay)
        train(replay, replay_opt, step, range(world))
    seen = {"eval": 0.0}
    model = DDP(copy.deepcopy(base), shard_parameters=True)
    optimizer = _nanogpt_optimizer(model, _lr_at(0))
    try:
        for step in range(steps):
            if step % interval == 0 and rank == 0:
                losses = estimate_loss(model)
                seen["eval"] = max([seen["eval"]] + [abs(a - b) for a, b in zip(losses, replay_losses[step])])
                if step > 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": step}, path)
            train(model, optimizer, step, [rank])
    finally:
        model.close()
    torch.distributed.barrier()
    checkpoint = torch.load(path, weights_only=True)
    resumed = TinyGPT()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = _nanogpt_optimizer(resumed, _lr_at(0))
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed = DDP(resumed, shard_parameters=True)
    try:
        for step in range(checkpoint["iter_num"], steps):
            train(resumed, resumed_opt, step, [rank])
        seen["resumed"] = _diff(resumed, replay)
        return seen
    finally:
        resumed.close()
