"""Rank-side cases of ``test_rewrap.py``: checkpoint code and libraries do
with a DDP model what they do with any module, and gradsync's must follow.

* the wrapped module saved, pickled and deep-copied (whole-module
  checkpoints, the YOLOv5/Ultralytics style), then training goes on;
* a deep copy of the module wrapped while the first wrapper lives ("restart
  from the best weights");
* the wrapper itself deep-copied and round-tripped through ``torch.save``;
* ``ddp = DDP(model)`` run again after unfreezing a layer;
* ``model.reducer``, as Lightning and Accelerate call it.

Each case runs under ``impl`` (``"gradsync"`` or ``"ddp"``) on this rank's
batch and compares every step with a reference in this process that trains
on every rank's batch (``dropin``'s helpers). torch's DDP pickles only on the
default process group, so these cases build both wrappers there.
"""

import contextlib
import copy
import io
import pickle

import torch
import torch.nn as nn

import gradsync
from cases import Outcome, close
from dropin import batch, diff, mlp, reference_grads
from gradsync.torch import DistributedDataParallel as GradsyncDDP


def wrap_default(model, impl, **kwargs):
    """``model`` under ``impl`` on the default process group."""
    if impl == "gradsync":
        return GradsyncDDP(model, **kwargs)
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def sgd_steps(wrapped, model, reference, world, rank, first, steps, outcome, lr=0.05):
    """``steps`` SGD steps of ``wrapped`` (over ``model``'s parameters) from
    batch ``first`` on, each compared with ``reference`` trained on every
    rank's batch; the reference takes the same averaged step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(first, first + steps):
        want = reference_grads(reference, world, step)
        opt.zero_grad()
        wrapped(batch(step, rank)).square().sum().backward()
        outcome.record(diff([p.grad for p in model.parameters()], want))
        opt.step()
        with torch.no_grad():
            for p, g in zip(reference.parameters(), want):
                p.sub_(lr * g)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def module_checkpoints(rank, world, impl):
    """``torch.save(ddp.module)``, ``pickle.dumps(ddp.module)`` and a
    checkpoint dict holding ``copy.deepcopy(ddp.module).half()`` (YOLOv5's),
    between training steps: each loads back equal, and training goes on exact."""
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = wrap_default(model, impl)
    with Outcome(impl, wrapped) as outcome:
        sgd_steps(wrapped, model, reference, world, rank, 0, 2, outcome)
        buf = io.BytesIO()
        torch.save(wrapped.module, buf)
        buf.seek(0)
        assert same(torch.load(buf, weights_only=False), model), "torch.save(ddp.module) did not load back equal"
        assert same(pickle.loads(pickle.dumps(wrapped.module)), model), "pickle of ddp.module did not load back equal"
        ckpt = io.BytesIO()
        torch.save({"epoch": 1, "model": copy.deepcopy(wrapped.module).half()}, ckpt)
        ckpt.seek(0)
        half = torch.load(ckpt, weights_only=False)["model"]
        assert all(torch.equal(h, p.detach().half()) for h, p in zip(half.parameters(), model.parameters()))
        sgd_steps(wrapped, model, reference, world, rank, 2, 2, outcome)
    return outcome.result


def wrap_a_copy(rank, world, impl):
    """Restart from the best weights: ``snap = copy.deepcopy(ddp.module)``
    after a step, training goes on, then ``DDP(snap)`` while the first
    wrapper lives. Both wrappers train exactly (the copy owns its parameters)."""
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = wrap_default(model, impl)
    second = None
    with Outcome(impl, wrapped) as outcome:
        sgd_steps(wrapped, model, reference, world, rank, 0, 1, outcome)
        snap = copy.deepcopy(wrapped.module)
        snap_reference = copy.deepcopy(reference)
        sgd_steps(wrapped, model, reference, world, rank, 1, 1, outcome)
        second = wrap_default(snap, impl)
        sgd_steps(second, snap, snap_reference, world, rank, 2, 2, outcome)
        # The first wrapper still synchronizes its own module.
        sgd_steps(wrapped, model, reference, world, rank, 4, 1, outcome)
    close(second)
    return outcome.result


def copy_the_wrapper(rank, world, impl):
    """``copy.deepcopy(ddp)`` and ``torch.save(ddp)`` / ``torch.load``: each
    gives a working wrapper of its own copy of the module; the original
    goes on as before."""
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = wrap_default(model, impl)
    twin = loaded = None
    with Outcome(impl, wrapped) as outcome:
        sgd_steps(wrapped, model, reference, world, rank, 0, 1, outcome)
        twin = copy.deepcopy(wrapped)
        assert twin.module is not model and same(twin.module, model)
        twin_reference = copy.deepcopy(reference)
        buf = io.BytesIO()
        torch.save(wrapped, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        loaded_reference = copy.deepcopy(reference)
        assert type(loaded) is type(wrapped) and same(loaded.module, model)
        sgd_steps(twin, twin.module, twin_reference, world, rank, 1, 2, outcome)
        sgd_steps(loaded, loaded.module, loaded_reference, world, rank, 3, 2, outcome)
        sgd_steps(wrapped, model, reference, world, rank, 5, 1, outcome)
    close(twin)
    close(loaded)
    return outcome.result


def wrap_again(rank, world, impl):
    """A fine-tuning schedule: the first layer frozen, one step, then
    unfrozen and ``ddp = DDP(model)`` run again (the old wrapper alive while
    the new one is built, the name rebound after). Every layer, the unfrozen
    one included, is averaged from the new wrapper's first step. Under
    gradsync the old wrapper was retired: using it raises ``ClosedError``."""
    model = mlp()
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    reference[0].requires_grad_(True)
    ddp = wrap_default(model, impl)
    retired = None
    with Outcome(impl, ddp) as outcome:
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trained, lr=0.05)
        opt.zero_grad()
        ddp(batch(0, rank)).square().sum().backward()
        want = reference_grads(reference, world, 0)[2:]  # the first layer's weight and bias are frozen
        outcome.record(diff([p.grad for p in trained], want))
        opt.step()
        with torch.no_grad():
            for p, g in zip(list(reference.parameters())[2:], want):
                p.sub_(0.05 * g)
        model[0].requires_grad_(True)
        old = ddp
        ddp = wrap_default(model, impl)
        outcome.wrapped = ddp
        if impl == "gradsync":
            try:
                old(batch(0, rank))
            except gradsync.ClosedError as error:
                retired = str(error)
        del old
        sgd_steps(ddp, model, reference, world, rank, 1, 3, outcome)
    result = outcome.result
    if result["status"] == "ok":
        result["retired"] = retired
    return result


def sgd_step_by_parameters(wrapped, opt, model, reference, world, rank, number, outcome, reading):
    """One SGD step of ``wrapped`` (over ``model``) and of the one-process
    ``reference`` (lr 0.05, the parameters ``model`` trains), then the
    parameters compared, read inside ``reading`` (a context): for sharded
    gradients, whose ``.grad`` stays ``None``."""
    opt.zero_grad()
    wrapped(batch(number, rank)).square().sum().backward()
    opt.step()
    want = reference_grads(reference, world, number)  # (every reference parameter requires grad)
    with torch.no_grad():
        for p, g, mine in zip(reference.parameters(), want, model.parameters()):
            if mine.requires_grad:
                p.sub_(0.05 * g)
    with reading:
        outcome.record(diff([p.detach().clone() for p in model.parameters()], list(reference.parameters())))


def wrap_a_copy_sharded(rank, world, impl):
    """:func:`wrap_a_copy` with ``shard_parameters=True`` under gradsync
    (torch's DDP, beside it, unsharded): ``copy.deepcopy(ddp.module)``
    between steps is read alone from every rank's pieces (a whole, plain
    module), and a wrapper of it trains exactly while the first goes on.
    Every step compares the parameters read between steps, under
    ``torch.no_grad()`` alone, with the reference's."""
    settings = {"shard_parameters": True} if impl == "gradsync" else {}
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = wrap_default(model, impl, **settings)
    second = None

    def step(ddp, opt, module, ref, number, outcome):
        sgd_step_by_parameters(ddp, opt, module, ref, world, rank, number, outcome, torch.no_grad())

    with Outcome(impl, wrapped) as outcome:
        first = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        step(wrapped, first, model, reference, 0, outcome)
        snap = copy.deepcopy(wrapped.module)
        snap_reference = copy.deepcopy(reference)
        outcome.record(0.0 if all(type(p) is nn.Parameter and p.numel() == p.data.numel()
                                  for p in snap.parameters()) else float("inf"))
        step(wrapped, first, model, reference, 1, outcome)
        second = wrap_default(snap, impl, **settings)
        opt = torch.optim.SGD(second.parameters(), lr=0.05)
        for number in (2, 3):
            step(second, opt, snap, snap_reference, number, outcome)
        step(wrapped, first, model, reference, 4, outcome)
    close(second)
    return outcome.result


def wrap_again_sharded(rank, world, impl):
    """:func:`wrap_again` with ``shard_parameters=True`` under gradsync
    (torch's DDP, beside it, unsharded). The gradients are sharded (``.grad``
    stays ``None``), so every step compares the parameters, read inside
    ``whole_parameters()``, with the reference's. The retired wrapper's
    hooks on the module (its state-dict refusals, its gathers for a direct
    forward) come off with it: the new wrapper's forward meets none of them."""
    sharded = impl == "gradsync"
    settings = {"shard_parameters": True} if sharded else {}
    model = mlp()
    reference = copy.deepcopy(model)
    model[0].requires_grad_(False)
    ddp = wrap_default(model, impl, **settings)
    retired = None

    def step(wrapped, opt, number, outcome):
        sgd_step_by_parameters(wrapped, opt, model, reference, world, rank, number, outcome,
                               wrapped.whole_parameters() if sharded else contextlib.nullcontext())

    def optimizer():  # (one per wrapper, over what it trains: a new one's first step follows the old one's)
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)

    with Outcome(impl, ddp) as outcome:
        step(ddp, optimizer(), 0, outcome)
        model[0].requires_grad_(True)
        old = ddp
        ddp = wrap_default(model, impl, **settings)
        outcome.wrapped = ddp
        if sharded:
            try:
                old(batch(0, rank))
            except gradsync.ClosedError as error:
                retired = str(error)
        del old
        opt = optimizer()
        for number in range(1, 4):
            step(ddp, opt, number, outcome)
    result = outcome.result
    if result["status"] == "ok":
        result["retired"] = retired
    return result


def reducer_calls(rank, world, impl):
    """``model.reducer`` as the libraries call it: a forward under
    ``no_sync`` whose backward is made to synchronize by
    ``reducer.prepare_for_backward([])`` (Accelerate's
    ``trigger_sync_in_backward``), and Lightning's manual-optimization calls
    around two backward passes of one forward. Returns, for gradsync, what an
    unsupported call raised and whether ``hasattr`` probes see it."""
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = wrap_default(model, impl)
    extra = {}
    with Outcome(impl, wrapped) as outcome:
        for step in range(2):
            wrapped.zero_grad()
            with wrapped.no_sync():
                out_a = wrapped(batch(2 * step, rank))
                out_b = wrapped(batch(2 * step + 1, rank))
            out_a.square().sum().backward()
            wrapped.require_backward_grad_sync = True
            wrapped.reducer.prepare_for_backward([])
            out_b.square().sum().backward()
            want = [a + b for a, b in zip(reference_grads(reference, world, 2 * step), reference_grads(reference, world, 2 * step + 1))]
            outcome.record(diff([p.grad for p in model.parameters()], want))
        # Lightning's manual optimization: one forward, two backward passes,
        # each prepared the way Lightning's pre_backward prepares it.
        wrapped.zero_grad()
        out = wrapped(batch(4, rank))
        for loss in (out.mean(), out.square().mean()):
            wrapped.reducer._rebuild_buckets()
            wrapped.reducer.prepare_for_backward([])
            loss.backward(retain_graph=True)
        ref = copy.deepcopy(reference)
        ref.zero_grad()
        for r in range(world):
            o = ref(batch(4, r))
            (o.mean() / world + o.square().mean() / world).backward()
        outcome.record(diff([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]))
        wrapped.reducer._check_reducer_finalized()
        if impl == "gradsync":
            for name in ("prepare_for_forward", "_push_all_rebuilt_params", "_delay_all_reduce", "_set_static_graph"):
                getattr(wrapped.reducer, name)()
            assert wrapped.reducer._rebuild_buckets() is False
            extra["hasattr"] = hasattr(wrapped.reducer, "_install_post_backward_futures")
            try:
                wrapped.reducer._get_local_used_map()
            except gradsync.ConfigError as error:
                extra["unsupported"] = str(error)
    outcome.result.update(extra)
    return outcome.result


def manual_finalization(rank, world):
    """torch's DDP manual finalization on gradsync: with
    ``require_manual_backward_finalization = True`` the step ends at
    ``finalize_backward()``, and an optimizer step before it is refused."""
    model = mlp()
    reference = copy.deepcopy(model)
    wrapped = GradsyncDDP(model)
    wrapped.require_manual_backward_finalization = True
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    worst, refused = 0.0, None
    for step in range(2):
        opt.zero_grad()
        wrapped(batch(step, rank)).square().sum().backward()
        assert wrapped.should_finalize_after_backward
        if step == 0:
            try:
                opt.step()
            except gradsync.UnfinishedStepError as error:
                refused = str(error)
        wrapped.finalize_backward()
        want = reference_grads(reference, world, step)
        worst = max(worst, diff([p.grad for p in model.parameters()], want))
        opt.step()
        with torch.no_grad():
            for p, g in zip(reference.parameters(), want):
                p.sub_(0.05 * g)
    wrapped.close()
    return {"max_diff": worst, "refused": refused}
