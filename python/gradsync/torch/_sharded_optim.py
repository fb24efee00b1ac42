"""``ShardedOptimizer``: an optimizer that steps only this rank's partition.

Built by ``model.shard_optimizer(torch.optim.AdamW, lr=...)`` on a wrapper
made with ``shard_gradients=True``. Each rank's optimizer holds state for
its pieces only (``_partition``: the parts of parameters inside its
partition of each bucket), so optimizer memory per rank is about
``1 / world`` of an unsharded one. :meth:`ShardedOptimizer.step`:

1. steps the inner optimizer (the class you named) over this rank's pieces,
   whose ``.grad`` hold the averaged gradients of its partition: the pieces
   are views of the parameters, so the parameters change in place;
2. all-gathers every rank's updated pieces into every rank's parameters,
   so every replica holds the same parameters before the next forward.

Pieces are slices of parameters, so the inner optimizer must update each
element from that element's gradient and state alone (SGD, Adam, AdamW,
Adagrad, RMSprop, ...: :data:`ELEMENTWISE`). An optimizer that looks at a
whole tensor (a trust ratio, a factored second moment, LBFGS) would see a
slice and is refused; register one that is elementwise with
:func:`elementwise`.

The object is a ``torch.optim.Optimizer``: ``param_groups`` (the inner
optimizer's, whose ``params`` are pieces) take learning-rate schedulers
unchanged; ``zero_grad()`` drops the pieces' gradients. ``state_dict()`` is
the full, consolidated state in torch's format for the wrapped parameters
(collect it with :meth:`ShardedOptimizer.consolidate_state_dict` first, as
with torch's ``ZeroRedundancyOptimizer``), and ``load_state_dict`` takes
such a full state on any world size.
"""

import hashlib
import weakref

import torch

from gradsync._errors import ConfigError
from gradsync.torch._grads import reals
from gradsync.torch._partition import LOST

#: Optimizer classes that update each element from that element's own
#: gradient and state (so a slice of a parameter steps exactly as the whole
#: would). Extend it with :func:`elementwise`.
ELEMENTWISE = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
}


def elementwise(optimizer_class):
    """Declare that ``optimizer_class`` updates each element of a parameter
    from that element's gradient and state alone, so
    ``model.shard_optimizer`` may step slices of parameters with it.
    Returns the class (usable as a decorator)."""
    ELEMENTWISE.add(optimizer_class)
    return optimizer_class


def _groups(params, wrapped, names):
    """The caller's ``params`` (tensors, or dicts of them with options) as
    groups of wrapper parameter indices, checked: each a parameter of the
    wrapper, none twice."""
    index = {id(p): i for i, p in enumerate(wrapped)}
    if params is None:
        params = list(wrapped)
    params = list(params)
    if not params:
        raise ConfigError("shard_optimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    seen = set()
    out = []
    for group in groups:
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(
                "shard_optimizer takes parameters, or dicts of them with options, as torch's optimizers do"
            )
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        indices = []
        for t in tensors:
            i = index.get(id(t))
            if i is None:
                raise ConfigError(
                    "shard_optimizer: a parameter given is not one the wrapper synchronizes (a parameter of another "
                    "model, frozen when wrapped, or ignored): a sharded optimizer steps only the wrapper's parameters"
                )
            if i in seen:
                raise ConfigError(f"shard_optimizer: parameter {names[i]!r} appears in more than one group")
            seen.add(i)
            indices.append(i)
        out.append(({k: v for k, v in group.items() if k != "params"}, indices))
    return out


def _digest(optimizer_class, groups, defaults):
    """What every rank must agree on, as 8 bytes: the class, each group's
    parameters and options, the defaults."""
    text = repr(
        (
            f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
            [(sorted((k, repr(v)) for k, v in options.items()), indices) for options, indices in groups],
            sorted((k, repr(v)) for k, v in defaults.items()),
        )
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class ShardedOptimizer(torch.optim.Optimizer):
    """See the module docs. Build it with ``model.shard_optimizer(...)``:
    ``partition`` is the wrapper's ``_partition.Partition``, ``names`` its
    parameters' names, ``states`` its state group; the remaining arguments
    are those of torch's optimizers (``params`` defaults to every parameter
    the wrapper synchronizes). ``adopt``: an optimizer of ``optimizer_class``
    built over the wrapper's parameters, converted in place to step the
    pieces (its state sliced to them): it becomes :attr:`inner`, so what
    holds it (an LR scheduler, a library's loop) goes on working with it."""

    def __init__(self, partition, names, states, optimizer_class, params=None, *, adopt=None, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ConfigError(f"shard_optimizer needs a torch.optim.Optimizer class, not {optimizer_class!r}")
        if optimizer_class not in ELEMENTWISE:
            raise ConfigError(
                f"{optimizer_class.__qualname__} is not known to update each element from that element's gradient "
                "and state alone, and a sharded optimizer steps slices of parameters; if it does, declare it with "
                "gradsync.torch.elementwise(cls); otherwise train it unsharded"
            )
        self._partition = partition
        self._names = names
        self._states = states
        self._class = optimizer_class
        groups = _groups(params, partition.params, names)
        self._check_same_everywhere(optimizer_class, groups, defaults)
        #: Per group: the wrapper parameter indices it was given with (full-state order).
        self._group_params = [indices for _, indices in groups]
        piece_groups = [{**options, "params": self._held(indices)} for options, indices in groups]
        #: Per piece tensor (by id): its piece.
        self._piece_of = {id(piece.tensor): piece for piece in partition.every_held_piece()}
        full = None
        if adopt is None:
            self.inner = optimizer_class(piece_groups, **defaults)
        else:
            full = adopt.state_dict() if adopt.state else None  # (whole, before its groups change)
            for group, pieces in zip(adopt.param_groups, piece_groups):
                group["params"] = pieces["params"]
            adopt.state.clear()
            self.inner = adopt
        super().__init__(piece_groups, self.inner.defaults)
        # One set of groups and state: the inner optimizer's (schedulers change its groups).
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._consolidated = None
        # The global step hooks (gradsync.torch.ddp) make a step of the inner
        # optimizer a sharded one, however it is called: commit, step, gather.
        self.inner._gradsync_sharded = self
        # While a change of members is settled, the inner optimizer steps without them.
        self._quiet = False
        # A rank out of data (join) steps the last optimizer built, for the others.
        partition.optimizer = weakref.ref(self)
        if adopt is not None:
            # What saves and loads it (a library's checkpointing) gets the whole state, as here.
            adopt.state_dict = self.state_dict
            adopt.load_state_dict = self.load_state_dict
            adopt.consolidate_state_dict = self.consolidate_state_dict
            if full is not None:
                self.load_state_dict(full)

    #: (The global step hooks leave a ShardedOptimizer's own step to its inner optimizer's.)
    _gradsync_facade = True

    def _held(self, indices):
        """The piece tensors of parameters ``indices`` this rank steps: its
        own, then its buddy copies."""
        part = self._partition
        return ([piece.tensor for i in indices for piece in part.of_param.get(i, ())]
                + [piece.tensor for i in indices for piece in part.buddy_of_param.get(i, ())])

    def rebind(self, state):
        """The partition was laid out anew (a change of members, ``_reshard``):
        step its pieces from now on, with ``state`` (piece tensor -> its
        state entry)."""
        for group, indices in zip(self.inner.param_groups, self._group_params):
            group["params"] = self._held(indices)
        self._piece_of = {id(piece.tensor): piece for piece in self._partition.every_held_piece()}
        self.inner.state.clear()
        self.inner.state.update(state)
        self._states = self._partition.states

    def _check_same_everywhere(self, optimizer_class, groups, defaults):
        """Every rank must shard the same optimizer over the same groups
        (each rank steps its part of one whole); else :class:`ConfigError`
        naming the ranks that differ from rank 0."""
        digest = _digest(optimizer_class, groups, defaults)
        every = self._states.everyones([digest])[:, 0].tolist()
        odd = [r for r, d in enumerate(every) if d != every[0]]
        if odd:
            raise ConfigError(
                f"ranks {odd} built a sharded optimizer that differs from rank 0's (its class, parameter groups or "
                "options): every rank steps its part of one optimizer, so every rank must build the same one"
            )

    def __getstate__(self):
        raise TypeError("a ShardedOptimizer holds views of this process's parameters: save state_dict() instead")

    def step(self, closure=None):
        """Step this rank's pieces, then gather every rank's into the
        parameters (every rank must call it, as every rank steps under DDP).
        A ``closure`` (Lightning passes one: forward and backward run inside
        the step) is taken, except in an elastic job: a member lost between
        one rank's step and the others' would leave them apart."""
        if closure is not None and self._partition.recover is not None:
            raise ConfigError("in an elastic job a ShardedOptimizer takes no closure: run forward and backward "
                              "before step()")
        return self.inner.step() if closure is None else self.inner.step(closure)

    def before_step(self):
        """Called by the global step pre-hook before the inner optimizer
        steps. In an elastic job: every member holds the step's averages
        before any steps them (a member lost now leaves no survivor a step
        ahead that the others could not follow, ``_reshard``); a member lost
        here is recovered from, and the step then finds nothing to step."""
        part = self._partition
        if self._quiet or part.settled or part.recover is None:
            return
        try:
            self._states.everyones([1])
        except LOST as error:
            part.recover(error)

    @torch.no_grad()
    def after_step(self):
        """Called by the global step post-hook after the inner optimizer
        stepped: count the step, and gather every rank's pieces into the
        parameters (a member lost here is recovered from in an elastic job)."""
        part = self._partition
        if self._quiet or part.settled:
            return
        if part.pending:
            part.taken += 1
            part.pending = False
        try:
            part.gather()
        except LOST as error:
            if part.recover is None:
                raise
            part.recover(error)

    def zero_grad(self, set_to_none=True):
        """Drop the pieces' gradients (``set_to_none``, the default, also
        hands the step's bucket memory back to the runtime), or zero them."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients of every parameter this optimizer steps by
        their global norm (a collective); returns the norm."""
        params = [self._partition.params[i] for indices in self._group_params for i in indices]
        return self._partition.clip(params, max_norm, norm_type, error_if_nonfinite)

    # ---- full state -----------------------------------------------------------------------

    @torch.no_grad()
    def consolidate_state_dict(self, to=0):
        """Collect the full optimizer state on rank ``to`` (every rank calls
        it; -1: on every rank), for :meth:`state_dict`."""
        full = self._full_state()
        self._consolidated = full if to in (-1, self._partition.rank) else None

    def state_dict(self):
        """The full optimizer state, as the unsharded optimizer's
        ``state_dict()`` would be: per parameter (numbered across groups
        in order) its state tensors whole. Call
        :meth:`consolidate_state_dict` on every rank first."""
        if self._consolidated is None:
            raise ConfigError(
                "a ShardedOptimizer's state is spread over the ranks: call optimizer.consolidate_state_dict(to=R) "
                "on every rank, then state_dict() on rank R (as with torch's ZeroRedundancyOptimizer); HF Trainer: "
                "Trainer(..., callbacks=[gradsync.torch.hf.ShardedCheckpoints()]) does it before each checkpoint"
            )
        return self._consolidated

    def drop_consolidated(self):
        """Free the state :meth:`consolidate_state_dict` collected."""
        self._consolidated = None

    def _full_state(self):
        """Every rank's pieces of every state tensor, gathered per bucket
        into whole parameters: ``{"state": {n: {key: value}}, "param_groups": [...]}``."""
        part = self._partition
        _, number = self._numbering()
        # Which keys the state has, and their types, from every rank (a rank may hold no piece).
        keys = {}
        for piece in part.pieces:
            for key, value in self.inner.state.get(piece.tensor, {}).items():
                keys[key] = value
        spec = sorted((k, _kind(v)) for k, v in keys.items())
        everyone = self._states.all_gather_objects(spec)
        merged = {}
        for rank_spec in everyone:
            for key, kind in rank_spec:
                merged[key] = kind
        state = {}
        for b, layout in enumerate(part.buckets):
            for key, kind in sorted(merged.items()):
                if kind == "scalar":
                    continue
                mine = part.chunk(b, lambda piece: self.inner.state.get(piece.tensor, {}).get(key), torch.float64)
                full = self._states.all_gather(mine)[: layout.numel].split(layout.sizes)
                for i, values in zip(layout.members, full):
                    if i in number:
                        p = part.params[i]
                        like = torch.view_as_real(p.detach()) if p.is_complex() else p.detach()
                        state.setdefault(number[i], {})[key] = values.to(like.dtype).reshape(like.shape).clone()
        present, scalars = self._present_and_scalars(number)
        for n, values in scalars.items():
            state.setdefault(n, {}).update(values)
        state = {n: values for n, values in sorted(state.items()) if n in present}
        return {"state": state, "param_groups": self._groups_by_number(number)}

    def _numbering(self):
        """Wrapper parameter indices in full-state order, and their numbers."""
        numbered = [i for indices in self._group_params for i in indices]
        return numbered, {i: n for n, i in enumerate(numbered)}

    def _present_and_scalars(self, number):
        """Which parameters (by number) have state on some rank (stepped at
        least once), and their scalars (a step count), sent by the rank
        holding each parameter's first piece: the same on every rank (a
        collective)."""
        present, scalars = set(), {}
        for i, pieces in self._partition.of_param.items():
            entry = self.inner.state.get(pieces[0].tensor, {})
            if i not in number or not entry:
                continue
            present.add(number[i])
            if pieces[0].offset == 0:
                for key, value in entry.items():
                    if _kind(value) == "scalar":
                        scalars.setdefault(number[i], {})[key] = value.clone() if torch.is_tensor(value) else value
        for rank_present, rank_scalars in self._states.all_gather_objects((present, scalars)):
            present |= rank_present
            for n, values in rank_scalars.items():
                scalars.setdefault(n, {}).update(values)
        return present, scalars

    def _groups_by_number(self, number):
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": [number[i] for i in indices]}
                for group, indices in zip(self.inner.param_groups, self._group_params)]

    @torch.no_grad()
    def sharded_state_dict(self, template=None):
        """This rank's part of the optimizer state, for
        ``torch.distributed.checkpoint`` (``gradsync.torch.checkpoint``): per
        parameter number, each state tensor as one flat ``ShardedTensor`` of
        the parameter's element count whose shards are every rank's pieces
        (this rank's hold its values), scalars whole; and the parameter
        groups. Every rank calls it (a collective). ``template``: the keys a
        checkpoint holds (number -> key -> DCP metadata), to build an empty
        state of this layout to load into."""
        from gradsync.torch.checkpoint import flat_sharded

        part = self._partition
        numbered, number = self._numbering()
        if template is None:
            present, scalars = self._present_and_scalars(number)
            kinds = {}
            for piece in part.pieces:
                for key, value in self.inner.state.get(piece.tensor, {}).items():
                    kinds[key] = (_kind(value), value.dtype if torch.is_tensor(value) else None)
            merged = {}
            for rank_kinds in self._states.all_gather_objects(kinds):
                merged.update(rank_kinds)
            entries = {
                n: {key: kind for key, kind in merged.items() if key in scalars.get(n, {}) or kind[0] != "scalar"}
                for n in sorted(present)
            }
        else:
            entries = {}
            for n, keys in template.items():
                if n >= len(numbered):
                    raise ConfigError(f"the checkpoint holds optimizer state for parameter {n}; this optimizer steps "
                                      f"{len(numbered)}: it was saved for another model")
                entries[n] = {key: ("scalar" if len(getattr(m, "size", ())) == 0 else "tensor",
                                    getattr(getattr(m, "properties", None), "dtype", None), m)
                              for key, m in keys.items()}
        state = {}
        for n, keys in entries.items():
            i = numbered[n]
            p = part.params[i]
            mine = {piece.offset: piece for piece in part.of_param.get(i, ())}
            out = state[str(n)] = {}
            for key, how in keys.items():
                kind, dtype = how[0], how[1]
                if kind == "scalar":
                    if template is None:
                        out[key] = scalars[n][key]
                    else:
                        meta = how[2]
                        out[key] = torch.zeros(meta.size, dtype=meta.properties.dtype) if hasattr(meta, "size") else 0
                    continue
                pieces = []
                for owner, offset, length in part.every_piece(i):
                    local = None
                    if owner == part.rank:
                        piece = mine[offset]
                        held = self.inner.state.get(piece.tensor, {}).get(key) if template is None else None
                        local = held.reshape(-1) if held is not None else torch.zeros(length, dtype=dtype)
                    pieces.append((owner, offset, length, local))
                out[key] = flat_sharded(pieces, reals(p), dtype, p.device)
        return {"state": state, "param_groups": self._groups_by_number(number)}

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict):
        """Load :meth:`sharded_state_dict`'s form (filled by
        ``torch.distributed.checkpoint.load``): each piece takes its shard."""
        from gradsync.torch.checkpoint import check_layout

        check_layout(state_dict["param_groups"], [len(ix) for ix in self._group_params],
                     [[self._names[i] for i in ix][:3] for ix in self._group_params])
        numbered, _ = self._numbering()
        self.inner.state.clear()
        for n, values in state_dict["state"].items():
            i = numbered[int(n)]
            for piece in self._partition.of_param.get(i, ()):
                entry = {}
                for key, value in values.items():
                    if hasattr(value, "local_shards"):
                        (shard,) = [s for s in value.local_shards() if s.metadata.shard_offsets[0] == piece.offset]
                        entry[key] = shard.tensor.clone().to(piece.tensor.device)
                    else:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
                self.inner.state[piece.tensor] = entry
        for group, saved in zip(self.inner.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self._partition.buddy:
            # The buddy copies (an elastic job) from their owners, who loaded them.
            from gradsync.torch._reshard import settle

            part = self._partition
            settle(part, self._states, part.rank, part.world, mark=False)

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Load a full state (from :meth:`state_dict`, or the unsharded
        optimizer's, over the same parameters in the same groups), on any
        world size: each rank takes its pieces' slices."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(ix) for ix in self._group_params]:
            raise ConfigError(
                "this optimizer state has groups of other sizes than this optimizer's: it was saved for other "
                "parameter groups"
            )
        numbered, _ = self._numbering()
        saved = [n for g in groups for n in g["params"]]
        index_of = dict(zip(saved, numbered))
        inner_state = {}
        for n, values in state_dict["state"].items():
            i = index_of.get(int(n))
            if i is None:
                raise ConfigError(f"optimizer state for parameter {n}, which no group holds")
            p = self._partition.params[i]
            for piece in self._partition.of_param.get(i, []) + self._partition.buddy_of_param.get(i, []):
                entry = {}
                for key, value in values.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        if value.numel() != reals(p):
                            raise ConfigError(
                                f"optimizer state {key!r} of parameter {self._names[i]!r} has {value.numel()} values, "
                                f"the parameter {reals(p)}: it was saved for another model"
                            )
                        flat = (torch.view_as_real(value) if value.is_complex() else value).reshape(-1)
                        entry[key] = flat[piece.offset : piece.offset + piece.length].clone()
                    else:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
                inner_state[piece.tensor] = entry
        for group, saved_group in zip(self.inner.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.inner.state.clear()
        for tensor, entry in inner_state.items():
            device = tensor.device
            self.inner.state[tensor] = {
                k: (v.to(device) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in entry.items()
            }


def _kind(value):
    """``"tensor"`` for per-element state, ``"scalar"`` for the rest (a step count)."""
    return "tensor" if torch.is_tensor(value) and value.dim() > 0 else "scalar"
