"""The runtime's collectives on torch's gloo engine.

gradsync's communicator thread (a Rust OS thread) runs every collective: the
plan agreement, the buckets in plan order, the control vector, a
correction. The group is a ``ProcessGroupGloo`` over a ``PrefixStore`` of
the default store, unique to one wrapped model, so gradsync's collectives
never interleave with the program's own (on the default group or any other)
and a reset can open a fresh group (new prefix) on every rank without the
global call order ``dist.new_group`` imposes. Every collective has a
deadline (gloo's per-operation timeout). Positions, epochs and failures are
:class:`gradsync._gloo.GlooCommunicator`'s.

One path runs the collectives, chosen when the wrapper is built:

* **native** (the product): the thread calls the C functions of
  ``gradsync.torch._collectives``, compiled against torch by ``pip
  install``, on an ``Endpoint`` that holds this group and the store. No
  Python, no interpreter lock. Python is entered only to name the culprits
  of a failure (:meth:`TorchCommunicator.failure`) and to reset.
* **python**, for a build without that module: the thread calls
  :meth:`TorchCommunicator.start` and :meth:`TorchCommunicator.wait_oldest`,
  which release the lock while gloo waits.

Either way the memory arrives as an address and an element type (a bucket
that travels as bfloat16 or float16 was converted by the runtime) and is
summed in place, without a copy.

**Buckets on the device** (``plane_device``): the buckets are torch tensors
on the parameters' device, packed on a stream of a ``_collectives.Plane``
and summed on a *data group* beside the gloo group, over the same store
prefix (no second rendezvous): ``ProcessGroupNCCL`` for CUDA, the gloo group
itself on the CPU (what CI runs: the same code, no stream). Control words and
plan agreements stay on gloo, in host memory: they are a few words, and the
host reads them at once. This path needs the native collectives.
"""

import collections
import datetime

import torch
import torch.distributed as dist

from gradsync._gloo import SCALED, GlooCommunicator

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class TorchCommunicator(GlooCommunicator):
    """One rank's end of gradsync's private gloo group (see the module docs).

    ``shim`` is the loaded ``_collectives`` module for the native path, or
    ``None`` for the Python path; ``plane_device``, the device whose tensors
    hold the buckets (``None``: host memory)."""

    def __init__(self, *, store, prefix, rank, world, timeout_s, shim, plane_device=None, cancel=None):
        super().__init__(store=store, prefix=prefix, rank=rank, world=world)
        self._shim = shim
        # An elastic job's cancellation (a `_collectives.Cancel`): the
        # liveness monitor breaks a membership epoch, and the waits of this
        # communicator's endpoints of that epoch fail at once (`move`).
        # Otherwise one of its own, which `abandon` breaks.
        self._own_cancel = cancel is None and shim is not None
        self._cancel = shim.Cancel() if self._own_cancel else cancel
        self.membership_epoch = 0
        # Groups of earlier membership epochs, kept: a gloo group whose work
        # waits on a vanished peer blocks its destructor until gloo's timeout.
        self._retired = []
        # The device plane (its stream), kept for the communicator's life:
        # the runtime's store holds its address.
        self.plane_device = plane_device
        self._plane = None if plane_device is None else shim.Plane(plane_device)
        # The data group of the device plane (NCCL on CUDA), per epoch.
        self._data = None
        # Each operation has its own deadline (AllreduceOptions.timeout). This one
        # bounds connecting a group: after a failure, ranks reach their reset up
        # to a deadline apart, and the reset agreement waits three deadlines.
        self._timeout = datetime.timedelta(seconds=3 * timeout_s)
        # Started collectives, oldest first: (work, tensor, factor, position, tag).
        self._flight = collections.deque()
        self._group = self._endpoint = None
        self._new_group()

    def abandon(self):
        """The wrapper is closing: a collective still waiting (a step left
        half done, its peers never to join) fails at once instead of holding
        the close until its timeout. Only for a cancellation of its own (an
        elastic job's belongs to the job)."""
        if self._own_cancel:
            self._cancel.cancel(2**62)

    def native(self):
        """``(table address, endpoint address)`` for the runtime's native
        path, or ``None`` (the Python path)."""
        if self._shim is None:
            return None
        return self._shim.table(), self._endpoint.address

    def plane(self):
        """``(table address, plane address)`` when the buckets are on the
        device plane, else ``None``."""
        if self._plane is None:
            return None
        return self._shim.table(), self._plane.address

    def enter(self):
        """A step's backward begins: the device plane's stream waits for
        what the caller queued so far (no-op without a device stream)."""
        if self._plane is not None:
            self._plane.enter()

    def leave(self):
        """A step's reduction is queued: the caller's current stream waits
        for the device plane's stream (the host does not block)."""
        if self._plane is not None:
            self._plane.leave()

    def bucket_tensor(self, address):
        """The device-plane bucket at ``address`` (``Step.buckets()``) as a tensor."""
        return self._shim.bucket_tensor(address)

    def lend(self, bucket, params, offsets, loan):
        """Make each of ``params``' ``.grad`` a view of ``bucket`` at its offset
        in ``offsets``, the views keeping ``loan`` alive (in C++, as DDP's
        reducer sets its bucket views)."""
        self._shim.lend(bucket, params, offsets, loan)

    def move(self, prefix, rank, world, membership_epoch, store):
        """An elastic job changed its members: the next :meth:`reset` opens
        the first group of ``prefix`` in ``store`` as ``rank`` of ``world``
        (every member of the new epoch moves to the same prefix)."""
        self._prefix, self.rank, self.world, self.membership_epoch = prefix, rank, world, membership_epoch
        self._store = store
        self._epoch = -1
        self._retired.append((self._group, self._endpoint, self._data))

    def _new_group(self):
        store = dist.PrefixStore(f"{self._prefix}/epoch{self._epoch}", self._store)
        self._group = dist.ProcessGroupGloo(store, self.rank, self.world, self._timeout)
        self._abort_data()
        if self.plane_device is not None and self.plane_device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            data_store = dist.PrefixStore(f"{self._prefix}/epoch{self._epoch}/nccl", self._store)
            self._data = dist.ProcessGroupNCCL(data_store, self.rank, self.world, options)
        if self._shim is not None:
            self._endpoint = self._shim.Endpoint(self._group, self._store, self._key(self.rank), self._data,
                                                 cancel=self._cancel, epoch=self.membership_epoch)

    def _abort_data(self):
        """End the previous epoch's NCCL group: after a failure its kernels
        may wait for a peer that never comes (abort frees them)."""
        if self._data is not None and hasattr(self._data, "abort"):
            try:
                self._data.abort()
            except RuntimeError:  # already torn down by torch's watchdog
                pass
        self._data = None

    def all_reduce(self, addr, numel, dtype, factor, tag, kind, timeout_s):
        """Sum ``numel`` elements of ``dtype`` at ``addr`` over every rank, in
        place, then multiply a float sum by ``factor``; within ``timeout_s`` seconds."""
        self.start(addr, numel, dtype, factor, tag, kind, timeout_s)
        self.wait_oldest()

    def start(self, addr, numel, dtype, factor, tag, kind, timeout_s):
        """Start :meth:`all_reduce` and return; :meth:`wait_oldest` finishes it
        (collectives finish in the order they started). The memory at
        ``addr`` stays valid until then."""
        mine = self._mark()
        tensor = torch.frombuffer(self._array(addr, numel, dtype), dtype=_TORCH_DTYPES[dtype])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        try:
            work = self._group.allreduce([tensor], opts)
        except RuntimeError as e:
            raise self.failure(e, tag, mine) from None
        self._flight.append((work, tensor, factor if dtype in SCALED else 1.0, mine, tag))

    def wait_oldest(self):
        """Finish the oldest started collective: wait, scale."""
        work, tensor, factor, mine, tag = self._flight.popleft()
        try:
            work.wait()
        except RuntimeError as e:
            raise self.failure(e, tag, mine) from None
        if factor != 1.0:
            tensor.mul_(factor)

    def discard(self):
        """Forget the started collectives (they failed with an earlier one;
        :meth:`reset` follows)."""
        self._flight.clear()

    def reset(self):
        """Start a new epoch on a fresh group (after a failed collective, the
        old group's connections hold half-finished messages)."""
        self._flight.clear()
        super().reset()
