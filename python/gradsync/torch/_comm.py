"""The runtime's collectives on torch's gloo engine.

gradsync's communicator thread (a Rust OS thread) runs every collective: the
plan agreement, the buckets in plan order, the control vector, a
correction. The group is a ``ProcessGroupGloo`` over a ``PrefixStore`` of
the default store, unique to one wrapped model, so gradsync's collectives
never interleave with the program's own (on the default group or any other)
and a reset can open a fresh group (new prefix) on every rank without the
global call order ``dist.new_group`` imposes. Every collective has a
deadline (gloo's per-operation timeout). Positions and epochs are
:class:`gradsync._gloo.GlooCommunicator`'s.

The communicator thread calls the C functions of
``gradsync.torch._collectives``, compiled against torch by ``pip install``,
on an ``Endpoint`` that holds this group and the store: no Python, no
interpreter lock; a failure is classified from facts the C++ side reads
(which ranks never reached the failed collective) and the time waited.
Python is entered only to reset. The memory arrives as an
address and an element type (a bucket that travels as bfloat16 or float16
was converted by the runtime) and is summed in place, without a copy.

**Buckets on the device** (``plane_device``): the buckets are torch tensors
on the parameters' device, packed on a stream of a ``_collectives.Plane``
and summed on a *data group* beside the gloo group, over the same store
prefix (no second rendezvous): ``ProcessGroupNCCL`` for CUDA, the gloo group
itself on the CPU (what CI runs: the same code, no stream). Control words and
plan agreements stay on gloo, in host memory: they are a few words, and the
host reads them at once.
"""

import datetime
import os

import torch.distributed as dist

from gradsync._gloo import GlooCommunicator, never_free


def gloo_group(store, rank, world, timeout):
    """A ``ProcessGroupGloo`` of ``world`` ranks over ``store`` whose pairs
    connect on first use: a ring all-reduce connects a rank to its two
    neighbours, a broadcast or an all-gather to a few more, so a member
    holds O(1) connections of the group, not one per member. torch's
    default connects every pair when the group is made: O(world) sockets
    and handshakes per member, 10,000 at 10,000 members (past the usual
    limit of 1,024 open files), for each of a wrapper's groups.
    ``GLOO_SOCKET_IFNAME`` names the interfaces as it does for torch's
    groups; ``timeout``: each operation's, and a first connection's."""
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = timeout
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    options._devices = ([gloo.create_device(interface=n, lazy_init=True) for n in names]
                        or [gloo.create_default_device(lazy_init=True)])
    options._threads = 2 * len(options._devices)
    return gloo(store, rank, world, options)


class TorchCommunicator(GlooCommunicator):
    """One rank's end of gradsync's private gloo group (see the module docs).

    ``shim`` is the loaded ``_collectives`` module; ``plane_device``, the device whose tensors
    hold the buckets (``None``: host memory)."""

    def __init__(self, *, store, prefix, rank, world, timeout_s, shim, plane_device=None, cancel=None,
                 membership_epoch=0):
        super().__init__(store=store, prefix=prefix, rank=rank, world=world)
        self._shim = shim
        # An elastic job's cancellation (a `_collectives.Cancel`): the
        # liveness monitor breaks a membership epoch, and the waits of this
        # communicator's endpoints of that epoch fail at once (`move`).
        # Otherwise one of its own, which `abandon` breaks.
        self._own_cancel = cancel is None
        self._cancel = shim.Cancel() if self._own_cancel else cancel
        # The membership epoch its endpoints belong to (an epoch the monitor
        # already broke must not cancel a later epoch's first group).
        self.membership_epoch = membership_epoch
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
        self._group = self._endpoint = None
        self._new_group()

    def abandon(self):
        """The wrapper is closing: a collective still waiting (a step left
        half done, its peers never to join) fails at once instead of holding
        the close until its timeout. Only for a cancellation of its own (an
        elastic job's belongs to the job)."""
        if self._own_cancel:
            self._cancel.cancel(2**62)

    def closed(self):
        """The runtime stopped. A collective it gave up may still be inside
        gloo: a bucket whose peers closed without starting it waits on a
        pair they never connect (the groups connect lazily), until gloo's
        timeout, and freeing the group would join that wait. Such a group
        is left to the process; an idle one is freed as usual."""
        self._let_go()

    def _let_go(self):
        """Keep the current group for the process's life if a collective
        started on it is still inside gloo (``Endpoint.busy``)."""
        kept = self._retired and self._retired[-1][1] is self._endpoint
        if self._endpoint is not None and not kept and self._endpoint.busy:
            self._retired.append(never_free((self._group, self._endpoint, self._data)))

    def native(self):
        """``(table address, endpoint address)``: the runtime's way to the C++ collectives."""
        return self._shim.table(), self._endpoint.address

    def plane(self):
        """``(table address, plane address)`` when the buckets are on the
        device plane, else ``None``."""
        if self._plane is None:
            return None
        return self._shim.table(), self._plane.address

    def plane_stream(self):
        """The device plane's stream (a ``torch.Stream``), or ``None``: on
        the CPU, or without a device plane. The C++ hook orders it after the
        caller's stream when a backward begins, and the caller's after it
        before the write-back."""
        return None if self._plane is None else self._plane.stream

    def bucket_tensor(self, address):
        """The device-plane bucket at ``address`` (``Step.buckets()``) as a tensor."""
        return self._shim.bucket_tensor(address)

    def move(self, prefix, rank, world, membership_epoch, store):
        """An elastic job changed its members: the next :meth:`reset` opens
        the first group of ``prefix`` in ``store`` as ``rank`` of ``world``
        (every member of the new epoch moves to the same prefix)."""
        self._prefix, self.rank, self.world, self.membership_epoch = prefix, rank, world, membership_epoch
        self._store = store
        self._epoch = -1
        self._retired.append(never_free((self._group, self._endpoint, self._data)))

    def _new_group(self):
        # A reset after a failure: the failed epoch's group may still hold
        # a collective a peer never joined.
        self._let_go()
        store = dist.PrefixStore(f"{self._prefix}/epoch{self._epoch}", self._store)
        self._group = gloo_group(store, self.rank, self.world, self._timeout)
        self._abort_data()
        if self.plane_device is not None and self.plane_device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            data_store = dist.PrefixStore(f"{self._prefix}/epoch{self._epoch}/nccl", self._store)
            self._data = dist.ProcessGroupNCCL(data_store, self.rank, self.world, options)
        self._endpoint = self._shim.Endpoint(self._group, self._store, self._positions(), self.rank, self.world,
                                             self._data, cancel=self._cancel, epoch=self.membership_epoch)

    def _abort_data(self):
        """End the previous epoch's NCCL group: after a failure its kernels
        may wait for a peer that never comes (abort frees them)."""
        if self._data is not None and hasattr(self._data, "abort"):
            try:
                self._data.abort()
            except RuntimeError:  # already torn down by torch's watchdog
                pass
        self._data = None
