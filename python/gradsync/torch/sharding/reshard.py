"""A sharded model through a change of members (an elastic job with
``shard_gradients=True`` or ``shard_parameters=True``): nothing of the
optimizer or of the parameters is lost, and every survivor ends on the
same step.

Each rank keeps its own partition of every bucket and its *buddy's* (the
partition of the rank ``buddy_stride`` on, which the roster picks on
another node when the job spans several; ``sharding.partition``), and steps both
every step, so every partition lives on two ranks, and on two nodes. When the members change (a rank lost, a replacement
admitted), :func:`settle` runs on every member of the new group, inside the
wrapper's ``reconfigure`` (before the runtime agrees on the step to go on
at), on the new group's state group:

1. **Where each stands**: which layout each member holds (its old rank and
   world; a replacement holds none), how many optimizer steps it took,
   whether it holds this step's averages not stepped yet, and the step's
   clipping, in a few reductions (``sharding.standing``: O(1) words a member,
   and a bitmap of the old ranks held). The step's optimizer update starts only after every
   member confirmed it holds the step's averages (``ShardedOptimizer.step``),
   so either nobody stepped, or every member not yet stepped holds what it
   needs to:

   * some stepped: the others step now (clipped by the same coefficient);
   * nobody stepped, every member holds the averages: every one steps now
     (the clipping norm, if it was not known yet, computed here);
   * nobody stepped and some never got the averages (their backward failed
     and skipped the step): the step is dropped where it was pending (the
     elastic job counts it unapplied), so every survivor skips it.

2. **The move**: every element of every bucket has a *source*, a member that
   holds it (its owner first, else the owner's buddy); each source sends
   the parameters' values and optimizer state of its runs (and, with a
   ``ShardedAveragedModel``, their averages: one more kind of state), bit for bit,
   point to point to the members whose new partition or new buddy
   partition they fall in (:func:`transfers`), each message after the
   kinds of state of the parameters it carries, so each member sends and
   receives what it holds, about ``2/world`` of the model, not the model;
   every member keeps the state of its new partition and new buddy
   partition, and with unsharded parameters gathers each bucket's new
   partitions into its parameters (repairing an all-gather the loss cut
   short). Under parameter sharding (``shard_parameters=True``) the
   parameters are released and the pieces hold their values: each member
   writes its new pieces (its own and its buddy's) instead, and its next
   forward gathers. An element no member holds (a rank and its buddy lost
   together) is a :class:`gradsync.MembershipError`: the shard is lost.

After a settlement the step's remaining collectives (clip, optimizer step,
gather) are not made (``ShardedStep.settled``), unless the runtime reduces the
failed step again among the survivors (partial policy): then the step goes
on as usual, in the new layout.
"""

import torch

from gradsync._errors import MembershipError
from gradsync._native import held_ranges
from gradsync._native import partition as partition_of
from gradsync._native import sources
from gradsync.torch.sharding.layout import write_values
from gradsync.torch.sharding.norm import norm_of
from gradsync.torch.sharding.optim_state import kind_of
from gradsync.torch.sharding.standing import places_of, survey


def runs(numel, everyone):
    """Bucket of ``numel`` values: ``[(lo, hi, source)]`` covering it, each
    source a member (index into ``everyone``: its old place and buddy
    stride) holding ``[lo, hi)``: an owner first (the first member in
    order), else a buddy; ``None`` where no member holds it. The runtime's
    rule (``gradsync._native.sources``: one sweep, ``O(world log world)``
    a bucket)."""
    return sources(numel, places_of(everyone))


class Sources:
    """Where each value of every bucket comes from in one change of members
    (``places``: every member's old place, :func:`~gradsync.torch.sharding.standing.places_of`),
    by the rule of :func:`runs`: an owner first, else a buddy.

    When every member that holds a layout holds the same one (an old world
    and stride: every change but a member caught between two), an old
    partition's source is its old owner if it is a member, else the
    holder of its buddy copy (the old rank ``stride`` before it): a table
    of the members by old rank, built once (``O(world)``), answers each
    question about a bucket from the few old partitions it spans, so a
    member's work per bucket is that of the values it holds, whatever the
    world. Mixed layouts are swept per bucket (:func:`runs`), as every
    layout is with ``sweep`` (the tests' reference)."""

    def __init__(self, places, sweep=False):
        self._places = places
        held = {place[1:] for place in places if place is not None}
        #: The old layout every holder holds, ``(world, stride)``; ``None``: mixed, swept.
        self._held = next(iter(held)) if len(held) == 1 and not sweep else None
        #: Member by old rank (the first in member order, as the rule says).
        self._member_of = {}
        for member, place in enumerate(places):
            if place is not None:
                self._member_of.setdefault(place[0], member)
        #: The old partitions no member holds (uniform layouts).
        self._lost = [] if self._held is None else [p for p in range(self._held[0]) if self._source(p) is None]
        #: The swept runs by bucket size (mixed layouts).
        self._swept = {}

    def _source(self, p):
        """The member holding old partition ``p`` (uniform layouts), or ``None``."""
        owner = self._member_of.get(p)
        world, stride = self._held
        holder = (p - stride) % world
        if owner is None and stride > 0 and holder != p:
            return self._member_of.get(holder)
        return owner

    def _runs(self, numel):
        if numel not in self._swept:
            self._swept[numel] = sources(numel, self._places)
        return self._swept[numel]

    def runs_over(self, numel, lo, hi):
        """The runs ``[(a, b, source)]`` covering ``[lo, hi)`` of a bucket of
        ``numel`` values, neighbours with one source merged."""
        out = []
        if lo >= hi:
            return out
        if self._held is None:
            found = [(max(a, lo), min(b, hi), m) for a, b, m in self._runs(numel) if max(a, lo) < min(b, hi)]
        else:
            world = self._held[0]
            chunk = partition_of(numel, 0, world)[1]
            found = []
            for p in range(lo // chunk, min(world, (hi - 1) // chunk + 1)):
                a, b = partition_of(numel, p, world)
                if max(a, lo) < min(b, hi):
                    found.append((max(a, lo), min(b, hi), self._source(p)))
        for a, b, m in found:
            if out and out[-1][1] == a and out[-1][2] == m:
                out[-1] = (out[-1][0], b, m)
            else:
                out.append((a, b, m))
        return out

    def sourced_by(self, numel, member):
        """The ranges ``[(lo, hi)]`` of a bucket of ``numel`` values whose
        source is ``member``, in order, neighbours merged: its old
        partition, and its buddy copy where the owner is gone."""
        if self._held is None:
            return _merged([(a, b) for a, b, m in self._runs(numel) if m == member])
        place = self._places[member]
        if place is None:
            return []
        world, stride = self._held
        olds = sorted({place[0], (place[0] + stride) % world} if stride > 0 else {place[0]})
        ranges = [partition_of(numel, p, world) for p in olds if self._source(p) == member]
        return _merged([(lo, hi) for lo, hi in ranges if lo < hi])

    def lost(self, numel):
        """The first value of a bucket of ``numel`` values that no member
        holds, or ``None``."""
        if self._held is None:
            return next((a for a, _, m in self._runs(numel) if m is None), None)
        for p in self._lost:
            a, b = partition_of(numel, p, self._held[0])
            if a < b:
                return a
        return None


def _merged(spans):
    """``spans`` (sorted ``(lo, hi)``) with neighbours joined."""
    out = []
    for lo, hi in spans:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _values(pieces, lo, hi, value_of):
    """Values ``[lo, hi)`` of a bucket from ``pieces`` of it (which cover
    that range), each ``value_of(piece)`` or zeros, as float64."""
    out = torch.zeros(hi - lo, dtype=torch.float64)
    for piece in pieces:
        a, b = max(lo, piece.start), min(hi, piece.start + piece.length)
        if a < b:
            value = value_of(piece)
            if value is not None:
                out[a - lo : b - lo].copy_(value.reshape(-1)[a - piece.start : b - piece.start])
    return out


def _kinds_in(pieces, spans, kinds):
    """The state kinds (``kinds``: parameter -> :func:`_entry_kinds`) of
    the parameters whose ``pieces`` of a bucket overlap ``spans``."""
    params = {p.param for p in pieces for lo, hi in spans if max(lo, p.start) < min(hi, p.start + p.length)}
    return {i: kinds[i] for i in sorted(params) if i in kinds}


def _tensor_keys(entries):
    """The tensor states' keys among ``entries`` (each a parameter's
    :func:`_entry_kinds`), sorted: the rows of a message after its values."""
    return sorted({k for entry in entries for k, (kind, _) in entry.items() if kind == "tensor"})


def _write_gathered(part, states, b, numel, members, held):
    """Bucket ``b``'s parameters whole on every member (unsharded
    parameters): each member's new partition of it (its own pieces'
    values, ``held``: rows by piece) gathered from every member in rank
    order, one all-gather per bucket."""
    lo, hi = partition_of(numel, part.rank, part.world)
    chunk = partition_of(numel, 0, part.world)[1]
    mine = torch.zeros(chunk, dtype=torch.float64)
    for piece in part.of_bucket.get(b, ()):
        mine[piece.start - lo : piece.start - lo + piece.length] = held[id(piece)][0]
    whole = states.all_gather(mine)[:numel]
    sizes = [part.reals(part.params[i]) for i in members]
    for i, values in zip(members, whole.split(sizes)):
        write_values(part.params[i], values)


def _entry_kinds(entry):
    """A state entry's keys: ``("tensor", dtype)`` or ``("scalar", value)``."""
    out = {}
    for key, value in entry.items():
        if kind_of(value) == "tensor":
            out[key] = ("tensor", str(value.dtype).removeprefix("torch."))
        else:
            out[key] = ("scalar", value.clone() if torch.is_tensor(value) else value)
    return out


@torch.no_grad()
def settle(part, states, rank, world, mark=True, buddy_stride=None):
    """Settle a change of members for ``part`` (a ``sharding.partition.Partition``,
    its optimizer built): this process is now ``rank`` of ``world`` on
    ``states`` (the new state group), keeping buddy copies ``buddy_stride``
    ranks on (``None``: the same stride). Every member calls it (collectives).
    Returns whether this rank dropped a step it had applied (its elastic
    job counts it unapplied). ``mark``: the step's remaining collectives are
    not made (a change of members; not for a refresh of the buddy copies
    after a load)."""
    optimizer = part.optimizer() if part.optimizer is not None else None
    if optimizer is None:
        raise MembershipError.of(
            "broken", "a sharded elastic job changed members before its optimizer was built: build it with "
            "model.shard_optimizer(...) right after wrapping"
        )
    step = part.sharded_step
    standing = survey(part, states, rank, world)
    plan = part.plan
    layout = Sources(standing.places)
    lost = [(b, layout.lost(numel)) for b, (numel, _) in enumerate(plan)]
    lost = [(b, lo) for b, lo in lost if lo is not None]
    if lost:
        b, lo = lost[0]
        world_then, stride = standing.layout_held()
        owner = next(r for r in range(world_then) if partition_of(plan[b][0], r, world_then)[0] <= lo
                     < partition_of(plan[b][0], r, world_then)[1])
        raise MembershipError.of(
            "shard_lost",
            f"ranks {sorted({owner, (owner - stride) % world_then})} of the last membership (of {world_then}) were "
            f"lost together, and with them both copies of partition {owner} of the optimizer state (each partition "
            f"lives on its rank and on the rank {stride} before it, on another node when the job has several): the "
            "job cannot go on from memory; restart it from the last sharded checkpoint "
            "(gradsync.torch.checkpoint.save/load)",
        )
    dropped, taken = _settle_step(part, optimizer, states, rank, standing, layout)
    averages = [a for a in (ref() for ref in part.averaged) if a is not None]
    for k, averaged in enumerate(averages):  # (their pieces' averages ride the move as more kinds of state)
        averaged.lend(optimizer.inner.state, states, f"gradsync.average.{k}")
    _move(part, optimizer, states, rank, world, layout, buddy_stride)
    for averaged in averages:
        averaged.settled(optimizer.inner.state, states, standing.places)
    step.settled_at(taken, latch=mark)
    return dropped


def _settle_step(part, optimizer, states, rank, standing, layout):
    """Step 1 of the module docs: every holder ends on the same optimizer
    step, from the members' ``standing`` (``sharding.standing``). Returns
    whether this rank dropped its pending step, and the optimizer steps
    every holder has now taken."""
    top, behind = standing.top, standing.behind
    if standing.apart:
        raise MembershipError.of(
            "broken", "the survivors stand more than one optimizer step apart, or one stepped while another never "
            "received the step's averages: this should not happen; report it, with the log of every rank"
        )
    step = part.sharded_step
    if not behind and not standing.ready:
        # Nobody stepped, and some never got the averages: nobody steps.
        dropped = step.holds and step.pending
        if dropped:
            part.clear()
        return dropped, top
    # Some stepped, or every holder can: the step is taken everywhere, clipped alike.
    mine_clipped = step.clipped is not None
    wanted, coef = None, None
    if standing.clipped:
        (total, coef), (_, _, indices) = standing.clipped
        step.settlement_clipped((total, coef))
        wanted = set(indices)
    elif standing.asked:
        max_norm, norm_type, indices = standing.asked
        wanted = set(indices)
        grads = []
        for b, (numel, _) in enumerate(part.plan):
            pieces = part.held_of_bucket.get(b, ())
            for lo, hi in layout.sourced_by(numel, rank):
                grads.append(_values(pieces, lo, hi, lambda p: p.tensor.grad if p.param in wanted else None))
        total = float(norm_of(grads, norm_type, lambda local, op: states.reduce(local.reshape(1).cpu(), op)[0]))
        coef = min(max_norm / (total + 1e-6), 1.0)
        step.settlement_clipped((total, coef))
    if step.holds and step.pending:
        if coef is not None and not mine_clipped:
            part.scale(wanted, coef)
        optimizer._quiet = True  # (no commit, no gather: the settlement moves the parameters)
        if part.residence is None:  # (sharded parameters: the pieces are the values)
            part.refresh()
        try:
            optimizer.inner.step()
        finally:
            optimizer._quiet = False
        if part.residence is None:
            part.write_owned()
        step.settlement_stepped()
    # (Laggards stepped up to those ahead; with nobody ahead, every holder stepped.)
    return False, top if behind else top + 1


def transfers(numel, layout, rank, world, stride):
    """What ``rank`` of the new ``world`` (buddies ``stride`` on) sends and
    receives of a bucket of ``numel`` values whose sources ``layout`` (a
    :class:`Sources`) says: ``(sends, receives)``, each
    ``{member: [(lo, hi), ...]}`` by ``lo``, neighbours merged, ``sends`` to the members whose
    new partitions (their own or their buddy's) cover values this rank is
    the source of, ``receives`` from the sources of this rank's new
    partitions (itself included: what it keeps). Every member derives every
    pair's list the same way, so a send and its receive agree without a
    word; each member moves what it holds, not the model.

    The members a run goes to are found by arithmetic on the partitions
    (chunks in rank order; partition ``q``'s buddy holder is ``q - stride``),
    and the sources of this rank's values by ``layout``'s table, not by a
    look at every member's layout: a member's work and messages are those
    of the values it holds, whatever the world."""
    chunk = partition_of(numel, 0, world)[1]
    sends, receives = {}, {}
    if chunk == 0:
        return sends, receives
    for a, b, _ in held_ranges(numel, rank, world, stride):
        for lo, hi, source in layout.runs_over(numel, a, b):
            receives.setdefault(source, []).append((lo, hi))
    for lo, hi in layout.sourced_by(numel, rank):
        for q in range(lo // chunk, min(world, (hi - 1) // chunk + 1)):
            a, b = partition_of(numel, q, world)
            if max(lo, a) >= min(hi, b):
                continue
            holders = {q} | ({(q - stride) % world} if stride > 0 else set())
            for member in holders:
                sends.setdefault(member, []).append((max(lo, a), min(hi, b)))
    for lists in (sends, receives):
        for member in lists:
            lists[member] = _merged(sorted(lists[member]))
    return sends, receives


def _move(part, optimizer, states, rank, world, layout, buddy_stride):
    """Step 2 of the module docs: the new holders of each partition get
    its parameters' values and optimizer state, point to point from the
    values' sources (:func:`transfers`: each member sends and receives what
    it holds, O(model / world), in a few messages per bucket); with
    unsharded parameters (``shard_gradients=True``) every member then
    gathers each bucket's new partitions into its whole parameters
    (repairing an all-gather the loss cut short). ``part`` is laid out for
    ``rank`` of ``world``, buddies ``buddy_stride`` on."""
    old = part.held_of_bucket  # (the layout being left: lay_out below builds new dicts)
    state = optimizer.inner.state
    # Which of the parameters this member holds have optimizer state, of
    # which kinds (the same on every holder after step 1): each message
    # carries the kinds of the parameters it carries, so no member reads
    # every member's (a word list per member: O(world) a member).
    mine = {}
    for piece in part.every_held_piece():
        entry = state.get(piece.tensor)
        if part.sharded_step.holds and entry and piece.param not in mine:
            mine[piece.param] = _entry_kinds(entry)
    # Sharded parameters are released: the new pieces are written from the sources' below.
    sharded_parameters = part.residence is not None
    part.lay_out(rank, world, buddy_stride, read=not sharded_parameters)
    fresh = {}
    for b, (numel, members) in enumerate(part.plan):
        sends, receives = transfers(numel, layout, rank, world, part.buddy_stride)
        pieces_then = old.get(b, ())
        kinds_out = {m: _kinds_in(pieces_then, spans, mine) for m, spans in sends.items()}
        kinds_in = states.exchange_objects({m: k for m, k in kinds_out.items() if m != rank},
                                           [m for m in receives if m != rank], tag=b)
        if rank in receives:
            kinds_in[rank] = kinds_out[rank]
        keys_out = {m: _tensor_keys(k.values()) for m, k in kinds_out.items()}
        keys_in = {m: _tensor_keys(k.values()) for m, k in kinds_in.items()}

        def rows_of(lo, hi, keys):
            return torch.stack([_values(pieces_then, lo, hi, lambda p: p.tensor)]
                               + [_values(pieces_then, lo, hi, lambda p, k=k: state.get(p.tensor, {}).get(k))
                                  for k in keys])

        outgoing = {m: torch.cat([rows_of(lo, hi, keys_out[m]) for lo, hi in spans], dim=1)
                    for m, spans in sends.items()}
        incoming = {m: torch.empty(1 + len(keys_in[m]), sum(hi - lo for lo, hi in spans), dtype=torch.float64)
                    for m, spans in receives.items() if m != rank}
        states.exchange({m: t for m, t in outgoing.items() if m != rank}, incoming, tag=b)
        if rank in receives:
            incoming[rank] = outgoing[rank]
        got = {}  # (lo, hi) -> (rows of the values there, each row's name: None for the values, else a state key)
        kinds = {}  # parameter -> its state's kinds, from the messages that carried it
        for m, spans in receives.items():
            kinds.update(kinds_in[m])
            names, at = [None, *keys_in[m]], 0
            for lo, hi in spans:
                got[(lo, hi)] = (incoming[m][:, at : at + hi - lo], names)
                at += hi - lo

        def new_rows(piece, names):
            out = torch.zeros(len(names), piece.length, dtype=torch.float64)
            for (lo, hi), (data, their_names) in got.items():
                a, z = max(lo, piece.start), min(hi, piece.start + piece.length)
                if a < z:
                    rows = [their_names.index(name) if name in their_names else None for name in names]
                    for row, theirs in enumerate(rows):
                        if theirs is not None:
                            out[row, a - piece.start : z - piece.start] = data[theirs, a - lo : z - lo]
            return out

        new_pieces = part.held_of_bucket.get(b, ())
        names_of = {id(piece): [None, *_tensor_keys([kinds.get(piece.param, {})])] for piece in new_pieces}
        held = {id(piece): new_rows(piece, names_of[id(piece)]) for piece in new_pieces}
        if sharded_parameters:
            for piece in new_pieces:
                piece.tensor.copy_(held[id(piece)][0])
        else:
            _write_gathered(part, states, b, numel, members, held)
        for piece in new_pieces:
            if piece.param not in kinds:
                continue
            entry = {}
            for key, (kind, value) in kinds[piece.param].items():
                if kind == "tensor":
                    row = held[id(piece)][names_of[id(piece)].index(key)]
                    entry[key] = row.to(getattr(torch, value)).to(piece.tensor.device).clone()
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            fresh[piece.tensor] = entry
    part.states = states
    optimizer.rebind(fresh)
