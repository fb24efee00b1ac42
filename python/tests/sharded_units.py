"""Parameter sharding by units, run on every rank of a test world: how
often each unit is gathered, how many are whole at once, and what a rank
whose forward differs from the others' does to the rounds."""

import copy
import io
import logging
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from gradsync import ConfigError
from gradsync.torch import DistributedDataParallel as GradsyncDDP

LR = 1e-2
WIDTH = 12


class Stack(nn.Module):
    """An embedding-like input layer, four blocks in a ``ModuleList`` (the
    units), a head; each block optionally checkpointed (``"reentrant"`` or
    ``"non_reentrant"``); ``extra_on``: a fifth block run only on that
    rank (a module some ranks never use); ``width``: the blocks' (the
    input is :data:`WIDTH` wide)."""

    def __init__(self, recompute=None, extra_on=None, rank=0, width=WIDTH):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(WIDTH, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(4)
        )
        self.extra = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)
        self.recompute, self.extra_on, self.rank = recompute, extra_on, rank

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.recompute is None:
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.recompute == "reentrant")
        if self.extra_on == self.rank:
            h = self.extra(h)
        return self.head(h)


def _batch(step, rank, world):
    x = torch.randn(world * 3, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    return x if rank is None else x[rank * 3 : (rank + 1) * 3]


def _watch_waits(wrapped):
    """Record, after each wait of ``buckets_in_flight``, the buckets still
    in flight (launched, not reduced) when the wait ended in time."""
    residence = wrapped._partition.residence
    left = []
    wait = residence.await_in_flight

    def watched(most, within_s):
        reached = wait(most, within_s)
        if reached:
            progress = wrapped._sync.session.progress()
            left.append(progress["buckets_launched"] - progress["buckets_done"])
        return reached

    residence.await_in_flight = watched
    return left


def training(rank, world, recompute=None, steps=3, prefetch=True, compiled=False, in_flight=None):
    """``steps`` steps of :class:`Stack` under ``shard_parameters=True``
    next to one process over the whole batch. Returns the units' names,
    the largest parameter difference, the gathers of each unit this rank
    kept in forward and backward, the most units whole at once, the rounds
    opened ahead of a unit's use, and the blocks' values held between
    forward and backward. ``prefetch``: ``prefetch_units``, gather the next
    block (by the last step's order) while the current one computes. ``compiled``: each
    block ``torch.compile``d before wrapping (aot_eager: compiled autograd
    graphs, no C++ compiler), or, ``"after"``, compiled in place after
    wrapping, as torchtitan compiles its layers after ``fully_shard`` (the
    hooks then run inside the compiled frames; the graphs of the same
    blocks compiled unwrapped come back beside, and dynamo's recompile-limit
    warnings).
    ``in_flight``: ``buckets_in_flight``; then also the buckets still in
    flight after each wait (one entry per wait: each ends when they settle)."""
    reference = Stack(recompute).double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    model = copy.deepcopy(reference)
    unsharded_graphs = None
    if compiled == "after":
        unsharded_graphs = _graphs_unsharded(copy.deepcopy(reference), steps, rank, world)
    elif compiled:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager")
    wrapped = GradsyncDDP(model, shard_parameters=True, bucket_cap_mb=0.001, buckets_in_flight=in_flight,
                          prefetch_units=prefetch)
    limits = _RecompileLimits()
    if compiled == "after":
        for block in wrapped.module.blocks:
            block.compile(backend="aot_eager")
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    residence = wrapped._partition.residence
    left = _watch_waits(wrapped) if in_flight is not None else []
    worst = 0.0
    gathers = [0] * len(residence.units)
    try:
        for step in range(steps):
            ref_opt.zero_grad()
            reference(_batch(step, None, world)).square().mean().backward()
            ref_opt.step()
            opt.zero_grad()
            before = list(residence.counts["gathers"])
            loss = wrapped(_batch(step, rank, world)).square().mean()
            # A unit's parameters are empty between its forward and its backward.
            between = [p.data.numel() for p in wrapped.module.blocks.parameters()]
            loss.backward()
            gathers = [g + now - then for g, now, then in zip(gathers, residence.counts["gathers"], before)]
            opt.step()
            with wrapped.whole_parameters():
                worst = max(worst, max((a - b).abs().max().item()
                                       for a, b in zip(reference.parameters(), wrapped.module.parameters())))
                if not compiled:  # (a compiled block would compile its no_grad graph too: counted below)
                    with torch.no_grad():  # an evaluation of the module itself inside the block keeps it whole
                        evaluated = wrapped.module(_batch(step, rank, world)) - reference(_batch(step, rank, world))
                    worst = max(worst, evaluated.abs().max().item(), max(
                        (a - b).abs().max().item() for a, b in zip(reference.parameters(), wrapped.module.parameters())))
        return {
            "names": [u.name for u in residence.units],
            "worst": worst,
            "gathers": gathers,
            "most_whole": residence.counts["most_whole"],
            "prefetched": residence.counts["prefetched"],
            "between": sum(between),
            # Graphs dynamo compiled in this process (the blocks', when ``compiled``).
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "unsharded_graphs": unsharded_graphs,
            "recompile_limits": limits.hit,
            "left_in_flight": left,
        }
    finally:
        limits.close()
        wrapped.close()


def _graphs_unsharded(model, steps, rank, world):
    """The dynamo graphs of ``model``'s blocks compiled in place and run
    ``steps`` forwards and backwards unwrapped (the count a sharded run is
    held to); dynamo's caches and counters are reset after."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    for step in range(steps):
        model(_batch(step, rank, world)).square().mean().backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return graphs


class _RecompileLimits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings while attached."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hit = 0
        logging.getLogger("torch._dynamo").addHandler(self)

    def emit(self, record):
        self.hit += "recompile_limit" in record.getMessage()

    def close(self):
        logging.getLogger("torch._dynamo").removeHandler(self)
        super().close()


def extra_on_one_rank(rank, world, steps=3, in_flight=None):
    """A block run by rank 0 only: rank 1 serves its gathers at its step's
    end. The average is every rank's gradient, summed, over the world (the
    extra block's from rank 0 alone). Returns the largest difference from
    that reference, the gathers of the extra block this rank kept, the
    rounds it joined while waiting for reductions (``buckets_in_flight``:
    ``in_flight``), the bound in force after the steps, and the longest
    step (seconds)."""
    reference = [Stack(extra_on=0, rank=r).double() for r in range(world)]
    model = copy.deepcopy(reference[rank])
    wrapped = GradsyncDDP(model, shard_parameters=[*model.blocks, model.extra], bucket_cap_mb=0.001,
                          buckets_in_flight=in_flight)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    residence = wrapped._partition.residence
    worst = 0.0
    kept = 0
    longest = 0.0
    try:
        extra = [u.name for u in residence.units].index("extra")
        for step in range(steps):
            for r, model in enumerate(reference):
                model.zero_grad()
                model(_batch(step, r, world)).square().mean().backward()
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in reference)):
                    grads = [p.grad for p in ps if p.grad is not None]
                    mean = sum(grads) / world
                    for p in ps:
                        p -= LR * mean
            opt.zero_grad()
            before = residence.counts["gathers"][extra]
            began = time.perf_counter()
            wrapped(_batch(step, rank, world)).square().mean().backward()
            longest = max(longest, time.perf_counter() - began)
            kept += residence.counts["gathers"][extra] - before
            opt.step()
            with wrapped.whole_parameters():
                worst = max(worst, max((a - b).abs().max().item()
                                       for a, b in zip(reference[rank].parameters(), wrapped.module.parameters())))
        return {"worst": worst, "extra_gathers": kept, "polls": residence.counts["polls"],
                "in_flight_after": residence.in_flight, "longest_s": longest}
    finally:
        wrapped.close()


def units_differ(rank, world):
    """Rank 0 gathers by blocks, rank 1 by two other modules: wrapping is
    refused on every rank. Returns the error this rank saw."""
    model = Stack().double()
    try:
        wrapped = GradsyncDDP(model, shard_parameters=list(model.blocks) if rank == 0 else [model.inp, model.head],
                              bucket_cap_mb=0.001, timeout=20)
    except ConfigError as error:
        return str(error)
    wrapped.close()
    return None


def mixed_precision(rank, world, units=True, steps=4, recompute=None, width=WIDTH, **settings):
    """``param_dtype=torch.bfloat16`` over a float32 :class:`Stack`: each
    step computes with a bfloat16 copy of the pieces, the gradients'
    average (summed in float32) reaches the float32 pieces, AdamW steps
    them. The reference does the same by hand in one process: a bfloat16
    copy of float32 master weights, each rank's batch through it, the
    float32 sum over the world. After the first step the parameters are
    read inside ``whole_parameters``, after the second gathered whole as a
    framework's teardown leaves them (the steps after each check that the
    gradients still arrive, in bfloat16). ``recompute``: the blocks
    checkpointed; ``width``: the blocks' (an odd one gives odd chunks,
    padded to whole words when carried); ``settings``: the wrapper's too. Returns the largest difference from the
    reference, the same from plain float32 training (what bfloat16
    changed), the dtypes the blocks computed in, held between steps, held
    inside ``whole_parameters`` and saved in its state dict, and the
    bucket gathers carried in bfloat16 (``padded``: of an odd chunk)."""
    master = Stack(recompute, width=width)
    plain = copy.deepcopy(master)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=LR)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    wrapped = GradsyncDDP(copy.deepcopy(master), shard_parameters=units, param_dtype=torch.bfloat16,
                          **{"bucket_cap_mb": 0.001, **settings})
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    seen = {"forward": set(), "carried": 0, "padded": 0}
    hook = wrapped.module.blocks[1].register_forward_pre_hook(lambda m, args: seen["forward"].add(m[0].weight.dtype))
    part = wrapped._partition
    size_of = part.gather_size

    def gather_size(b, carry=None):  # (counts the gathers of buckets carried in bfloat16, and those padded)
        if carry is not None:
            seen["carried"] += 1
            seen["padded"] += part.buckets[b].chunk % 2
        return size_of(b, carry)

    part.gather_size = gather_size
    try:
        for step in range(steps):
            low = copy.deepcopy(master).to(torch.bfloat16)
            grads = [None] * len(list(low.parameters()))
            for r in range(world):
                low.zero_grad()
                low(_batch(step, r, world).to(torch.bfloat16)).float().square().mean().backward()
                for k, p in enumerate(low.parameters()):
                    if p.grad is not None:  # (the extra block is used by no rank: no gradient, as under gradsync)
                        grads[k] = p.grad.float() if grads[k] is None else grads[k] + p.grad.float()
            for p, g in zip(master.parameters(), grads):
                p.grad = None if g is None else g / world
            ref_opt.step()
            plain_opt.zero_grad()
            plain(_batch(step, None, world).float()).square().mean().backward()
            plain_opt.step()
            opt.zero_grad()
            wrapped(_batch(step, rank, world).float()).float().square().mean().backward()
            opt.step()
            if step == 0:
                seen["between"] = {p.dtype for p in wrapped.module.blocks.parameters()}
                with wrapped.whole_parameters():
                    seen["whole"] = {p.dtype for p in wrapped.module.parameters()}
                    seen["state"] = {t.dtype for t in wrapped.module.state_dict().values()}
            if step == 1:
                wrapped._gather_whole()  # (Lightning's teardown: whole in float32 until the next forward)
        with wrapped.whole_parameters():
            state = wrapped.module.state_dict()
        seen["worst"] = max((state[n] - p).abs().max().item() for n, p in master.named_parameters())
        seen["from_plain"] = max((state[n] - p).abs().max().item() for n, p in plain.named_parameters())
        for key in ("forward", "between", "whole", "state"):
            seen[key] = sorted(str(d) for d in seen[key])
        return seen
    finally:
        hook.remove()
        wrapped.close()


def lost_gathers(rank, world, units=True, recompute="reentrant"):
    """A gather that fails mid-step in an elastic job (emulated: the
    residence told to go on, the lane or the whole-model gather made to
    fail as a lost member's would). Returns what the test checks: the
    step after a failure only while serving applied, an evaluation and
    then a step's forward and backward after a failure in the forward's
    gathers run to their end and the step refused (this rank's gradients
    came from zeros), the pieces untouched by those zeros,
    ``whole_parameters()`` refused rather than zeros."""
    model = Stack(recompute).double()
    wrapped = GradsyncDDP(model, shard_parameters=units, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    try:
        return _lost_gathers(rank, world, units, wrapped, opt, _batch)
    finally:
        wrapped.close()


def _lost_gathers(rank, world, units, wrapped, opt, batch):
    from gradsync import MembershipError, StepFailedError

    part, residence = wrapped._partition, wrapped._partition.residence

    def step(n):
        opt.zero_grad()
        loss = wrapped(batch(n, rank, world)).square().mean()
        loss.backward()
        opt.step()
        return loss

    step(0)  # (the first step runs whole as built; from here on every forward gathers)
    part.recover = lambda error: None  # (an elastic job's: the members settle; here the test looks)
    seen = {}
    if units is True:
        # A failure in a round where this rank only serves the others: its own gradients are whole.
        post = residence.lane.post

        def failing_when_serving(words):
            if not any(words[:-1]):  # (the last word says whether it serves)
                raise RuntimeError("emulated: a member was lost (serving)")
            return post(words)

        residence.lane.post = failing_when_serving
        step(1)
        seen["served_only"] = (wrapped.last_report.outcome, residence.broken is not None, residence.spoiled)
        residence.broken = None
        residence.protocol.settled(world)  # (the members settled: rounds make collectives again)
        residence.lane.post = post
        calls = []

        def failing_after_one(words):
            calls.append(words)
            if len(calls) > 1:
                raise RuntimeError("emulated: a member was lost (forward)")
            return post(words)

        residence.lane.post = failing_after_one
    else:
        def failing(*args, **kwargs):
            raise RuntimeError("emulated: a member was lost (forward)")

        part.gather = failing
    pieces = [piece.tensor.clone() for piece in part.every_held_piece()]
    with torch.no_grad():  # an evaluation first: it fails as the member is lost, and must not read zeros back
        seen["evaluated"] = tuple(wrapped(batch(2, rank, world)).shape)
    opt.zero_grad()
    loss = wrapped(batch(2, rank, world)).square().mean()
    seen["finite"] = bool(torch.isfinite(loss))
    try:
        loss.backward()
        seen["backward"] = "returned"
    except MembershipError as error:  # (no member is really lost: the step's own collectives completed)
        seen["backward"] = f"{error.kind}: {error}"
    seen["spoiled"] = residence.spoiled
    seen["grads"] = [piece.tensor.grad is not None for piece in part.every_held_piece()]
    seen["pieces_kept"] = all(torch.equal(a, piece.tensor) for a, piece in zip(pieces, part.every_held_piece()))
    try:
        with wrapped.whole_parameters():
            seen["whole"] = "entered"
    except StepFailedError as error:
        seen["whole"] = f"refused: {error}"
    return seen


def meta_init(rank, world, units=True, steps=3, param_dtype=None, default_init=False):
    """:class:`Stack` built on the meta device and wrapped: materialized a
    unit at a time (the most parameter bytes whole at once, seen from each
    module's initialization), every rank's values rank 0's (each rank seeds
    differently here), then ``steps`` steps next to one process that starts
    from the materialized values (the largest difference). ``default_init``:
    no ``param_init`` (each module's ``reset_parameters()``; nothing seen then)."""
    with torch.device("meta"):
        model = Stack("reentrant").double()
    torch.manual_seed(100 + rank)  # (after Stack's own seed: the initializations differ by rank, rank 0's must win)
    whole_now = []
    recorded = {}

    def init(module):  # (called on every module, as module.apply calls its function)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        for p in module.parameters(recurse=False):
            recorded[len(recorded)] = p.sum().item()  # (this rank's own values, before rank 0's are sent)
        # (Whole: its storage holds every element; a placeholder holds one, expanded.)
        whole_now.append(sum(p.numel() * p.element_size() for p in model.parameters()
                             if p.untyped_storage().nbytes() >= p.numel() * p.element_size()))

    settings = {} if param_dtype is None else {"param_dtype": param_dtype}
    if not default_init:
        settings["param_init"] = init
    wrapped = GradsyncDDP(model, shard_parameters=units, bucket_cap_mb=0.001, **settings)
    try:
        with wrapped.whole_parameters():
            start = {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}
        reference = Stack("reentrant").double()
        reference.load_state_dict(start)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
        worst = 0.0
        for step in range(steps):
            ref_opt.zero_grad()
            reference(_batch(step, None, world)).square().mean().backward()
            ref_opt.step()
            opt.zero_grad()
            wrapped(_batch(step, rank, world)).square().mean().backward()
            opt.step()
        with wrapped.whole_parameters():
            worst = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), wrapped.module.parameters()))
        unit_bytes = max(sum(p.numel() * 8 for p in block.parameters()) for block in reference.blocks)
        root_bytes = sum(p.numel() * 8 for n, p in reference.named_parameters() if not n.startswith("blocks."))
        # In the order the units were initialized: this rank's own draws, and what it started from.
        order = recorded_names(model, list(model.blocks) if units is True else [])
        return {"recorded": list(recorded.values()), "start": [start[n].sum().item() for n in order], "worst": worst,
                "most_whole": max(whole_now, default=0), "unit_bytes": unit_bytes, "root_bytes": root_bytes,
                "model_bytes": sum(p.numel() * 8 for p in reference.parameters()),
                "released": all(p.data.numel() == 0 for p in wrapped.module.parameters())}
    finally:
        wrapped.close()


def recorded_names(model, listed):
    """The parameters' names in the order ``meta_init``'s ``init`` saw them:
    unit by unit (the root, then each block), each unit's modules children
    first (``sharding.materialize``)."""
    from gradsync.torch.sharding.materialize import unit_modules

    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for unit in unit_modules(model, listed):
        for m in reversed(unit):
            out += [names[id(p)] for p in m.parameters(recurse=False)]
    return out


class _NoReset(nn.Module):
    """A module with a parameter of its own and no ``reset_parameters``."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * self.scale


def meta_refusals(rank, world):
    """What each refused meta wrapping says (a fragment of each message)."""
    said = []
    cases = [
        (lambda: nn.Linear(WIDTH, WIDTH, device="meta"), {}, "shard_parameters=True, which materializes it"),
        (lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), _NoReset()).to("meta"), {"shard_parameters": True},
         "no reset_parameters()"),
        (lambda: nn.Linear(WIDTH, WIDTH), {"shard_parameters": True, "param_init": lambda m: None},
         "param_init initializes a model built on the meta device"),
        (lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH, device="meta")),
         {"shard_parameters": True}, "several devices"),
    ]
    for build, settings, fragment in cases:
        try:
            GradsyncDDP(build(), **settings).close()
            said.append("accepted")
        except ConfigError as error:
            said.append(fragment if fragment in str(error) else str(error))
    return said


def reads_between_steps(rank, world, units=True):
    """What a training loop written the usual way reads of a sharded
    model's parameters: an L2 penalty summed over ``model.parameters()``
    after the forward, a weight-norm log between the backward and
    ``optimizer.step()`` and after it, a deep copy (an EMA) and a
    ``torch.save`` of the module between steps, writes between steps; and
    inside ``whole_parameters()`` the same log, run beside it. Returns,
    per read, the error's class, parameter and message, or the value."""
    from gradsync import ReleasedParameterError

    reference = Stack().double()
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=units, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    seen = {}

    def attempt(what, read):
        try:
            seen[what] = read()
        except ReleasedParameterError as error:
            seen[what] = (type(error).__name__, error.parameter, str(error))

    def norms():
        return [p.norm().item() for p in wrapped.module.parameters()]

    try:
        for step in range(2):
            opt.zero_grad()
            loss = wrapped(_batch(step, rank, world)).square().mean()
            if step == 1:
                attempt("penalty", lambda: float(sum(p.square().sum() for p in wrapped.parameters())))
            loss.backward()
            if step == 1:
                with torch.no_grad():
                    attempt("pending", norms)
            opt.step()
        with torch.no_grad():
            seen["before_closure"] = norms()

        def closure():  # (as Lightning steps: forward and backward inside optimizer.step, given positionally)
            opt.zero_grad()
            loss = wrapped(_batch(2, rank, world)).square().mean()
            with torch.no_grad():
                attempt("in_closure", norms)
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            attempt("norms", norms)
        attempt("graphed", norms)  # (autograd on: no gradient could reach the pieces)
        attempt("detached", lambda: [p.detach().norm().item() for p in wrapped.module.parameters()])
        first = next(wrapped.module.parameters())
        # A hand-written EMA over .data, and a norm log over it: p.data reads as p does.
        seen["data_norms"] = [p.data.norm().item() for p in wrapped.module.parameters()]
        ema_by_data = [torch.zeros(p.shape, dtype=p.dtype) for p in wrapped.module.parameters()]
        for e, p in zip(ema_by_data, wrapped.module.parameters()):
            e.data.mul_(0.5).add_(p.data, alpha=0.5)
        attempt("data_written", lambda: first.data.normal_())
        with torch.no_grad():
            attempt("written", lambda: first.mul_(1.0))
        attempt("copy_written", lambda: first.detach().add_(0.0))
        seen["repr"] = repr(first)
        wrapped.module.to("cpu")  # (where it is: nothing changes, as torch's no-op move)
        seen["moved"] = {type(p).__name__ for p in wrapped.module.parameters()}
        attempt("cast", lambda: wrapped.module.float())
        seen["dtypes"] = {p.dtype for p in wrapped.module.parameters()}
        # An EMA copy, and a pickle of the module, between steps: plain modules of their own, without the wrapper.
        ema, saved = copy.deepcopy(wrapped.module), io.BytesIO()
        torch.save(wrapped.module, saved)
        seen["held"] = sum(p.data.numel() for p in wrapped.module.parameters())
        x = _batch(7, rank, world)
        with wrapped.whole_parameters():
            seen["whole_norms"] = norms()
            seen["whole_first"] = first.detach().clone()
            seen["ema_by_data_off"] = max(float((e - 0.5 * p).abs().max())
                                          for e, p in zip(ema_by_data, wrapped.module.parameters()))
            with torch.no_grad():
                want = wrapped.module(x)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        with torch.no_grad():
            seen["copies_off"] = max(float((ema(x) - want).abs().max()), float((loaded(x) - want).abs().max()))
        seen["copy_hooks_inert"] = all(type(h).__name__ == "_Inert" for m in ema.modules()
                                       for h in m._forward_pre_hooks.values())
        seen["copies_plain"] = {type(p).__name__ for m in (ema, loaded) for p in m.parameters()}
        seen["grad_of_released"] = [p.grad for p in wrapped.module.parameters()].count(None)
        seen["named"] = [n for n, _ in wrapped.module.named_parameters()]
        # What reads no values answers as the whole parameter: a parameter count, shapes, sizes.
        seen["count"] = (sum(p.numel() for p in wrapped.module.parameters()),
                         sum(p.numel() for p in reference.parameters()))
        seen["shapes"] = ([(tuple(p.shape), p.size(), p.dim(), p.ndim, p.size(-1)) for p in wrapped.module.parameters()],
                          [(tuple(p.shape), p.size(), p.dim(), p.ndim, p.size(-1)) for p in reference.parameters()])
        return seen
    finally:
        wrapped.close()


def _meta_stack(seed):
    """:class:`Stack` built on the meta device and wrapped (units), its
    values drawn from ``seed`` as it is materialized."""
    with torch.device("meta"):
        model = Stack().double()
    draws = torch.Generator().manual_seed(seed)

    def init(module):
        for p in module.parameters(recurse=False):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=draws) * 0.3)

    return GradsyncDDP(model, shard_parameters=True, bucket_cap_mb=0.001, param_init=init)


def _train(model, opt, steps, rank, world, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        model(_batch(step, rank, world)).square().mean().backward()
        opt.step()


def _untouched(wrapped, call):
    """``call()`` with no parameter gathered: the protocol's gathers before
    and after, and whether every parameter stayed released."""
    residence = wrapped._partition.residence
    before = residence.counts["gathers"]
    call()
    return {"gathers": [now - then for now, then in zip(residence.counts["gathers"], before)],
            "released": all(p.data.numel() == 0 for p in wrapped.module.parameters())}


def meta_save(rank, world, path, steps=3):
    """A :class:`Stack` built on the meta device, trained ``steps`` steps
    with AdamW and saved with ``gradsync.torch.checkpoint`` to ``path``:
    whether the save gathered anything, and (rank 0) the whole values it
    started from and the state dict it saved (gathered before and after,
    for the reference)."""
    from gradsync.torch import checkpoint

    wrapped = _meta_stack(11)
    try:
        with wrapped.whole_parameters():
            start = {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
        _train(wrapped, opt, steps, rank, world)
        seen = _untouched(wrapped, lambda: checkpoint.save(path, wrapped, opt))
        with wrapped.whole_parameters():
            saved = {n: t.detach().clone() for n, t in wrapped.module.state_dict().items()}
        return {**seen, "start": start if rank == 0 else None, "saved": saved if rank == 0 else None}
    finally:
        wrapped.close()


def meta_load(rank, world, path, start, saved_world, saved_steps=3, steps=2):
    """Another :class:`Stack` on the meta device (other values), on this
    world size: ``path`` loaded into it, then ``steps`` more steps, next to
    one process that ran the saved job's steps (``saved_world`` ranks'
    batches) and then these: whether the load gathered anything, and the
    largest difference of the parameters after the loaded steps."""
    from gradsync.torch import checkpoint

    reference = Stack().double()
    reference.load_state_dict(start)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    _train(reference, ref_opt, saved_steps, None, saved_world)
    _train(reference, ref_opt, steps, None, world, first=saved_steps)
    wrapped = _meta_stack(99)
    try:
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
        seen = _untouched(wrapped, lambda: checkpoint.load(path, wrapped, opt))
        _train(wrapped, opt, steps, rank, world, first=saved_steps)
        with wrapped.whole_parameters():
            worst = max((a - b).abs().max().item()
                        for a, b in zip(reference.parameters(), wrapped.module.parameters()))
        return {**seen, "worst": worst}
    finally:
        wrapped.close()


def files_on_the_gradient_path(rank, world, steps=3):
    """The gradsync Python files one ZeRO-3 gradient passes: the frames of
    the last step's ``loss.backward()`` and ``optimizer.step()`` (AdamW)
    on this process's Python threads (the runtime's own threads run Rust
    and C++), as paths inside the package."""
    import sys
    import threading

    import gradsync

    root = gradsync.__file__.rsplit("/", 1)[0] + "/"
    wrapped = GradsyncDDP(Stack(), shard_parameters=True, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    files = set()

    def trace(frame, event, arg):
        if frame.f_code.co_filename.startswith(root):
            files.add(frame.f_code.co_filename[len(root):])

    try:
        for step in range(steps):
            opt.zero_grad()
            loss = wrapped(_batch(step, rank, world).float()).square().mean()
            if step == steps - 1:
                threading.settrace(trace)
                sys.settrace(trace)
            try:
                loss.backward()
                opt.step()
            finally:
                sys.settrace(None)
                threading.settrace(None)
        return sorted(files)
    finally:
        wrapped.close()
