"""The runtime's collectives over Paddle's own gloo process groups.

gradsync's communicator thread (a Rust OS thread) calls
:meth:`PaddleCommunicator.all_reduce` for every collective: the plan
agreement, the buckets in plan order, the control vector, a correction. The
bucket arrives as an address; a numpy view of that memory, handed to Paddle
with ``paddle.from_dlpack``, is a tensor sharing it (no copy), which the
group sums in place.

* The group is a ``ProcessGroupGloo`` of gradsync's own, created from the
  communicator thread over the job's store with a group id no program uses
  (``_BASE_GROUP_ID`` and up), so its collectives never interleave with the
  program's. After a failure, :meth:`reset` opens a fresh one under the next
  id on every rank (measured on Paddle 3.3.1: a group may be created and used
  from a thread other than the one that trains, and a fresh group works
  after the old one timed out; ``../shared/notes/paddle-3.3.md``).
* Paddle's gloo runs a collective to the end inside the call (also with
  ``sync_op=False``) and gives up after gloo's fixed 30 s
  (:data:`GLOO_TIMEOUT_S`), which nothing in Paddle's API changes: that is
  the deadline of every collective here.
* Before each collective this rank counts its position in the store; when a
  collective times out, the ranks whose count is behind this one's never
  joined it, and the error names them.
* Data buckets may travel as bfloat16 (half the bytes). Not float16: Paddle's
  gloo sums float16 to ``inf`` (measured), so it is refused at wrap time.
"""

import numpy as np
import paddle
from paddle.base import core

from gradsync._gloo import CTYPES, AddressArrays, collective_failure

#: Seconds after which Paddle's gloo gives up on a collective (gloo's default;
#: ``ProcessGroupGloo.create`` takes no timeout).
GLOO_TIMEOUT_S = 30.0
# Group ids of gradsync's groups: wrapper n, epoch e uses BASE + n * STRIDE + e.
# Paddle numbers the program's groups from 0 up, one per new_group call.
_BASE_GROUP_ID = 7_000_000
_STRIDE = 10_000


class PaddleCommunicator:
    """One rank's end of gradsync's private gloo group (see the module docs).

    ``store`` is the job's store (``init_parallel_env``'s), ``nth`` the
    wrapper's number among those built over the same ranks (the same on
    every rank), ``rank`` and ``world`` within those ranks.
    """

    def __init__(self, *, store, nth, rank, world, wire_dtype="float32"):
        self.rank = rank
        self.world = world
        self._store = store
        self._first_id = _BASE_GROUP_ID + nth * _STRIDE
        # Data buckets travel in this type; control words and corrections
        # always travel exactly.
        self._wire = wire_dtype
        self._epoch = 0
        self._arrays = AddressArrays()
        # Created by the first collective, on the communicator thread.
        self._group = None

    def _group_id(self):
        return self._first_id + self._epoch

    def _key(self, rank):
        return f"gradsync/{self._group_id()}/position/{rank}"

    def _array(self, addr, numel, dtype):
        # The runtime guarantees `addr` holds `numel` elements for this call;
        # the array shares that memory and does not outlive the call.
        return np.ctypeslib.as_array(self._arrays.at(addr, numel, CTYPES[dtype]))

    def all_reduce(self, addr, numel, dtype, factor, tag, kind, timeout_s):
        """Sum ``numel`` elements of ``dtype`` at ``addr`` over every rank, in
        place, then multiply by ``factor``. The deadline is gloo's
        (:data:`GLOO_TIMEOUT_S`); ``timeout_s`` is the runtime's, equal to it."""
        mine = self._store.add(self._key(self.rank), 1)
        array = self._array(addr, numel, dtype)
        tensor = paddle.from_dlpack(array)
        wire = tensor.astype(self._wire) if kind == "bucket" and self._wire != "float32" else tensor
        try:
            if self._group is None:
                self._group = core.ProcessGroupGloo.create(self._store, self.rank, self.world, self._group_id())
            self._group.all_reduce(wire, core.ReduceOp.SUM, True).wait()
        except Exception as e:  # Paddle raises its own error types
            raise self._failure(e, mine, tag) from None
        if wire is not tensor:
            array[:] = wire.astype("float32").numpy()
        if factor != 1.0:
            array *= array.dtype.type(factor)

    def _behind(self, mine):
        """Ranks whose position is before ``mine`` (they never joined this collective)."""
        try:
            return [r for r in range(self.world) if r != self.rank and self._store.add(self._key(r), 0) < mine]
        except Exception:  # the store itself is unreachable: nothing to say
            return []

    def _failure(self, error, mine, tag):
        return collective_failure(error, tag, self._behind(mine))

    def reset(self):
        """Start a new epoch on a fresh group (after a failed collective, the
        old group's connections hold half-finished messages); every rank
        creates it at its first collective after the reset."""
        self._epoch += 1
        self._group = None
