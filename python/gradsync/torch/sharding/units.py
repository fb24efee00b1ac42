"""Parameter sharding by units: whole parameters only while a unit's forward or backward needs them.

A *unit* is a group of modules whose parameters are gathered together:
by default every block of the model's largest ``ModuleList`` or
``Sequential`` (a transformer's layers), or the modules the program lists
(``shard_parameters=[block, ...]``), as ``fully_shard`` is applied per
block; the *root unit* holds every parameter no listed module holds
(embeddings, the final norm, the head). A bucket never holds two units'
parameters (the runtime's plan cuts at a unit's edge), so a unit's gather
is whole buckets. Each rank keeps its pieces of every parameter
(``Layout(own_all=True)``) and::

    the wrapper's forward begins ─▶ the root unit gathered; whole until the step ends
    a unit's forward begins  ─▶ every other unit nothing holds released; this one gathered
                                (with the units whose weights it shares); the next one's
                                round started (a prefetch, by the last step's order)
    its backward begins      ─▶ gathered again (a hook on its outputs' gradients), held
    its backward ends        ─▶ the hold goes (a hook on its inputs' gradients)
    a forward recomputed inside backward (checkpointing) is held until its unit's backward ends
    the step ends            ─▶ every rank serves the others' last rounds, then every parameter released

A unit stays whole after its forward or backward until another unit is
needed, so the modules of a block never called itself (a ``ModuleDict``,
whose submodules carry the hooks) share one gather. Counts (forwards
running, backwards held, recomputations) decide a release, so a unit
called twice, recomputed once or twice, or sharing a weight with another
is never freed while anything still needs it.

**Rounds, so that no rank's own forward can hang the others.** Which
unit is whole, which round gathers what and when a unit is released is
the runtime's residency protocol (``gradsync._native.Residency``, a state
machine in Rust with its specification tests there): the hooks here
report events (a unit's forward begins or ends, its backward begins or
ends, the step ends) and carry out its commands one at a time (release a
unit, post a round's words, start and finish its gathers, wait for
reductions). Gathers run on the gather lane (``gradsync._native.Lane``: a
communicator of its own, so they never queue behind the step's
reductions). Each gather is part of a *round*: every rank sends the units
it needs now (one word per unit, and one saying it serves), the words are
summed, and every rank gathers the union in unit order, keeping what it
asked for. A rank opens a round only when a unit it needs is not whole
(or to prefetch one); a rank whose step ended (or an evaluation, or an
abort) *serves*: it joins rounds asking for nothing until every rank
serves. Each rank's rounds pair one for one, so a module used on some
ranks only, unused parameters, tied weights across units or one rank's
out-of-memory error all end in the same rounds on every rank (here unit 3
runs on rank 1 only)::

    rank 0: round {1} ─ round {2} ─ serve: round {} ─ round {}      ─▶ the step's result
    rank 1: round {1} ─ round {2} ─ round {3}       ─ serve: round {} ─▶ the step's result
    round 3 gathers unit 3 on both ranks (rank 0 keeps nothing of it); in round 4 every rank serves

A step's end is asked of the runtime first (its remaining buckets
launched: ``Session.begin_finish``), then the rank serves, then it
collects the step's result: so a peer's reductions never wait for a rank
that serves.

**Reductions a backward starts behind** (``buckets_in_flight=k``;
unless set, 1 on a CUDA device and 0 elsewhere): before a unit's
backward, the rank waits until at most ``k`` of the step's buckets are
still in their reduction, so earlier units' whole buckets are freed
before this one's fill (less memory, less overlap). A bucket in flight
may wait for a peer that needs this rank in a round first (a unit used
on some ranks only), so the waiting rank *polls*: it posts a round asking
for nothing and waits for whichever comes first, the round's sum (a peer
asked: it gathers with it, then waits on) or its reductions. No timer
ends a wait: each ends because what it waits for happened.

Between its uses a unit's parameters are empty tensors (a stray read of
their values raises, naming the parameter: ``sharding.released``), and
the storage they had is resized to nothing (as FSDP does): the tensors autograd saved of them (a transposed
weight) share it, so a release really frees it, and the gather before
backward grows the same storage back and refills it (under
``_unsafe_preserve_version_counter``: autograd sees the tensor it saved).
Code that reads parameters outside their unit's forward and backward (a
penalty over every weight) belongs in the model's forward, or between
steps in ``model.whole_parameters()``.
"""

import zlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradsync._errors import ConfigError, StepFailedError
from gradsync._native import Residency
from gradsync.torch.sharding.layout import flat_values
from gradsync.torch.sharding.norm import LOST
from gradsync.torch.sharding.parameters import ShardedParameters
from gradsync.torch.sharding.released import held, mark_whole
from gradsync.torch.sharding.unit_modules import BackwardEnds, ModuleHook, Unit, entries

#: How long one look at the lane or the reductions lasts while a rank waits
#: for whichever of the two comes first (seconds): a poll's tick, not a
#: deadline (the wait goes on until one of them comes).
TICK_S = 0.002

#: How long a rank looks, once, whether its reductions settled before it
#: polls (seconds): the answer of a scheduler that has it at hand.
GLANCE_S = 0.0002


class UnitResidence(ShardedParameters):
    """``ShardedParameters`` gathered a unit at a time (see the module
    docs). ``units``: each parameter's unit (``choose``); ``modules``: the
    listed modules, unit ``u`` is ``modules[u - 1]``; ``model``: the
    wrapped module (its modules holding root parameters are hooked too).
    It gathers on the lane it takes (:meth:`take_lane`) once the wrapper's
    hooks exist."""

    def __init__(self, partition, units, names, modules, model):
        super().__init__(partition)
        #: The gather lane (``sharding.gather.LaneGather``).
        self.lane = None
        self.units = [Unit(u, name) for u, name in enumerate(names)]
        for i, u in enumerate(units):
            self.units[u].params.append(i)
        for b, layout in enumerate(partition.buckets):
            self.units[units[layout.members[0]]].buckets.append(b)
        index = {id(p): i for i, p in enumerate(partition.params)}
        for unit, m in zip(self.units[1:], modules):
            for p in m.parameters():
                owner = units[index[id(p)]] if id(p) in index else unit.index
                if owner not in unit.needs:
                    unit.needs.append(owner)
        #: The residency protocol: what is whole, what each round gathers.
        self.protocol = Residency(list(names), [u.needs for u in self.units], partition.world)
        #: Per parameter: the bytes of its storage when whole (to regrow it).
        self._nbytes = [0] * len(partition.params)
        #: Per parameter released inside the step: its emptied whole tensor,
        #: whose storage grows back before its backward (``None``: none).
        self._kept = [None] * len(partition.params)
        #: Whether the round under way allocates in the parameters' own
        #: dtype (``assemble_all``), not their step dtype.
        self._exact = False
        #: Called after every round that gathered (a benchmark's memory sample), or ``None``.
        self.after_round = None
        #: ``buckets_in_flight``: before a unit's backward, wait until at most
        #: this many of the step's buckets are still in their reduction
        #: (``None``: no wait). Set by :meth:`pace`.
        self.in_flight = None
        #: ``fn(most, within_s) -> bool``: whether at most ``most`` buckets are in
        #: their reduction, asked for ``within_s`` (:meth:`pace`).
        self.await_in_flight = None
        #: The gathers the lane started (``LaneGather.start``'s flight), or ``None``.
        self._flight = None
        #: A failure posting the round's words, answered when its sum is awaited.
        self._post_failed = None
        #: Whether the wrapper's forward is running (from its assemble to its end).
        self._forwarding = False
        #: Whether the forward running is an evaluation this rank runs alone
        #: (:meth:`assemble_alone`): its units are read from the piece servers.
        self._alone = False
        self._handles = []
        for unit, m in zip(self.units[1:], modules):
            for entry in entries(m):
                self._handles.append(
                    entry.register_forward_pre_hook(ModuleHook(self._before_forward(unit)), with_kwargs=True))
                self._handles.append(entry.register_forward_hook(ModuleHook(self._after_forward(unit))))
        in_units = {id(sub) for m in modules for sub in m.modules()}
        root = {id(partition.params[i]) for i in self.units[0].params}
        for m in model.modules():
            if id(m) not in in_units and any(id(p) in root for p in m._parameters.values() if p is not None):
                self._handles.append(m.register_forward_pre_hook(ModuleHook(_outside_compile(self._root_needed))))

    def pace(self, pacing, await_in_flight):
        """How the units pace their gathers and a backward's waits:
        ``pacing``: ``(buckets_in_flight, prefetch_units)``
        (``sharding.settings.pacing_of``); ``await_in_flight(most, within_s)
        -> bool``: whether at most ``most`` of the step's buckets are in
        their reduction, asked for ``within_s`` (``ModelSync.await_in_flight``)."""
        self.in_flight, self.prefetch = pacing
        self.await_in_flight = await_in_flight

    @property
    def prefetch(self):
        """Whether the next unit (by the last step's order) is gathered
        while the current one computes (``prefetch_units``)."""
        return self.protocol.prefetch

    @prefetch.setter
    def prefetch(self, on):
        self.protocol.set_prefetch(bool(on))

    @property
    def counts(self):
        """What the gathers did since the wrapper was built, for tests and
        benchmarks: rounds joined (serving included), gathers of each unit
        kept by this rank, the most units but the root whole at once, the
        rounds opened ahead of the unit's use (prefetches), and the rounds
        joined while waiting for reductions (polls)."""
        rounds, gathers, most_whole, prefetched, polls = self.protocol.counts()
        return {"rounds": rounds, "gathers": gathers, "most_whole": most_whole, "prefetched": prefetched,
                "polls": polls}

    # ---- what the wrapper calls -------------------------------------------------------------

    def take_lane(self, lane):
        """Gather on ``lane`` (``sharding.gather.LaneGather``, the current
        members') from now on, after :meth:`agree` on it; the earlier lane,
        if any, is stopped and returned (its group must outlive any wait
        on a vanished peer)."""
        earlier, self.lane = self.lane, lane
        if earlier is not None:
            earlier.close()
        self.agree()
        return earlier

    def agree(self):
        """Check on the lane, once, that every rank cut the model into the
        same units (the rounds' words mean units; a rank with others would
        gather other buckets): :class:`ConfigError` on every rank if not."""
        digest = zlib.crc32(repr([(u.name, len(u.params), u.buckets) for u in self.units]).encode())
        mine = [len(self.units), len(self.units) ** 2, digest, digest * digest]
        world = self._partition.world
        summed = self.lane.needs(mine)
        if summed != [world * w % (1 << 64) for w in mine]:
            raise ConfigError(
                f"rank {self._partition.rank}: the ranks cut the model into different units for shard_parameters "
                f"(this rank: {[u.name for u in self.units[1:]]}); give every rank the same modules (or True)"
            )

    @torch.no_grad()
    def assemble(self):
        """The wrapper's forward begins: the root unit gathered (kept whole
        until the step ends). Returns whether it gathered."""
        if self.whole:
            return False
        if self.gathered:
            raise ConfigError(
                "this rank's parameters could not all be read back in this step's gathers (out of memory most "
                "likely); the other ranks went on. Call model.abort_step() and go on with the next step"
            )
        if self.protocol.state(0) == "whole":
            return False
        self.protocol.assemble()
        self._drive()
        return True

    def assemble_alone(self):
        """An evaluation forward this rank runs alone (``evaluates_alone``):
        the root unit read from every rank's piece server now, each other
        unit as its forward begins, released as it ends; no round, nothing
        asked of the other ranks' training threads. Returns ``True``."""
        self._alone = True
        self._read_alone_units([0])
        return True

    def _read_alone_units(self, units):
        """The parameters of ``units`` not whole yet, read alone."""
        params = self._partition.params
        self.read_alone([i for u in units for i in self.units[u].params if not held(params[i]).numel()])

    @torch.no_grad()
    def assemble_all(self):
        """Every unit whole in its own dtype (``whole_parameters``): one
        round asking for all (a unit whole in its step dtype is released
        first, to be gathered exact)."""
        for unit in self.units:
            if self.protocol.state(unit.index) != "released" and any(self.rounded(i) for i in unit.params):
                for i in unit.params:
                    self._released(i)
                self.protocol.released(unit.index)
        self._exact = True
        try:
            self.protocol.assemble_all()
            self._drive()
        finally:
            self._exact = False
        self.whole = True

    @torch.no_grad()
    def release(self, step_ended=True):
        """The step (or, not ``step_ended``, an evaluation or
        ``whole_parameters``) ended: serve the others' last rounds, the
        pieces of whole units read their parameters, then every parameter
        is an empty tensor. A step's order of units is what the next step
        prefetches by. A step that ends inside the wrapper's forward (manual
        optimization: a backward and ``optimizer.step()`` in it) leaves the
        root unit to be gathered again where its modules run next."""
        if not step_ended:
            self._forwarding = False
        if self._alone:  # (an evaluation alone: nothing to serve, nothing to read back)
            self._alone = False
            super().release(step_ended)
            return
        self.serve()
        part = self._partition
        whole_units = range(len(self.units)) if self.whole else self.protocol.whole_units()
        # (After a failed gather the whole units hold zeros, never read back.)
        whole = {i for u in whole_units if self.broken is None for i in self.units[u].params}
        for piece in part.owned:
            if piece.param in whole and held(part.params[piece.param]).numel() and not self.rounded(piece.param):
                values = flat_values(part.params[piece.param])
                piece.tensor.copy_(values[piece.offset : piece.offset + piece.length])
        self.protocol.reset(step_ended)
        for i in range(len(part.params)):
            self._empty(i, inside_step=False)
        self._kept = [None] * len(part.params)
        self.whole = self.gathered = False
        self.hook_again()

    def take_part(self):
        """This rank aborts its step: nothing yet; it serves the others'
        rounds once its zeros went out (:meth:`serve`, from the step's end)."""

    def serve(self):
        """Join rounds asking for nothing until every rank serves (once per
        step: every rank does it where its step ends, after asking the
        runtime to end it)."""
        self.protocol.serve()
        self._drive()

    def shadow(self, send_zeros):
        """This rank ran out of data (``join``) and shadows one step of the
        others: ``send_zeros()`` sends its zeros for the step first (so the
        others' reductions never wait for it), then it serves that step's
        rounds, whatever its own last step left."""
        send_zeros()
        self.protocol.serve_again()
        self._drive()

    def forget(self):
        """After a failed step's reset (every rank): the lane starts a new
        epoch and nothing is owed to anyone's rounds."""
        self._flight = self._post_failed = None
        self.lane.reset()
        self.protocol.forget()
        self.release(step_ended=False)

    def discard(self):
        """The members settled after a change (``sharding.reshard``), on a
        new lane: every unit released without reading it back (the pieces
        hold the new layout's values), nothing owed to anyone's rounds."""
        self._flight = self._post_failed = None
        self.protocol.settled(self._partition.world)
        self._kept = [None] * len(self._partition.params)
        super().discard()

    def remove_hooks(self):
        """Take the units' hooks off their modules (the wrapper closed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forward_begins(self):
        """The wrapper's forward begins (whether or not it gathers)."""
        self._forwarding = True

    def forward_ended(self):
        """The wrapper's forward returned: the units nothing holds are
        released. Inside ``whole_parameters()`` nothing is (the block holds
        every unit; its hooks told the protocol of no forward either)."""
        self._forwarding = False
        if self.whole:
            return
        self.protocol.forward_ended()
        self._drive()

    def _root_needed(self, module, args):
        """A module holding root parameters is called: inside the wrapper's
        forward, after a step ended in it (manual optimization: backward
        and ``optimizer.step()`` inside, Lightning's GAN recipe), the root
        unit is released and is gathered again here, with the values the
        optimizer just stepped. Elsewhere nothing (a read of a released
        parameter raises, naming it)."""
        if self._forwarding and not self.whole and not self._alone and self.protocol.state(0) == "released":
            self.protocol.assemble()
            self._drive()

    # ---- hooks --------------------------------------------------------------------------------

    def _before_forward(self, unit):
        def hook(module, args, kwargs):
            if self.whole:
                return None
            if self._alone:
                self._read_alone_units(unit.needs)
                return None
            # Recomputed inside backward (checkpointing): held until the unit's backward ends.
            call = self.protocol.forward_begins(unit.index, torch._C._current_graph_task_id() != -1)
            self._drive()
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not at:
                return None  # (its backward's end is not seen: it is released at the step's end)
            through = BackwardEnds.apply(lambda: self.protocol.backward_ends(call), *[flat[i] for i in at])
            for i, t in zip(at, through):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return _outside_compile(hook)

    def _after_forward(self, unit):
        def hook(module, args, output):
            if self.whole:
                return None
            if self._alone:
                for i in (i for u in unit.needs if u != 0 for i in self.units[u].params):
                    self._empty(i, inside_step=False)
                return None
            call = self.protocol.forward_ends(unit.index, torch._C._current_graph_task_id() != -1)
            if call is None or not torch.is_grad_enabled():
                return None
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._before_backward(call))
            return None
        return _outside_compile(hook)

    def _before_backward(self, call):
        def hook(grad):
            if not self.whole:
                self.protocol.backward_begins(call, self.in_flight)
                self._drive()
            return grad
        return _outside_compile(hook)

    # ---- the driver: the protocol's commands carried out -------------------------------------

    @torch.no_grad()
    def _drive(self):
        """Carry out the protocol's commands until none is left (see
        ``gradsync._native.Residency`` for what each means)."""
        protocol = self.protocol
        while (command := protocol.next_command()) is not None:
            kind = command[0]
            if kind == "release":
                for i in self.units[command[1]].params:
                    self._empty(i, inside_step=True)
            elif kind == "post":
                try:
                    self.lane.post(command[1])
                except LOST as error:
                    self._post_failed = error
            elif kind == "await_sum":
                self._answer_sum(None)
            elif kind == "await_sum_or_reductions":
                self._answer_sum(command[1])
            elif kind == "await_reductions":
                _, most, patient = command
                protocol.answer("settled", bool(self.await_in_flight(most, TICK_S if patient else GLANCE_S)))
            elif kind == "gather":
                self._start(command[1])
            elif kind == "finish_gather":
                self._finish(command[1])
            elif kind == "zeros":
                self._zeros(command[1])
            else:
                raise AssertionError(f"the residency protocol sent {command!r}, which this driver does not know")

    def _answer_sum(self, most):
        """The posted round's sum, or (``most`` not ``None``) the reductions
        settled to at most ``most`` in flight, whichever comes first."""
        error, self._post_failed = self._post_failed, None
        try:
            if error is not None:
                raise error
            while True:
                summed = self.lane.sum_within(TICK_S if most is not None else 1.0)
                if summed is not None:
                    self.protocol.answer("sum", summed)
                    return
                if most is not None and self.await_in_flight(most, TICK_S):
                    self.protocol.answer("settled", True)
                    return
        except LOST as error:
            self._lost(error)

    def _start(self, asked):
        """Start the round's gathers: every bucket of the ``asked`` units."""
        buckets = [b for u in asked for b in self.units[u].buckets]
        try:
            self._flight = self.lane.start(self._partition, buckets, None if self._exact else self.carries)
        except LOST as error:
            self._lost(error)
            return
        self.protocol.answer("started")

    def _finish(self, keep):
        """Wait for the started gathers; what this rank keeps allocated and
        read back. An out-of-memory error while allocating is raised after
        the round completes (every rank's gathers go on)."""
        wanted = {b for u in keep for b in self.units[u].buckets}
        failure = None

        def before_unpack(b):
            nonlocal failure
            if b in wanted and failure is None:
                try:
                    self._allocate(b)
                except torch.OutOfMemoryError as error:  # the round still completes on every rank
                    failure = error
            return b in wanted and failure is None

        flight, self._flight = self._flight, None
        try:
            self.lane.finish(flight, before_unpack, self._partition.unpack)
        except LOST as error:
            self._lost(error)
            return
        if failure is not None:
            self.protocol.answer("out_of_memory")
            self.gathered = True  # (assemble refuses until abort_step)
            raise failure
        self.protocol.answer("gathered")
        if self.after_round is not None:
            self.after_round()

    def _zeros(self, keep):
        """A gather failed in this epoch: what this rank needs allocated
        and left zeros (its gradients of the step are never summed)."""
        if self._exact:
            raise StepFailedError(f"the parameters could not be gathered whole: {self.broken}")
        self.spoiled = True
        for u in keep:
            for b in self.units[u].buckets:
                self._allocate(b, zeros=True)

    def _lost(self, error):
        """A collective of the lane failed: the protocol is told (no round
        makes a collective again in this epoch), then, outside an elastic
        job or for ``whole_parameters``, it is raised (``lost``)."""
        self.protocol.answer("lost")
        self.lost(error, self._exact)

    def _allocate(self, b, zeros=False):
        """Bucket ``b``'s parameters given their memory again: the storage a
        release inside the step emptied grows back to its size (the tensors
        autograd saved of the parameter see it again), else a new one;
        ``zeros``: filled with zeros (a gather that failed)."""
        part = self._partition
        for i in part.buckets[b].members:
            p, kept = part.params[i], self._kept[i]
            if held(p).numel():
                continue
            if kept is not None and not self._exact:
                kept.untyped_storage().resize_(self._nbytes[i])
                mark_whole(p)
                p.data = kept
            else:
                self._new_whole(i, self._exact)
                self._nbytes[i] = p.untyped_storage().nbytes()
            if zeros:
                held(p).zero_()

    def _empty(self, i, inside_step):
        """Parameter ``i`` released: an empty tensor. ``inside_step``: its
        storage is emptied too (freed, though autograd's saved tensors hold
        it) and remembered, to grow back before its backward; between steps
        it is only let go (a state dict taken before may still read it)."""
        if not held(self._partition.params[i]).numel():
            return
        whole = self._released(i)
        if inside_step:
            whole.untyped_storage().resize_(0)
            self._kept[i] = whole


def _outside_compile(hook):
    """``hook`` run as it is where a compiled module calls it (a block
    compiled after wrapping, as torchtitan compiles its layers): dynamo
    never traces it (its calls into the runtime are not tensor code, and
    tracing them compiled one graph per state it saw), so the block's graph
    is the same as unsharded, between the hooks."""
    return torch.compiler.disable(hook, recursive=True)
