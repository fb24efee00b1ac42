"""A sharded wrapper's part in its members: the gather lane of each
membership, and a change of members.

Parameter sharding by units gathers on a lane of its own (a communicator
and a runtime thread apart from the step's, ``sharding.gather.LaneGather``),
made for one membership: its group, its rank and world. In an elastic job
a change of members (``DistributedDataParallel.reconfigure``) settles the
partitions (``sharding.reshard.settle``: the pieces of the optimizer state,
and of the parameters when they are sharded, move from their holders), then
opens a new lane on the new group, and every member's parameters are
released, so that the next forward's first round pairs up on every member::

    reconfigure ─▶ settle (state group of the new members) ─▶ a new lane ─▶ released
    first boundary ─▶ rank 0's module sent ─▶ the pieces read it (the model as built)
"""

from gradsync._native import Lane
from gradsync.torch._comm import TorchCommunicator
from gradsync.torch.sharding.gather import LaneGather
from gradsync.torch.sharding.reshard import settle


class ShardedMembers:
    """The membership side of ``sharding.wrapper.Sharding`` (see the module docs)."""

    #: What a gather lane is built from (``_open_lane``), or ``None``: no lane.
    _lane_parts = None

    def _open_lane(self, collectives, arrivals, plane_device, pacing=(None, True)):
        """The gather lane of parameter sharding by units (:meth:`_new_lane`),
        closed with the wrapper; ``pacing``: ``(buckets_in_flight,
        prefetch_units)`` (``sharding.settings.pacing_of``)."""
        self._lane_parts = (collectives, arrivals, plane_device)
        self._retired_lanes = []
        residence = self._partition.residence
        residence.pace(pacing, self._sync.await_in_flight)
        self._sync.on_close.append(lambda: residence.lane.close())
        self._sync.on_close.append(residence.remove_hooks)
        self._new_lane()

    def _new_lane(self):
        """A gather lane for the current members: a communicator of its own
        (its group under this wrapper's prefix, its device plane's stream
        and NCCL communicator; in an elastic job the job's cancellation,
        so a member gone silent fails its gathers too) and the runtime's
        ``Lane`` thread over it. The lane of earlier members, if any, is
        stopped (its group kept: a gloo group waiting on a vanished peer
        blocks its destructor). Every member calls it at the same point."""
        collectives, arrivals, plane_device = self._lane_parts
        elastic = self._sync.elastic
        comm = TorchCommunicator(
            store=self._store, prefix=f"{self._prefix}/lane", rank=self._rank, world=self._world,
            timeout_s=self._timeout_s, shim=collectives, plane_device=plane_device,
            cancel=None if elastic is None else elastic.cancel,
            membership_epoch=0 if elastic is None else elastic.epoch,
        )
        lane = Lane(comm, self._rank, self._world, timeout_s=self._timeout_s)
        residence = self._partition.residence
        if residence.lane is not None:
            residence.lane.close()
            self._retired_lanes.append(residence.lane)
        residence.lane = LaneGather(lane, comm, arrivals.host_bucket, comm if plane_device is not None else None)
        residence.agree()

    def _settle_members(self, rank, world, buddy_stride):
        """A change of members (``reconfigure``): the partitions move to the
        new layout (buddy copies ``buddy_stride`` ranks on), losing nothing
        (``sharding.reshard.settle``). Sharded parameters are then released
        on every member (the pieces hold the new layout's values) and
        gathered by the next forward, on a new lane. Returns whether this
        rank dropped a step it had applied."""
        if self._partition is None:
            return False
        dropped = settle(self._partition, self._states, rank, world, buddy_stride=buddy_stride)
        residence = self._partition.residence
        if residence is not None:
            if self._lane_parts is not None:
                self._new_lane()
            residence.discard()
        if self._partition.served is not None:  # (the pieces held now, under the new members: sharding.served)
            self._partition.served.moved(self._store, self._prefix, self._sync.elastic.epoch)
        return dropped

    def broadcast_module_states(self):
        """``DistributedDataParallel.broadcast_module_states``; with sharded
        parameters whole (an elastic job's first boundary: the model as
        built), the pieces then read rank 0's values."""
        super().broadcast_module_states()
        residence = self._partition.residence if self._partition is not None else None
        if residence is not None and residence.whole:
            self._partition.refresh()

    def boundary_passed(self):
        """An elastic job's step boundary passed: the next step makes its
        collectives again, and optimizers built from now on check at once."""
        if self._partition is not None:
            self._partition.sharded_step.boundary_passed()
            self._partition.start_checks = None

    def run_start_checks(self):
        """An elastic job's first step boundary: the checks its optimizers'
        construction held back (``Partition.start_checks``), on every first
        member (inside the boundary's recovery)."""
        if self._partition is not None:
            for check in self._partition.start_checks or ():
                check()
