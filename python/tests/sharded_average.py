"""An averaged copy (EMA, SWA) of a parameter-sharded model, run on every
rank of a test world beside ``torch.optim.swa_utils.AveragedModel`` of a
one-process replay of the same training."""

import copy

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from gradsync import ConfigError
from gradsync.torch import DistributedDataParallel as GradsyncDDP
from gradsync.torch import ShardedAveragedModel

LR = 1e-2
WIDTH = 12


class Decaying(nn.Module):
    """A buffer its forward moves in training (the same on every rank and
    in the replay, unlike a batch norm's statistics of each rank's batch)
    and scales by."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(WIDTH, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.05)
                self.calls += 1
        return h * self.scale


class Normed(nn.Module):
    """Blocks in a ``ModuleList`` (the units) with buffers in the head,
    which an average keeps (or averages) beside the parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))
        self.norm = Decaying()
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def _batch(step, rank, world):
    x = torch.randn(world * 3, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    return x if rank is None else x[rank * 3 : (rank + 1) * 3]


def _average_settings(kind, use_buffers):
    multi = get_ema_multi_avg_fn(0.75) if kind == "ema" else None
    return {"multi_avg_fn": multi, "use_buffers": use_buffers}


def _train(model, opt, averaged, steps, rank, world, first=0, beside=None):
    """``steps`` steps, the average updated after each; ``beside``: an
    ``AveragedModel`` of the sharded model's own values, updated inside
    ``whole_parameters()``."""
    for step in range(first, first + steps):
        opt.zero_grad()
        model.train()
        model(_batch(step, rank, world)).square().mean().backward()
        opt.step()
        averaged.update_parameters(model)
        if beside is not None:
            with model.whole_parameters():
                beside.update_parameters(model.module)


def _apart(a, b):
    """The largest difference between tensors ``a`` and ``b``, or between
    two sequences (or dicts) of them, key for key."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        a, b = list(a.values()), list(b.values())
    if isinstance(a, (list, tuple)):
        return max(_apart(x, y) for x, y in zip(a, b, strict=True))
    return (a.double() - b.double()).abs().max().item()


def _outcome(what):
    try:
        what()
        return None
    except ConfigError as error:
        return str(error)


def averaged_training(rank, world, kind="ema", use_buffers=False, units=True, steps=4):
    """Train a sharded :class:`Normed` and a one-process replay, each with
    its average updated after every step; returns, by what was looked at,
    how far the sharded average is from ``AveragedModel``'s (evaluated on
    every rank, read alone on rank 0, the parameters' norms read alone)
    and from an ``AveragedModel`` of its own values (``beside``),
    how far the trained values that come back after ``applied()`` are from
    the replay's, and the
    refusals of a step and an update inside it."""
    reference = Normed().double()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_average = AveragedModel(reference, **_average_settings(kind, use_buffers))
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=units, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    averaged = ShardedAveragedModel(wrapped, **_average_settings(kind, use_buffers))
    with wrapped.whole_parameters():
        beside = AveragedModel(wrapped.module, **_average_settings(kind, use_buffers))
    try:
        _train(reference, ref_opt, ref_average, steps, None, world)
        _train(wrapped, opt, averaged, steps, rank, world, beside=beside)
        probe = _batch(100, None, world)
        ref_average.eval()
        wrapped.eval()
        seen = {"pieces_bytes": averaged.held_bytes}
        with torch.no_grad():
            want = ref_average(probe)
            with averaged.applied():
                seen["evaluated"] = _apart(wrapped(probe), want)
                seen["norms"] = _apart(torch.stack([p.norm() for p in wrapped.module.parameters()]),
                                       torch.stack([p.norm() for p in ref_average.module.parameters()]))
                if rank == 0:  # (the others are already at the block's end, waiting: read alone)
                    mine = wrapped.module.state_dict()
                    seen["state_dict"] = _apart(mine, ref_average.module.state_dict())
                    seen["beside"] = _apart(mine, beside.module.state_dict())
                seen["step_inside"] = _outcome(opt.step)
                seen["update_inside"] = _outcome(averaged.update_parameters)
            reference.eval()
            seen["trained_back"] = _apart(wrapped(probe), reference(probe))
        # Training goes on from the trained values, and the average with it.
        wrapped.train()
        reference.train()
        _train(reference, ref_opt, ref_average, 2, None, world, first=steps)
        _train(wrapped, opt, averaged, 2, rank, world, first=steps)
        ref_average.eval()
        wrapped.eval()
        with torch.no_grad(), averaged.applied():
            seen["after_more"] = _apart(wrapped(probe), ref_average(probe))
        seen["n_averaged"] = int(averaged.n_averaged) == int(ref_average.n_averaged)
        return seen
    finally:
        wrapped.close()


def averaged_saved(rank, world, path, steps=3):
    """A sharded :class:`Normed` trained with an EMA, the average saved by
    every rank inside ``applied()`` with ``gradsync.torch.checkpoint``, and
    its per-rank state dict round-tripped; returns whether that round trip
    kept the average and the refusal of a state of another rank."""
    from gradsync.torch import checkpoint

    wrapped = GradsyncDDP(Normed().double(), shard_parameters=True, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    averaged = ShardedAveragedModel(wrapped, **_average_settings("ema", False))
    try:
        _train(wrapped, opt, averaged, steps, rank, world)
        with averaged.applied():
            checkpoint.save(path, wrapped)
        state = averaged.state_dict()
        other = ShardedAveragedModel(wrapped, **_average_settings("ema", False))
        other.load_state_dict(state)
        probe = _batch(100, None, world)
        wrapped.eval()
        with torch.no_grad():
            with averaged.applied():
                want = wrapped(probe)
            with other.applied():
                kept = torch.equal(wrapped(probe), want)
        moved = dict(state, layout=(1 - rank, *state["layout"][1:]))
        return {"kept": kept, "other_rank": _outcome(lambda: other.load_state_dict(moved)),
                "want": want if rank == 0 else None}
    finally:
        wrapped.close()


def averaged_loaded(rank, world, path):
    """Another sharded :class:`Normed` (other values) on this world size:
    the average saved by :func:`averaged_saved` loaded inside ``applied()``;
    returns the evaluation of the average then."""
    from gradsync.torch import checkpoint

    torch.manual_seed(77)
    model = Normed().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    wrapped = GradsyncDDP(model, shard_parameters=True, bucket_cap_mb=0.001)
    averaged = ShardedAveragedModel(wrapped, **_average_settings("ema", False))
    try:
        with averaged.applied():
            checkpoint.load(path, wrapped)
        wrapped.eval()
        with torch.no_grad(), averaged.applied():
            return wrapped(_batch(100, None, 2))
    finally:
        wrapped.close()


def refusals(rank, world):
    """ShardedAveragedModel over models it does not average: an unsharded
    wrapper, a ZeRO-2 one; and applied() in the middle of a step."""
    seen = {}
    for what, setting in (("unsharded", {}), ("zero2", {"shard_gradients": True})):
        wrapped = GradsyncDDP(Normed().double(), **setting)
        try:
            seen[what] = _outcome(lambda: ShardedAveragedModel(wrapped))
        finally:
            wrapped.close()
    wrapped = GradsyncDDP(Normed().double(), shard_parameters=True, bucket_cap_mb=0.001)
    averaged = ShardedAveragedModel(wrapped)
    try:
        loss = wrapped(_batch(0, rank, world)).square().mean()

        def inside_a_step():
            with averaged.applied():
                pass

        seen["mid_forward"] = _outcome(inside_a_step)
        loss.backward()
        seen["mid_step"] = _outcome(inside_a_step)
        return seen
    finally:
        wrapped.close()



class _OthersAhead:
    """A state group on which the other members averaged one update more
    than this one (what ``ShardedAveragedModel.lend`` finds on a member that
    took a step's update in a settlement, the others having stepped and
    averaged it in before the loss showed)."""

    def extremes(self, values):
        return [v + 1 for v in values], list(values)


def taken_early(rank, world, steps=3):
    """``steps`` steps with the average updated after each, then one more
    optimizer step and a change of members (``lend`` / ``settled``, as
    ``sharding.reshard.settle`` calls them) at which the others stand one
    update ahead: the average takes that step's update there, and the
    ``update_parameters()`` the loop makes after the step is taken as done.
    Returns how far the average is then from ``AveragedModel``'s of a
    replay of ``steps + 1`` steps, both update counts, and whether any
    optimizer state entry kept the average's key."""
    reference = Normed().double()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    ref_average = AveragedModel(reference, **_average_settings("ema", False))
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=True, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    averaged = ShardedAveragedModel(wrapped, **_average_settings("ema", False))
    try:
        _train(reference, ref_opt, ref_average, steps + 1, None, world)
        _train(wrapped, opt, averaged, steps, rank, world)
        opt.zero_grad()
        wrapped(_batch(steps, rank, world)).square().mean().backward()
        opt.step()  # (this member's step; the others averaged it in already)
        state = wrapped._partition.optimizer().inner.state
        part = wrapped._partition
        averaged.lend(state, _OthersAhead(), "gradsync.average.0")
        averaged.settled(state, _OthersAhead(), [(r, world, 0) for r in range(world)])
        early = int(averaged.n_averaged)
        averaged.update_parameters(wrapped)  # (the loop's own, after the step: already done)
        probe = _batch(100, None, world)
        wrapped.eval()
        ref_average.eval()
        with torch.no_grad(), averaged.applied():
            apart = (wrapped(probe) - ref_average(probe)).abs().max().item()
        return {"apart": apart, "early": early, "after": int(averaged.n_averaged), "want": int(ref_average.n_averaged),
                "key_left": any("gradsync.average.0" in state.get(p.tensor, {}) for p in part.every_held_piece())}
    finally:
        wrapped.close()
