"""``ShardedOptimizer``: an optimizer that steps only this rank's partition.

Built by ``model.shard_optimizer(torch.optim.AdamW, lr=...)`` on a wrapper
made with ``shard_gradients=True``. Each rank's optimizer holds state for
its pieces only (``sharding.partition``: the parts of parameters inside its
partition of each bucket), so optimizer memory per rank is about
``1 / world`` of an unsharded one. :meth:`ShardedOptimizer.step`:

1. steps the inner optimizer (the class you named) over this rank's pieces,
   whose ``.grad`` hold the averaged gradients of its partition: the pieces
   are views of the parameters (of contiguous ones; others' pieces read the
   parameter before the step), so the parameters change in place;
2. all-gathers every rank's updated pieces into every rank's parameters,
   so every replica holds the same parameters before the next forward.

After a skipped step (an abort, a lost member) it is a no-op on every rank,
whether or not each rank calls it: no piece holds a gradient and nothing is
gathered. Frozen parameters in the optimizer's groups (``requires_grad=False``,
as ``AdamW(model.parameters())`` over a partly frozen model gives) stay in
its groups as they are and are skipped, as torch's optimizers skip a
parameter without a gradient.

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
such a full state on any world size (``sharding.optim_state``).
"""

import contextlib
import hashlib
import weakref

import torch

from gradsync._errors import ConfigError
from gradsync.torch.sharding import clip as _clip
from gradsync.torch.sharding import optim_state
from gradsync.torch.sharding.norm import LOST
from gradsync.torch.sharding.reshard import settle

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


def _groups(params, wrapped, names, name_of):
    """The caller's ``params`` (tensors, or dicts of them with options) as
    groups of *entries*, checked: each a parameter of the wrapper (its
    index) or a frozen tensor (``requires_grad=False``: it gets no gradient,
    and torch's optimizers skip it; kept as it is), none twice.
    ``name_of(tensor)``: a tensor's name in the module, for errors."""
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
        entries = []
        for t in tensors:
            if id(t) in seen:
                raise ConfigError(f"shard_optimizer: parameter {name_of(t)!r} appears in more than one group")
            seen.add(id(t))
            i = index.get(id(t))
            if i is not None:
                entries.append(i)
            elif not t.requires_grad:
                entries.append(t)
            else:
                raise ConfigError(
                    f"the optimizer steps parameter {name_of(t)!r}, which is not one the wrapper synchronizes (a "
                    "parameter of another model, or one the wrapper was told to ignore) and requires grad: a "
                    "sharded optimizer steps only the wrapper's parameters (and leaves frozen ones alone). For two "
                    "models trained together (a siamese pair, a GAN), wrap one module holding both, or build one "
                    "optimizer per wrapper"
                )
        out.append(({k: v for k, v in group.items() if k != "params"}, entries))
    return out


def _digest(optimizer_class, groups, defaults):
    """What every rank must agree on, as 8 bytes: the class, each group's
    parameters and options, the defaults."""
    text = repr(
        (
            f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
            [(sorted((k, repr(v)) for k, v in options.items()),
              [e if isinstance(e, int) else ("frozen", tuple(e.shape)) for e in entries])
             for options, entries in groups],
            sorted((k, repr(v)) for k, v in defaults.items()),
        )
    )
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class ShardedOptimizer(torch.optim.Optimizer):
    """See the module docs. Build it with ``model.shard_optimizer(...)``:
    ``partition`` is the wrapper's ``sharding.partition.Partition``, ``names`` its
    parameters' names, ``states`` its state group; the remaining arguments
    are those of torch's optimizers (``params`` defaults to every parameter
    the wrapper synchronizes). ``adopt``: an optimizer of ``optimizer_class``
    built over the wrapper's parameters, converted in place to step the
    pieces (its state sliced to them): it becomes :attr:`inner`, so what
    holds it (an LR scheduler, a library's loop) goes on working with it."""

    def __init__(self, partition, names, states, optimizer_class, params=None, *, adopt=None, name_of=None,
                 **defaults):
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
        index = {id(p): i for i, p in enumerate(partition.params)}
        groups = _groups(params, partition.params, names,
                         name_of or (lambda t: names[index[id(t)]] if id(t) in index else "(unnamed)"))
        if partition.start_checks is None:
            self._check_same_everywhere(optimizer_class, groups, defaults)
        else:
            # An elastic job's first members check at their first step boundary,
            # where a member lost meanwhile is recovered from (``Partition.start_checks``).
            partition.start_checks.append(lambda: self._check_same_everywhere(optimizer_class, groups, defaults))
        #: Per group, its entries in torch's numbering: a wrapper parameter
        #: index, or a frozen tensor (kept as it is: it gets no gradient).
        self.entries = [entries for _, entries in groups]
        piece_groups = [{**options, "params": self._held(entries)} for options, entries in groups]
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
        # The step under way follows a skipped step: no collective, no gather (``ShardedStep.stepping``).
        self._noop = False
        # Between before_step and after_step: other ranks' reads of the pieces wait (``sharding.served``).
        self._writing = False
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

    def _held(self, entries):
        """The tensors of ``entries`` this rank steps: the pieces of its own
        partition, then its buddy copies, then the frozen tensors."""
        part = self._partition
        indices = [e for e in entries if isinstance(e, int)]
        return ([piece.tensor for i in indices for piece in part.of_param.get(i, ())]
                + [piece.tensor for i in indices for piece in part.buddy_of_param.get(i, ())]
                + [e for e in entries if not isinstance(e, int)])

    def parameter_indices(self):
        """The wrapper parameters this optimizer steps (their indices)."""
        return {e for entries in self.entries for e in entries if isinstance(e, int)}

    def rebind(self, state):
        """The partition was laid out anew (a change of members, ``sharding.reshard``):
        step its pieces from now on, with ``state`` (piece tensor -> its
        state entry; a frozen tensor's state stays)."""
        frozen = [e for entries in self.entries for e in entries if not isinstance(e, int)]
        kept = {t: self.inner.state[t] for t in frozen if t in self.inner.state}
        for group, entries in zip(self.inner.param_groups, self.entries):
            group["params"] = self._held(entries)
        self.inner.state.clear()
        self.inner.state.update(kept)
        self.inner.state.update(state)
        self._states = self._partition.states

    def _check_same_everywhere(self, optimizer_class, groups, defaults):
        """Every rank must shard the same optimizer over the same groups
        (each rank steps its part of one whole); else :class:`ConfigError`
        naming the ranks that differ from rank 0."""
        digest = _digest(optimizer_class, groups, defaults)
        highest, lowest = self._states.extremes([digest])
        if highest != lowest:  # (then, and only then, a word per rank: to name the ones that differ)
            every = self._states.everyones([digest])[:, 0].tolist()
            odd = [r for r, d in enumerate(every) if d != every[0]]
            raise ConfigError(
                f"ranks {odd} built a sharded optimizer that differs from rank 0's (its class, parameter groups or "
                "options): every rank steps its part of one optimizer, so every rank must build the same one"
            )

    def __getstate__(self):
        """Refused: see the message."""
        raise TypeError("a ShardedOptimizer holds views of this process's parameters: save state_dict() instead")

    def step(self, closure=None):
        """Step this rank's pieces, then gather every rank's into the
        parameters (every rank must call it, as every rank steps under DDP).
        After a skipped step it does nothing, on every rank, whether or not
        each rank calls it. A ``closure`` (Lightning passes one: forward and
        backward run inside the step) is taken, except in an elastic job: a
        member lost between one rank's step and the others' would leave
        them apart."""
        if closure is not None and self._partition.recover is not None:
            raise ConfigError("in an elastic job a ShardedOptimizer takes no closure: run forward and backward "
                              "before step()")
        return self.inner.step() if closure is None else self.inner.step(closure)

    def before_step(self, args=(), kwargs=None):
        """Called by the global step pre-hook (with the step's ``args`` and
        ``kwargs``) before the inner optimizer steps. After a skipped step:
        nothing to do, on any rank (no piece holds a gradient; the gather is
        not made). Otherwise the pieces that hold their values themselves
        read them from the parameters, and in an elastic job every member
        holds the step's averages before any steps them (a member lost now
        leaves no survivor a step ahead that the others could not follow,
        ``sharding.reshard``); a member lost here is recovered from, and the
        step then finds nothing to step. The other ranks' reads of the
        pieces wait from here, or, given a closure (Lightning's: forward and
        backward run inside the step, where a read alone must be answered),
        from the closure's end: returns the step's ``(args, kwargs)`` with
        the closure wrapped so, else ``None``."""
        part = self._partition
        if part.averaged_applied:
            raise ConfigError("optimizer.step() inside ShardedAveragedModel.applied(): the pieces hold the average "
                              "there, not the trained values; step after the block")
        self._noop = part.sharded_step.stepping()
        if self._quiet or self._noop:
            return None
        kwargs = dict(kwargs or {})
        # (``args`` are the step's own: the optimizer first, then the closure if given positionally.)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        changed = None
        if part.served is not None and closure is not None:
            def then_writing():
                try:
                    return closure()
                finally:
                    self._pieces_written_from_here()

            if "closure" in kwargs:
                kwargs["closure"] = then_writing
            else:
                args = (args[0], then_writing, *args[2:])
            changed = (args, kwargs)
        else:
            self._pieces_written_from_here()
        if part.residence is None:  # (released parameters hold nothing to read: the pieces are the values)
            part.refresh()
        if part.sharded_step.settled or part.recover is None:
            return changed
        try:  # (every member holds the averages: one word summed, O(1) bytes a member, not a word per member)
            self._states.reduce(torch.ones(1, dtype=torch.int64), "sum")
        except LOST as error:
            part.recover(error)
        return changed

    def _pieces_written_from_here(self):
        """The other ranks' reads of the pieces wait until the step ends
        (``sharding.served``); once per step."""
        served = self._partition.served
        if served is not None and not self._writing:
            served.writing()
            self._writing = True

    def after_step(self):
        """Called by the global step post-hook after the inner optimizer
        stepped: count the step, and gather every rank's pieces into the
        parameters (a member lost here is recovered from in an elastic job);
        under parameter sharding the next forward gathers them instead, and
        the pieces are served again, at the step taken."""
        try:
            self._after_step()
        finally:
            if self._writing:
                self._writing = False
                self._partition.served.written()

    @torch.no_grad()
    def _after_step(self):
        """:meth:`after_step`'s count and gather."""
        part = self._partition
        if self._quiet or part.sharded_step.settled or self._noop:
            return
        part.sharded_step.stepped()
        part.applied(self.parameter_indices())
        if part.residence is not None:
            return  # parameter sharding: the next forward gathers the pieces
        part.write_owned()
        try:
            part.gather()
        except LOST as error:
            if part.recover is None:
                raise
            part.recover(error)
            return
        part.sharded_step.gathered()

    def zero_grad(self, set_to_none=True):
        """Drop the pieces' gradients (``set_to_none``, the default, also
        hands the step's bucket memory back to the runtime), or zero them."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients of every parameter this optimizer steps by
        their global norm (a collective); returns the norm."""
        return self._partition.clip(self.parameter_indices(), max_norm, norm_type, error_if_nonfinite)

    # ---- the whole and the sharded state (``sharding.optim_state``) ---------------------------------

    def consolidate_state_dict(self, to=0):
        """Collect the full optimizer state on rank ``to`` (every rank calls
        it; -1: on every rank), for :meth:`state_dict`."""
        full = optim_state.full_state(self)
        self._consolidated = full if to in (-1, self._partition.rank) else None

    def state_dict(self):
        """The full optimizer state, as the unsharded optimizer's
        ``state_dict()`` would be: per parameter (numbered across groups
        in order) its state tensors whole. Call
        :meth:`consolidate_state_dict` on every rank first; under parameter
        sharding any rank may call it alone instead (every rank's state read
        from its piece server, ``sharding.served``)."""
        served = self._partition.served
        if self._consolidated is None and served is not None and served.serves:
            return optim_state.full_state_alone(self)  # (parameter sharding: any rank alone, sharding.served)
        if self._consolidated is None:
            raise ConfigError(
                "a ShardedOptimizer's state is spread over the ranks: call optimizer.consolidate_state_dict(to=R) "
                "on every rank, then state_dict() on rank R (as with torch's ZeroRedundancyOptimizer), or save it "
                "sharded with gradsync.torch.checkpoint.save (HF Trainer's checkpoints do the first by themselves)"
            )
        return self._consolidated

    def drop_consolidated(self):
        """Free the state :meth:`consolidate_state_dict` collected."""
        self._consolidated = None

    def load_state_dict(self, state_dict):
        """Load a full state (from :meth:`state_dict`, or the unsharded
        optimizer's, over the same parameters in the same groups), on any
        world size: each rank takes its pieces' slices."""
        if self._partition.served is not None:
            self._partition.served.everyone_read("optimizer.load_state_dict()")
        with self._loading_state():
            optim_state.load_full(self, state_dict)

    @contextlib.contextmanager
    def _loading_state(self):
        """Within the block the state is loaded (every rank loads): no other
        rank's read copies the pieces' state meanwhile; after it the new
        state tensors are served, at the pieces' next version (``sharding.served``)."""
        served = self._partition.served
        with self._partition.writing_pieces():
            yield
            if served is not None:
                served.register()
        if served is not None:
            served.wrote()

    def sharded_state_dict(self, template=None, group=None):
        """This rank's part of the state for ``torch.distributed.checkpoint``
        (``gradsync.torch.checkpoint``; a collective, see ``sharding.optim_state``),
        its shards placed by rank of ``group`` (the wrapper's
        ``torch_group()``; ``None``: torch's default group)."""
        return optim_state.sharded_state_dict(self, template, group)

    def load_sharded_state_dict(self, state_dict, copy=True):
        """Load :meth:`sharded_state_dict`'s form (filled by
        ``torch.distributed.checkpoint.load``): each piece takes its shard
        (a copy; not ``copy``: the shard's own tensor, for a state dict
        built to be loaded once, as ``gradsync.torch.checkpoint`` builds
        it); in an elastic job the buddy copies then come from their owners."""
        with self._loading_state():
            optim_state.load_sharded(self, state_dict, copy=copy)
            part = self._partition
            if part.buddy:  # (inside: the buddy copies it writes are served at the load's version)
                settle(part, self._states, part.rank, part.world, mark=False)


def converted(optimizer):
    """``optimizer``'s ``ShardedOptimizer`` if it is one or was converted to
    one, else ``None`` (nothing is converted)."""
    if getattr(optimizer, "_gradsync_facade", False):
        return optimizer
    return getattr(optimizer, "_gradsync_sharded", None)


def sharded_optimizer_of(optimizer, wrapper=None):
    """The ``ShardedOptimizer`` that steps ``optimizer`` (a torch optimizer):
    the one it was converted to, or, if it steps parameters of a sharded
    wrapper (``wrapper``, or any live one), a new conversion; ``None`` for
    an optimizer of no sharded wrapper."""
    sharded = converted(optimizer)
    if sharded is not None:
        return sharded
    owners = [wrapper] if wrapper is not None else _clip.live()
    owners = [w for w in owners if w._partition is not None]
    if not owners:
        return None  # (every step of an unsharded job comes here: no parameter list built)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owners = [w for w in owners if w._holds_any(params)]
    if not owners:
        return None
    if len(owners) > 1:
        raise ConfigError("one optimizer steps the parameters of several sharded wrappers: build one per model")
    partition = owners[0]._partition
    index = partition.index_of
    stale = partition.applied_again({index[id(p)] for p in params if id(p) in index})
    if stale:
        raise ConfigError(
            f"a new optimizer's first step over parameters {stale[:3]}{' and more' if len(stale) > 3 else ''}, "
            "whose sharded gradients still hold what an earlier optimizer step applied: the averages live in this "
            "rank's pieces, which an optimizer reaches from its first step on, so its zero_grad() before that "
            "cleared nothing and this step would apply them again. Keep one optimizer for the model, clear the "
            "gradients through the wrapper (model.zero_grad()) before the backward, or build the optimizer "
            "with model.shard_optimizer(...)"
        )
    return owners[0]._take_over(optimizer)
