"""A sharded wrapper's one seam: :class:`Sharded`, the object
``DistributedDataParallel`` holds when it shards, and the only one through
which the wrapper reaches its sharded state.

It owns this rank's partition (``sharding.partition.Partition``), where the
parameters' whole values stand (``sharding.parameters`` /
``sharding.units``), the piece service other ranks read from
(``sharding.served``), the gather lane of each membership and the module
hooks it put on the wrapped module. The wrapper calls its verbs at fixed
points and keeps none of that state itself::

    DDP.__init__ ─▶ Sharded(...)        the partition laid over the plan, the parameters released
                 ─▶ hooked(hooks)       after the C++ hooks exist: their remaking, the units' lane
    forward      ─▶ forward_begins()    gathered (or read alone) ─▶ the module ─▶ forward_ends()
    abort / reset / join                take_part() / forget() / shadow()
    reconfigure  ─▶ settle_members(...) the partitions moved (``sharding.reshard``), a new lane

The wrapper's public sharded methods (``whole_parameters``,
``shard_optimizer``, ``clip_grad_norm_``, ...) are in
``sharding.wrapper``; each is a call into this object.

A change of members (``DistributedDataParallel.reconfigure``) settles the
partitions (the pieces of the optimizer state, and of the parameters when
they are sharded, move from their holders), then opens a new lane on the new
group, and every member's parameters are released, so that the next
forward's first round pairs up on every member::

    reconfigure ─▶ settle (state group of the new members) ─▶ a new lane ─▶ released
    first boundary ─▶ rank 0's module sent ─▶ the pieces read it (the model as built)
"""

import logging
import weakref

import torch

from gradsync._errors import ConfigError, StepFailedError
from gradsync._native import Lane
from gradsync.torch._comm import TorchCommunicator
from gradsync.torch.sharding.gather import LaneGather, ParameterGather
from gradsync.torch.sharding.materialize import materialize, refuse_uninitializable, unit_modules
from gradsync.torch.sharding.optimizer import ShardedOptimizer
from gradsync.torch.sharding.parameters import ShardedParameters
from gradsync.torch.sharding.partition import Partition
from gradsync.torch.sharding.reshard import settle
from gradsync.torch.sharding.served import PieceService
from gradsync.torch.sharding.unit_modules import ModuleHook
from gradsync.torch.sharding.units import UnitResidence

_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel

log = logging.getLogger("gradsync.elastic")


class Where:
    """Where a wrapper's groups live: its ``store``, its ``prefix`` there,
    this process's ``rank`` of ``world``, the collectives' ``timeout_s``
    and an elastic job's ``abandon`` (see ``_states.StateBroadcast``)."""

    __slots__ = ("store", "prefix", "rank", "world", "timeout_s", "abandon")

    def __init__(self, store, prefix, rank, world, timeout_s, abandon):
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world
        self.timeout_s, self.abandon = timeout_s, abandon


class Sharded:
    """A wrapper's sharded state and its verbs (see the module docs).

    ``wrapper``: the ``DistributedDataParallel`` (held weakly: its module's
    hooks ask whether it is the active DDP module); ``sync``: its
    ``ModelSync``; ``params``, ``names``: the synchronized parameters;
    ``reals(p)``: values of ``p`` in a bucket; ``where``: :class:`Where`;
    ``states``: the state group; ``gathering``: the runtime's gathers
    (``ParameterGather``); ``elastic``: the job's ``Elastic`` or ``None``.
    ``parameters``: the parameters are sharded too (their pieces own their
    values): ``sharding.units.choose``'s ``(units, names, modules)``;
    with more than one unit they are gathered a unit at a time
    (``sharding.units``, on a lane :meth:`hooked` opens), else whole once
    per step (``sharding.parameters``). ``param_dtype``: the dtype their
    float32 and float64 parameters compute in (they are released now: the
    hooks, made next, see that dtype); ``meta``: a model built on the meta
    device, ``(forms, param_init)`` (``materialize.place``), materialized
    here a unit at a time. In an ``elastic`` job each rank keeps its
    buddy's partition too, on another node when there is one."""

    def __init__(self, wrapper, sync, params, names, reals, where, states, gathering, elastic=None, parameters=None,
                 param_dtype=None, meta=None):
        module = wrapper.module
        self._wrapper = weakref.ref(wrapper)
        self._sync = sync
        self._module = module
        #: Where the groups live now (moved by :meth:`settle_members`).
        self._where = where
        if meta is not None:
            built = unit_modules(module, parameters[2])
            refuse_uninitializable(built, meta[1])
        joining = elastic is not None and elastic.joining
        #: This rank's partition of every bucket, and the sharded step's state.
        self.partition = part = Partition(
            sync.session.plan(), params, names, where.rank, where.world, reals, states, gathering,
            buddy_stride=0 if elastic is None else elastic.buddy_stride, own_all=bool(parameters),
            read=meta is None, recover=None if elastic is None else elastic.recover,
            # (An elastic job's first members check their optimizers at its first boundary; a joiner's is
            # checked by the members' fingerprint. A replacement holds nothing until its first settlement.)
            start_checks=[] if elastic is not None and not joining else None, holds=not joining,
        )
        #: The lane's makings (``hooked``): ``(collectives, host_tensor, plane_device)``; ``None``: no lane.
        self._lane_parts = None
        #: Lanes of earlier members, stopped, kept (a gloo group waiting on a vanished peer blocks its destructor).
        self._retired_lanes = []
        #: Per forward of the module called directly (not through the wrapper): whether it gathered.
        self._direct = []
        if not parameters:
            return
        units, unit_names, modules = parameters
        # (Set here once, by their one owner: each refers to the partition.)
        part.residence = residence = (UnitResidence(part, units, unit_names, modules, module) if len(unit_names) > 1
                                      else ShardedParameters(part))
        if meta is not None:
            forms, param_init = meta
            materialize(part, residence, built, forms, param_init, states)
        if param_dtype is not None:
            residence.compute_in(param_dtype)
        #: Whether the hooks must find the parameters released (:meth:`hooked`).
        self._release_when_hooked = param_dtype is not None or meta is not None
        # (An elastic job's servers follow its members: settle_members.)
        part.served = PieceService(
            part, where.store, where.prefix, where.timeout_s, epoch=0 if elastic is None else max(elastic.epoch, 0),
            abandon=where.abandon, publish=not joining,
        )
        sync.on_close.append(part.served.close)
        handles = [
            # A released parameter is empty: a state dict reads it from every rank's pieces, a load writes them.
            module.register_state_dict_pre_hook(ModuleHook(lambda *_: residence.state_dict_begins())),
            module.register_state_dict_post_hook(ModuleHook(lambda *_: residence.state_dict_ended())),
            module.register_load_state_dict_pre_hook(ModuleHook(lambda *_: residence.load_begins())),
            module.register_load_state_dict_post_hook(ModuleHook(lambda *_: residence.load_ended())),
            # The module called itself, not through this wrapper (HF Trainer's evaluation does).
            module.register_forward_pre_hook(ModuleHook(self._direct_forward_begins)),
            module.register_forward_hook(ModuleHook(self._direct_forward_ends)),
        ]
        # Closed or retired, the wrapper takes them off: a newer wrapper of the module would meet them.
        sync.on_close.append(lambda: [handle.remove() for handle in handles])

    def hooked(self, rehook, collectives, host_tensor, plane_device, pacing):
        """The wrapper made its C++ hooks (``rehook()`` makes them again):
        released parameters meet them released; gathered by units, the
        lane opens (``collectives``: the shim's, ``host_tensor``: the
        arrivals' ``host_bucket``, ``plane_device``: the device plane's,
        or ``None``; ``pacing``: ``(buckets_in_flight, prefetch_units)``,
        ``sharding.settings.pacing_of``), closed with the wrapper."""
        residence = self.partition.residence
        if residence is None:
            return
        residence.hooked(rehook, release=self._release_when_hooked)
        if not isinstance(residence, UnitResidence):
            return
        self._lane_parts = (collectives, host_tensor, plane_device)
        residence.pace(pacing, self._sync.await_in_flight)
        self._sync.on_close.append(lambda: residence.lane.close())
        self._sync.on_close.append(residence.remove_hooks)
        self._new_lane()

    def _new_lane(self):
        """A gather lane for the current members: a communicator of its own
        (its group under the wrapper's prefix, its device plane's stream
        and NCCL communicator; in an elastic job the job's cancellation,
        so a member gone silent fails its gathers too) and the runtime's
        ``Lane`` thread over it, taken by the units (which stop the lane
        of earlier members, kept here). Every member calls it at the same
        point."""
        collectives, host_tensor, plane_device = self._lane_parts
        elastic, where = self._sync.elastic, self._where
        comm = TorchCommunicator(
            store=where.store, prefix=f"{where.prefix}/lane", rank=where.rank, world=where.world,
            timeout_s=where.timeout_s, shim=collectives, plane_device=plane_device,
            cancel=None if elastic is None else elastic.cancel,
            membership_epoch=0 if elastic is None else elastic.epoch,
        )
        lane = Lane(comm, where.rank, where.world, timeout_s=where.timeout_s)
        earlier = self.partition.residence.take_lane(
            LaneGather(lane, comm, host_tensor, comm if plane_device is not None else None))
        if earlier is not None:
            self._retired_lanes.append(earlier)

    # ---- what the wrapper reads -------------------------------------------------------------

    @property
    def residence(self):
        """Where the parameters' whole values stand, or ``None`` (ZeRO-2)."""
        return self.partition.residence

    @property
    def parameter_bytes(self):
        """Bytes of this rank's pieces of the parameters (its buddy's too)."""
        return sum(piece.tensor.numel() * piece.tensor.element_size() for piece in self.partition.every_held_piece())

    # ---- forward -----------------------------------------------------------------------------

    def refuse_if_owed(self):
        """Before a forward with gradients, ahead of its step: refused while
        an aborted step's update is owed (``Partition.refuse_if_owed``)."""
        self.partition.refuse_if_owed("forward")

    def forward_begins(self):
        """Before a forward through the wrapper: parameter-sharded, the
        released parameters gathered (every rank's forward does it at the
        same point). Returns whether it gathered."""
        residence = self.partition.residence
        if residence is None:
            return False
        residence.forward_begins()
        if torch.is_grad_enabled() and residence.whole_in_own_dtype():
            # Whole in their own dtype (gathered for a framework's teardown): a step computes in param_dtype.
            self._sync.refuse_if_closed()
            residence.release(step_ended=False)
        if residence.whole:
            return False
        self._sync.refuse_if_closed()
        if residence.evaluates_alone():  # (no collective: the others need not evaluate with it)
            return residence.assemble_alone()
        return residence.assemble()

    def forward_ends(self, gathered, grad_enabled):
        """After a forward: one without gradients (an evaluation) that
        gathered the parameters releases them again (no backward needs them)."""
        residence = self.partition.residence
        if residence is None:
            return
        if not grad_enabled and residence.spoiled:
            log.warning("gradsync elastic: a member was lost during an evaluation forward's parameter gathers: its "
                        "output was computed with zeros where they failed; the job recovers in its next step")
        if gathered and not grad_enabled:
            residence.release(step_ended=False)
        else:
            residence.forward_ended()

    def _direct_forward_begins(self, module, args):
        """A forward of the wrapped module itself, not through the wrapper
        (HF ``Trainer`` evaluates the bare module): under ``no_grad`` it
        gathers as the wrapper's forward does (every rank evaluates the
        same batches, as DDP's evaluation needs too); with gradients on it
        is refused, saying what to call."""
        if _TORCH_DDP._active_ddp_module is self._wrapper():
            return
        if torch.is_grad_enabled():
            if self.partition.residence.whole:
                return
            raise ConfigError(
                "the wrapped module was called directly, with gradients on, while its parameters are sharded "
                "(shard_parameters=True): call the wrapper, model(x), which gathers them and synchronizes the "
                "step; evaluate the module itself under torch.no_grad()"
            )
        self._direct.append(self.forward_begins())

    def _direct_forward_ends(self, module, args, output):
        """The end of :meth:`_direct_forward_begins`' forward: released again."""
        if _TORCH_DDP._active_ddp_module is self._wrapper() or torch.is_grad_enabled():
            return
        self.forward_ends(self._direct.pop() if self._direct else False, False)

    # ---- whole parameters ---------------------------------------------------------------------

    def gather_whole(self):
        """Every parameter whole from now on (a collective), when sharded
        and released: what a framework that unwraps the module calls."""
        residence = self.partition.residence
        if residence is not None and not residence.whole:
            self._sync.refuse_if_closed()
            residence.assemble_all()

    def whole_begins(self):
        """The start of ``whole_parameters()``: returns whether it gathered
        (then :meth:`whole_ends` releases them)."""
        residence = self.partition.residence
        if residence is not None and residence.spoiled:
            raise StepFailedError(f"the parameters could not be gathered whole: {residence.lost_gather()}")
        if residence is None or residence.whole:
            return False
        self._sync.refuse_if_closed()
        residence.assemble_all()
        return True

    def whole_ends(self):
        """The end of a ``whole_parameters()`` that gathered: released, and
        what was written there is served at a new version."""
        self.partition.residence.release(step_ended=False)
        if self.partition.served is not None:
            self.partition.served.wrote()

    # ---- the step's controls ------------------------------------------------------------------

    def take_part(self):
        """``abort_step``: with sharded parameters, a rank that aborts
        before its first forward of the step still takes part in the step's
        parameter gather, as the others' forwards do (nobody waits for it);
        gathered by units, it serves the others' rounds once its zeros
        went out."""
        if self.partition.residence is not None:
            self._sync.refuse_if_closed()
            self.partition.residence.take_part()

    def forget(self):
        """``reset``: with sharded parameters every rank releases them,
        whatever the failed step left (gathered or not), so that every
        rank's next forward gathers."""
        if self.partition.residence is not None:
            self.partition.residence.forget()

    def shadow(self):
        """This rank ran out of data (``join``) and shadows a step of the
        others: with sharded parameters it takes part in that step's
        gathers, asking for nothing; gathered by units, its zeros for the
        step go out first, so that the others' reductions, which a unit's
        backward may wait for (``buckets_in_flight``), never wait for this
        rank. The shadow step that follows collects the step."""
        if self.partition.residence is not None:
            self._sync.refuse_if_closed()
            self.partition.residence.shadow(self._sync.begin_shadow_step)

    def join_now(self):
        """This rank ran out of data: it shadows each step of the others
        (their gathers, its partition stepped with their averages) until
        every rank has joined. Returns ``{"first_step", "steps"}``."""
        self._sync.refuse_if_closed()
        first, steps = self._sync.current_step, 0
        while True:
            self.shadow()
            report = self._sync.shadow_step()
            steps += 1
            if report.outcome == "all_joined":
                return {"first_step": first, "steps": steps}

    def zero_grad(self, set_to_none=True):
        """The gradients of this rank's pieces, where the averages live, dropped (or zeroed)."""
        self.partition.zero_grad(set_to_none)

    def clip(self, params, max_norm, norm_type, error_if_nonfinite):
        """Clip by the global norm over every rank's partition (a collective):
        ``params``: the wrapper's tensors to clip. Returns the total norm."""
        index = self.partition.index_of
        return self.partition.clip({index[id(p)] for p in params if id(p) in index}, max_norm, norm_type,
                                   error_if_nonfinite)

    # ---- the optimizer -------------------------------------------------------------------------

    def shard_optimizer(self, optimizer_class, params, defaults):
        """A ``ShardedOptimizer`` of ``optimizer_class`` over this rank's
        partition of ``params`` (``None``: every synchronized parameter)."""
        self._sync.refuse_if_closed()
        part = self.partition
        return ShardedOptimizer(part, part.names, part.states, optimizer_class, params, name_of=self._name_of,
                                **defaults)

    def take_over(self, optimizer):
        """``optimizer`` (built over the wrapper's parameters) converted in
        place to step this rank's pieces: returns its ``ShardedOptimizer``."""
        self._sync.refuse_if_closed()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in optimizer.param_groups]
        part = self.partition
        return ShardedOptimizer(part, part.names, part.states, type(optimizer), groups, adopt=optimizer,
                                name_of=self._name_of)

    def _name_of(self, tensor):
        """``tensor``'s name in the wrapped module, for errors."""
        for name, p in self._module.named_parameters():
            if p is tensor:
                return name
        return "(not a parameter of the wrapped module)"

    # ---- an elastic job's members ----------------------------------------------------------------

    def settle_members(self, where, states, buddy_stride):
        """A change of members (``reconfigure``), the groups now ``where``:
        the partitions move to the new layout (buddy copies
        ``buddy_stride`` ranks on), losing nothing (``sharding.reshard.settle``,
        on ``states``, the new members' state group). Sharded parameters are then released on
        every member (the pieces hold the new layout's values) and gathered
        by the next forward, on a new lane. Returns whether this rank
        dropped a step it had applied."""
        self._where = where
        part = self.partition
        dropped = settle(part, states, where.rank, where.world, buddy_stride=buddy_stride)
        residence = part.residence
        if residence is not None:
            if self._lane_parts is not None:
                self._new_lane()
            residence.discard()
        if part.served is not None:  # (the pieces held now, under the new members: sharding.served)
            part.served.moved(where.store, where.prefix, self._sync.elastic.epoch)
        return dropped

    def reduced_again(self):
        """The failed step was reduced again among the new members: it is
        clipped, stepped and gathered as usual."""
        self.partition.sharded_step.reduced_again()

    def boundary_passed(self):
        """An elastic job's step boundary passed: the next step makes its
        collectives again, and optimizers built from now on check at once."""
        self.partition.sharded_step.boundary_passed()
        self.partition.start_checks = None

    def run_start_checks(self):
        """An elastic job's first step boundary: the checks its optimizers'
        construction held back (``Partition.start_checks``), on every first
        member (inside the boundary's recovery)."""
        for check in self.partition.start_checks or ():
            check()
