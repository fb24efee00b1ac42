"""An averaged copy of a parameter-sharded model (EMA, SWA) that is never whole.

``torch.optim.swa_utils.AveragedModel(model)`` deep-copies the model: every
rank then holds the average whole, which a model sharded because it does
not fit one rank cannot afford. :class:`ShardedAveragedModel` keeps, on each
rank, the average of *its pieces* only (``1/world`` of the model, as its
optimizer state is), updated where they lie, with no communication::

    optimizer.step()           each rank steps its pieces
    averaged.update_parameters(model)
                               each rank: average ← fn(average, its pieces)   (no collective)
    with averaged.applied():   every rank: its pieces hold the average, the
                               model's buffers the averaged copy's; the
                               parameters are released, so whatever reads the
                               model reads the average: an evaluation (on every
                               rank, or on one alone), ``model.state_dict()``
                               saved by rank 0 alone, a sharded checkpoint
                               (``gradsync.torch.checkpoint``), a load
    (block ends)               every rank: the average takes what the pieces
                               hold (what a load wrote), the trained values
                               come back

An average is elementwise (torch's SWA and EMA functions are, and
``get_ema_multi_avg_fn`` works as given), so each rank's part of it is
exactly the whole average's part: the values equal ``AveragedModel``'s of
the same training, element for element.

Buffers are not sharded (every rank holds them whole): as in
``AveragedModel``, with ``use_buffers=False`` the copy keeps the model's
buffers as they were at the last update, and with ``use_buffers=True``
averages them too.
"""

import contextlib
import weakref

import torch
from torch.optim.swa_utils import get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _group_tensors_by_device_and_dtype

from gradsync._errors import ConfigError, MembershipError
from gradsync.torch.sharding.released import held


class ShardedAveragedModel:
    """The running average of a parameter-sharded wrapper's parameters, each
    rank keeping its pieces' (see the module docs). ``model``: a gradsync
    ``DistributedDataParallel`` built with ``shard_parameters=True``;
    ``avg_fn`` / ``multi_avg_fn`` / ``use_buffers``: as
    ``torch.optim.swa_utils.AveragedModel`` takes them (default: the equal
    average, SWA's), each elementwise. Every rank builds it, at the same
    point, between steps.

    In an elastic job the averages of a rank's pieces live on its buddy too
    (its optimizer steps the buddy's pieces, and they are averaged with its
    own), so a lost member loses none: at a change of members they move
    with the pieces (:meth:`lend`, :meth:`settled`), and a replacement takes
    ``n_averaged`` and the averages of what is not sharded from a member
    that stayed."""

    def __init__(self, model, avg_fn=None, multi_avg_fn=None, use_buffers=False):
        part = getattr(model, "_partition", None)
        if part is None or part.residence is None:
            raise ConfigError(
                "ShardedAveragedModel averages a model whose parameters are sharded: wrap it with gradsync's "
                "DistributedDataParallel(model, shard_parameters=True). A model whose parameters are whole on every "
                "rank (unsharded, or shard_gradients=True) averages with torch.optim.swa_utils.AveragedModel(model)"
            )
        self._model = model
        self._partition = part
        self._avg_fn = avg_fn
        self._multi_avg_fn = multi_avg_fn
        self._use_buffers = use_buffers
        #: How many times the average was updated (``AveragedModel.n_averaged``).
        self.n_averaged = torch.tensor(0, dtype=torch.long)
        sharded = {id(p) for p in part.params}
        #: What is averaged, as ``(owner, average, kind)``: this rank's
        #: pieces of every sharded parameter (``"piece"``: the owner a
        #: ``Piece``, whose tensor the optimizer steps in place), the
        #: module's parameters that are not sharded (``"whole"``: not
        #: synchronized, whole on every rank) and its buffers (``"buffer"``:
        #: averaged under ``use_buffers``, else copied at each update).
        self._averages = [(piece, piece.tensor.detach().clone(), "piece") for piece in part.every_held_piece()]
        self._averages += [(p, p.detach().clone(), "whole") for p in model.module.parameters() if id(p) not in sharded]
        self._averages += [(b, b.detach().clone(), "buffer") for b in model.module.buffers()]
        #: Inside :meth:`applied`: the trained values put aside (in the
        #: order of ``_averages``); ``None`` outside.
        self._aside = None
        #: Whether a change of members averaged in the step the next
        #: :meth:`update_parameters` is for (:meth:`lend`).
        self._taken_early = False
        #: The key its pieces' averages take in their optimizer state while
        #: a change of members moves them (:meth:`lend`), or ``None``.
        self._key = None
        part.averaged.append(weakref.ref(self))

    def lend(self, state, states, key):
        """A change of members begins (``sharding.reshard.settle``, after
        every holder took the same optimizer steps): each held piece's
        average goes into its optimizer ``state`` entry under ``key`` (the
        same on every member), to move with the piece's state. A member whose
        pieces took the step's update in the settlement, while the others
        had averaged it in already (``n_averaged`` one behind theirs:
        ``states``, the new state group, finds out in one reduction),
        averages it in now, and its own ``update_parameters()`` after this
        step is then taken as done."""
        self._refuse_inside("a change of members")
        holds = self._partition.sharded_step.holds
        n = int(self.n_averaged)
        high, _ = states.extremes([n if holds else -1])
        if holds and n < high[0]:
            if n != high[0] - 1:
                raise MembershipError.of(
                    "broken", f"the averaged model's members stand {high[0] - n} updates apart at a change of "
                    "members (ShardedAveragedModel.update_parameters): call it on every member after every "
                    "optimizer.step()")
            self._update()
            self._taken_early = True
        self._key = key
        for owner, average, kind in self._averages:
            if kind == "piece":
                state.setdefault(owner.tensor, {})[key] = average

    def settled(self, state, states, places):
        """The change of members moved the pieces: the averages of the new
        pieces come out of the optimizer ``state`` again; when a member
        holds no old place (``places``: per new rank, the old place it
        holds, or ``None``: a replacement), every member takes
        ``n_averaged`` and the averages of what is not sharded from the
        first that holds one (``states``: the new state group; a broadcast
        of the unsharded part only)."""
        pieces = []
        for piece in self._partition.every_held_piece():
            entry = state.get(piece.tensor)
            average = entry.pop(self._key, None) if entry is not None else None
            if entry is not None and not entry:
                del state[piece.tensor]  # (the average alone: no optimizer state of its own)
            pieces.append((piece, piece.tensor.detach().clone() if average is None else average, "piece"))
        self._averages = pieces + [a for a in self._averages if a[2] != "piece"]
        if None in places:
            root = next(r for r, place in enumerate(places) if place is not None)
            states.broadcast([self.n_averaged, *(a for _, a, kind in self._averages if kind != "piece")], root)

    @property
    def held_bytes(self):
        """Bytes this rank holds of the sharded parameters' average: its pieces'."""
        return sum(a.numel() * a.element_size() for _, a, kind in self._averages if kind == "piece")

    def _sides(self, buffers=True):
        """``(current values, averages)``, each in the order of
        ``_averages`` (without the buffers unless ``buffers``)."""
        chosen = [(owner, a, kind) for owner, a, kind in self._averages if buffers or kind != "buffer"]
        return [owner.tensor if kind == "piece" else owner.detach() for owner, _, kind in chosen], [
            a for _, a, _ in chosen]

    @torch.no_grad()
    def update_parameters(self, model=None):
        """Average the model's current values in (after ``optimizer.step()``):
        each rank its pieces, with no collective (so any rank may call it
        at any point; every rank calls it after the same steps, as under
        DDP, where each rank's copy is its own). ``model``: the wrapper
        this average was built over (or its module), or ``None``."""
        if model is not None and model is not self._model and model is not self._model.module:
            raise ConfigError("ShardedAveragedModel.update_parameters(model): the model must be the wrapper it was "
                              "built over (or its module); build one ShardedAveragedModel per model")
        self._refuse_inside("update_parameters()")
        if self._taken_early:  # (a change of members averaged this step in: see lend)
            self._taken_early = False
            return
        self._update()

    @torch.no_grad()
    def _update(self):
        """Average the current values in (:meth:`update_parameters`)."""
        values, averages = self._sides(buffers=self._use_buffers)
        if self.n_averaged == 0:
            _copy(averages, values)
        else:
            self._average(averages, values)
        if not self._use_buffers:
            for b, copy, kind in self._averages:
                if kind == "buffer":
                    copy.copy_(b.detach())
        self.n_averaged += 1

    def _average(self, averages, values):
        """``averages`` ← the average function of them and ``values``, as
        ``AveragedModel.update_parameters`` calls it (grouped by device and
        dtype for the multi-tensor functions)."""
        if self._multi_avg_fn is None and self._avg_fn is not None:
            for average, value in zip(averages, values):
                average.copy_(self._avg_fn(average, value, self.n_averaged.to(average.device)))
            return
        groups = _group_tensors_by_device_and_dtype([averages, values])
        for (device, _), ([group_averages, group_values], _) in groups.items():
            n = self.n_averaged.to(device)
            if self._multi_avg_fn is not None:
                self._multi_avg_fn(group_averages, group_values, n)
            elif device is not None and device.type in _get_foreach_kernels_supported_devices():
                get_swa_multi_avg_fn()(group_averages, group_values, n)
            else:
                for average, value in zip(group_averages, group_values):
                    average.copy_(get_swa_avg_fn()(average, value, n))

    @contextlib.contextmanager
    def applied(self):
        """Within the block the model holds the average (a collective: every
        rank enters it at the same point, between steps, and leaves it
        together). The parameters are released (those whole before the
        first forward first): an evaluation on every
        rank gathers the average, one rank alone reads it from the others'
        pieces (``model.state_dict()`` saved by rank 0 only), a sharded
        checkpoint saves or loads it. What is loaded inside becomes the
        average. ``optimizer.step()`` inside is refused."""
        self._refuse_inside("applied()")
        part = self._partition
        served = part.served
        if served is not None and served.mid_update:
            raise ConfigError("ShardedAveragedModel.applied() between this step's backward and the end of "
                              "optimizer.step(): call it after optimizer.step()")
        mid_step = self._model._sync.record.sync_pending  # (a forward of a step ran; its backward did not end)
        if part.residence.whole and not mid_step:  # (before the first forward, or inside whole_parameters())
            part.residence.release(step_ended=False)
            if served is not None:
                served.wrote()
        elif mid_step or any(held(p).numel() for p in part.params):
            raise ConfigError("ShardedAveragedModel.applied() between steps only (after optimizer.step()): some "
                              "parameters are whole now, inside a forward or backward")
        current, averages = self._sides()
        with torch.no_grad():
            aside = [t.clone() for t in current]
            self._swap_in(lambda: _copy(current, averages))
        self._aside = aside
        part.averaged_applied = True
        try:
            yield self
        finally:
            part.averaged_applied = False
            self._aside = None
            # What a forward with gradients gathered inside is released
            # (its pieces read it back: the average, as it was left).
            if not self._model._sync.record.sync_pending and any(held(p).numel() for p in part.params):
                part.residence.release(step_ended=False)
            # Every rank leaves together: a rank reading the average alone
            # (rank 0's save) finds the others' pieces still holding it.
            if served is not None:
                served.everyone_read("ShardedAveragedModel.applied()")
            with torch.no_grad():
                self._swap_in(lambda: self._restore(aside))

    def _restore(self, aside):
        """The block ends: the averages take what the model holds (a load's
        values), and the trained values (``aside``) come back."""
        current, averages = self._sides()
        _copy(averages, current)
        _copy(current, aside)

    def _swap_in(self, write):
        """``write`` the pieces as every rank does at the same point: the
        pieces' version moves on (a read alone at it waits for the ranks
        not through yet)."""
        served = self._partition.served
        with served.rewriting() if served is not None else contextlib.nullcontext():
            write()

    def _refuse_inside(self, what):
        if self._aside is not None:
            raise ConfigError(f"ShardedAveragedModel.{what} inside its own applied() block: leave the block first")

    def state_dict(self):
        """This rank's part of the average, for a checkpoint saved by every
        rank (each its own file), loadable at the same world and layout:
        ``n_averaged`` and the averages of its pieces, the unsharded
        parameters and the buffers. A checkpoint at another world: save
        the model inside :meth:`applied` with ``gradsync.torch.checkpoint``."""
        return {"n_averaged": self.n_averaged.clone(), "layout": self._layout(),
                "averages": [a.clone() for _, a, _ in self._averages]}

    def load_state_dict(self, state):
        """What :meth:`state_dict` gave on this rank, at the same layout
        (refused, naming both, at another)."""
        if state.get("layout") != self._layout():
            raise ConfigError(
                f"ShardedAveragedModel.load_state_dict(): the state is of another layout ({state.get('layout')}) "
                f"than this rank's ({self._layout()}): load it on the rank that saved it at the same world size, or "
                "save and load the average as a model inside applied() with gradsync.torch.checkpoint"
            )
        with torch.no_grad():
            _copy([a for _, a, _ in self._averages], state["averages"])
        self.n_averaged = state["n_averaged"].clone()

    def _layout(self):
        """Where this rank's pieces lie: ``(rank, world, (parameter, offset, length) per piece)``."""
        part = self._partition
        return (part.rank, part.world,
                [(piece.param, piece.offset, piece.length) for piece, _, kind in self._averages if kind == "piece"])


def _copy(targets, sources):
    """Each of ``targets`` takes the values of its ``sources`` (in place)."""
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)
