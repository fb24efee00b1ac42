"""Model states shared by the replicas: parameters at construction, buffers
before each forward, everything at the end of a ``Join``.

These broadcasts run on the program's thread, on a gloo group of their own
(:class:`StateBroadcast`), so they never interleave with the collectives of
gradsync's communicator thread.
"""

import datetime

import torch
import torch.distributed as dist


class StateBroadcast:
    """Broadcasts of model states among ``world`` ranks on a private gloo group."""

    def __init__(self, store, prefix, rank, world, timeout_s):
        self._rank = rank
        self._world = world
        self._group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/states", store), rank, world, datetime.timedelta(seconds=timeout_s)
        )

    def broadcast(self, tensors, root=0):
        """Rank ``root``'s values into ``tensors`` on every rank: one flat
        message per dtype, in the order the dtypes first appear (the same on
        every rank). One message of mixed dtypes would promote them: an int64
        buffer sent as float32 loses its low bits above 2**24."""
        if self._world == 1 or not tensors:
            return
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for same in by_dtype.values():
            self._broadcast_flat(same, root)

    def _broadcast_flat(self, tensors, root):
        """:meth:`broadcast` of tensors of one dtype, as one message."""
        flat = torch._utils._flatten_dense_tensors([t.detach() for t in tensors])
        moved = flat.to("cpu") if flat.device.type != "cpu" else flat
        # gloo sends bytes of the types it knows: bool travels as uint8.
        message = moved.view(torch.uint8) if moved.dtype == torch.bool else moved
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._group.broadcast([message], opts).wait()
        if moved is not flat:
            flat.copy_(moved)
        with torch.no_grad():
            for t, v in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                t.copy_(v)

    def from_last_joiner(self, tensors, is_last_joiner):
        """Every rank takes the last joiner's values (the end of a ``Join``:
        ranks that joined early skipped optimizer steps)."""
        if self._world == 1:
            return
        last = torch.tensor([self._rank if is_last_joiner else -1], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._group.allreduce([last], opts).wait()
        self.broadcast(tensors, int(last.item()))
