"""The runtime's collectives over ``torch.distributed``.

gradsync's communicator thread (a Rust OS thread) calls :meth:`TorchCommunicator.all_reduce`
for every collective: the plan agreement, the buckets in plan order, the
control vector, a correction. The bucket arrives as an address; it becomes a
tensor without a copy and is summed in place by gloo on a process group of
gradsync's own:

* The group is a ``ProcessGroupGloo`` over a ``PrefixStore`` of the default
  store, unique to one wrapped model, so gradsync's collectives never
  interleave with the program's own (on the default group or any other) and a
  reset can open a fresh group (new prefix) on every rank without the global
  call order ``dist.new_group`` imposes.
* Every collective has a deadline (gloo's per-operation timeout).
* Before each collective this rank writes its position ``epoch:seq`` to the
  store. When a collective times out, the ranks whose position is behind this
  one are the ones that never joined: the error names them.

Two paths run the collectives on that group:

* **native** (the default, when the package was built with torch): the
  thread calls the C functions of ``gradsync.torch._collectives``, compiled
  against torch by ``pip install``, on an :class:`Endpoint` that holds this
  group and the store. No Python, no interpreter lock: the training thread's
  hooks never wait for the communicator, nor it for them. Python is entered
  only to name the culprits of a failure (:meth:`TorchCommunicator.failure`)
  and to reset.
* **python**: the thread calls :meth:`TorchCommunicator.start` and
  :meth:`TorchCommunicator.wait_oldest`, which release the lock while gloo
  waits. Taken when the shim is missing or was built against another torch
  (a warning says which), or on request (``GRADSYNC_COLLECTIVES=python``).
"""

import collections
import datetime
import os
import warnings

import torch
import torch.distributed as dist

from gradsync._gloo import CTYPES, AddressArrays, collective_failure
from gradsync.torch import _shim

_TORCH_DTYPES = {"float32": torch.float32, "int64": torch.int64}


# The shim's wire codes (python/shim/collectives.cpp, `Wire`).
_WIRE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _load_shim():
    """``(module, None)`` when the native path can run, else ``(None, why)``."""
    if os.environ.get("GRADSYNC_COLLECTIVES", "native") == "python":
        return None, None
    return _shim.load("collectives")


def _position(text):
    epoch, seq = text.split(":")
    return int(epoch), int(seq)


class TorchCommunicator:
    """One rank's end of gradsync's private gloo group (see the module docs).

    ``store`` is the job's store (the default group's), ``prefix`` a key
    prefix unique to the wrapped model and identical on every rank.
    """

    def __init__(self, *, store, prefix, rank, world, timeout_s, wire_dtype=torch.float32):
        self.rank = rank
        self._shim, why = _load_shim()
        if why is not None:
            warnings.warn(
                f"gradsync: collectives run through Python, slower: {why}. Reinstall gradsync with torch installed "
                "(pip install --no-build-isolation) to build them.",
                RuntimeWarning,
                stacklevel=3,
            )
        # Data buckets travel in this type (bfloat16 halves the bytes); the
        # control vector and corrections always travel exactly.
        self._wire = wire_dtype
        self.world = world
        self._store = store
        self._prefix = prefix
        # Each operation has its own deadline (AllreduceOptions.timeout). This one
        # bounds connecting a group: after a failure, ranks reach their reset up
        # to a deadline apart, and the reset agreement waits three deadlines.
        self._timeout = datetime.timedelta(seconds=3 * timeout_s)
        self._epoch = 0
        self._seq = 0
        self._arrays = AddressArrays()
        # Started collectives, oldest first: (work, tensor, wire tensor, factor, position, tag).
        self._flight = collections.deque()
        self._group = self._endpoint = None
        self._new_group()

    @property
    def is_native(self):
        """Whether collectives take the native path (see the module docs)."""
        return self._shim is not None

    def native(self):
        """``(table address, endpoint address)`` for the runtime's native
        path, or ``None`` (the Python path)."""
        if self._shim is None:
            return None
        return self._shim.table(), self._endpoint.address

    def set_wire(self, dtype):
        """Send the data buckets of later steps as ``dtype`` (set on every rank alike)."""
        self._wire = dtype
        if self._endpoint is not None:
            self._endpoint.set_wire(_WIRE_CODES[dtype])

    def _new_group(self):
        store = dist.PrefixStore(f"{self._prefix}/epoch{self._epoch}", self._store)
        self._group = dist.ProcessGroupGloo(store, self.rank, self.world, self._timeout)
        if self._shim is not None:
            self._endpoint = self._shim.Endpoint(self._group, self._store, self._key(self.rank), self._epoch)
            self._endpoint.set_wire(_WIRE_CODES[self._wire])

    def _key(self, rank):
        return f"{self._prefix}/position/{rank}"

    def _tensor(self, addr, numel, dtype):
        # The runtime guarantees `addr` holds `numel` elements for this call;
        # the tensor shares that memory and does not outlive the call.
        return torch.frombuffer(self._arrays.at(addr, numel, CTYPES[dtype]), dtype=_TORCH_DTYPES[dtype])

    def all_reduce(self, addr, numel, dtype, factor, tag, kind, timeout_s):
        """Sum ``numel`` elements of ``dtype`` at ``addr`` over every rank, in
        place, then multiply by ``factor``; within ``timeout_s`` seconds."""
        self.start(addr, numel, dtype, factor, tag, kind, timeout_s)
        self.wait_oldest()

    def start(self, addr, numel, dtype, factor, tag, kind, timeout_s):
        """Start :meth:`all_reduce` and return; :meth:`wait_oldest` finishes it
        (collectives finish in the order they started). The memory at
        ``addr`` stays valid until then."""
        self._seq += 1
        mine = (self._epoch, self._seq)
        self._store.set(self._key(self.rank), f"{mine[0]}:{mine[1]}")
        tensor = self._tensor(addr, numel, dtype)
        wire = tensor.to(self._wire) if kind == "bucket" and tensor.dtype != self._wire else tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        try:
            work = self._group.allreduce([wire], opts)
        except RuntimeError as e:
            raise self._failure(e, mine, tag) from None
        self._flight.append((work, tensor, wire, factor, mine, tag))

    def wait_oldest(self):
        """Finish the oldest started collective: wait, copy back from the wire
        type, scale."""
        work, tensor, wire, factor, mine, tag = self._flight.popleft()
        try:
            work.wait()
        except RuntimeError as e:
            raise self._failure(e, mine, tag) from None
        if wire is not tensor:
            tensor.copy_(wire)
        if factor != 1.0:
            tensor.mul_(factor)

    def discard(self):
        """Forget the started collectives (they failed with an earlier one;
        :meth:`reset` follows)."""
        self._flight.clear()

    def _behind(self, mine):
        """Ranks whose last position is before ``mine`` (never joined this collective)."""
        behind = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            key = self._key(rank)
            try:
                if not self._store.check([key]) or _position(self._store.get(key).decode()) < mine:
                    behind.append(rank)
            except Exception:  # the store itself is unreachable: nothing to say
                return []
        return behind

    def _failure(self, error, mine, tag):
        return collective_failure(error, tag, self._behind(mine))

    def failure(self, message, tag, seq):
        """The native path's failed collective (gloo's ``message``; ``seq``
        its place in this epoch) as the runtime's failure, naming the ranks
        that had not reached it. Judged against that collective, not the
        latest one started: later ones may already be on their way."""
        return self._failure(message, (self._epoch, seq), tag)

    def reset(self):
        """Start a new epoch on a fresh group (after a failed collective, the
        old group's connections hold half-finished messages)."""
        self._flight.clear()
        self._epoch += 1
        self._seq = 0
        self._new_group()
