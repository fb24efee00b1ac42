"""Training cases that run on every rank of a test world.

Each case trains a model on this rank's slice of a global batch, wrapped by
``impl`` (``"gradsync"`` or ``"ddp"``, torch's DistributedDataParallel), next
to a reference: the same model trained in this process on the whole batch.
It returns an outcome, so that the tests can assert gradsync's and record
DDP's:

* ``{"status": "ok", "max_diff": d}``: every step's gradients were compared;
* ``{"status": "error", "error": msg}``: the wrapper raised (DDP's failures);
* ``{"status": "blocked", ...}`` where a case measures a hang.

Data and models are float64 and identical on every rank (seeded), so the
reference is exact up to rounding. The model classes follow PyTorch's own DDP
checkpointing tests (``test/distributed/test_c10d_common.py``).
"""

import copy
import datetime
import importlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gradsync
from gradsync.torch import DistributedDataParallel as GradsyncDDP

# PyTorch's tolerances in _test_ddp_checkpointing.
RTOL, ATOL = 1.3e-6, 5e-5


class CheckpointOnceModule(nn.Module):
    """One layer checkpointed once."""

    def __init__(self, use_reentrant=True):
        super().__init__()
        self.l1 = nn.Linear(20, 20)
        self.l2 = nn.Linear(20, 20)
        self.use_reentrant = use_reentrant

    def forward(self, inp):
        x = self.l1(inp)
        return checkpoint(self.l2, x, use_reentrant=self.use_reentrant)


class CheckpointTwiceModule(CheckpointOnceModule):
    """The same layer checkpointed twice (as pipeline parallelism does)."""

    def forward(self, inp):
        x = self.l1(inp)
        x = checkpoint(self.l2, x, use_reentrant=self.use_reentrant)
        return checkpoint(self.l2, x, use_reentrant=self.use_reentrant)


class CheckpointTwiceModuleWeightSharing(CheckpointTwiceModule):
    """Checkpointed twice, and l1 shares l2's weight."""

    def __init__(self, use_reentrant=True):
        super().__init__(use_reentrant)
        self.l1.weight = self.l2.weight


class DynamicCheckpointTwiceModule(CheckpointTwiceModule):
    """Alternates between checkpointing l1 and l2: a graph that changes every step."""

    def __init__(self, use_reentrant=True):
        super().__init__(use_reentrant)
        self.count = 0

    def forward(self, inp):
        layer = self.l1 if self.count % 2 else self.l2
        self.count += 1
        return checkpoint(layer, inp, use_reentrant=self.use_reentrant)


class DynamicCheckpointTwiceModuleWeightSharing(DynamicCheckpointTwiceModule):
    def __init__(self, use_reentrant=True):
        super().__init__(use_reentrant)
        self.l1.weight = self.l2.weight


def weight_sharing_sequential(use_reentrant=True):
    """nn.Sequential(l1, l2) with l1.weight = l2.weight (checkpointed as a whole)."""
    l1, l2 = nn.Linear(20, 20), nn.Linear(20, 20)
    l1.weight = l2.weight
    return nn.Sequential(l1, l2)


MODELS = {
    "once": CheckpointOnceModule,
    "twice": CheckpointTwiceModule,
    "twice_weight_sharing": CheckpointTwiceModuleWeightSharing,
    "dynamic": DynamicCheckpointTwiceModule,
    "dynamic_weight_sharing": DynamicCheckpointTwiceModuleWeightSharing,
    "weight_sharing_sequential": weight_sharing_sequential,
}


def wrap(model, impl, **kwargs):
    """``model`` under ``impl``; DDP gets a group of its own so that its
    failures never leave the world's default group mid-collective."""
    if impl == "gradsync":
        return GradsyncDDP(model, **kwargs)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=kwargs.pop("group_timeout_s", 20)))
    return nn.parallel.DistributedDataParallel(model, process_group=group, **kwargs)


def close(wrapped):
    if isinstance(wrapped, GradsyncDDP):
        wrapped.close()


def first_line(error):
    """The error's type and first sentence (DDP's messages run for paragraphs)."""
    text = (str(error).strip().splitlines() or [""])[0]
    cut = text.find(". ", 20)
    return f"{type(error).__name__}: {text[: cut + 1] if cut > 0 else text}"


class Outcome:
    """One case's result under ``impl``, as a ``with`` block: ``ok`` with the
    largest difference recorded, or, for torch's DDP only, the error that
    ended it (DDP's failures are results of the comparison; gradsync's are
    test failures and propagate). Closes ``wrapped`` on the way out."""

    def __init__(self, impl, wrapped):
        self.impl = impl
        self.wrapped = wrapped
        self.worst = 0.0
        self.result = None

    def record(self, diff):
        self.worst = max(self.worst, diff)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        close(self.wrapped)
        if error is None:
            self.result = {"status": "ok", "max_diff": self.worst}
            return False
        if self.impl == "gradsync" or not isinstance(error, Exception):
            return False
        self.result = {"status": "error", "error": first_line(error)}
        return True



def max_diff(reference, wrapped, allow_none=False):
    """Largest |reference grad - wrapped grad|; asserts PyTorch's tolerances
    unless ``allow_none`` lets a parameter without gradient pass."""
    worst = 0.0
    for (name, a), b in zip(reference.named_parameters(), wrapped.parameters()):
        if a.grad is None or b.grad is None:
            assert allow_none or (a.grad is None and b.grad is None), f"{name}: gradient missing"
            assert (a.grad is None) == (b.grad is None) or allow_none, f"{name}: gradient present on one side only"
            continue
        worst = max(worst, (a.grad - b.grad).abs().max().item())
    return worst


def checkpointing(rank, world, model, impl, use_reentrant=True, run_checkpoint=False, allow_none_grads=False,
                  iters=5, **wrap_kwargs):
    """PyTorch's ``_test_ddp_checkpointing``: the reference on the whole batch,
    the wrapped model on this rank's slice, ``iters`` steps, every gradient
    compared after every step."""
    torch.manual_seed(31415)
    base = MODELS[model](use_reentrant).double()
    reference = copy.deepcopy(base)
    wrapped = wrap(copy.deepcopy(base), impl, bucket_cap_mb=1, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        ddp_bs = 16
        inp = torch.rand((ddp_bs * world, 20), dtype=torch.float64, requires_grad=True)
        target = torch.randn((ddp_bs * world, 20), dtype=torch.float64)
        mine = slice(rank * ddp_bs, (rank + 1) * ddp_bs)
        loss = nn.MSELoss()
        for _ in range(iters):
            reference.zero_grad(set_to_none=False)
            wrapped.zero_grad(set_to_none=False)
            for m, x, y in ((reference, inp, target), (wrapped, inp[mine], target[mine])):
                out = checkpoint(m, x, use_reentrant=use_reentrant) if run_checkpoint else m(x)
                loss(out, y).backward()
            outcome.record(max_diff(reference, wrapped, allow_none_grads))
    return outcome.result


def check(outcomes):
    """Every rank of a gradsync run is ok and within PyTorch's tolerance."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["status"] == "ok"
        assert outcome["max_diff"] <= ATOL, f"rank {rank}: gradients off by {outcome['max_diff']}"


#: Below this, a difference is float64 rounding: its last bits depend on the
#: order sums ran in (whether a gradient came late and was corrected), which
#: varies from run to run, so the table says only that it is below.
FLOAT64_ROUNDING = 1e-14


def describe(outcome, tol=ATOL):
    """An outcome as a table cell."""
    if outcome["status"] == "ok":
        d = outcome["max_diff"]
        if d < FLOAT64_ROUNDING:
            return f"ok, < {FLOAT64_ROUNDING:.0e}"
        return f"ok, {d:.1e}" if d <= tol else f"**wrong**: off by {d:.2g}"
    if outcome["status"] == "blocked":
        return outcome["detail"]
    return f"raises `{outcome['error']}`"


# ---- cases from distributed_test.py and test_c10d_gloo.py ---------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 10)

    def forward(self, x):
        return F.relu(self.lin(x))


def static_graph_multi_forward(rank, world, impl, **wrap_kwargs):
    """Two forwards before one backward (distributed_test's
    test_static_graph_multi_forward): the gradients equal a local model that
    ran the input ``world`` times, averaged."""
    torch.manual_seed(42)
    model = Net().double()
    local = copy.deepcopy(model)
    wrapped = wrap(model, impl, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        inp = torch.ones(2, 10, dtype=torch.float64)
        for _ in range(3):
            wrapped.zero_grad()
            local.zero_grad()
            (wrapped(inp).sum() + wrapped(inp).sum()).backward()
            for _ in range(world):
                (local(inp).sum() + local(inp).sum()).backward()
            for p in local.parameters():
                p.grad = p.grad / world
            outcome.record(max_diff(local, wrapped))
    return outcome.result


class ControlFlowModel(nn.Module):
    """lin2 is used only when the input is all ones, and (``rank_dependent``)
    only on rank 1 (distributed_test's control-flow models)."""

    def __init__(self, rank, rank_dependent):
        super().__init__()
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)
        self.rank, self.rank_dependent = rank, rank_dependent

    def forward(self, x):
        use_second = torch.equal(x, torch.ones_like(x)) and (not self.rank_dependent or self.rank == 1)
        h = F.relu(self.lin1(x))
        return self.lin2(h) if use_second else h


def per_rank_reference(make_model, world, batches, loss_fn):
    """The averaged gradients DDP promises: every rank's model on its own batch, summed, / world."""
    grads = None
    for r in range(world):
        m = make_model(r)
        loss_fn(m, batches[r]).backward()
        g = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
        grads = g if grads is None else [a if b is None else (b if a is None else a + b) for a, b in zip(grads, g)]
    return [None if g is None else g / world for g in grads]


def compare_to(grads, wrapped):
    worst = 0.0
    for want, p in zip(grads, wrapped.parameters()):
        if want is None:
            assert p.grad is None, "a parameter no rank used must have no gradient"
            continue
        assert p.grad is not None, "a parameter some rank used must have a gradient"
        worst = max(worst, (p.grad - want).abs().max().item())
    return worst


def control_flow(rank, world, impl, rank_dependent, steps=6, **wrap_kwargs):
    """Control flow that differs across steps (and, with ``rank_dependent``,
    across ranks): some parameters are unused on some or all ranks."""

    def make(r):
        torch.manual_seed(7)
        return ControlFlowModel(r, rank_dependent).double()

    wrapped = wrap(make(rank), impl, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        for i in range(steps):
            batches = [torch.ones(20, 10, dtype=torch.float64) if i % 2 else
                       torch.randn(20, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * i + r))
                       for r in range(world)]
            want = per_rank_reference(make, world, batches, lambda m, x: m(x).sum())
            wrapped.zero_grad()
            wrapped(batches[rank]).sum().backward()
            outcome.record(compare_to(want, wrapped))
    return outcome.result


class UnusedModel(nn.Module):
    """``never`` is used by no rank; ``odd`` only by odd ranks."""

    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.odd = nn.Linear(8, 8)
        self.rank = rank

    def forward(self, x):
        h = self.lin(x)
        return self.odd(h) if self.rank % 2 else h


def unused_parameters(rank, world, impl, **wrap_kwargs):
    """Globally unused parameters keep ``.grad is None``; locally unused ones
    are averaged with zeros."""

    def make(r):
        torch.manual_seed(3)
        return UnusedModel(r).double()

    wrapped = wrap(make(rank), impl, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        batches = [torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        want = per_rank_reference(make, world, batches, lambda m, x: m(x).pow(2).sum())
        for _ in range(3):
            wrapped.zero_grad()
            wrapped(batches[rank]).pow(2).sum().backward()
            outcome.record(compare_to(want, wrapped))
    return outcome.result


class OutsideForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return self.lin(x)


def parameter_used_outside_forward(rank, world, impl, **wrap_kwargs):
    """A parameter used in the loss but not in forward (distributed_test's
    find_unused_parameters kwarg case): its gradient is averaged too."""

    def make(r):
        torch.manual_seed(5)
        return OutsideForward().double()

    def loss(m, x):
        module = m.module if hasattr(m, "module") else m
        return (m(x) * module.scale).sum() + module.scale.pow(2).sum()

    wrapped = wrap(make(rank), impl, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        batches = [torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        want = per_rank_reference(make, world, batches, loss)
        for _ in range(3):
            wrapped.zero_grad()
            loss(wrapped, batches[rank]).backward()
            outcome.record(compare_to(want, wrapped))
    return outcome.result


# ---- the cases of the "Why" ---------------------------------------------------------


class SkipsOddSteps(nn.Module):
    """A block that runs on even steps only: the graph changes after step 0."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.count = 0

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.count % 2 == 0:
            h = torch.tanh(self.block(h))
        self.count += 1
        return self.out(h)


def changing_graph(rank, world, impl, steps=4, **wrap_kwargs):
    """Per step: compare with the average of every rank's own gradient. DDP's
    static_graph finishes step 1 with local gradients (the replicas diverge)."""

    def make(r):
        torch.manual_seed(11)
        return SkipsOddSteps().double()

    references = [make(r) for r in range(world)]
    wrapped = wrap(make(rank), impl, **wrap_kwargs)
    worst = 0.0
    try:
        for step in range(steps):
            batches = [torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + r))
                       for r in range(world)]
            grads = None
            for r, ref in enumerate(references):
                ref.zero_grad()
                ref(batches[r]).sum().backward()
                g = [None if p.grad is None else p.grad.clone() for p in ref.parameters()]
                grads = g if grads is None else [a if b is None else (b if a is None else a + b) for a, b in zip(grads, g)]
            want = [None if g is None else g / world for g in grads]
            wrapped.zero_grad()
            wrapped(batches[rank]).sum().backward()
            diff = compare_to(want, wrapped) if impl == "gradsync" else max(
                (p.grad - w).abs().max().item() for w, p in zip(want, wrapped.parameters()) if w is not None and p.grad is not None
            )
            worst = max(worst, diff)
        return {"status": "ok", "max_diff": worst}
    except Exception as e:
        if impl == "gradsync":
            raise
        if worst > ATOL:
            return {"status": "error", "error": f"gradients off by {worst:.2g} (never averaged), then {first_line(e)}"}
        return {"status": "error", "error": first_line(e)}
    finally:
        close(wrapped)


class SharedBetweenSegments(nn.Module):
    """A weight shared by two reentrant-checkpointed segments (a tied embedding)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(12, 12)
        self.mid = nn.Linear(12, 12)

    def forward(self, x):
        x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        x = checkpoint(lambda t: torch.tanh(self.mid(t)), x, use_reentrant=True)
        return checkpoint(lambda t: self.shared(t), x, use_reentrant=True)


def shared_weight_between_segments(rank, world, impl, iters=4, **wrap_kwargs):
    torch.manual_seed(13)
    base = SharedBetweenSegments().double()
    reference = copy.deepcopy(base)
    wrapped = wrap(copy.deepcopy(base), impl, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        inp = torch.randn(8 * world, 12, dtype=torch.float64, requires_grad=True)
        mine = slice(8 * rank, 8 * (rank + 1))
        for _ in range(iters):
            reference.zero_grad()
            wrapped.zero_grad()
            reference(inp).pow(2).mean().backward()
            wrapped(inp[mine]).pow(2).mean().backward()
            outcome.record(max_diff(reference, wrapped))
    return outcome.result


def two_forwards_reentrant(rank, world, impl, iters=3, **wrap_kwargs):
    """Two forwards of a reentrant-checkpointed module before one backward."""
    torch.manual_seed(17)
    base = CheckpointOnceModule(use_reentrant=True).double()
    reference = copy.deepcopy(base)
    wrapped = wrap(copy.deepcopy(base), impl, **wrap_kwargs)
    with Outcome(impl, wrapped) as outcome:
        a = torch.randn(4 * world, 20, dtype=torch.float64, requires_grad=True)
        b = torch.randn(4 * world, 20, dtype=torch.float64, requires_grad=True)
        mine = slice(4 * rank, 4 * (rank + 1))
        for _ in range(iters):
            reference.zero_grad()
            wrapped.zero_grad()
            (reference(a).pow(2).mean() + reference(b).sum() / (4 * world)).backward()
            (wrapped(a[mine]).pow(2).mean() + wrapped(b[mine]).sum() / 4).backward()
            outcome.record(max_diff(reference, wrapped))
    return outcome.result


class OutOfMemory(torch.autograd.Function):
    """Identity whose backward raises torch.OutOfMemoryError when armed."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if OutOfMemory.armed:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 2.00 GiB")
        return g


def oom_on_one_rank(rank, world, impl, oom_rank=1, oom_step=1, steps=3, **wrap_kwargs):
    """Rank ``oom_rank`` runs out of memory in backward at ``oom_step`` and
    skips the step in an ``except``, as training loops do. Reports, per step,
    what each rank saw and how long it took."""
    torch.manual_seed(19)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    reference = [copy.deepcopy(model) for _ in range(world)]
    wrapped = wrap(model, impl, **wrap_kwargs)
    seen = []
    try:
        for step in range(steps):
            x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 10 + rank))
            wrapped.zero_grad()
            t0 = time.monotonic()
            OutOfMemory.armed = rank == oom_rank and step == oom_step
            try:
                OutOfMemory.apply(wrapped(x)).sum().backward()
                outcome = "applied"
            except torch.OutOfMemoryError:
                OutOfMemory.armed = False
                if impl == "gradsync":
                    report = wrapped.abort_step("out_of_memory")
                    outcome = report.outcome
                else:
                    outcome = "skipped locally"
            else:
                if impl == "gradsync":
                    outcome = wrapped.last_report.outcome
            took = time.monotonic() - t0
            exact = None
            if outcome == "applied":
                grads = []
                for r in range(world):
                    ref = reference[r]
                    ref.zero_grad()
                    xr = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(step * 10 + r))
                    ref(xr).sum().backward()
                    grads.append([p.grad for p in ref.parameters()])
                want = [sum(gs) / world for gs in zip(*grads)]
                exact = max((p.grad - w).abs().max().item() for p, w in zip(wrapped.parameters(), want))
            seen.append({"step": step, "outcome": outcome, "seconds": took, "max_diff": exact,
                         "grads_none": all(p.grad is None for p in wrapped.parameters())})
        return {"status": "ok", "steps": seen}
    except Exception as e:
        if impl == "gradsync":
            raise
        return {"status": "error", "error": first_line(e), "steps": seen, "seconds": time.monotonic() - t0}
    finally:
        OutOfMemory.armed = False
        close(wrapped)


def report_dict(report):
    return None if report is None else report.to_dict()


def gradsync_exception_name(e):
    return type(e).__name__ if isinstance(e, gradsync.GradsyncError) else None


def share_gpus():
    """This process's NCCL settings for ranks sharing a GPU (more ranks
    than GPUs): a host id of its own (NCCL refuses two ranks of one host on
    one GPU) and sockets on loopback for every transfer."""
    os.environ.update(NCCL_HOSTID=f"gradsync-{os.getpid()}", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1",
                      NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="lo")


def on_device_plane(rank, world, case, *args, device=None, settings=None, **kwargs):
    """Run ``case`` with every gradsync wrapper it builds keeping its
    buckets on the device plane (``buckets="device"`` plus ``settings``),
    on the parameters' device: the CPU, or ``device`` (``"cuda"``: this
    rank's GPU), where the case's tensors and random generators are then
    made (torch's default device). Returns ``(case's result, each wrapper's path)``."""
    built = []
    saved = GradsyncDDP._replace_settings
    GradsyncDDP._replace_settings = {**saved, "buckets": "device", **(settings or {})}
    init, generator = GradsyncDDP.__init__, torch.Generator

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        built.append(self.path.buckets)

    GradsyncDDP.__init__ = recording_init
    if device == "cuda":
        # torch's lazy imports annotate with torch.Generator: done before it is replaced.
        importlib.import_module("torch._dynamo")
        gpu = rank % torch.cuda.device_count()
        if world > torch.cuda.device_count():
            share_gpus()
        torch.cuda.set_device(gpu)
        torch.set_default_device(f"cuda:{gpu}")
        torch.Generator = lambda device=f"cuda:{gpu}": generator(device)
    try:
        return case(rank, world, *args, **kwargs), built
    finally:
        GradsyncDDP._replace_settings = saved
        GradsyncDDP.__init__ = init
        torch.Generator = generator
        torch.set_default_device(None)


def device_plane_results(world, case, *args, **kwargs):
    """``case`` on every rank of ``world`` on the device plane
    (:func:`on_device_plane`, which takes ``device`` and ``settings``); its
    results by rank, after checking that every wrapper it built took the
    device plane."""
    outcomes = world.run(on_device_plane, case, *args, **kwargs)
    for rank, (_, paths) in enumerate(outcomes):
        assert paths, f"rank {rank}: the case built no gradsync wrapper"
        assert set(paths) == {"device"}, f"rank {rank}: {paths}"
    return [result for result, _ in outcomes]
