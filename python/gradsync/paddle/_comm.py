"""The runtime's collectives over Paddle's own gloo process groups.

gradsync's communicator thread (a Rust OS thread) calls
:meth:`PaddleCommunicator.all_reduce` for every collective: the plan
agreement, the buckets in plan order, the control vector, a correction. The
memory arrives as an address and an element type (a bucket that travels as
bfloat16 was converted by the runtime); a numpy view of it, handed to
Paddle with ``paddle.from_dlpack``, is a tensor sharing it (no copy), which
the group sums in place.

* The group is a ``ProcessGroupGloo`` of gradsync's own, created from the
  communicator thread over the job's store with a group id no program uses
  (``_BASE_GROUP_ID`` and up), so its collectives never interleave with the
  program's. After a failure, ``reset`` opens a fresh one under the next id
  on every rank (Paddle 3.3 lets a group be created and used from a thread
  other than the one that trains, and a fresh group works after the old one
  timed out: docs/paddle.md). Positions and the facts of a failure are
  :class:`gradsync._gloo.GlooCommunicator`'s.
* Paddle's gloo runs a collective to the end inside the call (also with
  ``sync_op=False``) and gives up after gloo's fixed 30 s
  (:data:`GLOO_TIMEOUT_S`), which nothing in Paddle's API changes: that is
  the deadline of every collective here.
* Paddle's gloo sums float16 to ``inf`` (measured), so that wire type is
  refused when the wrapper is built (:data:`REFUSED_WIRES`).
"""

import numpy as np
import paddle
from paddle.base import core

from gradsync._gloo import SCALED, GlooCommunicator

#: Seconds after which Paddle's gloo gives up on a collective (gloo's default;
#: ``ProcessGroupGloo.create`` takes no timeout).
GLOO_TIMEOUT_S = 30.0
#: Wire types Paddle's gloo cannot sum, and why.
REFUSED_WIRES = {"float16": "Paddle's gloo sums float16 to inf"}
# Group ids of gradsync's groups: wrapper n, epoch e uses BASE + n * STRIDE + e.
# Paddle numbers the program's groups from 0 up, one per new_group call.
_BASE_GROUP_ID = 7_000_000
_STRIDE = 10_000
# numpy's view of each element type the runtime hands over; Paddle's type
# when numpy's is not it (bfloat16, which numpy lacks, viewed from int16).
_NUMPY = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bfloat16": np.int16}
_PADDLE_VIEW = {"bfloat16": paddle.bfloat16}


class PaddleCommunicator(GlooCommunicator):
    """One rank's end of gradsync's private gloo group (see the module docs).

    ``store`` is the job's store (``init_parallel_env``'s), ``prefix`` a key
    prefix unique to the wrapper, ``nth`` the wrapper's number among those
    built over the same ranks (the same on every rank), ``rank`` and
    ``world`` within those ranks.
    """

    def __init__(self, *, store, prefix, nth, rank, world):
        super().__init__(store=store, prefix=prefix, rank=rank, world=world)
        self._first_id = _BASE_GROUP_ID + nth * _STRIDE
        # Created by the first collective, on the communicator thread.
        self._group = None

    def _new_group(self):
        # Created lazily, from the communicator thread, at the epoch's first collective.
        self._group = None

    def all_reduce(self, addr, numel, dtype, factor, timeout_s):
        """Sum ``numel`` elements of ``dtype`` at ``addr`` over every rank, in
        place, then multiply a float sum by ``factor``. The deadline is
        gloo's (:data:`GLOO_TIMEOUT_S`); ``timeout_s`` is the runtime's, equal
        to it. Returns ``None``, or for a failed collective what the runtime
        classifies it by: ``(message, ranks behind)`` (:meth:`failure`)."""
        mine = self._mark()
        array = np.ctypeslib.as_array(self._array(addr, numel, dtype)).view(_NUMPY[dtype])
        tensor = paddle.from_dlpack(array)
        if dtype in _PADDLE_VIEW:
            tensor = tensor.view(_PADDLE_VIEW[dtype])
        try:
            if self._group is None:
                self._group = core.ProcessGroupGloo.create(
                    self._store, self.rank, self.world, self._first_id + self._epoch
                )
            self._group.all_reduce(tensor, core.ReduceOp.SUM, True).wait()
        except Exception as e:  # Paddle raises its own error types
            return self.failure(e, mine)
        if dtype in SCALED and factor != 1.0:
            array *= array.dtype.type(factor)
        return None
