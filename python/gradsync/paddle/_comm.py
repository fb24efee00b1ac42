"""The runtime's collectives over Paddle's own process groups.

gradsync's communicator thread (a Rust OS thread) calls
:meth:`PaddleCommunicator.all_reduce` for every collective: the plan
agreement, the buckets in plan order, the control vector, a correction. The
bucket arrives as an address; ``paddle.from_dlpack`` over a numpy view of
that memory gives a tensor sharing it (no copy), which Paddle's gloo group
sums in place. The group is gradsync's own (``dist.new_group`` on every rank
at wrap time), so its collectives never interleave with the program's.
Measured on Paddle 3.3.1: collectives on such a group may be issued from a
thread other than the one that trains (``../shared/notes/paddle-3.3.md``).
"""

import ctypes

import numpy as np
import paddle
import paddle.distributed as dist

from gradsync._errors import _CollectiveFailed

_CTYPES = {"float32": ctypes.c_float, "int64": ctypes.c_int64}


class PaddleCommunicator:
    """One rank's end of gradsync's private Paddle group."""

    def __init__(self, group):
        self._group = group
        self._arrays = {}

    def _tensor(self, addr, numel, dtype):
        ctype = _CTYPES[dtype]
        array_type = self._arrays.get((ctype, numel))
        if array_type is None:
            array_type = self._arrays[(ctype, numel)] = ctype * numel
        # The runtime guarantees `addr` holds `numel` elements for this call;
        # the tensor shares that memory and does not outlive the call.
        return paddle.from_dlpack(np.ctypeslib.as_array(array_type.from_address(addr)))

    def all_reduce(self, addr, numel, dtype, factor, tag, kind, timeout_s):
        """Sum ``numel`` elements of ``dtype`` at ``addr`` over every rank, in
        place, then multiply by ``factor``. Paddle's gloo collectives take no
        per-operation deadline: a rank that never joins blocks this call."""
        tensor = self._tensor(addr, numel, dtype)
        try:
            dist.all_reduce(tensor, group=self._group)
        except Exception as e:  # Paddle raises its own error types
            raise _CollectiveFailed("backend", f"{tag}: {e}") from None
        if factor != 1.0:
            tensor.scale_(factor)

    def reset(self):
        """After a failed collective: Paddle's gloo group cannot be rebuilt
        from this thread, so a failed step ends the wrapper (close it)."""
        raise _CollectiveFailed("backend", "gradsync.paddle cannot reset its group after a failure: close the model")
