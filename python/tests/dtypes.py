"""Gradients of other types than float32, as training code makes them:
float64 models (reduced in float64, as DDP reduces them), models that mix
float32 and float64 parameters, and sparse embedding gradients. Each case
runs under gradsync and under torch's DDP (``impl``) on every rank of a
world, and measures itself against a one-process replay of the same steps.
"""

import copy

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from cases import Outcome, wrap
from features import SlowBackward

#: How far a float64 run may end from the one-process replay (the issue's
#: bound; float32 arithmetic anywhere on the way ends about 1e-8 away).
F64_TOL = 1e-12


def batch(step, rank, rows=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 3)
    return torch.randn(rows, 8, generator=g, dtype=dtype)


class Physics(nn.Module):
    """A small float64 network, each block optionally under reentrant
    checkpointing (the recompute fires the hooks of the block's parameters
    again)."""

    def __init__(self, reentrant=False):
        super().__init__()
        torch.manual_seed(11)
        self.blocks = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)])
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant:
            x = x.detach().requires_grad_()
        for i, block in enumerate(self.blocks):
            layer = block if i == len(self.blocks) - 1 else (lambda t, b=block: torch.tanh(b(t)))
            x = checkpoint(layer, x, use_reentrant=True) if self.reentrant else layer(x)
        return x


def _replay(model, world, steps, lr):
    """The steps in one process: every rank's batch, the mean of their losses."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        sum(ref(batch(step, r)).square().mean() for r in range(world)).div(world).backward()
        opt.step()
    return ref


def float64_training(rank, world, impl, reentrant, steps=4, lr=0.05):
    """A float64 model trained ``steps`` SGD steps; the largest parameter
    difference from the one-process replay."""
    model = Physics(reentrant).double()
    want = _replay(model, world, steps, lr)
    wrapped = wrap(model, impl)
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            opt.zero_grad()
            wrapped(batch(step, rank)).square().mean().backward()
            opt.step()
        outcome.record(max((a - b).abs().max().item() for a, b in zip(model.parameters(), want.parameters())))
        grad_types = sorted({str(p.grad.dtype) for p in model.parameters()})
    outcome.result.update(grad_types=grad_types)
    return outcome.result


class Pause(SlowBackward):
    """Identity whose backward waits 200 ms: what comes before it in forward
    reaches its gradients well after what comes after it."""

    PAUSE_S = 0.2


class Mixed(nn.Module):
    """float32 layers around a float64 one, and a float64 weight shared by
    two reentrant-checkpointed segments (its second gradient arrives after
    its bucket left: a correction, of a float64 bucket)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(23)
        self.inp = nn.Linear(8, 12)
        self.shared = nn.Linear(12, 12).double()
        self.out = nn.Linear(12, 4)

    def forward(self, x):
        x = torch.tanh(self.inp(x)).double()
        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        x = Pause.apply(x)
        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.out(x.float())


def mixed_types(rank, world, impl, steps=3):
    """Gradients of a model with float32 and float64 parameters against the
    one-process reference: the largest difference per type."""
    model = Mixed()
    ref = copy.deepcopy(model)
    wrapped = wrap(model, impl, bucket_cap_mb=1)
    worst = {"float32": 0.0, "float64": 0.0}
    corrections = []
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            ref.zero_grad()
            wrapped(batch(step, rank, dtype=torch.float32)).square().mean().backward()
            sum(ref(batch(step, r, dtype=torch.float32)).square().mean() for r in range(world)).div(world).backward()
            for a, b in zip(model.parameters(), ref.parameters()):
                key = str(a.dtype).removeprefix("torch.")
                worst[key] = max(worst[key], (a.grad - b.grad).abs().max().item())
                assert a.grad.dtype == a.dtype
            if impl == "gradsync":
                corrections.append(wrapped.last_report.corrections)
        outcome.record(max(worst.values()))
    outcome.result.update(worst=worst, corrections=corrections)
    return outcome.result


class Recommender(nn.Module):
    """A sparse embedding table and a dense head; with ``reentrant``, the
    head and a second lookup in the same table run under reentrant
    checkpointing (recomputed in backward: the table's hooks would fire twice)."""

    def __init__(self, reentrant=False):
        super().__init__()
        torch.manual_seed(29)
        self.table = nn.Embedding(40, 6, sparse=True)
        self.head = nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, ids, more):
        x = self.table(ids).mean(1)
        if not self.reentrant:
            return self.head(x) + self.table(more).sum(1)[:, :3]
        return checkpoint(lambda t: self.head(t) + self.table(more).sum(1)[:, :3], x, use_reentrant=True)


def lookups(step, rank, rows=5):
    """Ranks look up overlapping rows (some only one rank sees)."""
    g = torch.Generator().manual_seed(31 * step + 977 * rank + 5)
    return torch.randint(0, 40, (rows, 3), generator=g), torch.randint(0, 40, (rows, 2), generator=g)


def _optimizers(model, which, lr=0.05):
    sparse, dense = [model.table.weight], [p for n, p in model.named_parameters() if n != "table.weight"]
    if which == "sparse_adam":
        return [torch.optim.SparseAdam(sparse, lr=lr), torch.optim.Adam(dense, lr=lr)]
    return [torch.optim.SGD(sparse + dense, lr=lr)]


def sparse_training(rank, world, impl, which, reentrant, steps=4):
    """A float64 model with a sparse embedding trained with ``which``
    (``"sparse_adam"``: SparseAdam for the table, Adam for the head;
    ``"sgd"``); the largest parameter difference from the one-process
    replay, and whether every table gradient stayed sparse."""
    model = Recommender(reentrant).double()
    ref = copy.deepcopy(model)
    ref_opts = _optimizers(ref, which)
    for step in range(steps):
        for o in ref_opts:
            o.zero_grad()
        sum(ref(*lookups(step, r)).square().mean() for r in range(world)).div(world).backward()
        for o in ref_opts:
            o.step()
    wrapped = wrap(model, impl)
    opts = _optimizers(model, which)
    sparse_grads = True
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            for o in opts:
                o.zero_grad()
            wrapped(*lookups(step, rank)).square().mean().backward()
            sparse_grads &= model.table.weight.grad.is_sparse
            for o in opts:
                o.step()
        outcome.record(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    outcome.result.update(sparse_grads=sparse_grads, table=model.table.weight.detach().clone())
    return outcome.result
