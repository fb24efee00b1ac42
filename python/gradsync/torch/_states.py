"""Model states shared by the replicas: parameters at construction, buffers
before each forward, everything at the end of a ``Join``.

These broadcasts run on the program's thread, on a gloo group of their own
(:class:`StateBroadcast`), so they never interleave with the collectives of
gradsync's communicator thread.
"""

import datetime
import time

import torch
import torch.distributed as dist

from gradsync._errors import MembershipError

# How long a wait spins on a collective before it sleeps between looks.
_SPIN_S = 0.0002
_NAP_S = 0.001


class StateBroadcast:
    """Broadcasts of model states among ``world`` ranks on a private gloo group.

    ``abandon``: called while a collective waits; a text it returns (an
    elastic job's membership epoch broke: a member went silent) ends the
    wait with :class:`Abandoned` instead of waiting out gloo's timeout."""

    def __init__(self, store, prefix, rank, world, timeout_s, abandon=None):
        self._rank = rank
        self._world = world
        self._abandon = abandon
        self._group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/states", store), rank, world, datetime.timedelta(seconds=timeout_s)
        )

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
        if self._world == 1 or not tensors:
            return
        parts = [t.detach().reshape(-1).view(torch.uint8).cpu() for t in tensors]
        message = torch.cat(parts)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self._group.broadcast([message], opts))
        with torch.no_grad():
            for t, part in zip(tensors, message.split([p.numel() for p in parts])):
                # Written through a byte view of the destination: a slice of
                # the message may sit at an offset its dtype cannot view.
                dst = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                dst.view(-1).view(torch.uint8).copy_(part)
                if dst is not t:
                    t.copy_(dst)

    def everyones(self, values):
        """Every rank's integers ``values`` (a sequence, the same length on
        every rank), as a ``world x len(values)`` tensor by rank (an all-gather)."""
        slots = torch.zeros(self._world, len(values), dtype=torch.int64)
        slots[self._rank] = torch.tensor(list(values), dtype=torch.int64)
        if self._world > 1:
            self._wait(self._group.allreduce([slots]))
        return slots

    def from_last_joiner(self, tensors, is_last_joiner):
        """Every rank takes the last joiner's values (the end of a ``Join``:
        ranks that joined early skipped optimizer steps)."""
        if self._world == 1:
            return
        last = torch.tensor([self._rank if is_last_joiner else -1], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self._group.allreduce([last], opts))
        self.broadcast(tensors, int(last.item()))


class Abandoned(MembershipError, RuntimeError):
    """A state transfer given up because its group's members changed. An
    elastic job recovers from it at the step boundary; should it reach the
    caller, it is a :class:`gradsync.MembershipError` of kind ``"broken"``."""

    kind = "broken"
