"""Parameter sharding (``shard_parameters=True``) cases that run on every
rank of a test world: where the whole parameters stand through a step, and
what a program may do with them between steps."""

import copy
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential

from gradsync import ConfigError
from gradsync.torch import DistributedDataParallel as GradsyncDDP

LR = 1e-2


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(20, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 20)).double()


def _batch(step, rank, world):
    """Every rank's batch of ``step`` (rank ``rank``'s when ``rank`` is not ``None``)."""
    x = torch.randn(world * 4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    return x if rank is None else x[rank * 4 : (rank + 1) * 4]


def _loss(model, step, rank, world):
    """``model``'s loss on rank ``rank``'s batch of ``step`` (every rank's
    when ``rank`` is ``None``: the one-process reference, averaged as the
    wrapper averages)."""
    rows = 4 if rank is not None else world * 4
    return nn.functional.mse_loss(model(_batch(step, rank, world)), torch.zeros(rows, 20))


def _reference_step(reference, ref_opt, step, world):
    """One step of the one-process reference over every rank's batch."""
    ref_opt.zero_grad()
    _loss(reference, step, None, world).backward()
    ref_opt.step()


def _diff(reference, wrapped):
    """Largest parameter difference, ``wrapped``'s gathered whole (every rank calls it)."""
    with wrapped.whole_parameters():
        return max((a - b).abs().max().item() for a, b in zip(reference.parameters(), wrapped.module.parameters()))


def _refused(call):
    """The message of the ``ConfigError`` that ``call()`` raises (``None`` if it does not)."""
    try:
        call()
    except ConfigError as error:
        return str(error)
    return None


def _pair(units, reference=None, optimizer=torch.optim.AdamW, lr=LR, bucket_cap_mb=0.001):
    """The one-process ``reference`` (default: :func:`_model`) and a copy of
    it wrapped with ``shard_parameters=units``, each with its ``optimizer``:
    ``(reference, its optimizer, wrapper, its optimizer)``."""
    reference = _model() if reference is None else reference
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=units, bucket_cap_mb=bucket_cap_mb)
    return (reference, optimizer(reference.parameters(), lr=lr), wrapped, optimizer(wrapped.parameters(), lr=lr))


def _backward_both(reference, ref_opt, wrapped, opt, step, rank, world):
    """Step ``step``: the reference's whole step, the wrapper's backward
    (its optimizer steps where the caller says)."""
    _reference_step(reference, ref_opt, step, world)
    opt.zero_grad()
    _loss(wrapped, step, rank, world).backward()


def residence(rank, world, steps=3, units=True):
    """A parameter-sharded wrapper through ``steps`` steps next to one
    process over the whole batch, with the optimizer built as scripts build
    it (torch's AdamW over ``model.parameters()``, after wrapping). Returns
    what each phase saw: the parameters' element counts after backward,
    after the step and after an evaluation forward, this rank's piece
    values, a state dict between steps against the reference's, the
    element count after it and a load of the reference's, the evaluation's
    output against the reference's, whether a forward without gradients
    inside a step gathered again, the largest parameter difference, and the
    state dict read inside ``whole_parameters()`` against the reference's.
    ``units``: ``shard_parameters``'s value (``True``: each linear layer a
    unit; ``[]``: one unit, the whole model, gathered once per step)."""
    reference, ref_opt, wrapped, opt = _pair(units)
    seen = {"after_backward": [], "after_step": [], "worst": 0.0}
    try:
        for step in range(steps):
            _backward_both(reference, ref_opt, wrapped, opt, step, rank, world)
            seen["after_backward"].append(sum(p.data.numel() for p in wrapped.parameters()))
            opt.step()
            seen["after_step"].append(sum(p.data.numel() for p in wrapped.parameters()))
            seen["worst"] = max(seen["worst"], _diff(reference, wrapped))
        seen["held"] = sum(piece.tensor.numel() for piece in wrapped._partition.pieces)
        seen["whole"] = sum(p.numel() for p in reference.parameters())
        # A state dict between steps is whole (read from every rank's pieces), and a load of one on
        # every rank reaches the pieces (the evaluation and the steps below see it); both leave
        # the parameters released.
        state = wrapped.state_dict()
        seen["state_dict"] = max((state[f"module.{k}"] - v).abs().max().item() for k, v in reference.state_dict().items())
        with torch.no_grad():
            reference[4].bias.add_(0.25)
        wrapped.module.load_state_dict(reference.state_dict())
        seen["after_state_dicts"] = sum(p.data.numel() for p in wrapped.parameters())
        # An evaluation forward between steps gathers and releases again; a forward without
        # gradients inside a step (after the training forward) neither gathers nor releases.
        with torch.no_grad():
            x = _batch(steps, rank, world)
            seen["eval"] = (wrapped(x) - reference(x)).abs().max().item()
        seen["after_eval"] = sum(p.data.numel() for p in wrapped.parameters())
        loss = _loss(wrapped, steps, rank, world)
        before = [p.data_ptr() for p in wrapped.parameters()]
        with torch.no_grad():
            wrapped(x)
        seen["gathered_again"] = before != [p.data_ptr() for p in wrapped.parameters()]
        # Between its forward and its backward a unit's parameters are empty;
        # gathered once per step, they are whole, and what is written into them is kept.
        seen["between"] = wrapped.module[2].bias.data.numel()
        if not units:
            with torch.no_grad():
                wrapped.module[2].bias.add_(1.0)
                reference[2].bias.add_(1.0)
        loss.backward()
        opt.zero_grad()
        with wrapped.whole_parameters(), torch.no_grad():
            wrapped.module[0].weight.mul_(0.5)
            state = wrapped.module.state_dict()
        with torch.no_grad():
            reference[0].weight.mul_(0.5)
        seen["state_diff"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        for step in range(steps + 1, steps + 3):
            _backward_both(reference, ref_opt, wrapped, opt, step, rank, world)
            opt.step()
        seen["after_writes"] = _diff(reference, wrapped)
    finally:
        wrapped.close()
    return seen


def out_of_memory_while_gathering(rank, world, steps=4, oom=(1, 2)):
    """Rank ``oom[0]`` runs out of memory at step ``oom[1]`` while its
    forward allocates the parameters (its gather already under way): it
    calls ``abort_step`` and goes on, as the guide's loop does. Returns the
    step outcomes, the largest parameter difference from one process that
    skips that step, and the message of a forward retried without the
    abort (on the rank that ran out)."""
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=True, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    residence = wrapped._partition.residence
    allocate = residence._allocate
    seen = {"outcomes": [], "retry": None}

    def out_of_memory(b):
        raise torch.OutOfMemoryError("CPU out of memory (a test's, allocating the parameters)")

    try:
        for step in range(steps):
            if step != oom[1]:
                _reference_step(reference, ref_opt, step, world)
            opt.zero_grad()
            if (rank, step) == oom:
                residence._allocate = out_of_memory
            try:
                loss = _loss(wrapped, step, rank, world)
            except torch.OutOfMemoryError:
                residence._allocate = allocate
                seen["retry"] = _refused(lambda: wrapped(_batch(step, rank, world)))
                report = wrapped.abort_step("out_of_memory")
                seen["outcomes"].append(report.outcome)
                continue
            loss.backward()
            seen["outcomes"].append(wrapped.last_report.outcome)
            opt.step()
        seen["params"] = _diff(reference, wrapped)
    finally:
        wrapped.close()
    return seen


class Mixed(nn.Module):
    """Parameters of every kind a layout meets: complex, bfloat16, not
    contiguous (a transposed view), frozen, unused everywhere, and a
    linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.z = nn.Parameter(torch.randn(6, dtype=torch.complex64))
        self.h = nn.Parameter(torch.randn(5, 4).to(torch.bfloat16))
        self.t = nn.Parameter(torch.randn(4, 3).t())
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.lin = nn.Linear(3, 3)
        self.never = nn.Parameter(torch.randn(2))

    def forward(self, x):
        y = self.lin(x @ self.t.t()) + self.frozen
        return y.sum() + (self.z.abs() ** 2).sum() + self.h.float().sum() * 0.5


def mixed_parameters(rank, world, steps=3):
    """:class:`Mixed` under ``shard_parameters=True`` and SGD next to one
    process: per parameter, its element count between steps, its largest
    difference, dtype and strides once gathered."""
    reference, ref_opt, wrapped, opt = _pair(True, Mixed(), torch.optim.SGD, 0.5, 0.0001)
    try:
        for step in range(steps):
            x = torch.randn(world * 2, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            ref_opt.zero_grad()
            wrapped(x[rank * 2 : (rank + 1) * 2]).backward()
            for r in range(world):
                (reference(x[r * 2 : (r + 1) * 2]) / world).backward()
            opt.step()
            ref_opt.step()
        seen = {n: {"between": p.data.numel()} for n, p in wrapped.module.named_parameters()}
        with wrapped.whole_parameters():
            for (n, p), q in zip(wrapped.module.named_parameters(), reference.parameters()):
                seen[n].update(diff=(p.detach() - q.detach()).abs().max().item(), dtype=p.dtype,
                               stride=p.stride(), want=(q.dtype, q.stride()))
        return seen
    finally:
        wrapped.close()


def direct_evaluation(rank, world, units=True, steps=2):
    """The wrapped module evaluated itself, not through the wrapper (HF
    ``Trainer``'s evaluation loop does this) under ``no_grad`` after each
    step: its outputs against the one-process reference's, the parameters
    released after it; and the message of a direct call with gradients on."""
    reference, ref_opt, wrapped, opt = _pair(units)
    seen = {"eval": 0.0, "after": []}
    try:
        for step in range(steps):
            _backward_both(reference, ref_opt, wrapped, opt, step, rank, world)
            opt.step()
            with torch.no_grad():
                x = _batch(100 + step, rank, world)
                seen["eval"] = max(seen["eval"], (wrapped.module(x) - reference(x)).abs().max().item())
            seen["after"].append(sum(p.data.numel() for p in wrapped.module.parameters()))
        seen["with_grad"] = _refused(lambda: wrapped.module(_batch(0, rank, world)))
        return seen
    finally:
        wrapped.close()


class SharedSegments(nn.Module):
    """A layer used twice in a ``Sequential`` run by ``checkpoint_sequential``
    (reentrant) in two segments: once in the checkpointed first, once in the
    plain second. Its children are the units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        shared = nn.Linear(16, 16)
        self.seq = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), shared, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 shared, nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x):
        return checkpoint_sequential(self.seq, 2, x, use_reentrant=True)


def _rows(x, rank):
    """Rank ``rank``'s rows of ``x``, requiring grad (a reentrant checkpoint
    whose inputs need none gives its parameters no gradient)."""
    return x[rank * 4 : (rank + 1) * 4].clone().requires_grad_()


def shared_layer_under_autocast(rank, world, steps=3):
    """:class:`SharedSegments` under ``shard_parameters=True`` with forward
    *and backward* inside bfloat16 autocast (as scripts write it), next to
    one process doing the same over every rank's batch. Autocast caches
    one bfloat16 copy of the shared weight for the whole region, so its
    gradient reaches the weight after its unit's backward ended. Returns
    the largest parameter difference after ``steps`` steps."""
    reference, ref_opt, wrapped, opt = _pair(True, SharedSegments(), torch.optim.SGD, 0.1, 0.0001)
    try:
        for step in range(steps):
            x = torch.randn(world * 4, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            ref_opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                wrapped(_rows(x, rank)).float().square().mean().backward()
                for r in range(world):
                    (reference(_rows(x, r)).float().square().mean() / world).backward()
            opt.step()
            ref_opt.step()
        return _diff(reference, wrapped)
    finally:
        wrapped.close()


def saved_by_one_rank(rank, world, units=True, steps=3, saver=0):
    """The DDP tutorial's save under ``shard_parameters``: after each step
    rank ``saver`` alone takes the wrapper's ``state_dict()`` (as ``if rank
    == 0: torch.save(ddp_model.state_dict(), PATH)`` does) while the others
    go straight on to their next forward; in the second step rank 1 is
    still before its ``optimizer.step()`` when the saver reads (the read is
    at the saver's step). Returns, on the saver, per step the largest
    difference of the saved values from the one-process reference's and
    the parameters' element count after the save (released again), and
    the difference of the optimizer's ``state_dict()`` (taken alone too)
    from the reference's; on every rank the final difference, gathered whole."""
    reference, ref_opt, wrapped, opt = _pair(units)
    seen = {"saved": [], "after": [], "keys": None}
    try:
        for step in range(steps):
            _backward_both(reference, ref_opt, wrapped, opt, step, rank, world)
            if step == 1 and rank == 1:
                time.sleep(0.3)  # (the saver's read arrives before this rank's step: it waits for the step)
            opt.step()
            if rank == saver:
                state = wrapped.state_dict()
                seen["keys"] = sorted(state)
                seen["saved"].append(max((state[f"module.{n}"] - p).abs().max().item()
                                         for n, p in reference.named_parameters()))
                seen["after"].append(sum(p.data.numel() for p in wrapped.module.parameters()))
                seen["optimizer"] = _state_difference(opt.state_dict(), ref_opt.state_dict())
        seen["final"] = _diff(reference, wrapped)
        return seen
    finally:
        wrapped.close()


def a_rank_never_loads(rank, world, timeout_s=3.0):
    """Rank 0 loads a state dict between steps while rank 1 never does (it
    serves, elsewhere): the error rank 0 gets and how long it waited."""
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=True, bucket_cap_mb=0.001, timeout=timeout_s)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    try:
        _backward_both(reference, ref_opt, wrapped, opt, 0, rank, world)
        opt.step()
        if rank != 0:
            time.sleep(timeout_s + 3)
            return None
        state = wrapped.module.state_dict()  # (read alone)
        began = time.monotonic()
        error = _refused(lambda: wrapped.module.load_state_dict(state))
        return {"error": error, "waited": time.monotonic() - began}
    finally:
        wrapped.close()


def evaluated_by_one_rank(rank, world, units=True, steps=3, evaluator=0):
    """nanoGPT's ``estimate_loss()`` under ``shard_parameters``: after each
    step rank ``evaluator`` alone runs the model in eval mode without
    gradients over a few batches, while the others go straight on to their
    next step. Returns, on the evaluator, the largest difference of its
    outputs from the one-process reference's and the parameters' element
    count after each evaluation; on every rank the final difference."""
    reference, ref_opt, wrapped, opt = _pair(units)
    seen = {"eval": 0.0, "after": []}
    try:
        for step in range(steps):
            _backward_both(reference, ref_opt, wrapped, opt, step, rank, world)
            opt.step()
            if rank == evaluator:
                wrapped.eval()
                with torch.no_grad():
                    for k in range(3):
                        x = _batch(50 + k, None, world)
                        seen["eval"] = max(seen["eval"], (wrapped(x) - reference(x)).abs().max().item())
                wrapped.train()
                seen["after"].append(sum(p.data.numel() for p in wrapped.module.parameters()))
        seen["final"] = _diff(reference, wrapped)
        return seen
    finally:
        wrapped.close()


def _state_difference(state, want):
    """The largest difference between two optimizer state dicts (``inf``
    if their parameters, keys or groups differ)."""
    if state["param_groups"] != want["param_groups"] or sorted(state["state"]) != sorted(want["state"]):
        return float("inf")
    worst = 0.0
    for n, entry in want["state"].items():
        if sorted(entry) != sorted(state["state"][n]):
            return float("inf")
        for key, value in entry.items():
            worst = max(worst, (torch.as_tensor(state["state"][n][key]).double() - value.double()).abs().max().item())
    return worst
