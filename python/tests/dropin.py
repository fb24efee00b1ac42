"""Rank-side cases of ``test_dropin.py``: ordinary training code that runs
under torch's DDP must run under gradsync, exactly.

Each case runs one model under ``impl`` (``"gradsync"`` or ``"ddp"``) on this
rank's batch, next to a reference: the same model in this process on every
rank's batch, gradients divided by the world size. Models are float32 here
(unlike ``cases.py``), so gradsync's zero-copy path (``.grad`` as a view of
bucket memory) is the one exercised; tolerances are float32's.
"""

import contextlib
import copy
import dataclasses
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradsync
from cases import Outcome, close, wrap

TOL = 2e-6


def batch(step, rank, rows=4):
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    return torch.randn(rows, 8, generator=g)


def mlp(seed=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class UserMLP(nn.Module):
    """:func:`mlp` with a forward of its own, as user models have (dynamo
    starts compiling at a user frame; ``nn.Sequential``'s is torch's own)."""

    def __init__(self, width=16, seed=5, checkpointed=False):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))
        # Non-reentrant activation checkpointing around each layer (under
        # torch.compile: dynamo's checkpoint higher-order op).
        self.checkpointed = checkpointed

    def forward(self, x):
        for layer in self.layers:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def reference_grads(model, world, step, loss_fn=lambda out: out.square().sum()):
    """Every rank's batch of ``step`` through a copy of ``model``; gradients / world."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    for r in range(world):
        loss_fn(ref(batch(step, r))).backward()
    return [p.grad / world for p in ref.parameters()]


def diff(grads, want):
    return max((g - w).abs().max().item() for g, w in zip(grads, want))


# ---- 1. what the user does with .grad between steps -----------------------------------------

GRAD_MODES = ("keep_references", "zero_in_place", "clip_in_place", "own_tensor", "set_to_none", "never_zeroed")


def grad_semantics(rank, world, impl, mode, steps=4):
    """Train ``steps`` SGD steps; between steps, do ``mode`` to ``.grad``.

    * keep_references: keep every step's ``.grad`` (a logging list); each kept
      tensor must still hold its own step's average at the end;
    * zero_in_place: ``zero_grad(set_to_none=False)``: ``.grad`` stays the same
      tensor object across steps and holds the average;
    * clip_in_place: ``clip_grad_norm_`` then ``zero_grad(set_to_none=False)``;
    * own_tensor: put a zeroed tensor of the caller's own into ``.grad``
      before backward; after backward ``.grad`` is that tensor, averaged;
    * set_to_none: ``zero_grad()`` (the default);
    * never_zeroed: never zero: ``.grad`` accumulates the averages of every step.
    """
    model = mlp()
    wrapped = wrap(copy.deepcopy(model), impl)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    kept, identity_kept, own_is_grad = [], True, True
    accumulated = None
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            if mode == "own_tensor":
                own = [torch.zeros_like(p) for p in wrapped.parameters()]
                for p, t in zip(wrapped.parameters(), own):
                    p.grad = t
            before = [p.grad for p in wrapped.parameters()]
            wrapped(batch(step, rank)).square().sum().backward()
            want = reference_grads(model, world, step)
            if mode == "never_zeroed":
                accumulated = want if accumulated is None else [a + w for a, w in zip(accumulated, want)]
                want = accumulated
            grads = [p.grad for p in wrapped.parameters()]
            outcome.record(diff(grads, want))
            if mode == "zero_in_place" and step > 0:
                identity_kept &= all(b is g for b, g in zip(before, grads))
            if mode == "own_tensor":
                own_is_grad &= all(o is g for o, g in zip(own, grads))
            if mode == "keep_references":
                kept.append((step, grads, [w.clone() for w in want]))
            if mode == "clip_in_place":
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5)
            # The optimizer applies the same averaged step the reference takes.
            if mode != "never_zeroed":
                with torch.no_grad():
                    for p, g in zip(model.parameters(), [p.grad for p in wrapped.parameters()]):
                        p.sub_(0.05 * g)
                opt.step()
            if mode in ("zero_in_place", "clip_in_place"):
                opt.zero_grad(set_to_none=False)
            elif mode in ("set_to_none", "keep_references"):
                opt.zero_grad()
        for step, grads, want in kept:
            stale = diff(grads, want)
            assert stale <= TOL, f"the .grad kept from step {step} changed afterwards (off by {stale})"
    result = outcome.result
    if result["status"] == "ok":
        result.update(identity_kept=identity_kept, own_is_grad=own_is_grad)
    return result


# ---- 2. what the user does with the outputs ----------------------------------------------------


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    hidden: torch.Tensor
    label: str = "x"


class Shaped(nn.Module):
    """An MLP whose output comes in ``shape``."""

    def __init__(self, shape):
        super().__init__()
        self.body = mlp()
        self.shape = shape

    def forward(self, x):
        h = self.body(x)
        if self.shape == "dict":
            return {"logits": h, "hidden": h.detach(), "count": 3}
        if self.shape == "dataclass":
            return Prediction(h, h * 2)
        if self.shape == "model_output":
            from transformers.modeling_outputs import BaseModelOutput

            return BaseModelOutput(last_hidden_state=h, hidden_states=(h, h.detach()))
        if self.shape == "tuple_with_non_tensors":
            return h, None, "name", 7
        return h


OUTPUT_KINDS = (
    "in_place",
    "in_place_on_a_view",
    "dict",
    "dataclass",
    "model_output",
    "tuple_with_non_tensors",
    "no_grad_output",
)


def _loss(kind, out):
    if kind == "in_place":
        out.mul_(2)
        return out.square().sum() / 4
    if kind == "in_place_on_a_view":
        out[:, :2].mul_(2)  # the first two columns doubled
        scale = torch.tensor([0.5, 0.5, 1.0, 1.0])
        return (out * scale).square().sum()
    if kind == "dict":
        assert isinstance(out, dict) and out["count"] == 3
        return out["logits"].square().sum()
    if kind == "dataclass":
        assert isinstance(out, Prediction) and out.label == "x"
        return out.hidden.square().sum() / 4
    if kind == "model_output":
        assert type(out).__name__ == "BaseModelOutput"
        return out.last_hidden_state.square().sum()
    if kind == "tuple_with_non_tensors":
        assert out[1:] == (None, "name", 7)
        return out[0].square().sum()
    raise AssertionError(kind)


def outputs(rank, world, impl, kind, steps=3):
    """The output is used as ``kind`` says; gradients are exact and the
    output's type is what the module returned."""
    shape = kind if kind in ("dict", "dataclass", "model_output", "tuple_with_non_tensors") else "plain"
    model = Shaped(shape)
    wrapped = wrap(copy.deepcopy(model), impl)
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            if kind == "no_grad_output":
                with torch.no_grad():
                    out = wrapped(batch(step, rank))
                assert not out.requires_grad
                out.mul_(3)  # an evaluation output, changed in place
                # Then a training step as usual.
                wrapped(batch(step, rank)).square().sum().backward()
            else:
                _loss(kind, wrapped(batch(step, rank))).backward()
            want = reference_grads(model.body, world, step)
            outcome.record(diff([p.grad for p in wrapped.module.body.parameters()], want))
    return outcome.result


# ---- 3. torch.compile ----------------------------------------------------------------------------


COMPILE_VARIANTS = ("split", "no_split", "checkpointed")


def compiled(rank, world, impl, order, variant="split", steps=3):
    """``torch.compile(DDP(model))`` (``order="outer"``) or
    ``DDP(torch.compile(model))`` (``"inner"``), aot_eager backend (the
    autograd of compiled graphs, without a C++ compiler), after
    ``test_dynamo_distributed.py``'s DDP cases that run on CPU:

    * ``split``: the bucket cap holds one layer, so DDPOptimizer must split
      the model into several compiled graphs: each graph's backward hands its
      gradients over as soon as it ends, which is what lets buckets overlap
      backward under compile (``test_graph_split``);
    * ``no_split``: the first bucket holds the whole model: one graph (``test_no_split``);
    * ``checkpointed``: ``split`` with every layer under non-reentrant
      activation checkpointing (``test_higher_order_op``).

    Returns the number of graphs compiled."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    torch._dynamo.reset()
    graphs = []

    def count_and_run(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def run_backward(gm, example_inputs):
        return make_boxed_func(gm.forward)

    # Forward graphs are counted: one per piece DDPOptimizer split the model into.
    backend = aot_autograd(fw_compiler=count_and_run, bw_compiler=run_backward)
    # 512 wide: the middle layer alone is 1 MiB, DDPOptimizer's smallest
    # split (its first bucket). 16 wide: the whole model is under it.
    model = UserMLP(width=16 if variant == "no_split" else 512, checkpointed=variant == "checkpointed")
    inner = copy.deepcopy(model)
    if order == "inner":
        inner = torch.compile(inner, backend=backend)
    wrapped = wrap(inner, impl, bucket_cap_mb=25 if variant == "no_split" else 1)
    run = torch.compile(wrapped, backend=backend) if order == "outer" else wrapped
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            run(batch(step, rank)).square().mean().backward()
            want = reference_grads(model, world, step, lambda out: out.square().mean())
            outcome.record(diff([p.grad for p in wrapped.parameters()], want))
    result = outcome.result
    result["graphs"] = len(graphs)
    return result


# ---- 4. the DDP surface libraries touch ----------------------------------------------------------


def accumulation_flag(rank, world, impl, micro=3, steps=2):
    """Accelerate's gradient accumulation: ``require_backward_grad_sync =
    False`` for all micro-batches but the last (instead of ``no_sync()``)."""
    model = mlp()
    wrapped = wrap(copy.deepcopy(model), impl)
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            for m in range(micro):
                wrapped.require_backward_grad_sync = m == micro - 1
                wrapped(batch(step * micro + m, rank)).square().sum().backward()
            want = None
            for m in range(micro):
                g = reference_grads(model, world, step * micro + m)
                want = g if want is None else [a + b for a, b in zip(want, g)]
            outcome.record(diff([p.grad for p in wrapped.parameters()], want))
    return outcome.result


def accumulate_no_sync(rank, world, impl, num_iters, variant, rounds=2):
    """distributed_test's ``test_accumulate_gradients_no_sync`` and its
    ``_grad_is_view`` / ``_allreduce_hook`` variants: gradients are never
    zeroed; ``num_iters - 1`` iterations under ``no_sync()``, then one
    synchronized; each iteration shuffles the global batch. After every
    synchronized iteration ``.grad`` equals the gradient accumulated by one
    process on the whole batch (mean loss over the global batch). A forward
    under ``no_grad`` inside ``no_sync`` first must change nothing.
    ``variant``: ``"plain"``, ``"grad_is_view"`` (``gradient_as_bucket_view=True``)
    or ``"allreduce_hook"``."""
    import torch.nn.functional as F

    local_rows = 2
    model = mlp()
    kwargs = {"gradient_as_bucket_view": True} if variant == "grad_is_view" else {}
    wrapped = wrap(copy.deepcopy(model), impl, **kwargs)
    if variant == "allreduce_hook":
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    g = torch.Generator().manual_seed(99)
    inputs = torch.randn(world * local_rows, 8, generator=g)
    target = torch.randn(world * local_rows, 4, generator=g)
    with Outcome(impl, wrapped) as outcome:
        with torch.no_grad(), wrapped.no_sync():
            wrapped(inputs[:local_rows])
        for iteration in range(num_iters * rounds):
            F.mse_loss(model(inputs), target).backward()
            mine = slice(rank * local_rows, (rank + 1) * local_rows)
            synced = iteration % num_iters == num_iters - 1
            context = contextlib.nullcontext() if synced else wrapped.no_sync()
            with context:
                F.mse_loss(wrapped(inputs[mine]), target[mine]).backward()
            if synced:
                outcome.record(diff([p.grad for p in wrapped.parameters()], [p.grad for p in model.parameters()]))
            perm = torch.randperm(world * local_rows, generator=torch.Generator().manual_seed(1337 + iteration))
            inputs, target = inputs[perm], target[perm]
    return outcome.result


COMM_HOOKS = {
    "allreduce_hook": (default_hooks.allreduce_hook, TOL),
    "fp16_compress_hook": (default_hooks.fp16_compress_hook, 2e-2),
    "bf16_compress_hook": (default_hooks.bf16_compress_hook, 1e-1),
}


def comm_hook(rank, world, impl, name, steps=2):
    """DDP's built-in comm hooks (distributed_test's comm-hook tests):
    gradients within the wire type's precision of the exact average."""
    hook, _ = COMM_HOOKS[name]
    model = mlp()
    wrapped = wrap(copy.deepcopy(model), impl)
    wrapped.register_comm_hook(None, hook)
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            wrapped(batch(step, rank)).square().sum().backward()
            outcome.record(diff([p.grad for p in wrapped.parameters()], reference_grads(model, world, step)))
    return outcome.result


def unsupported_comm_hook(rank, world):
    """A comm hook gradsync cannot run is refused with what it can."""
    import gradsync
    from gradsync.torch import DistributedDataParallel

    def my_hook(state, bucket):
        raise AssertionError("never called")

    wrapped = DistributedDataParallel(mlp())
    try:
        wrapped.register_comm_hook(None, my_hook)
    except gradsync.ConfigError as e:
        return str(e)
    finally:
        wrapped.close()
    return None


def uneven_inputs(rank, world, impl, steps_of, divide_by_initial_world_size, how="method"):
    """DDP's uneven-inputs tests (distributed_test's ``test_ddp_uneven_inputs``
    and ``test_ddp_grad_div_uneven_inputs``): rank r has ``steps_of[r]``
    batches, inside ``with model.join(...)`` (``how="method"``) or
    ``with Join([model], ...)`` (``"context"``). Steps every rank runs are
    averaged over every rank; a step some rank sat out is the sum divided by
    the world size (``divide_by_initial_world_size=True``, DDP's default) or
    by the ranks that still contribute. At the end every rank holds the last
    joiner's parameters, equal to the reference's."""
    from torch.distributed.algorithms.join import Join

    model = mlp()
    wrapped = wrap(copy.deepcopy(model), impl)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    mine = steps_of[rank]
    if how == "method":
        join = wrapped.join(divide_by_initial_world_size=divide_by_initial_world_size)
    else:
        join = Join([wrapped], divide_by_initial_world_size=divide_by_initial_world_size)
    with Outcome(impl, wrapped) as outcome:
        with join:
            for step in range(mine):
                opt.zero_grad()
                wrapped(batch(step, rank)).square().sum().backward()
                opt.step()
        # The reference: every step of the longest rank, over the ranks that had data.
        for step in range(max(steps_of)):
            ref_opt.zero_grad()
            active = [r for r in range(world) if steps_of[r] > step]
            divisor = world if divide_by_initial_world_size else len(active)
            for r in active:
                (ref(batch(step, r)).square().sum() / divisor).backward()
            ref_opt.step()
        outcome.record(max((a - b).abs().max().item() for a, b in zip(ref.parameters(), wrapped.module.parameters())))
    return outcome.result


class Counting(nn.Module):
    """A model with buffers each rank changes differently in forward
    (distributed_test's buffer-broadcast tests): a float32 count, an int64
    count beyond float32's exact integers, and a flag."""

    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros(1))
        self.register_buffer("ticks", torch.tensor([2**40 + 1], dtype=torch.int64))
        self.register_buffer("flag", torch.tensor([rank == 0]))
        self.rank = rank

    def forward(self, x):
        self.seen += 1 + self.rank
        self.ticks += 1 + self.rank
        self.flag.logical_and_(torch.tensor([self.rank == 0]))
        return self.lin(x)


def buffers_and_state(rank, world, impl):
    """Buffers are rank 0's at each forward; state_dict has DDP's
    ``module.`` prefix and loads back; parameters are named with it.
    Built as libraries build it (``device_ids``/``output_device`` for a CPU
    module, ``_set_static_graph()`` as Lightning calls it)."""
    model = Counting(rank)
    wrapped = wrap(model, impl, device_ids=None, output_device=None)
    wrapped._set_static_graph()
    seen, ticks, flags = [], [], []
    with Outcome(impl, wrapped) as outcome:
        for step in range(3):
            wrapped(batch(step, rank)).sum().backward()
            seen.append(model.seen.item())
            ticks.append(model.ticks.item())
            flags.append(model.flag.item())
        state = wrapped.state_dict()
        names = [n for n, _ in wrapped.named_parameters()]
        fresh = Counting(rank)
        twin = wrap(fresh, impl)
        twin.load_state_dict(state)
        loaded = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
        if impl == "gradsync":
            twin.close()
    result = outcome.result
    result.update(seen=seen, ticks=ticks, flags=flags, keys=sorted(state), names=names, loaded=loaded)
    return result


#: When a forward happens and how: DDP broadcasts rank 0's buffers before a
#: forward only if the previous forward asked for a synchronized backward.
BUFFER_PATTERNS = ("no_sync_micro_batches", "eval_between_steps", "two_forwards")


def buffer_rule(rank, world, impl, pattern, steps=3):
    """:class:`Counting`'s buffers after every forward of ``pattern``
    (the test compares them with DDP's, bit for bit): micro-batches under
    ``no_sync``; an eval forward under ``no_grad`` between steps on every
    rank; two forwards before one backward; rank 0 alone evaluating through
    the wrapper after every step (the last included) while the others wait
    at a barrier, as training scripts validate."""
    model = Counting(rank)
    # DDP's rank 0 waits in its eval forward's broadcast for ranks that wait
    # at the barrier (on its own group as on the default one): a short timeout ends it.
    short = pattern == "rank0_validates" and impl == "ddp"
    wrapped = wrap(model, impl, **({"group_timeout_s": 5} if short else {}))
    gate = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5 if short else 60))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    seen = []

    def forward(x):
        out = wrapped(x)
        seen.append((model.seen.item(), model.ticks.item(), model.flag.item()))
        return out

    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            x = batch(step, rank)
            if pattern == "no_sync_micro_batches":
                with wrapped.no_sync():
                    forward(x).sum().backward()
                    forward(x).sum().backward()
                forward(x).sum().backward()
            elif pattern == "two_forwards":
                (forward(x).sum() + forward(x).sum()).backward()
            else:
                forward(x).sum().backward()
            opt.step()
            opt.zero_grad()
            if pattern == "eval_between_steps" or (pattern == "rank0_validates" and rank == 0):
                wrapped.eval()
                with torch.no_grad():
                    forward(x)
                wrapped.train()
            if pattern == "rank0_validates":
                dist.barrier(group=gate)
    outcome.result.update(seen=seen)
    return outcome.result


# ---- 5. what stays each rank's own, and what must not ---------------------------------------


class WithLocalState(nn.Module):
    """An MLP with state its users keep per rank, listed in DDP's ignore list
    (as code in the wild lists metrics, complex and fp8 tensors): a scale
    per rank, a complex parameter (no gradient type gradsync reduces), a
    running count; and a buffer that is shared (rank 0's at each forward).
    The per-rank state sits in a submodule: torch's DDP still averages the
    gradient of an ignored parameter of the root module (its reducer looks
    for the name with a leading dot)."""

    IGNORED = ["own.scale", "own.phase", "own.count"]

    def __init__(self, rank):
        super().__init__()
        self.body = mlp()
        # An empty parameter (a zero-width layer): nothing to average, and no reason to refuse the model.
        self.stub = nn.Parameter(torch.zeros(0, 4))
        self.own = nn.Module()
        self.own.scale = nn.Parameter(torch.full((4,), 1.0 + rank))
        self.own.phase = nn.Parameter(torch.full((2,), complex(1.0 + rank, 1.0)))
        self.own.register_buffer("count", torch.full((1,), 100.0 * rank))
        self.register_buffer("shared", torch.full((1,), 10.0 * rank))

    def forward(self, x):
        self.own.count += 1
        self.shared += 1
        return self.body(x) * self.own.scale + self.own.phase.abs().sum() + self.stub.sum()


def ignored_state(rank, world, impl, steps=3):
    """Parameters and buffers named in ``_set_params_and_buffers_to_ignore_for_model``
    stay each rank's own (not broadcast when wrapped or at forward, gradients
    not averaged); everything else is synchronized."""
    model = WithLocalState(rank)
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, WithLocalState.IGNORED)
    wrapped = wrap(model, impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record = {"scale": [], "count": [], "shared": [], "grads": []}
    with Outcome(impl, wrapped) as outcome:
        record["scale"].append(model.own.scale.detach().tolist())
        for step in range(steps):
            opt.zero_grad()
            wrapped(batch(step, rank)).square().sum().backward()
            record["count"].append(model.own.count.item())
            record["shared"].append(model.shared.item())
            record["grads"].append([p.grad.flatten().tolist() for p in model.parameters()])
            opt.step()
            record["scale"].append(model.own.scale.detach().tolist())
    outcome.result.update(record)
    return outcome.result


def unfrozen_after_wrapping(rank, world, impl):
    """The first layer is frozen when the model is wrapped and unfrozen at
    step 2 (as fine-tuning schedules do). Neither wrapper averages it; DDP
    steps it anyway, gradsync refuses the optimizer step and names it, and
    training goes on once the model is wrapped again."""
    model = mlp()
    first = model[0]
    first.requires_grad_(False)
    wrapped = wrap(model, impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    refused = None
    for step in range(2):
        if step == 1:
            first.requires_grad_(True)
        opt.zero_grad()
        wrapped(batch(step, rank)).square().sum().backward()
        try:
            opt.step()
        except gradsync.ConfigError as error:
            refused = str(error)
    gathered = [torch.empty_like(first.weight) for _ in range(world)]
    dist.all_gather(gathered, first.weight.detach())
    drift = max((g - gathered[0]).abs().max().item() for g in gathered)
    rewrapped_drift = None
    if refused is not None:
        wrapped.close()
        wrapped = wrap(model, impl)
        opt.zero_grad()
        wrapped(batch(2, rank)).square().sum().backward()
        opt.step()
        dist.all_gather(gathered, first.weight.detach())
        rewrapped_drift = max((g - gathered[0]).abs().max().item() for g in gathered)
    close(wrapped)
    return {"refused": refused, "drift": drift, "rewrapped_drift": rewrapped_drift}


def two_backwards(rank, world, impl, steps=3):
    """Two losses of one forward, each with its own ``backward()``
    (``retain_graph=True`` on the first), then one optimizer step: ``.grad``
    must hold the average of both losses' gradients."""
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            opt.zero_grad()
            out = wrapped(batch(step, rank))
            out.mean().backward(retain_graph=True)
            out.square().mean().backward()
            ref_opt.zero_grad()
            for r in range(world):
                ref_out = reference(batch(step, r))
                (ref_out.mean() / world + ref_out.square().mean() / world).backward()
            outcome.record(diff([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()]))
            opt.step()
            ref_opt.step()
    return outcome.result


class ComplexNet(nn.Module):
    """Complex parameters among real ones (spectral and state-space layers
    have them): a complex64 projection and a complex128 gate."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.lin = nn.Linear(8, 16)
        self.proj = nn.Parameter(torch.randn(16, 4, dtype=torch.complex64) * 0.3)
        self.gate = nn.Parameter(torch.randn(4, dtype=torch.complex128) * 0.3)

    def forward(self, x):
        h = torch.tanh(self.lin(x)).to(torch.complex64) @ self.proj
        return (h.to(torch.complex128) * self.gate).abs().float()


def complex_parameters(rank, world, impl, steps=3):
    """Complex gradients are averaged (real and imaginary parts alike), as DDP does."""
    model = ComplexNet()
    wrapped = wrap(model, impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            want = reference_grads(model, world, step)
            opt.zero_grad()
            wrapped(batch(step, rank)).square().sum().backward()
            outcome.record(diff([p.grad for p in model.parameters()], want))
            opt.step()
    return outcome.result


def accumulation_grads_visible(rank, world, impl, micro=3, steps=2):
    """Between micro-batches under ``no_sync``, ``.grad`` holds this rank's
    local sum so far (a loop that logs the gradient norm after each
    micro-batch, Lightning's ``on_after_backward``); what the program writes
    into it there (here: the sum halved after the first micro-batch) is what
    gets averaged, as under DDP. Returns the largest difference from the
    reference, local sums and final average alike."""
    model = mlp()
    wrapped = wrap(copy.deepcopy(model), impl)
    params = list(wrapped.parameters())
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            for m in range(micro):
                last = m == micro - 1
                context = contextlib.nullcontext() if last else wrapped.no_sync()
                with context:
                    wrapped(batch(step * micro + m, rank)).square().sum().backward()
                if not last:
                    # This rank's own sum so far, as one process computes it.
                    ref = copy.deepcopy(model)
                    ref.zero_grad()
                    for k in range(m + 1):
                        loss = ref(batch(step * micro + k, rank)).square().sum()
                        (loss * (0.5 if m >= 1 and k == 0 else 1.0)).backward()
                    outcome.record(diff([p.grad for p in params], [p.grad for p in ref.parameters()]))
                if m == 0:
                    with torch.no_grad():
                        for p in params:
                            p.grad.mul_(0.5)
            want = None
            for m in range(micro):
                g = reference_grads(model, world, step * micro + m)
                g = [x * 0.5 for x in g] if m == 0 else g
                want = g if want is None else [a + b for a, b in zip(want, g)]
            outcome.record(diff([p.grad for p in params], want))
    return outcome.result


class EarlyBranch(nn.Module):
    """An MLP with a side branch that only the first micro-batch of each
    step uses (``use_side``): its gradient comes from a ``no_sync``
    micro-batch only."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        torch.manual_seed(13)
        self.side = nn.Linear(8, 4)
        self.use_side = True

    def forward(self, x):
        out = self.body(x)
        return out + self.side(x) if self.use_side else out


def accumulation_early_branch(rank, world, impl, micro=3, steps=2):
    """A parameter that only a ``no_sync`` micro-batch reached is averaged
    with the step (its ``.grad`` holds the local sum; the synchronized
    backward never fires its hook). torch's DDP needs
    ``find_unused_parameters=True`` for it."""
    model = EarlyBranch()
    kwargs = {"find_unused_parameters": True} if impl == "ddp" else {}
    wrapped = wrap(copy.deepcopy(model), impl, **kwargs)
    inner = wrapped.module
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            wrapped.zero_grad()
            for m in range(micro):
                inner.use_side = m == 0
                context = contextlib.nullcontext() if m == micro - 1 else wrapped.no_sync()
                with context:
                    wrapped(batch(step * micro + m, rank)).square().sum().backward()
            ref = copy.deepcopy(model)
            for m in range(micro):
                ref.use_side = m == 0
                for r in range(world):
                    ref(batch(step * micro + m, r)).square().sum().backward()
            want = [p.grad / world for p in ref.parameters()]
            outcome.record(diff([p.grad for p in inner.parameters()], want))
    return outcome.result
