"""Model states shared by the replicas: parameters at construction, buffers
before each forward, everything at the end of a ``Join``.

These broadcasts run on the program's thread, on a gloo group of their own
(:class:`StateBroadcast`), so they never interleave with the collectives of
gradsync's communicator thread.

The buffer broadcast before a forward does not make its root wait for the
receivers (DDP's does, until gloo's timeout, when they never come): a loop in which
rank 0 alone evaluates through the wrapper while the others wait at a
barrier sends rank 0's buffers then, and the others take them before their
next forward (their previous forward was a synchronized one, rank 0's was
not, so each rank makes the same number of broadcasts). The root keeps the
message and its work until the receivers took it (:meth:`StateBroadcast.send`).
"""

import datetime
import hashlib
import pickle
import time

import torch
import torch.distributed as dist

from gradsync._errors import MembershipError
from gradsync.torch._comm import gloo_group

# A value past any digest or rank (for the extremes of the ranks that pass nothing).
_FAR = 2**62
# How long a wait spins on a collective before it sleeps between looks.
_SPIN_S = 0.0002
_NAP_S = 0.001


def _pickled(value):
    """``value`` pickled, as a flat uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


def _unpickled(data):
    """What :func:`_pickled` made ``data`` of."""
    return pickle.loads(data.numpy().tobytes())


class StateBroadcast:
    """Broadcasts of model states among ``world`` ranks on a private gloo group.

    ``abandon``: called while a collective waits; a text it returns (an
    elastic job's membership epoch broke: a member went silent) ends the
    wait with :class:`Abandoned` instead of waiting out gloo's timeout."""

    def __init__(self, store, prefix, rank, world, timeout_s, abandon=None):
        self._rank = rank
        self._world = world
        self._abandon = abandon
        states = dist.PrefixStore(f"{prefix}/states", store)
        if abandon is not None and world > 1:
            meet(states, rank, world, timeout_s, abandon)
        self._group = gloo_group(states, rank, world, datetime.timedelta(seconds=timeout_s))
        # Broadcasts this rank sent as root and did not wait for: (work, message),
        # oldest first; the message must live until the receivers took it.
        self._sent = []

    def _wait(self, work):
        if self._abandon is not None:
            began = time.monotonic()
            while not work.is_completed():
                why = self._abandon()
                if why:
                    raise Abandoned(why)
                if time.monotonic() - began > _SPIN_S:
                    time.sleep(_NAP_S)
        work.wait()

    def broadcast(self, tensors, root=0):
        """Rank ``root``'s values into ``tensors`` on every rank, as one
        message of their raw bytes. A broadcast does no arithmetic, so every
        dtype travels bit for bit; a message of values would promote mixed
        dtypes (an int64 buffer sent as float32 loses its low bits above 2**24)."""
        self._broadcast(tensors, root, wait_as_root=True)

    def send(self, tensors, root=0):
        """:meth:`broadcast`, except that the root does not wait for the
        receivers (see the module docs): its values are its own already, and
        the receivers take the message at their next broadcast. A send still
        untaken when a later one finds it failed raises that failure."""
        self._broadcast(tensors, root, wait_as_root=False)

    def _broadcast(self, tensors, root, wait_as_root):
        if self._world == 1 or not tensors:
            return
        self._reap()
        parts = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors]
        message = torch.cat(parts)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        work = self._group.broadcast([message], opts)
        if self._rank == root and not wait_as_root:
            self._sent.append((work, message))
            return
        self._wait(work)
        with torch.no_grad():
            for t, part in zip(tensors, message.split([p.numel() for p in parts])):
                # Written through a byte view of the destination: a slice of
                # the message may sit at an offset its dtype cannot view.
                dst = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                dst.view(-1).view(torch.uint8).copy_(part)
                if dst is not t:
                    t.copy_(dst)

    def _reap(self):
        """Forget the sends the receivers took; raise the failure of one
        that failed (gloo's timeout: a rank never made the matching broadcast)."""
        while self._sent and self._sent[0][0].is_completed():
            work, _message = self._sent.pop(0)
            try:
                work.wait()
            except RuntimeError as error:
                raise RuntimeError(
                    f"gradsync: rank {self._rank} sent its buffers before a forward and no rank took them before "
                    "the timeout; every rank must make the same number of forwards that follow a synchronized "
                    f"one (DDP's buffer rule): {error}"
                ) from error

    def exchange(self, sends, receives, tag=0):
        """Point to point: ``sends`` ``{rank: tensor}`` to each rank, and
        ``receives`` ``{rank: tensor}`` filled from each (contiguous CPU
        tensors of the sizes both sides agreed), every message posted
        before any is waited for, so no order of the ranks' calls
        deadlocks. ``tag`` tells apart exchanges between the same pair.

        Gloo's point-to-point work reports completion only once waited
        for, so these are waited for at once, not polled for an elastic
        job's abandonment (looked at before they are posted): a peer that
        dies meanwhile fails them when its connection closes, one that
        goes silent at the collective timeout."""
        if self._world == 1 or not (sends or receives):
            return
        self._reap()
        why = self._abandon() if self._abandon is not None else None
        if why:
            raise Abandoned(why)
        works = [self._group.send([t.contiguous()], dst, tag) for dst, t in sends.items()]
        works += [self._group.recv([t], src, tag) for src, t in receives.items()]
        for work in works:
            work.wait()

    def exchange_objects(self, sends, receives, tag=0):
        """:meth:`exchange` of picklable objects: ``sends`` ``{rank:
        value}``, ``receives`` the ranks to receive one from; returns
        ``{rank: value}`` of those (their lengths, then their bytes)."""
        if self._world == 1 or not (sends or receives):
            return {}
        data = {m: _pickled(v) for m, v in sends.items()}
        sizes = {m: torch.zeros(1, dtype=torch.int64) for m in receives}
        self.exchange({m: torch.tensor([d.numel()], dtype=torch.int64) for m, d in data.items()}, sizes, tag)
        got = {m: torch.empty(int(size), dtype=torch.uint8) for m, size in sizes.items()}
        self.exchange(data, got, tag)
        return {m: _unpickled(t) for m, t in got.items()}

    def sum_sparse(self, tensor):
        """The sum of every rank's sparse ``tensor`` (same shape and dtype on
        every rank), coalesced: gloo's sparse all-reduce gathers every rank's
        indices and values and adds them in rank order, so every rank gets
        the same tensor."""
        if self._world == 1:
            return tensor.coalesce()
        self._reap()
        work = self._group.allreduce([tensor])
        self._wait(work)
        return work.result()[0].coalesce()

    def everyones(self, values):
        """Every rank's integers ``values`` (a sequence, the same length on
        every rank), as a ``world x len(values)`` tensor by rank (an all-gather)."""
        slots = torch.zeros(self._world, len(values), dtype=torch.int64)
        slots[self._rank] = torch.tensor(list(values), dtype=torch.int64)
        if self._world > 1:
            self._wait(self._group.allreduce([slots]))
        return slots

    def all_gather(self, mine):
        """Every rank's ``mine`` (a flat CPU tensor of the same length and
        dtype on every rank), back to back in rank order."""
        if self._world == 1:
            return mine.clone()
        self._reap()
        out = torch.empty(self._world * mine.numel(), dtype=mine.dtype)
        self._wait(self._group._allgather_base(out, mine))
        return out

    def all_gather_objects(self, value):
        """Every rank's picklable ``value``, as a list in rank order."""
        if self._world == 1:
            return [value]
        data = _pickled(value)
        lengths = self.everyones([data.numel()])[:, 0].tolist()
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[: data.numel()] = data
        everyone = self.all_gather(mine).view(self._world, -1)
        return [_unpickled(everyone[r, :n]) for r, n in enumerate(lengths)]

    def distinct(self, value):
        """The values ranks pass (``None``: this rank has none), without
        repeats where they agree: ``[value]`` on every rank when every rank
        that passes one passes the same (equal pickles, compared by a
        112-bit digest), found in one reduction of five words and one
        broadcast from the lowest such rank; ``[]`` when none passes one.
        Only where they differ, every rank's (:meth:`all_gather_objects`,
        O(world) a member), in rank order, the ``None`` left out. For what
        is usually the same on every rank (the keys of an optimizer's
        state): merge what it returns."""
        if self._world == 1:
            return [] if value is None else [value]
        if value is None:
            words = [-1, -1, _FAR, _FAR, _FAR]
        else:
            digest = hashlib.blake2b(pickle.dumps(value), digest_size=14).digest()
            parts = [int.from_bytes(digest[:7], "little"), int.from_bytes(digest[7:], "little")]
            words = [*parts, *parts, self._rank]
        high, low = self.extremes(words)
        if high[0] == -1:
            return []
        if high[:2] == low[2:4]:
            return [self.broadcast_object(value, low[4])]
        return [v for v in self.all_gather_objects(value) if v is not None]

    def broadcast_bytes(self, data, root):
        """Rank ``root``'s ``data`` (a flat uint8 tensor; the others pass
        ``None``) on every rank: its length, then its bytes."""
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        self.broadcast([size], root)
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.broadcast([data], root)
        return data

    def broadcast_object(self, value, root):
        """Rank ``root``'s picklable ``value`` on every rank (the others
        pass anything)."""
        if self._world == 1 or self._rank == root:
            if self._world > 1:
                self.broadcast_bytes(_pickled(value), root)
            return value
        return _unpickled(self.broadcast_bytes(None, root))

    def reduce(self, tensor, op):
        """``tensor`` (a CPU tensor) combined over every rank in place,
        ``op`` ``"sum"`` or ``"max"``; returns it."""
        if self._world == 1:
            return tensor
        self._reap()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        self._wait(self._group.allreduce([tensor], opts))
        return tensor

    def extremes(self, values):
        """The largest and the smallest over every rank of each of the
        integers ``values`` (a sequence, the same length on every rank):
        ``(highest, lowest)``, two lists, in one reduction of twice their
        length (``everyones`` sends a word per rank: O(world) a member)."""
        both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
        self.reduce(both, "max")
        n = len(values)
        return both[:n].tolist(), [-v for v in both[n:].tolist()]

    def highest(self, mine):
        """The highest rank for which ``mine`` is true on its side, or -1."""
        if self._world == 1:
            return self._rank if mine else -1
        self._reap()
        rank = torch.tensor([self._rank if mine else -1], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self._group.allreduce([rank], opts))
        return int(rank.item())

    def from_last_joiner(self, tensors, is_last_joiner):
        """Every rank takes the last joiner's values (the end of a ``Join``:
        ranks that joined early skipped optimizer steps)."""
        if self._world == 1:
            return
        self.broadcast(tensors, self.highest(is_last_joiner))


def meet(store, rank, world, timeout_s, abandon):
    """Wait until every rank of a new group says it is there, giving up
    when ``abandon()`` says why (a member agreed into an elastic job's new
    epoch that died before it got here: gloo's rendezvous would wait for it
    until its timeout).

    Each rank counts itself in once; the last one opens a gate key, and the
    others look at that one key, backing off from 1 ms to a pause that
    grows with the world (5 ms up to 100 ranks, 0.5 s at 10,000): the
    store answers about as many looks a second whatever the world (reading
    every rank's key each time cost it O(world) per look, O(world²) per
    meeting), and a small group meets as fast as before."""
    if store.add("present", 1) >= world:
        store.set("present/all", "1")
    deadline = time.monotonic() + timeout_s
    nap, longest = 0.001, min(0.5, max(0.005, world * 50e-6))
    while not store.check(["present/all"]):
        why = abandon()
        if why:
            raise Abandoned(why)
        if time.monotonic() > deadline:
            raise Abandoned(f"the group's members did not all arrive within {timeout_s:.0f} s")
        time.sleep(nap)
        nap = min(2 * nap, longest)


class Abandoned(MembershipError, RuntimeError):
    """A state transfer given up because its group's members changed. An
    elastic job recovers from it at the step boundary; should it reach the
    caller, it is a :class:`gradsync.MembershipError` of kind ``"broken"``."""

    kind = "broken"
