"""Rank-side cases of ``test_features.py``: accumulation, two wrapped models,
gradient dtypes and layouts, explicit ends of steps, and what a run reports."""

import copy
import json
import os

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gradsync
from cases import max_diff
from gradsync.torch import DistributedDataParallel as DDP


def batch(step, rank, rows=6, cols=10, dtype=torch.float64):
    return torch.randn(rows, cols, dtype=dtype, generator=torch.Generator().manual_seed(1000 * step + rank))


class SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``PAUSE_S`` (30 ms): compute that a
    bucket launched before it can overlap."""

    PAUSE_S = 0.03

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @classmethod
    def backward(cls, ctx, g):
        import time

        time.sleep(cls.PAUSE_S)
        return g


class Slow(nn.Module):
    def forward(self, x):
        return SlowBackward.apply(x)


def mlp(dtype=torch.float64, seed=23, slow=False):
    torch.manual_seed(seed)
    middle = [Slow()] if slow else []
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), *middle, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def averaged_reference(model, world, step, micro=1, rows=6, scale=1.0, dtype=torch.float64):
    """Every rank's micro-batches through one copy of ``model``, gradients /
    world (None for a parameter no forward used)."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    for r in range(world):
        for m in range(micro):
            (ref(batch(step * micro + m, r, rows, dtype=dtype)).sum() * scale).backward()
    return [None if p.grad is None else p.grad / world for p in ref.parameters()]


def off_reference(wrapped, model, world, step):
    """How far ``wrapped``'s gradients of ``step`` are from the averaged reference."""
    want = averaged_reference(model, world, step)
    return max((p.grad - w).abs().max().item() for p, w in zip(wrapped.parameters(), want))


def accumulation(rank, world, micro=3, steps=3):
    """Gradient accumulation over micro-batches with ``no_sync()``: the sum of
    every micro-batch of every rank, averaged; the last micro-batch's backward
    overlaps the reduction (buckets reduced before the step ends)."""
    model = mlp(slow=True)
    wrapped = DDP(copy.deepcopy(model), bucket_cap_mb=0.0005)
    worst, overlapped = 0.0, []
    for step in range(steps):
        wrapped.zero_grad()
        with wrapped.no_sync():
            for m in range(micro - 1):
                wrapped(batch(step * micro + m, rank)).sum().backward()
                assert wrapped.current_step == step, "no_sync must not end the step"
        wrapped(batch(step * micro + micro - 1, rank)).sum().backward()
        want = averaged_reference(model, world, step, micro)
        worst = max(worst, max((p.grad - w).abs().max().item() for p, w in zip(wrapped.parameters(), want)))
        overlapped.append(wrapped.last_report.buckets_done_before_finish)
    wrapped.close()
    return {"max_diff": worst, "overlapped": overlapped, "buckets": wrapped.last_report.buckets_launched}


class DeclaredBackwards(nn.Module):
    """Layers declared last-used-first: registration order is backward's own
    order, the reverse of what the first bucket plan assumes. Backward spends
    30 ms (``Slow``) before the first layer's gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(31)
        self.head = nn.Linear(16, 1)
        self.middle = nn.Linear(16, 16)
        self.first = nn.Linear(10, 16)
        self.slow = Slow()

    def forward(self, x):
        return self.head(torch.tanh(self.middle(torch.tanh(self.slow(self.first(x))))))


def declared_backwards(rank, world, steps=4):
    """The plan is rebuilt in gradient order after the first step: from the
    second step, the buckets holding only the head's and middle's gradients
    are reduced while backward is still in ``Slow`` (in the first step every
    bucket waited for the first layer); every step is exact."""
    model = DeclaredBackwards().double()
    wrapped = DDP(copy.deepcopy(model), bucket_cap_mb=0.0005)
    worst, overlapped = 0.0, []
    for step in range(steps):
        wrapped.zero_grad()
        wrapped(batch(step, rank)).sum().backward()
        worst = max(worst, off_reference(wrapped, model, world, step))
        overlapped.append(wrapped.last_report.buckets_done_before_finish)
    buckets = wrapped.last_report.buckets_launched
    wrapped.close()
    return {"max_diff": worst, "overlapped": overlapped, "buckets": buckets}


def two_models(rank, world, steps=3):
    """``A(B(x))`` with each model wrapped separately (each has its own group)."""
    torch.manual_seed(29)
    a_ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    b_ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    a, b = DDP(copy.deepcopy(a_ref)), DDP(copy.deepcopy(b_ref))
    worst = 0.0
    for step in range(steps):
        a.zero_grad(), b.zero_grad(), a_ref.zero_grad(), b_ref.zero_grad()
        a(b(batch(step, rank, 4, 8))).pow(2).sum().backward()
        for r in range(world):
            a_ref(b_ref(batch(step, r, 4, 8))).pow(2).sum().backward()
        for ref, w in ((a_ref, a), (b_ref, b)):
            for p in ref.parameters():
                p.grad = p.grad / world
            worst = max(worst, max_diff(ref, w))
            for p in ref.parameters():
                p.grad = p.grad * world
    reports = (a.last_report.step, b.last_report.step)
    a.close(), b.close()
    return {"max_diff": worst, "steps": reports}


def dtypes(rank, world):
    """float32, float16 and bfloat16 parameters, and a non-contiguous gradient."""
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        torch.manual_seed(31)
        lin = nn.Linear(4, 4).to(dtype)
        wrapped = DDP(copy.deepcopy(lin))
        x = torch.full((2, 4), float(rank + 1), dtype=dtype)
        wrapped(x).sum().backward()
        ref = copy.deepcopy(lin)
        for r in range(world):
            ref(torch.full((2, 4), float(r + 1), dtype=dtype)).sum().backward()
        diff = max((p.grad.float() - q.grad.float() / world).abs().max().item() for p, q in zip(wrapped.parameters(), ref.parameters()))
        out[str(dtype)] = (str(wrapped.module.weight.grad.dtype), diff)
        wrapped.close()

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(12.0, dtype=torch.float64).reshape(3, 4).t())  # non-contiguous

        def forward(self, x):
            return x @ self.w

    model = Transposed()
    wrapped = DDP(model)
    wrapped(torch.full((2, 4), float(rank + 1), dtype=torch.float64)).sum().backward()
    want = sum(torch.full((2, 4), float(r + 1), dtype=torch.float64).t() @ torch.ones(2, 3, dtype=torch.float64) for r in range(world)) / world
    out["non_contiguous"] = (wrapped.module.w.grad.is_contiguous(), (wrapped.module.w.grad - want).abs().max().item())
    wrapped.close()
    return out


class Segments(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def nested_checkpoints(rank, world):
    """The wrapped model inside a reentrant checkpoint nested in another: no
    backward pass reaches its outputs outside a nested one, and the step
    still ends by itself when the outermost pass ends (every pass that
    reached the model is watched to its end), exact; ``finish_step()`` after
    it has nothing left to end. The model checkpointed whole at the top
    level ends its step by itself too."""
    torch.manual_seed(37)
    base = Segments().double()
    wrapped = DDP(copy.deepcopy(base))

    def nested(x):
        inner = lambda t: checkpoint(wrapped, t, use_reentrant=True)  # noqa: E731
        return checkpoint(inner, x, use_reentrant=True)

    x = batch(0, rank, 4, 6).requires_grad_()
    nested(x).sum().backward()
    ended = wrapped.last_report.step if wrapped.last_report is not None else None
    late_finish = wrapped.finish_step()
    ref = copy.deepcopy(base)
    for r in range(world):
        ref(batch(0, r, 4, 6)).sum().backward()
    diff = max((p.grad - q.grad / world).abs().max().item() for p, q in zip(wrapped.parameters(), ref.parameters()))
    wrapped.zero_grad()
    checkpoint(wrapped, x, use_reentrant=True).sum().backward()
    auto = wrapped.last_report.step
    wrapped.close()
    return {"ended": ended, "late_finish": late_finish, "max_diff": diff, "auto_step": auto}


def observability(rank, world, trace_dir, metrics_port):
    """The report as a Python object, the timeline as Chrome trace JSON, and
    the Prometheus endpoint (rank 0 serves it)."""
    if rank == 0:
        gradsync.install_prometheus(f"127.0.0.1:{metrics_port}")
    model = mlp()
    wrapped = DDP(model, record_timeline=True, bucket_cap_mb=0.0005)
    for step in range(3):
        wrapped.zero_grad()
        wrapped(batch(step, rank)).sum().backward()
    report = wrapped.last_report.to_dict()
    path = os.path.join(trace_dir, f"timeline-{rank}.json")
    events = wrapped.write_timeline(path)
    with open(path) as f:
        trace = json.load(f)
    scraped = None
    if rank == 0:
        import urllib.request

        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    memory = wrapped.session.memory_bytes
    wrapped.close()
    closed = None
    try:
        wrapped(batch(0, rank))
    except gradsync.ClosedError as e:
        closed = str(e)
    return {"report": report, "events": events, "trace_events": len(trace["traceEvents"]), "scraped": scraped,
            "memory": memory, "closed": closed}


def training_converges(rank, world, steps=40):
    """A few steps of SGD: every replica stays identical and the loss falls."""
    model = mlp(seed=41)
    wrapped = DDP(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    losses = []
    target = lambda x: 0.3 * x.sum(dim=1, keepdim=True)  # noqa: E731
    for step in range(steps):
        x = batch(step, rank, 16)
        opt.zero_grad()
        loss = (wrapped(x) - target(x)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in wrapped.parameters()])
    wrapped.close()
    return {"first": sum(losses[:3]) / 3, "last": sum(losses[-3:]) / 3, "params": flat}


def wire_types(rank, world, steps=3):
    """The same steps with float32 and bfloat16 on the wire: each one's
    distance from the averaged reference."""
    out = {}
    for wire in ("float32", "bfloat16"):
        model = mlp()
        wrapped = DDP(copy.deepcopy(model), wire_dtype=wire)
        worst = 0.0
        for step in range(steps):
            wrapped.zero_grad()
            wrapped(batch(step, rank)).sum().backward()
            worst = max(worst, off_reference(wrapped, model, world, step))
        out[wire] = worst
        wrapped.close()
    return out


class TiedCheckpointed(nn.Module):
    """A layer used twice (one use under reentrant checkpointing, so its
    hook fires in a nested backward), a head, and a layer no forward uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(29)
        self.shared = nn.Linear(10, 10)
        self.head = nn.Linear(10, 1)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.shared(t)), x.requires_grad_(), use_reentrant=True)
        return self.head(torch.tanh(self.shared(h)))


def held_gradients(rank, world, steps=3):
    """float32 steps over a parameter whose hook fires twice (once in a
    nested backward), an unused one, and a step whose ``.grad`` tensors are
    held (``zero_grad(set_to_none=False)``): the distance from the averaged
    reference, and whether the held tensors received the average."""
    model = TiedCheckpointed()
    wrapped = DDP(copy.deepcopy(model))
    worst, held_kept = 0.0, True
    for step in range(steps):
        wrapped.zero_grad(set_to_none=step != 1)
        held = [p.grad for p in wrapped.parameters()]
        wrapped(batch(step, rank, dtype=torch.float32)).sum().backward()
        if step == 1:
            held_kept = all(h is p.grad for h, p in zip(held, wrapped.parameters()) if p.grad is not None)
        for p, want in zip(wrapped.parameters(), averaged_reference(model, world, step, dtype=torch.float32)):
            if want is None:
                assert p.grad is None or not p.grad.any(), "an unused parameter got a gradient"
                continue
            worst = max(worst, (p.grad - want).abs().max().item())
    wrapped.close()
    return {"max_diff": worst, "held_kept": held_kept}
