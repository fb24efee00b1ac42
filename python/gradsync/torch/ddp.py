"""``DistributedDataParallel``: gradsync under PyTorch's DDP interface.

What happens in one step::

    forward          the wrapped module runs; its outputs pass through a sink
                     whose backward marks "backward reached this model"
    backward         every parameter's hook (C++, on its AccumulateGrad node:
                     ``_hooks``) hands its .grad (the contribution since the
                     last firing) to the runtime, token = the hook's firing
                     index in the step; buckets are all-reduced while
                     backward goes on (under ``no_sync`` the gradients stay
                     in .grad and sum up there, as under DDP)
    end of backward  when the last backward pass that reached the model ends
                     (the outermost: a reentrant checkpoint's nested passes
                     end inside it), a callback ends the step: remaining
                     buckets, control, corrections; then the averaged
                     gradients are written into .grad

A second backward through the outputs of a synchronized forward
(``retain_graph=True``) after its step ended is a step of its own: its
average is added to ``.grad``.

So, as with DDP, ``.grad`` holds the averaged gradient when ``loss.backward()``
returns, but a parameter whose hook fires twice (reentrant checkpointing,
shared weights, two forwards before one backward) is exact instead of an
error, and a parameter that is unused on some ranks, or every rank, needs no
``find_unused_parameters``.

What ``.grad`` is after a step (DDP's rules, with DDP's default
``gradient_as_bucket_view=False`` as the model):

* a parameter whose ``.grad`` existed when backward began (kept by
  ``zero_grad(set_to_none=False)``, scaled or clipped in place, or a tensor
  you assigned) gets the average written into that same tensor: every
  reference to it, and every view of it, sees the average;
* a parameter whose ``.grad`` was ``None`` (``zero_grad()``, the default)
  gets a new tensor; a reference kept from an earlier step keeps that step's
  average, unchanged, for as long as you hold it. The new tensor is a view of
  gradsync's bucket memory (no copy) when nothing holds the previous step's
  views, and a copy otherwise, so holding references never blocks a step and
  never makes gradsync keep more than one extra set of buckets (``_grads``).

This module holds what is torch's own: building the wrapper over torch's
process group and the forward. The step state and its rules are the
framework-neutral core's (``gradsync._core``); the hook, the record and
writing results are in ``_hooks`` (over the C++ ``Ledger``), the framework's
part in ``_grads``, the rest of torch's DDP surface in ``_surface`` (uneven
inputs in ``_join``), finding the tensors of the model's outputs in ``_outputs``.
"""

import functools
import itertools
import logging
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, _JoinConfig
from torch.utils._pytree import tree_map_only

from gradsync._controls import StepControls
from gradsync._core import ModelSync, Replica, SyncSettings, check_wire, select_parameters
from gradsync._errors import ConfigError
from gradsync._gloo import never_free
from gradsync.torch import _shim, _torch_group
from gradsync.torch._comm import TorchCommunicator
from gradsync.torch._live import LIVE, enlist
from gradsync.torch.sharding import clip as _clip
from gradsync.torch.sharding.gather import ParameterGather
from gradsync.torch.sharding.materialize import on_meta
from gradsync.torch._grads import TorchGrads, reals
from gradsync.torch._hooks import Hooks
from gradsync.torch._reducer import Reducer
from gradsync.torch._states import StateBroadcast
from gradsync.torch.sharding.unit_modules import choose as choose_units
from gradsync.torch.sharding.sharded import Sharded, Where
from gradsync.torch.sharding.wrapper import ShardedSurface, install_framework_saves, placed_meta
from gradsync.torch.sharding.settings import refuse as refuse_sharded
from gradsync.torch.sharding.settings import pacing_of, param_dtype_of, scatters
from gradsync.torch._sparse import SparseGrads, refuse_in_elastic_job, sparse_parameters
from gradsync.torch._surface import DdpSurface, timeout_seconds

log = logging.getLogger("gradsync.torch")

# Per parameter dtype, the real type the runtime reads its gradient as. A
# complex gradient is its real and imaginary parts (the same memory, read as
# twice as many reals): a sum does not mix them.
_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.complex64: "float32",
    torch.complex128: "float64",
}
_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel
_REFUSED = ("mixed_precision", "device_mesh", "delay_all_reduce_named_params", "param_to_hook_all_reduce")

# Where a torch backward can end without gradsync seeing it: nowhere known
# (the C++ hook watches every task that reaches the model to its end).
_UNSEEN_END = "a backward whose end the C++ hook did not see; please report it"
# Wrappers built per process group, in order: every rank builds them in the
# same order (as with DDP), so the n-th wrapper has the same prefix everywhere.
_BUILT = {}


def _end_of_backward(ref):
    """The last backward that reached a wrapped model ended (the C++ hook
    calls this once per step): end its step."""
    ddp = ref()
    if ddp is not None:
        ddp._sync.end_of_backward()


def _sync_asked(ref):
    """A second backward runs through the outputs of a synchronized forward
    (``retain_graph=True``) after that step ended: a step of its own, whose
    average is added to ``.grad``, as one backward of both losses would have
    left it."""
    ddp = ref()
    if ddp is not None:
        ddp._ask_for_sync()


class DistributedDataParallel(ShardedSurface, StepControls, DdpSurface, _TORCH_DDP):
    """Data parallelism for ``module``, a drop-in for
    ``torch.nn.parallel.DistributedDataParallel`` (and a subclass of it, so
    libraries that check for DDP or unwrap ``.module`` treat it as DDP; see
    :func:`gradsync.torch.replace_ddp` to make such libraries build it).

    Build one per rank after ``torch.distributed.init_process_group`` (every
    rank wraps its models in the same order). ``process_group`` selects the
    ranks (default: all); gradsync runs its collectives on a gloo group of its
    own over those ranks. ``bucket_cap_mb`` caps a bucket (default 25); the
    last three buckets of backward hold a half, a quarter and an eighth of
    it, so little is left to reduce when backward ends.
    ``broadcast_buffers`` sends rank 0's buffers to every rank at each
    forward, as DDP does. Parameters and buffers named by torch's
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    stay each rank's own, as under DDP. A parameter that did not require
    grad when the module was wrapped is not averaged if it is unfrozen later
    (nor is it by DDP): an optimizer step over its gradient raises
    :class:`gradsync.ConfigError`; wrap the module again instead: a new
    wrapper of a module takes it over from the old one, which is retired
    (no ``close()`` needed). ``model.reducer`` answers the calls libraries
    make on torch's reducer (``gradsync.torch._reducer``). The wrapper
    deep-copies and pickles as torch's DDP does (see :meth:`__setstate__`).

    Accepted for compatibility and not needed: ``find_unused_parameters``,
    ``static_graph``, ``gradient_as_bucket_view``, ``check_reduction``,
    ``device_ids``, ``output_device``, ``dim``, ``init_sync``,
    ``skip_all_reduce_unused_params`` (gradsync finds unused parameters and
    repeated hooks by itself, with overlap from the first step). DDP features
    gradsync does not have (``mixed_precision``, ``device_mesh``,
    ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``) are
    refused with a :class:`gradsync.ConfigError`.

    gradsync's own settings:

    * ``timeout``: how long a collective waits for the other ranks (seconds or
      ``timedelta``; default 300 s); a rank that does not join is named.
    * ``abort_policy``: ``"skip"`` (default): a step some rank aborted is
      applied by no rank; ``"partial"``: the ranks that finished apply it,
      averaged over themselves (and so does the aborting rank).
    * ``record_timeline``: keep every step's timeline for :meth:`write_timeline`.
    * ``wire_dtype``: ``"bfloat16"`` or ``"float16"`` sends the data buckets in
      that type (half the bytes, like DDP's ``bf16_compress_hook`` /
      ``fp16_compress_hook``; the sum loses precision), ``"float32"`` (default)
      sends them as they are. Control words and corrections always travel exactly.
    * ``buckets``: where the buckets live. ``"device"`` (the default for CUDA
      parameters): torch tensors on the parameters' GPU, packed on a stream
      of gradsync's after each gradient's producing stream (an event, no host
      wait), summed by NCCL while backward goes on; the caller's stream waits
      for the result when backward ends, as under DDP. ``"host"`` (the
      default for CPU parameters): the runtime's own memory, summed by gloo;
      for CUDA parameters that stages every gradient through host memory
      (slow, warned about). Where the device plane cannot run (a build
      without gradsync's C++ modules, an accelerator other than CUDA) the
      default is ``"host"``, with that warning; ``"device"`` there raises
      ``ConfigError``.
    * ``shard_gradients``: ``True`` shards gradients and optimizer state
      (ZeRO-2): each rank keeps the averages of its partition of every
      bucket only (reduce-scattered on NCCL, all-reduced on gloo and in an
      elastic job, whose ranks keep a buddy's partition too), ``model.shard_optimizer(AdamW, ...)``
      builds the optimizer that steps it and all-gathers the parameters
      (``gradsync.torch.sharding.wrapper``). ``.grad`` stays ``None``; clip with
      ``model.clip_grad_norm_`` or ``torch.nn.utils.clip_grad_norm_``.
    * ``shard_parameters``: ``True`` shards the parameters too (ZeRO-3):
      each rank keeps its pieces of every parameter in memory of their own,
      and a *unit* of modules (each block of the model's largest
      ``ModuleList`` or ``Sequential``; or the modules given, as
      ``shard_parameters=[block, ...]``) is whole only while its forward or
      backward runs, gathered on a lane of its own in rounds every rank
      joins, so no rank's own forward can hang the others
      (``gradsync.torch.sharding.units``); the rest of the model (the root
      unit) is whole from the forward to the step's end. A model with no
      such blocks (or ``shard_parameters=[]``) is gathered whole once per step
      (``gradsync.torch.sharding.parameters``). Between steps each parameter
      is an empty tensor: read or write them there inside ``with
      model.whole_parameters():`` (every rank). ``join`` works as under
      DDP, and so does an elastic job (each rank keeps its buddy's pieces
      too). A model built on the meta device (``with torch.device("meta"):``)
      is materialized a unit at a time on ``device_ids[0]`` (else the
      current CUDA device, else the CPU), each unit initialized by
      ``param_init`` and sent from rank 0 (``gradsync.torch.sharding.materialize``).
    * ``param_dtype``: with ``shard_parameters``, ``torch.bfloat16`` or
      ``torch.float16``: the float32 and float64 parameters compute in it
      (a step gathers a rounded copy of the pieces; as FSDP2's
      ``MixedPrecisionPolicy(param_dtype=...)``), while the pieces, the
      average of their gradients (reduced in float32) and the optimizer
      stay in the parameters' own dtype. The parameters are released when
      wrapping; inside ``whole_parameters()`` (state dicts, checkpoints)
      they are whole in their own dtype, exactly. Not in an elastic job yet.
    * ``buckets_in_flight``: with ``shard_parameters`` on a model with
      blocks, the most buckets still in their reduction when a block's
      backward begins; it waits for the rest (joining the other ranks'
      gather rounds meanwhile, so a peer that needs this rank first is
      never left waiting). ``1`` (the default on a CUDA device): one
      block's reduction overlaps the next block's backward, as FSDP2's
      reduce-scatter stream does; ``0`` (the default elsewhere, as FSDP2's
      blocking reduce-scatter on CPU): one whole bucket at a time, no
      overlap across blocks; ``None``: no wait (a lagging communicator
      holds more buckets whole).
    * ``prefetch_units``: with ``shard_parameters`` on a model with blocks,
      ``False`` gathers each block only when it is needed, not while the
      one before computes: one block whole instead of two, no overlap of
      the gathers (``True``, the default).
    * ``param_init``: for a model built on the meta device (with
      ``shard_parameters``), ``fn(module)`` initializing a module's own
      parameters and buffers in place (default: its ``reset_parameters()``;
      for HF models ``model._init_weights``).
    * ``elastic``: a :class:`gradsync.torch.Elastic` (the job runs under
      ``python -m gradsync.launch``; no ``init_process_group`` needed): a lost
      rank does not end the job, a replacement joins it (see
      :mod:`gradsync.torch.elastic`).

    Gradients of float32 and float64 parameters are reduced in their own type
    (as DDP reduces them); float16 and bfloat16 ones in float32 (exact) and
    rounded back; complex64 and complex128 ones as their real and imaginary
    parts (float32, float64). Non-contiguous gradients are copied. The
    sparse gradients of embeddings built with ``sparse=True`` are reduced
    outside the buckets when a step applies, and stay sparse (``_sparse``).
    ``path`` says which hooks, collectives and bucket memory run. See the
    module docs for what ``.grad`` holds after a step.
    """

    _NAME = "DistributedDataParallel"
    #: gradsync's own keyword arguments (also accepted by :func:`gradsync.torch.replace_ddp`).
    GRADSYNC_SETTINGS = ("timeout", "abort_policy", "record_timeline", "wire_dtype", "buckets", "elastic",
                         "shard_gradients", "shard_parameters", "param_dtype", "buckets_in_flight",
                         "prefetch_units", "param_init")
    # Settings given to replace_ddp, applied to wrappers that torch's constructor builds.
    _replace_settings = {}

    def __init__(
        self,
        module,
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=True,
        init_sync=True,
        process_group=None,
        bucket_cap_mb=None,
        find_unused_parameters=False,
        check_reduction=False,
        gradient_as_bucket_view=False,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
        **settings,
    ):
        torch.nn.Module.__init__(self)
        # What torch's Joinable.__init__ sets (torch's DDP.__init__ is not run).
        self._join_config = _JoinConfig.construct_disabled_join_config()
        #: The step whose coming the ranks out of data were told of (``_notify_join``).
        self._join_notified = None
        unknown = set(settings) - set(self.GRADSYNC_SETTINGS)
        if unknown:
            raise TypeError(
                f"DistributedDataParallel got unexpected keyword arguments {sorted(unknown)}; gradsync's own "
                f"settings are {list(self.GRADSYNC_SETTINGS)}"
            )
        settings = {**self._replace_settings, **settings}
        features = (mixed_precision, device_mesh, delay_all_reduce_named_params, param_to_hook_all_reduce)
        for name, value in zip(_REFUSED, features):
            if value is not None:
                raise ConfigError(f"{name} is a torch DDP feature gradsync does not have: leave it unset")
        if isinstance(module, DistributedDataParallel):
            raise ConfigError("this is a gradsync DistributedDataParallel already: wrap the plain module (its .module)")
        if isinstance(module, _TORCH_DDP):
            raise ConfigError("this module is already wrapped by torch's DistributedDataParallel: wrap the plain module")
        elastic = settings.get("elastic")
        if elastic is None and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("call torch.distributed.init_process_group(...) before wrapping (torchrun sets it up)")
        # What a copy or an unpickled wrapper is rebuilt with (__getstate__).
        self._init_settings = dict(
            settings, device_ids=device_ids, output_device=output_device, dim=dim,
            broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
        )
        wire = check_wire(settings.get("wire_dtype", "float32"))
        self.module = module
        # `ddp = DDP(model)` run again: the wrapper that holds this module's parameters is retired first, and
        # one that sharded them gives them back whole, so this one sees (and selects) their values.
        for earlier in [w for w in LIVE if w is not self and w._holds_any(list(module.parameters()))]:
            earlier._retire()
        param_init = settings.get("param_init")
        meta = (placed_meta(module, settings, device_ids), param_init) if on_meta(module) else None
        if param_init is not None and meta is None:
            raise ConfigError("param_init initializes a model built on the meta device, and this one is not: leave "
                              "it unset, or build the model under torch.device('meta')")
        self._select_parameters(module)
        shard_parameters = settings.get("shard_parameters", False)
        # (An empty list of units is one unit, the whole model.)
        wanted = shard_parameters is not None and shard_parameters is not False
        units = choose_units(module, self._params, shard_parameters) if wanted else None
        sharded = wanted or bool(settings.get("shard_gradients", False))
        param_dtype = param_dtype_of(settings)
        pacing = pacing_of(settings, units, self._device.type)
        #: ``param_dtype`` (or ``None``): the forward's floating-point inputs are cast to it.
        self._param_dtype = param_dtype
        if sharded:
            refuse_sharded(settings, [n for n, _ in self._sparse_named])
        # DDP's plain attributes, which libraries read (Lightning reads
        # static_graph). gradsync needs none of these declarations.
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.device = self._device
        self.device_type = self._device.type
        self.static_graph = bool(static_graph)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.mixed_precision = None
        self.logger = None
        self.require_forward_param_sync = True
        self._broadcast_buffers = broadcast_buffers
        timeout_s = timeout_seconds(settings.get("timeout"))
        cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * (1 << 20))
        # torch.compile's DDPOptimizer splits compiled graphs at this many
        # bytes of parameters; it refuses less than torch's first-bucket size.
        self.bucket_bytes_cap = max(cap, dist._DEFAULT_FIRST_BUCKET_BYTES)
        path, arrivals, collectives = _shim.data_path(self._device, settings.get("buckets"))
        if elastic is not None:
            # An elastic job: the groups live in the job's store, under its membership epoch.
            if process_group is not None:
                raise ConfigError("elastic=...: the members are the elastic job's; leave process_group unset")
            refuse_in_elastic_job([n for n, _ in self._sparse_named])
            self.process_group = None
            store, prefix, self._rank, self._world = elastic.attach(self)
        else:
            prefix, store = self._join_group(process_group)
        self._store, self._prefix, self._timeout_s = store, prefix, timeout_s
        comm = TorchCommunicator(
            store=store, prefix=prefix, rank=self._rank, world=self._world, timeout_s=timeout_s, shim=collectives,
            plane_device=self._device if path.buckets == "device" else None,
            cancel=None if elastic is None else elastic.cancel,
            membership_epoch=0 if elastic is None else elastic.epoch,
        )
        self._comm = comm
        self._abandon = None if elastic is None else elastic.abandoned
        self._retired_states = []
        self._states = StateBroadcast(store, prefix, self._rank, self._world, timeout_s, self._abandon)
        if elastic is None and meta is None:
            # (An elastic job sends them at its first step boundary, where a lost member is recovered from;
            # a model on the meta device, a unit at a time as it is materialized.)
            self.broadcast_module_states()
        # (Under param_dtype, the float32 and float64 parameters' gradients come in that dtype.)
        lowered = {torch.float32, torch.float64} if param_dtype is not None else set()
        replica = Replica(self._rank, self._world, self._names, [reals(p) for p in self._params],
                          [_DTYPES[param_dtype if p.dtype in lowered else p.dtype] for p in self._params])
        options = {k: settings[k] for k in ("abort_policy", "record_timeline") if k in settings}
        self._sync = ModelSync(self._NAME, _UNSEEN_END, path, comm, replica,
                               SyncSettings(cap, timeout_s, wire_dtype=wire, partitioned=sharded,
                                            reduce_scatter=scatters(path, self._device),
                                            buddy_stride=elastic.buddy_stride if sharded and elastic else 0,
                                            units=units[0] if units and len(units[1]) > 1 else None, **options),
                               membership=None if elastic is None else elastic.membership)
        if elastic is not None:
            self._sync.elastic = elastic
            if elastic.fixed_global_batch:
                self._sync.set_divisor(elastic.first_world)
        plane = comm if path.buckets == "device" else None
        if sharded:
            #: The wrapper's one sharded object (``sharding.sharded``): all of its sharded state.
            self._sharded = Sharded(
                self, self._sync, self._params, self._names, reals,
                Where(store, prefix, self._rank, self._world, timeout_s, self._abandon), self._states,
                ParameterGather.of_session(self._sync.session, arrivals.host_bucket, plane), elastic=elastic,
                parameters=units, param_dtype=param_dtype, meta=meta,
            )
            _clip.track(self)
            install_framework_saves(bool(units))
        self._attach_hooks(arrivals, plane)
        if sharded:
            self._sharded.hooked(self._hooks.rehook, collectives, arrivals.host_bucket, comm.plane_device, pacing)
        # torch's model.reducer, as far as libraries call it (_reducer).
        self.reducer = Reducer(self)
        enlist(self)

    # ---- what an elastic job's membership calls (gradsync.torch.Elastic) ---------------------

    def reconfigure(self, *, store, prefix, rank, world, epoch, buddy_stride=1):
        """The one seam of a membership change: this replica is now ``rank``
        of ``world`` in membership epoch ``epoch`` (a sharded one keeping
        buddy copies ``buddy_stride`` ranks on), its groups under
        ``prefix`` of ``store``. The groups move there (the old ones are
        kept until the process ends, ``_gloo.never_free``: a gloo group's
        destructor waits out work abandoned on a silent peer), and the
        runtime agrees with the new members on the step to go on at.
        Returns the failed step reduced again among them (a ``Step``, under
        the partial policy when every member could), or ``None``. Every
        member calls it at the same point."""
        self._rank, self._world, self._store, self._prefix = rank, world, store, prefix
        _torch_group.retire()
        self._comm.move(prefix, rank, world, epoch, store)
        self._retired_states.append(never_free(self._states))
        self._states = StateBroadcast(self._store, prefix, rank, world, self._timeout_s, self._abandon)
        dropped = False
        if self._sharded is not None:
            dropped = self._sharded.settle_members(
                Where(store, prefix, rank, world, self._timeout_s, self._abandon), self._states, buddy_stride)
        _, redone = self._sync.session.resume(rank, world, buddy_stride)
        if dropped:
            self._sync.elastic.step_dropped()
        if redone is not None and self._sharded is not None:
            self._sharded.reduced_again()
        return redone

    def torch_group(self):
        """This wrapper's ranks as a group ``torch.distributed`` knows (for
        ``torch.distributed.checkpoint``): ``process_group``, or in an
        elastic job torch's default group over the current members, made
        on first use in each membership epoch (``_torch_group``; every
        member calls it at the same point)."""
        if self._sync.elastic is None:
            return self.process_group
        return _torch_group.elastic_world(self._store, self._prefix, self._rank, self._world, self._timeout_s,
                                          self._abandon)

    @property
    def state_group(self):
        """The wrapper's state group of the current epoch (``_states.StateBroadcast``):
        where parameters, buffers and an elastic job's state travel, on the
        training thread (never the communicator's)."""
        return self._states

    def broadcast_module_states(self):
        """Rank 0's parameters and buffers to every rank (what the
        constructor does; an elastic job does it at its first boundary)."""
        self._states.broadcast(self._model_states())

    def broadcast_buffers(self, *, force=False):
        """Rank 0's buffers to every rank, waiting for the receivers, under
        DDP's rule (after a synchronized forward); ``force``: whatever each
        rank's last forward was (after a membership change, every member
        sends or receives them alike)."""
        if force:
            self.require_forward_param_sync = True
        self._broadcast_buffers_now(wait=True)

    def _broadcast_buffers_now(self, wait=False, joined=False):
        """Rank 0's buffers to every rank, when DDP would send them: before a
        forward that follows a synchronized one (``require_forward_param_sync``,
        set by each forward as DDP sets it). An elastic job's boundary does it
        instead of the forward, under the same rule, where a lost member is
        recovered from (``wait``: rank 0 waits for the receivers there, so a
        lost one is seen at the boundary; before a forward it does not, see
        ``_states``).

        Inside a ``Join`` (uneven inputs) the buffers come from the highest
        rank still training, as DDP takes them (rank 0 may have run out of
        data, its buffers stale); a rank that ``joined`` takes part from its
        join hook, once per step of the others."""
        if self._broadcast_buffers and self.require_forward_param_sync:
            buffers = self._shared(self.module.named_buffers())
            if not buffers:
                return
            root = 0
            if self._join_config.enable:
                root = self._states.highest(not joined)
                if root < 0:
                    raise ConfigError("every rank joined, yet a forward asks for buffers: nothing to send them from")
            (self._states.broadcast if wait or joined else self._states.send)(buffers, root)

    def _select_parameters(self, module):
        """The parameters to average: those that require grad and have
        elements, less DDP's ignore list (``_set_params_and_buffers_to_ignore_for_model``,
        set on the module before wrapping: never averaged or broadcast, each
        rank's own; a root-level name may come with a leading dot, as torch's
        own recipe writes it)."""
        self.parameters_to_ignore = {
            n[1:] if n.startswith(".") else n for n in getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ()
        }
        ignored = self.parameters_to_ignore
        # Empty parameters (a zero-width layer, a placeholder) have nothing to
        # average: their gradients are left as they are, as under DDP.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored and p.numel()]
        # Embeddings built with sparse=True: reduced outside the buckets (_sparse).
        sparse = sparse_parameters(module)
        self._sparse_named = [(n, p) for n, p in named if id(p) in sparse]
        named = [(n, p) for n, p in named if id(p) not in sparse]
        if self._sparse_named and not named:
            raise ConfigError(
                f"every parameter of the model wrapped by {self._NAME} has sparse gradients "
                f"({[n for n, _ in self._sparse_named][:3]}): gradsync needs at least one dense parameter to "
                "synchronize (build the embedding with sparse=False)"
            )
        self._names, self._params = select_parameters(
            named,
            dtype_name=lambda p: _DTYPES.get(p.dtype),
            device_of=lambda p: str(p.device),
            kind=self._NAME,
            empty_hint=" outside the ones it asks DDP to ignore" if ignored else "",
            dtype_hint="; list it in DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, "
            "names) before wrapping to keep it out",
        )
        # Parameters frozen when wrapped (and not ignored): gradsync has no hook
        # on them, so a gradient they get after being unfrozen is not averaged.
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and n not in ignored]
        self._device = self._params[0].device
        if self._device.type == "meta":
            raise ConfigError("the module is on the meta device: materialize its parameters first")

    def _join_group(self, process_group):
        """This rank's place in ``process_group`` (default: every rank) and
        the store prefix of this wrapper's own groups: the n-th wrapper built
        over the same ranks gets the same prefix on every rank."""
        group = process_group if process_group is not None else dist.group.WORLD
        self.process_group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        if self._rank < 0:
            raise ConfigError("this process is not a member of process_group")
        key = "-".join(map(str, dist.get_process_group_ranks(group)))
        nth = _BUILT[key] = _BUILT.get(key, 0) + 1
        return f"gradsync/{key}/{nth}", dist.distributed_c10d._get_default_store()

    def _attach_hooks(self, arrivals, plane):
        """The C++ hook on the parameters (a wrapper that held one of them
        was retired when this one was built: its hooks are off).
        ``plane``: the communicator, when the buckets are on the device
        plane."""
        ref = weakref.ref(self)
        hooks = Hooks(
            arrivals, self._names, self._params, self._device, self._sync.session,
            functools.partial(_end_of_backward, ref), functools.partial(_sync_asked, ref),
            staging=plane is None and self._device.type != "cpu", device_plane=plane is not None,
            plane_stream=None if plane is None else plane.plane_stream(),
        )
        sparse = SparseGrads([n for n, _ in self._sparse_named], [p for _, p in self._sparse_named], self._states,
                             self._rank)
        self._hooks = hooks
        self._sync.attach(TorchGrads(self._params, hooks, plane, sparse, self._partition))

    # ---- forward and the end of backward --------------------------------------------------

    # The wrapper's bookkeeping runs eagerly under torch.compile (as DDP's
    # forward does); frames it calls, the wrapped module's, are compiled.
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs, **kwargs):
        """Run the module (as torch's active DDP module, for ``torch.compile``);
        the outermost backward through its outputs ends a synchronized step."""
        sync = self._sync
        grad_enabled = torch.is_grad_enabled()
        if self._sharded is not None and grad_enabled:
            self._sharded.refuse_if_owed()
        synced = sync.before_forward(grad_enabled)
        if synced or (grad_enabled and self.parameters_sharded):
            # Inside `with model.join()`: tell ranks whose inputs ran out that
            # one more step is coming (they shadow it); with sharded
            # parameters at its first forward, synchronized or not (a
            # no_sync micro-batch gathers too).
            self._notify_join()
        if sync.elastic is None:
            self._broadcast_buffers_now()
        # After the buffers' broadcast: a rank out of data (join) takes part
        # in it before it serves this step's gathers.
        gathered = self._sharded.forward_begins() if self._sharded is not None else False
        if grad_enabled and torch._C._current_graph_task_id() != -1:
            # Recomputed inside backward (the model in a reentrant checkpoint):
            # the backward running now reached the model.
            self._hooks.reached()
        # As the active DDP module, torch.compile's DDPOptimizer splits a
        # compiled module at bucket boundaries, so its backward still
        # produces gradients bucket by bucket (overlap under compile).
        if self._param_dtype is not None:
            # As FSDP2's cast_forward_inputs: the parameters compute in param_dtype, so do the inputs.
            inputs, kwargs = _cast_floats((inputs, kwargs), self._param_dtype)
        previous = _TORCH_DDP._active_ddp_module
        _TORCH_DDP._active_ddp_module = self
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            _TORCH_DDP._active_ddp_module = previous
        if self._sharded is not None:
            self._sharded.forward_ends(gathered, grad_enabled)
        # DDP's rule for the next forward's buffer broadcast: only after a
        # forward that asked for a synchronized backward (under grad, outside
        # no_sync); so after a no_sync micro-batch or an eval forward, the
        # next forward keeps each rank's buffers, as under DDP.
        self.require_forward_param_sync = grad_enabled and sync.require_sync
        if grad_enabled:
            self._hooks.watch(output, synced)
        return output

    def _ask_for_sync(self):
        """The open step ends, averaged, with the outermost backward that
        reaches the model (``reducer.prepare_for_backward`` asks for it too)."""
        if not self._sync.record.sync_pending:
            self._notify_join()
            self._sync.ask_for_sync()

    def _notify_join(self):
        """Inside ``with model.join()``: tell the ranks whose inputs ran out
        that this rank's step is coming (each shadows it: ``_join``), once
        per step."""
        step = self._sync.current_step
        if self._join_notified == step:
            return
        self._join_notified = step
        Join.notify_join_context(self)

    def _raise_if_unaveraged(self, optimizer):
        """Refuse an optimizer step over a gradient no rank averaged: a
        parameter unfrozen after wrapping (torch's DDP steps it silently,
        and the replicas drift apart)."""
        late = [(n, p) for n, p in self._frozen if p.requires_grad and p.grad is not None]
        if not late:
            return
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        late = [n for n, p in late if id(p) in stepped]
        if late:
            raise ConfigError(
                f"parameters {late[:5]}{' and more' if len(late) > 5 else ''} did not require grad when the model "
                "was wrapped and have gradients now; gradsync averages only the parameters it was built with, so "
                "this step would move every replica its own way. Wrap the model again after changing "
                "requires_grad (ddp = DistributedDataParallel(model): the new wrapper retires this one), or set it "
                "before wrapping; for parameters meant to stay each rank's own, list them in "
                "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) before wrapping"
            )

    @staticmethod
    def _placement(p):
        return (p.dtype, p.device)

    # ---- closing and retiring -------------------------------------------------------------

    def close(self):
        """Stop gradsync's threads and remove the hooks; later use raises
        ``ClosedError``. Optional, as with torch's DDP: wrapping the module
        again retires this wrapper, and a wrapper the program drops is closed
        when it is collected."""
        self._sync.close(f"this gradsync {self._NAME} was closed")
        LIVE.discard(self)

    def _holds_any(self, params):
        """Whether this wrapper synchronizes any of ``params``."""
        mine = {id(p) for p in self._params}
        return any(id(p) in mine for p in params)

    def _retire(self):
        """A newer wrapper took this one's module over (as ``ddp = DDP(model)``
        run again does under torch's DDP, whose old reducer dies with the old
        wrapper): remove the hooks, stop the threads, refuse later use."""
        names = ", ".join(repr(n) for n in self._names[:3]) + (" ..." if len(self._names) > 3 else "")
        if self.parameters_sharded and not self._sync.closed:
            # The newer wrapper takes the module as it is: give it the values (a collective, as building a
            # wrapper is: every rank wraps again at the same point).
            self._gather_whole()
        self._sync.close(
            f"this gradsync {self._NAME} was retired: its module (parameters {names}) was wrapped again by a "
            f"newer {self._NAME}, which synchronizes it now; use the new wrapper"
        )
        LIVE.discard(self)
        log.info("gradsync: a newer wrapper took parameters %s over; the older wrapper was retired", names)

    def _model_states(self):
        """The wrapped module's parameters and buffers (what replicas share)."""
        return self._shared(itertools.chain(self.module.named_parameters(), self.module.named_buffers()))

    def _shared(self, named):
        """The tensors of ``(name, tensor)`` pairs that are not ignored."""
        ignored = self.parameters_to_ignore
        return [t for n, t in named if n not in ignored]


def _cast_floats(tree, dtype):
    """``tree`` (nested tuples, lists, dicts) with its floating-point tensors cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)
