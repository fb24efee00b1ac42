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

**Rounds, so that no rank's own forward can hang the others.** Gathers
run on the gather lane (``gradsync._native.Lane``: a communicator of its
own, so they never queue behind the step's reductions). Each gather is
part of a *round*: every rank sends the units it needs now (one word per
unit), the words are summed, and every rank gathers the union in unit
order, keeping what it asked for. A rank opens a round only when a unit
it needs is not whole (or to prefetch one); a rank at its step's end (or
an evaluation's end, or an abort) *serves*: it joins rounds asking for
nothing until a round where nobody asks for anything. Each rank's rounds
pair one for one, so a module used on some ranks only, unused parameters,
tied weights across units or one rank's out-of-memory error all end in
the same rounds on every rank (here unit 3 runs on rank 1 only)::

    rank 0: round {1} ─ round {2} ─ serve: round {} ─ round {} ─▶ the step's collectives
    rank 1: round {1} ─ round {2} ─ round {3}       ─ serve: round {} ─▶ the step's collectives
    round 3 gathers unit 3 on both ranks (rank 0 keeps nothing of it); in round 4 nobody asks

**Reductions a backward starts behind** (``buckets_in_flight=k``;
unless set, 1 on a CUDA device and 0 elsewhere): before a unit's
backward, the rank waits until at most ``k`` of the step's buckets are
still in their reduction, so earlier units' whole buckets are freed
before this one's fill (less memory, less overlap). The wait is bounded (:data:`IN_FLIGHT_WAIT_S`): a bucket in
flight may wait for a peer that needs this rank in a round first (a unit
used on some ranks only). A wait that runs out means this program's
graph differs across ranks, where every wait could run out again, so the
rank stops waiting for the rest of the job (and says so once).

Between its uses a unit's parameters are empty tensors (a stray read gets
nothing, never freed memory), and the storage they had is resized to
nothing (as FSDP does): the tensors autograd saved of them (a transposed
weight) share it, so a release really frees it, and the gather before
backward grows the same storage back and refills it (under
``_unsafe_preserve_version_counter``: autograd sees the tensor it saved).
Code that reads parameters outside their unit's forward and backward (a
penalty over every weight) belongs in the model's forward, or between
steps in ``model.whole_parameters()``.
"""

import logging
import zlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradsync._errors import ConfigError, StepFailedError
from gradsync.torch.sharding.layout import flat_values
from gradsync.torch.sharding.norm import LOST
from gradsync.torch.sharding.parameters import ShardedParameters
from gradsync.torch.sharding.unit_modules import BackwardEnds, Call, Unit, entries

log = logging.getLogger("gradsync.torch")

#: The longest a unit's backward waits for earlier buckets' reductions under
#: ``buckets_in_flight`` (seconds). A reduction in flight completes within
#: milliseconds unless a peer holds it up; a peer that needs this rank in a
#: gather round first is the one case it cannot complete, and the wait
#: ending keeps that case from hanging.
IN_FLIGHT_WAIT_S = 2.0


class UnitResidence(ShardedParameters):
    """``ShardedParameters`` gathered a unit at a time (see the module
    docs). ``units``: each parameter's unit (``choose``); ``modules``: the
    listed modules, unit ``u`` is ``modules[u - 1]``. Its :attr:`lane` is
    set by the wrapper once its hooks exist."""

    def __init__(self, partition, units, names, modules):
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
        #: Per parameter: the bytes of its storage when whole (to regrow it).
        self._nbytes = [0] * len(partition.params)
        #: Per parameter released inside the step: its emptied whole tensor,
        #: whose storage grows back before its backward (``None``: none).
        self._kept = [None] * len(partition.params)
        #: Whether this rank served the others' rounds since the last release.
        self._served = False
        #: Whether the round under way allocates in the parameters' own
        #: dtype (``assemble_all``), not their step dtype.
        self._exact = False
        #: What the gathers did since the wrapper was built, for tests and
        #: benchmarks: rounds joined (serving included), gathers of each
        #: unit kept by this rank, the most units but the root whole at
        #: once, and the rounds opened ahead of the unit's use (prefetches).
        #: ``in_flight_waits`` counts the waits for buckets in flight, and
        #: ``in_flight_waits_expired`` those that ran out (:data:`IN_FLIGHT_WAIT_S`).
        self.counts = {"rounds": 0, "gathers": [0] * len(self.units), "most_whole": 0, "prefetched": 0,
                       "in_flight_waits": 0, "in_flight_waits_expired": 0}
        #: Called after every round that gathered (a benchmark's memory sample), or ``None``.
        self.after_round = None
        #: Whether the next unit (by the last step's order) is gathered
        #: while the current one computes.
        self.prefetch = True
        #: ``buckets_in_flight``: before a unit's backward, wait until at most
        #: this many of the step's buckets are still in their reduction
        #: (``None``: no wait; also after a wait ran out). Set with :attr:`await_in_flight`.
        self.in_flight = None
        #: ``fn(most, within_s) -> bool``: the session's bounded wait
        #: (``Session.await_in_flight``); ``False`` when it ran out.
        self.await_in_flight = None
        #: The units this rank needed in this step, in order; the last step's.
        self._order, self._learned = [], []
        #: The prefetch round in flight (``_open``'s), or ``None``.
        self._prefetching = None
        self._handles = []
        for unit, m in zip(self.units[1:], modules):
            for entry in entries(m):
                self._handles.append(entry.register_forward_pre_hook(self._before_forward(unit), with_kwargs=True))
                self._handles.append(entry.register_forward_hook(self._after_forward(unit)))

    # ---- what the wrapper calls -------------------------------------------------------------

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
        until the step ends), or, when gradsync was asked for every
        parameter whole (``gathered`` cleared by ``whole_parameters``),
        every unit. Returns whether it gathered."""
        if self.whole:
            return False
        if self.gathered:
            raise ConfigError(
                "this rank's parameters could not all be read back in this step's gathers (out of memory most "
                "likely); the other ranks went on. Call model.abort_step() and go on with the next step"
            )
        root = self.units[0]
        if root.whole:
            return False
        self._round({u for u in root.needs if not self.units[u].whole})
        with torch.no_grad():
            self._prefetch()
        return True

    @torch.no_grad()
    def assemble_all(self):
        """Every unit whole in its own dtype (``whole_parameters``): one
        round asking for all (a unit whole in its step dtype is released
        first, to be gathered exact)."""
        for unit in self.units:
            if unit.whole and any(self.rounded(i) for i in unit.params):
                for i in unit.params:
                    self._released(i)
                unit.whole = False
        self._exact = True
        try:
            self._round({u.index for u in self.units if not u.whole}, everything=True)
        finally:
            self._exact = False
        self.whole = True

    @torch.no_grad()
    def release(self, step_ended=True):
        """The step (or, not ``step_ended``, an evaluation or
        ``whole_parameters``) ended: serve the others' last rounds, the
        pieces of whole units read their parameters, then every parameter
        is an empty tensor. A step's order of units is what the next step
        prefetches by."""
        self.serve()
        self._finish_prefetch()
        if step_ended and self._order:
            self._learned = self._order
        self._order = []
        part = self._partition
        # (After a failed gather the whole units hold zeros, never read back.)
        whole = {i for unit in self.units if (unit.whole or self.whole) and self.broken is None for i in unit.params}
        for piece in part.owned:
            if piece.param in whole and part.params[piece.param].numel() and not self.rounded(piece.param):
                values = flat_values(part.params[piece.param])
                piece.tensor.copy_(values[piece.offset : piece.offset + piece.length])
        for unit in self.units:
            unit.whole, unit.forwards, unit.holds, unit.calls, unit.recomputes = False, 0, [], [], []
            unit.reserved = False
        for i in range(len(part.params)):
            self._empty(i, inside_step=False)
        self._kept = [None] * len(part.params)
        self.whole = self.gathered = self._served = False
        self.hook_again()

    def take_part(self):
        """This rank aborts its step: it serves the others' rounds."""
        self.serve()

    def serve(self):
        """Join rounds asking for nothing until nobody asks for anything
        (once per step: every rank does it where its step ends)."""
        if self._served or self._partition.world == 1:
            return
        self._served = True
        while self._round(set(), serving=True):
            pass

    def shadow(self, send_zeros):
        """This rank ran out of data (``join``) and shadows one step of the
        others: ``send_zeros()`` sends its zeros for the step first (the
        rounds run on their own lane, and a peer's unit may wait for its
        reductions before the rounds go on: ``buckets_in_flight``), then it
        serves that step's rounds, whatever its own last step left."""
        send_zeros()
        self._served = False
        self.serve()

    def forget(self):
        """After a failed step's reset (every rank): the lane starts a new
        epoch and nothing is owed to anyone's rounds."""
        self._prefetching = None
        self.lane.reset()
        self._served = True
        self.release(step_ended=False)

    def discard(self):
        """The members settled after a change (``sharding.reshard``), on a
        new lane: every unit released without reading it back (the pieces
        hold the new layout's values), nothing owed to anyone's rounds."""
        self._prefetching = None
        self._order = []
        for unit in self.units:
            unit.whole, unit.forwards, unit.holds, unit.calls, unit.recomputes = False, 0, [], [], []
            unit.reserved = False
        self._kept = [None] * len(self._partition.params)
        super().discard()
        self._served = True

    def remove_hooks(self):
        """Take the units' hooks off their modules (the wrapper closed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- hooks --------------------------------------------------------------------------------

    def _before_forward(self, unit):
        def hook(module, args, kwargs):
            if self.whole:
                return None
            self._ensure(unit)
            call = Call(unit, recompute=torch._C._current_graph_task_id() != -1)
            if call.recompute:
                # Recomputed inside backward (checkpointing): held until the
                # unit's backward ends; a non-reentrant checkpoint may stop
                # the recomputation early, so its forward's end is not waited for.
                self._hold(call)
                unit.recomputes.append(call)
            else:
                for u in unit.needs:
                    self.units[u].forwards += 1
                unit.calls.append(call)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not at:
                return None  # (its backward's end is not seen: it is released at the step's end)
            through = BackwardEnds.apply(lambda: self._after_backward(call), *[flat[i] for i in at])
            for i, t in zip(at, through):
                flat[i] = t
            return tree_unflatten(flat, spec)
        return hook

    def _after_forward(self, unit):
        def hook(module, args, output):
            if self.whole:
                return None
            if torch._C._current_graph_task_id() != -1:
                call = unit.recomputes.pop() if unit.recomputes else None
            else:
                call = unit.calls.pop() if unit.calls else None
                if call is not None:
                    for u in unit.needs:
                        self.units[u].forwards -= 1
            if call is None:
                return None
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled():
                for t in outputs:
                    t.register_hook(self._before_backward(call))
            return None
        return hook

    def _before_backward(self, call):
        def hook(grad):
            if not self.whole:
                if self.in_flight is not None and not any(c is call for c in call.unit.holds):
                    self._wait_for_reductions()
                self._ensure(call.unit)
                self._hold(call)
            return grad
        return hook

    def _wait_for_reductions(self):
        """A unit's backward is about to begin (its first output gradient):
        wait until at most :attr:`in_flight` of the step's buckets are still
        in their reduction, so the whole buckets of earlier units are freed
        before this one's fill (``buckets_in_flight``). The wait is bounded
        (:data:`IN_FLIGHT_WAIT_S`): a bucket in flight here may be waiting
        for a peer whose forward took another path and who needs this rank
        in a round first. Then this rank goes on, and waits no more in this
        job: such a graph would make it wait out the bound again."""
        self.counts["in_flight_waits"] += 1
        if not self.await_in_flight(self.in_flight, IN_FLIGHT_WAIT_S):
            self.counts["in_flight_waits_expired"] += 1
            log.warning("buckets_in_flight=%d: a unit's backward waited %g s for earlier buckets' reductions and "
                        "went on: a peer is likely waiting for this rank's gathers (a module used on some ranks "
                        "only). This rank no longer waits, and holds more whole buckets while reductions lag; "
                        "set buckets_in_flight=None to skip this first wait", self.in_flight, IN_FLIGHT_WAIT_S)
            self.in_flight = None

    def _after_backward(self, call):
        """A forward's backward ended (its inputs' gradients are computed):
        its hold goes, and with it every hold of the unit's recomputations
        (their saved tensors were read by now)."""
        unit = call.unit
        for u in unit.needs:
            held = self.units[u].holds
            held[:] = [c for c in held if c is not call and not (c.recompute and c.unit is unit)]
        unit.recomputes.clear()

    def forward_ended(self):
        """The wrapper's forward returned: the units nothing holds are released."""
        self._release_unused(range(1, len(self.units)))

    def _ensure(self, unit):
        """``unit`` and the units it shares weights with whole (a round if
        one is not), after every other unit nothing holds is released: a
        unit stays whole after its forward or backward until another unit
        is needed (so the modules of a block that is never called itself,
        a ``ModuleDict``, share one gather)."""
        with torch.no_grad():
            self._finish_prefetch()
            self._release_unused(u for u in range(1, len(self.units)) if u not in unit.needs)
            missing = {u for u in unit.needs if not self.units[u].whole}
            if missing:
                self._round(missing)
            for u in unit.needs:
                self.units[u].reserved = False
            self._order.append(unit.index)
            self._prefetch()

    def _hold(self, call):
        """``call``'s backward needs its units whole until it ends."""
        for u in call.unit.needs:
            held = self.units[u].holds
            if not any(c is call for c in held):
                held.append(call)

    # ---- gathering and releasing -------------------------------------------------------------

    def _round(self, wanted, serving=False, everything=False):
        """One round (see the module docs): ``wanted`` units asked for, the
        union of every rank's gathered; those this rank wanted kept whole
        (``everything``: all of them, for ``whole_parameters``). Returns
        whether anybody asked for anything."""
        flight = self._open(wanted, serving)
        if flight is None:
            return False
        self._close(flight, everything)
        return True

    def _open(self, wanted, serving=False):
        """A round's first half: the needs summed, every unit any rank asked
        for started on the lane (after a prefetch in flight is finished:
        one round at a time). ``None`` when nobody asked for anything."""
        self._finish_prefetch()
        if not serving:
            self._served = False
        if self.broken is None:
            try:
                counts = self.lane.needs([1 if u.index in wanted else 0 for u in self.units])
                asked = [u for u, count in zip(self.units, counts) if count]
                if not asked:
                    return None
                flight = self.lane.start(self._partition, [b for u in asked for b in u.buckets],
                                         None if self._exact else self.carries)
                return (asked, set(wanted), flight)
            except LOST as error:
                self.lost(error, self._exact)
        # A gather failed in this epoch (``broken``): no collective; what is wanted is left zeros.
        if self._exact and wanted:
            raise StepFailedError(f"the parameters could not be gathered whole: {self.broken}")
        asked = [u for u in self.units if u.index in wanted]
        return (asked, set(wanted), None) if asked else None

    def _close(self, opened, everything=False):
        """A round's second half: each gather waited for; what this rank
        asked for allocated, read back and whole. An out-of-memory error
        while allocating is raised after the round completes (every rank's
        gathers go on)."""
        asked, wanted, flight = opened
        keep = {b for u in asked if u.index in wanted and not u.whole for b in u.buckets}
        failure = None

        def before_unpack(b):
            nonlocal failure
            if b in keep and failure is None:
                try:
                    self._allocate(b)
                except torch.OutOfMemoryError as error:  # the round still completes on every rank
                    failure = error
            return b in keep and failure is None

        if flight is not None:
            try:
                self.lane.finish(flight, self._partition, before_unpack)
            except LOST as error:
                self.lost(error, self._exact)
        if self.broken is not None and keep:  # (what was not read back is left zeros)
            self.spoiled = True
            for b in sorted(keep):
                if failure is None and not all(self._partition.params[i].numel()
                                               for i in self._partition.buckets[b].members):
                    before_unpack(b)
                    for i in self._partition.buckets[b].members:
                        self._partition.params[i].data.zero_()
        if failure is not None:
            self.gathered = True  # (assemble refuses until abort_step)
            raise failure
        for u in asked:
            if u.index in wanted:
                u.whole = True
                self.counts["gathers"][u.index] += 1
        self.counts["rounds"] += 1
        if self.after_round is not None:
            self.after_round()
        if not everything:
            whole = sum(u.whole for u in self.units[1:])
            self.counts["most_whole"] = max(self.counts["most_whole"], whole)

    def _prefetch(self):
        """Start the round of the unit this rank will need next, by the
        order of the last step (it computes meanwhile). Nothing when the
        step so far left that order, or the next unit is whole."""
        if not self.prefetch or self._prefetching is not None:
            return
        at = len(self._order)
        if at >= len(self._learned) or self._order != self._learned[:at]:
            return
        unit = self.units[self._learned[at]]
        missing = {u for u in unit.needs if not self.units[u].whole}
        if not missing:
            return
        for u in missing:
            self.units[u].reserved = True
        self._prefetching = self._open(missing)
        self.counts["prefetched"] += 1

    def _finish_prefetch(self):
        """The prefetch in flight, if any, waited for and read back."""
        opened, self._prefetching = self._prefetching, None
        if opened is not None:
            self._close(opened)

    def _allocate(self, b):
        """Bucket ``b``'s parameters given their memory again: the storage a
        release inside the step emptied grows back to its size (the tensors
        autograd saved of the parameter see it again), else a new one."""
        part = self._partition
        for i in part.buckets[b].members:
            p, kept = part.params[i], self._kept[i]
            if p.numel():
                continue
            if kept is not None and not self._exact:
                kept.untyped_storage().resize_(self._nbytes[i])
                p.data = kept
            else:
                self._new_whole(i, self._exact)
                self._nbytes[i] = p.untyped_storage().nbytes()

    def _empty(self, i, inside_step):
        """Parameter ``i`` released: an empty tensor. ``inside_step``: its
        storage is emptied too (freed, though autograd's saved tensors hold
        it) and remembered, to grow back before its backward; between steps
        it is only let go (a state dict taken before may still read it)."""
        if not self._partition.params[i].numel():
            return
        whole = self._released(i)
        if inside_step:
            whole.untyped_storage().resize_(0)
            self._kept[i] = whole

    def _release_unused(self, indices):
        """Release the units among ``indices`` nothing holds any more (never
        the root before the step's end)."""
        for u in indices:
            unit = self.units[u]
            if u == 0 or not unit.whole or unit.forwards > 0 or unit.holds or unit.reserved:
                continue
            for i in unit.params:
                self._empty(i, inside_step=True)
            unit.whole = False
