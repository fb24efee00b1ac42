"""Rank-side cases of ``test_faults.py``."""

import copy
import os
import time

import torch
import torch.nn as nn

import gradsync
from cases import OutOfMemory
from features import batch, mlp
from gradsync.torch import DistributedDataParallel as DDP


class FailsHere(nn.Module):
    """Identity; its backward raises torch.OutOfMemoryError on the armed rank."""

    def forward(self, x):
        return OutOfMemory.apply(x)


def partial_abort(rank, world, aborting=2):
    """``abort_policy="partial"``: rank ``aborting`` runs out of memory in the
    middle of backward, after the buckets of the later layers went out, and
    aborts. Every rank (the aborting one too) gets the average over the ranks
    that finished: what the aborting rank had sent is retracted."""
    torch.manual_seed(47)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), FailsHere(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    wrapped = DDP(copy.deepcopy(model), abort_policy="partial", bucket_cap_mb=0.0005)
    x = batch(0, rank) * (100.0 if rank == aborting else 1.0)  # what must not leak into the average
    OutOfMemory.armed = rank == aborting
    try:
        wrapped(x).sum().backward()
        report = wrapped.last_report
    except torch.OutOfMemoryError:
        sent = wrapped.session.progress()["buckets_launched"]
        assert sent >= 1, "the later layers' buckets went out before the failure"
        report = wrapped.abort_step("out_of_memory")
    finally:
        OutOfMemory.armed = False
    ref = copy.deepcopy(model)
    for r in range(world):
        if r != aborting:
            ref(batch(0, r)).sum().backward()
    diff = max((p.grad - q.grad / (world - 1)).abs().max().item() for p, q in zip(wrapped.parameters(), ref.parameters()))
    wrapped.close()
    return {"outcome": report.outcome, "aborted": report.aborted, "contributors": report.contributors, "max_diff": diff}


def stalled_rank(rank, world, timeout_s, stalled=1):
    """Rank ``stalled`` stops answering during step 1 (stuck for longer than the
    deadline). The others fail within the deadline naming it; then every rank
    resets and step 2 is exact."""
    model = mlp()
    wrapped = DDP(copy.deepcopy(model), timeout=timeout_s)
    wrapped(batch(0, rank)).sum().backward()
    error, waited = None, None
    if rank == stalled:
        time.sleep(timeout_s * 1.5)
    t0 = time.monotonic()
    try:
        wrapped(batch(1, rank)).sum().backward()
    except gradsync.StepFailedError as e:
        error, waited = e, time.monotonic() - t0
    assert error is not None, "step 1 must fail on every rank"
    restart = wrapped.reset()
    wrapped.zero_grad()
    wrapped(batch(2, rank)).sum().backward()
    ref = copy.deepcopy(model)
    for r in range(world):
        ref(batch(2, r)).sum().backward()
    diff = max((p.grad - q.grad / world).abs().max().item() for p, q in zip(wrapped.parameters(), ref.parameters()))
    wrapped.close()
    return {
        "error": type(error).__name__,
        "message": str(error),
        "missing": getattr(error, "missing_ranks", None),
        "waited": waited,
        "restart": restart,
        "max_diff": diff,
    }


def stalled_rank_sharded(rank, world, timeout_s, setting, stalled=1):
    """:func:`stalled_rank` sharded (``setting``: ``"shard_gradients"`` or
    ``"shard_parameters"``), with AdamW over the wrapper's parameters: step
    1 fails on every rank, every rank resets, and step 2 trains exactly as
    one process that skips step 1. Returns the largest parameter
    difference and the error's class."""
    model = mlp()
    wrapped = DDP(copy.deepcopy(model), timeout=timeout_s, bucket_cap_mb=0.0005, **{setting: True})
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    error = None
    try:
        for step in range(3):
            opt.zero_grad()
            if step == 1 and rank == stalled:
                time.sleep(timeout_s * 1.5)
            try:
                wrapped(batch(step, rank)).sum().backward()
            except gradsync.StepFailedError as e:
                error = e
                wrapped.reset()
                continue
            opt.step()
            if step != 1:
                ref_opt.zero_grad()
                for r in range(world):
                    (ref(batch(step, r)).sum() / world).backward()
                ref_opt.step()
        with wrapped.whole_parameters():
            diff = max((p - q).abs().max().item() for p, q in zip(wrapped.parameters(), ref.parameters()))
    finally:
        wrapped.close()
    return {"error": type(error).__name__, "max_diff": diff}


def desync(rank, world, odd=2):
    """Rank ``odd`` wraps a model with one more layer than the others."""
    torch.manual_seed(43)
    layers = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1)]
    if rank == odd:
        layers.insert(0, nn.Linear(6, 6))
    wrapped = DDP(nn.Sequential(*layers).double(), timeout=20)
    try:
        wrapped(batch(0, rank, 4, 6)).sum().backward()
    except gradsync.DesyncError as e:
        return {"ranks": e.ranks, "majority": e.majority, "message": str(e)}
    finally:
        wrapped.close()
    return None


def killed_rank(rank, world, timeout_s, dies=1):
    """Rank ``dies`` exits in the middle of training (a crash)."""
    wrapped = DDP(mlp(), timeout=timeout_s)
    wrapped(batch(0, rank)).sum().backward()
    if rank == dies:
        os._exit(1)
    t0 = time.monotonic()
    try:
        wrapped(batch(1, rank)).sum().backward()
    except gradsync.StepFailedError as e:
        return {"error": type(e).__name__, "message": str(e), "waited": time.monotonic() - t0,
                "named": getattr(e, "peer", None) if isinstance(e, gradsync.PeerGoneError) else getattr(e, "missing_ranks", None)}
    return None


def uneven_inputs(rank, world, batches=(4, 2, 3)):
    """Ranks have different numbers of batches; each joins when out of data.
    Every step is averaged over the ranks that still had data."""
    model = mlp()
    wrapped = DDP(copy.deepcopy(model))
    worst, contributors = 0.0, []
    for step in range(batches[rank]):
        wrapped.zero_grad()
        wrapped(batch(step, rank)).sum().backward()
        live = [r for r in range(world) if batches[r] > step]
        ref = copy.deepcopy(model)
        for r in live:
            ref(batch(step, r)).sum().backward()
        worst = max(worst, max((p.grad - q.grad / len(live)).abs().max().item()
                               for p, q in zip(wrapped.parameters(), ref.parameters())))
        contributors.append(wrapped.last_report.contributors)
    joined = wrapped.join_now()
    wrapped.close()
    return {"max_diff": worst, "contributors": contributors, "joined": joined}
