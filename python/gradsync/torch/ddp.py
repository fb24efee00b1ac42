"""``DistributedDataParallel``: gradsync under PyTorch's DDP interface.

What happens in one step::

    forward          the wrapped module runs; its outputs pass through a sink
                     whose backward marks "backward reached this model"
    backward         every parameter's hook (C++ on its AccumulateGrad node,
                     or Python: ``_steps``) hands its .grad (the contribution
                     since the last firing) to the runtime, token = the
                     hook's firing index in the step; buckets are all-reduced
                     while backward goes on
    end of backward  in the *outermost* backward pass, a callback ends the
                     step: remaining buckets, control, corrections; then the
                     averaged gradients are written into .grad

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

Uneven inputs (torch's ``Join``) are in ``_join``; what the model's outputs
carry to see backward begin, in ``_outputs``.
"""

import datetime
import functools
import itertools
import logging
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, _JoinConfig
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradsync import _accumulate
from gradsync._errors import (
    ConfigError,
    GradientLayoutError,
    StepOrderError,
    UnfinishedStepError,
)
from gradsync._native import Session
from gradsync._wrapper import StepControls
from gradsync.torch import _autograd, _comm_hooks, _outputs, _steps
from gradsync.torch._grads import GradWriter, reals
from gradsync.torch._join import ShadowStep, rescale_to_initial_world
from gradsync.torch._reducer import Reducer
from gradsync.torch._states import StateBroadcast
from gradsync.torch._comm import TorchCommunicator

log = logging.getLogger("gradsync.torch")

_STRIDED = torch.strided
_current_task = torch._C._current_graph_task_id
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
_WIRES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel

# Wrappers alive and not closed in this process: for the optimizer check,
# and to find the wrapper a new one takes a module over from.
_LIVE = weakref.WeakSet()
# Wrappers built per process group, in order: every rank builds them in the
# same order (as with DDP), so the n-th wrapper has the same prefix everywhere.
_BUILT = {}
_OPTIMIZER_HOOK = None


def _check_before_optimizer_step(optimizer, args, kwargs):
    """An optimizer step must not apply gradients a wrapper never averaged."""
    for ddp in list(_LIVE):
        ddp._raise_if_unfinished("optimizer.step()")
        ddp._raise_if_unaveraged(optimizer)


def _backward_reached(ref, grad_outputs=None):
    """Backward reached a wrapped model's outputs (an output node's pre-hook,
    see ``_outputs``), or a native hook saw a new autograd task: the
    gradients pass unchanged."""
    ddp = ref()
    if ddp is not None:
        ddp._backward_activity()


def _synced_backward_reached(ref, grad_outputs=None):
    """As :func:`_backward_reached`, at the outputs of a forward that asked
    for a synchronized step. A second backward through them
    (``retain_graph=True``) after that step ended is a step of its own: its
    gradients are averaged and added to ``.grad``, as one backward of both
    losses would have left them."""
    ddp = ref()
    if ddp is not None:
        ddp._ask_for_sync()
        ddp._backward_activity()


def _odd_gradient(ref, index):
    """A native hook met a gradient the runtime cannot read."""
    ddp = ref()
    if ddp is not None:
        raise ddp._layout_error(index, ddp._params[index].grad)


class DistributedDataParallel(StepControls, _TORCH_DDP):
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

    Gradients of float32 parameters are reduced as they are; float64, float16
    and bfloat16 gradients are converted to float32 for the reduction and back
    (float64 loses precision beyond float32); complex64 and complex128 ones as
    their real and imaginary parts (float32, float64). Non-contiguous gradients are
    copied; sparse gradients are refused. CUDA parameters are staged through
    host memory (correct, not fast). See the module docs for what ``.grad``
    holds after a step.
    """

    _NAME = "DistributedDataParallel"
    #: gradsync's own keyword arguments (also accepted by :func:`gradsync.torch.replace_ddp`).
    GRADSYNC_SETTINGS = ("timeout", "abort_policy", "record_timeline", "wire_dtype")
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
        unknown = set(settings) - set(self.GRADSYNC_SETTINGS)
        if unknown:
            raise TypeError(
                f"DistributedDataParallel got unexpected keyword arguments {sorted(unknown)}; gradsync's own "
                f"settings are {list(self.GRADSYNC_SETTINGS)}"
            )
        settings = {**self._replace_settings, **settings}
        # What a copy or an unpickled wrapper is rebuilt with (__getstate__).
        self._init_settings = dict(
            settings,
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        timeout = settings.get("timeout")
        abort_policy = settings.get("abort_policy", "skip")
        record_timeline = settings.get("record_timeline", False)
        wire_dtype = settings.get("wire_dtype", "float32")
        for name, value in (
            ("mixed_precision", mixed_precision),
            ("device_mesh", device_mesh),
            ("delay_all_reduce_named_params", delay_all_reduce_named_params),
            ("param_to_hook_all_reduce", param_to_hook_all_reduce),
        ):
            if value is not None:
                raise ConfigError(f"{name} is a torch DDP feature gradsync does not have: leave it unset")
        if isinstance(module, DistributedDataParallel):
            raise ConfigError("this is a gradsync DistributedDataParallel already: wrap the plain module (its .module)")
        if isinstance(module, _TORCH_DDP):
            raise ConfigError("this module is already wrapped by torch's DistributedDataParallel: wrap the plain module")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("call torch.distributed.init_process_group(...) before wrapping (torchrun sets it up)")
        # Names torch's DDP leaves alone (``_set_params_and_buffers_to_ignore_for_model``,
        # set on the module before wrapping): never averaged or broadcast, each rank's own.
        # A root-level name may come with a leading dot (torch's own recipe,
        # f"{module_name}.{param_name}", writes it so): the same tensor.
        self.parameters_to_ignore = {
            n[1:] if n.startswith(".") else n for n in getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ()
        }
        # Empty parameters (a zero-width layer, a placeholder) have nothing to
        # average: their gradients are left as they are, as under DDP.
        named = [
            (n, p)
            for n, p in module.named_parameters()
            if p.requires_grad and n not in self.parameters_to_ignore and p.numel() > 0
        ]
        if not named:
            raise ConfigError(
                "the module has no parameter that requires grad"
                + (" outside the ones it asks DDP to ignore" if self.parameters_to_ignore else "")
                + ": there is nothing to synchronize"
            )
        devices = sorted({str(p.device) for _, p in named})
        if len(devices) > 1:
            by_device = {d: [n for n, p in named if str(p.device) == d][:3] for d in devices}
            raise ConfigError(f"parameters live on several devices {by_device}: put the module on one device")
        for name, p in named:
            if p.dtype not in _DTYPES:
                raise ConfigError(
                    f"parameter {name!r} has dtype {p.dtype}: gradsync averages float32, float64, float16, "
                    "bfloat16 and complex gradients; list it in "
                    "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) before "
                    "wrapping to keep it out"
                )
        if wire_dtype not in _WIRES:
            raise ConfigError(f"wire_dtype {wire_dtype!r}: use one of {list(_WIRES)}")
        self.module = module
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        # Parameters frozen when wrapped (and not ignored): gradsync has no hook
        # on them, so a gradient they get after being unfrozen is not averaged.
        self._frozen = [
            (n, p) for n, p in module.named_parameters() if not p.requires_grad and n not in self.parameters_to_ignore
        ]
        self._device = self._params[0].device
        if self._device.type == "meta":
            raise ConfigError("the module is on the meta device: materialize its parameters first")
        self._staging = self._device.type != "cpu"
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
        timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 300.0)
        group = process_group if process_group is not None else dist.group.WORLD
        self.process_group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        if self._rank < 0:
            raise ConfigError("this process is not a member of process_group")
        key = "-".join(map(str, dist.get_process_group_ranks(group)))
        nth = _BUILT[key] = _BUILT.get(key, 0) + 1
        prefix = f"gradsync/{key}/{nth}"
        store = dist.distributed_c10d._get_default_store()
        self._comm = TorchCommunicator(
            store=store, prefix=prefix, rank=self._rank, world=self._world, timeout_s=timeout_s, wire_dtype=_WIRES[wire_dtype]
        )
        self._wire_name = wire_dtype
        self._states = StateBroadcast(store, prefix, self._rank, self._world, timeout_s)
        self._broadcast_buffers = broadcast_buffers
        self.require_forward_param_sync = True
        self._states.broadcast(self._model_states())
        cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * (1 << 20))
        # torch.compile's DDPOptimizer splits compiled graphs at this many
        # bytes of parameters; it refuses less than torch's first-bucket size.
        self.bucket_bytes_cap = max(cap, dist._DEFAULT_FIRST_BUCKET_BYTES)
        session = Session(
            self._comm,
            self._rank,
            self._world,
            self._names,
            [reals(p) for p in self._params],
            [_DTYPES[p.dtype] for p in self._params],
            bucket_cap_bytes=max(cap, 1),
            timeout_s=timeout_s,
            abort_policy=abort_policy,
            record_timeline=record_timeline,
        )
        self._session = session
        self._give = session.give
        self._require_sync = True
        self._closed = False
        # Why later use is refused (closed, or retired by a newer wrapper of the same module).
        self._closed_why = None
        # finalize_backward() ends each synchronized step instead of the end of backward.
        self._manual_finalization = False
        # torch's model.reducer, as far as libraries call it (_reducer).
        self.reducer = Reducer(self)
        self._grads = GradWriter(self._params, self._staging)
        # The writer's list, read by the hook without an attribute hop.
        self._viewable = self._grads.viewable
        # Inside a Join context with divide_by_initial_world_size=True (DDP's
        # default): a step some rank shadowed is divided by the world size.
        self._divide_by_initial_world = False
        self.last_report = None
        ref = weakref.ref(self)
        self._ref = ref
        self._on_backward = functools.partial(_backward_reached, ref)
        self._on_synced_backward = functools.partial(_synced_backward_reached, ref)
        # A wrapper that holds any of these parameters is retired: its hooks
        # come off before this one's go on (``ddp = DDP(model)`` run again).
        for earlier in [w for w in _LIVE if w is not self and w._holds_any(self._params)]:
            earlier._retire()
        self._recorder = _steps.Recorder(
            self._params,
            self._viewable,
            self._staging,
            session,
            on_grad=self._make_hook,
            on_task=self._on_backward,
            on_odd=functools.partial(_odd_gradient, ref),
        )
        self._open = self._recorder.step(0)
        _LIVE.add(self)
        global _OPTIMIZER_HOOK
        if _OPTIMIZER_HOOK is None:
            _OPTIMIZER_HOOK = register_optimizer_step_pre_hook(_check_before_optimizer_step)

    # ---- forward and the end of backward --------------------------------------------------

    # The wrapper's bookkeeping runs eagerly under torch.compile (as DDP's
    # forward does); frames it calls, the wrapped module's, are compiled.
    @torch._disable_dynamo(recursive=False)
    def forward(self, *inputs, **kwargs):
        self._refuse_if_closed()
        self._raise_if_unfinished("forward")
        if self._broadcast_buffers and self.require_forward_param_sync:
            buffers = self._shared(self.module.named_buffers())
            if buffers:
                self._states.broadcast(buffers)
        grad_enabled = torch.is_grad_enabled()
        synced = grad_enabled and self._require_sync
        if synced:
            self._ask_for_sync()
        if grad_enabled:
            if _autograd.current_task() != -1:
                # Recomputed inside backward (the model in a reentrant checkpoint):
                # the backward running now may be the outermost one.
                self._backward_activity()
        # As the active DDP module, torch.compile's DDPOptimizer splits a
        # compiled module at bucket boundaries, so its backward still
        # produces gradients bucket by bucket (overlap under compile).
        previous = _TORCH_DDP._active_ddp_module
        _TORCH_DDP._active_ddp_module = self
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            _TORCH_DDP._active_ddp_module = previous
        if grad_enabled:
            _outputs.hook_backward_entry(output, self._on_synced_backward if synced else self._on_backward)
        return output

    def _ask_for_sync(self):
        """The open step ends, averaged, with the outermost backward that reaches the model."""
        if not self._open.sync_pending:
            # Inside `with model.join()`: tell ranks whose inputs ran
            # out that one more step is coming (they shadow it).
            Join.notify_join_context(self)
            self._open.sync_pending = True

    def _backward_activity(self):
        """Backward (or a recomputed forward inside it) reached this model: if
        this is the outermost pass, end the step when it ends."""
        task = _autograd.current_task()
        step = self._open
        if task == step.task_seen:
            return
        step.task_seen = task
        if not step.began:
            # Backward begins for this step: which .grad tensors exist already
            # (their holders expect them to receive the average, as with DDP).
            step.begin_backward(self._params)
        if step.end_queued_for != task and _autograd.in_outermost_backward():
            step.end_queued_for = task
            _autograd.at_end_of_current_task(self._end_of_backward)

    def _end_of_backward(self):
        step = self._open
        step.end_queued_for = None
        step.task_seen = None
        if step.sync_pending and not self._closed and not self._manual_finalization:
            self._finish()

    def _make_hook(self, index):
        ref = self._ref

        def hook(param):
            ddp = ref()
            if ddp is not None:
                ddp._on_grad(index, param)

        return hook

    def _on_grad(self, index, param):
        # The Python hooks' hot path (the native hooks do the same in C++,
        # python/shim/arrivals.cpp): one call per gradient; keep lookups to a
        # minimum.
        if self._closed:
            return
        grad = param.grad
        if grad.layout is not _STRIDED:
            raise self._layout_error(index, grad)
        step = self._open
        if _current_task() != step.task_seen:
            self._backward_activity()
        # Move the gradient out: autograd starts a fresh .grad for any later
        # contribution, so every hand-over is an increment and nothing is
        # copied here (the runtime reads the tensor in place).
        param.grad = None
        if self._staging:
            given = grad.detach().to("cpu")
        elif grad.is_contiguous():
            given = grad
        else:
            given = grad.contiguous()
        fired = step.fired
        token = fired[index]
        if token == 0 and (not self._viewable[index] or id(grad) in step.existing):
            # This tensor receives the average: the caller's own .grad, or a
            # gradient whose type or layout a bucket view cannot have. Others
            # are not kept: the runtime drops them once packed into a bucket.
            step.out[index] = grad
        fired[index] = token + 1
        self._give(step.number, index, token, given, given.data_ptr())
        step.arrivals += 1

    def _layout_error(self, index, grad):
        if grad.layout is not _STRIDED:
            return GradientLayoutError(
                f"parameter {self._names[index]!r} has a {grad.layout} gradient: gradsync reduces dense "
                "gradients; use a dense embedding (sparse=False)"
            )
        return GradientLayoutError(
            f"parameter {self._names[index]!r} has a gradient on {grad.device}, and gradsync was built for "
            f"parameters on {self._device}: move the module before wrapping it, not after"
        )

    @property
    def native_hooks(self):
        """Whether gradients reach the runtime through the C++ hooks (see
        ``gradsync.torch._steps``) rather than Python ones."""
        return self._recorder.native

    # ---- ending steps (finish_step, abort_step, join_now, reset: gradsync._wrapper) --------

    def join_now(self):
        """As :meth:`gradsync._wrapper.StepControls.join_now`; DDP's
        context-manager form is :meth:`join`."""
        joined = super().join_now()
        self._divide_by_initial_world = False
        return joined

    def _apply_result(self, result):
        report = result.report
        self.last_report = report
        step = self._open
        lent = False
        try:
            if result.applied:
                lent = self._grads.write(result, step.outputs(), set(report.unused_everywhere))
                if self._divide_by_initial_world:
                    rescale_to_initial_world(self._params, report, self._world)
            else:
                # Skipped on every rank: no optimizer may apply this step.
                for p in self._params:
                    p.grad = None
                if report.outcome == "skipped":
                    log.warning("gradsync step %d skipped: ranks %s aborted", report.step, report.aborted)
        finally:
            if not lent:
                result.release()
            self._new_step()
        return report

    def _new_step(self):
        self._open = self._recorder.step(self._session.current_step)

    def _raise_if_unfinished(self, before):
        step = self._open
        if not (step.sync_pending and step.arrivals and not self._closed and step.end_queued_for is None):
            return
        if self._manual_finalization:
            raise UnfinishedStepError(
                f"step {step.number}: require_manual_backward_finalization is on and {before} was called before "
                "model.finalize_backward(): call it once after each synchronized backward"
            )
        raise UnfinishedStepError(
                f"step {step.number}: gradients arrived from a backward whose end gradsync could not see "
                f"(torch.autograd.grad, or a backward nested in another), and {before} was called before "
                "the step ended: call model.finish_step() after that backward, so that .grad holds the "
                "average instead of this rank's own gradient"
            )

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
                "before wrapping; for parameters meant to stay "
                "each rank's own, list them in "
                "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) before wrapping"
            )

    # ---- the rest of the DDP surface ------------------------------------------------------

    @staticmethod
    def _placement(p):
        return (p.dtype, p.device)

    def no_sync(self):
        """Accumulate gradients over several backward passes (micro-batches);
        the first backward outside the context ends the step with the sum.
        Unlike DDP's, gradients are still handed over as they are produced, so
        the last micro-batch's backward overlaps the all-reduce (and ``.grad``
        reads ``None`` between micro-batches)."""
        return _accumulate.no_sync(self)

    @property
    def require_backward_grad_sync(self):
        """Whether the next backward ends a synchronized step (``False``
        inside :meth:`no_sync`; Accelerate and Lightning set it directly)."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value):
        self._require_sync = bool(value)

    @property
    def native_collectives(self):
        """Whether the collectives run natively on torch's gloo engine, with no
        Python on the way (``False``: through ``torch.distributed`` in
        Python, because the native part was not built for this torch, or
        ``GRADSYNC_COLLECTIVES=python`` asked for it; a warning said which)."""
        return self._comm.is_native

    @property
    def broadcast_buffers(self):
        """Whether rank 0's buffers are sent to every rank at each forward."""
        return self._broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self._broadcast_buffers = bool(value)

    def register_comm_hook(self, state, hook):
        """DDP's comm hooks, where gradsync has an equivalent: torch's
        ``allreduce_hook`` (float32 buckets), ``fp16_compress_hook`` and
        ``bf16_compress_hook`` (buckets travel as float16 / bfloat16). Any
        other hook raises :class:`gradsync.ConfigError`. Call it before the
        first step, on every rank (as with DDP)."""
        self._set_wire(_comm_hooks.wire_of_hook(state, hook), f"register_comm_hook({hook.__name__})")

    def _register_builtin_comm_hook(self, comm_hook_type):
        """DDP's built-in hook types: ``ALLREDUCE`` and ``FP16_COMPRESS``."""
        self._set_wire(_comm_hooks.wire_of_builtin(comm_hook_type), f"built-in comm hook {comm_hook_type}")

    def _set_wire(self, wire, what):
        if self._session.current_step != 0 or self._open.arrivals:
            raise ConfigError(f"{what} after training started: register comm hooks before the first step")
        self._comm.set_wire(_WIRES[wire])
        self._wire_name = wire

    def _get_ddp_logging_data(self):
        """DDP's run description, which Lightning reads: gradsync's facts in
        DDP's keys (there is no static graph to set)."""
        return {
            "world_size": self._world,
            "rank": self._rank,
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "static_graph": self.static_graph,
            "can_set_static_graph": False,
            "find_unused_parameters": self.find_unused_parameters,
            "backend_name": "gradsync",
        }

    def _set_static_graph(self):
        """Accepted (DDP's static-graph mode): gradsync needs no declaration
        of a static graph and overlaps from the first step."""

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """DDP's uneven-inputs context manager: ``with model.join(): for batch
        in loader: ...``. A rank whose loop ends early contributes zeros to
        the other ranks' steps until every rank's loop has ended; then every
        rank takes the parameters and buffers of the rank that ran longest.
        A step some rank sat out is the sum divided by the world size
        (``divide_by_initial_world_size=True``, DDP's default) or by the
        number of ranks that contributed (``False``). Same as
        ``torch.distributed.algorithms.Join([model], ...)``. The immediate
        form is :meth:`join_now`."""
        return Join([self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        """The hook ``torch.distributed.algorithms.Join`` runs on a rank whose
        inputs ran out: each call shadows one step of the other ranks.
        ``divide_by_initial_world_size`` (default ``True``) as in :meth:`join`."""
        self._divide_by_initial_world = bool(kwargs.get("divide_by_initial_world_size", True))
        return ShadowStep(self)

    @property
    def join_device(self):
        """Where ``Join`` counts the ranks still training (gloo: the CPU)."""
        return torch.device("cpu")

    @property
    def join_process_group(self):
        """The group ``Join`` counts the ranks still training on."""
        return self.process_group

    def close(self):
        """Stop gradsync's threads and remove the hooks; later use raises
        ``ClosedError``. Optional, as with torch's DDP: wrapping the module
        again retires this wrapper, and a wrapper the program drops is closed
        when it is collected."""
        self._close(f"this gradsync {self._NAME} was closed")

    def _close(self, why):
        if self._closed:
            return
        self._closed = True
        self._closed_why = why
        self._recorder.remove()
        self._session.close()
        _LIVE.discard(self)

    def _holds_any(self, params):
        """Whether this wrapper synchronizes any of ``params``."""
        mine = {id(p) for p in self._params}
        return any(id(p) in mine for p in params)

    def _retire(self):
        """A newer wrapper took this one's module over (as ``ddp = DDP(model)``
        run again does under torch's DDP, whose old reducer dies with the old
        wrapper): remove the hooks, stop the threads, refuse later use."""
        names = ", ".join(repr(n) for n in self._names[:3]) + (" ..." if len(self._names) > 3 else "")
        self._close(
            f"this gradsync {self._NAME} was retired: its module (parameters {names}) was wrapped again by a "
            f"newer {self._NAME}, which synchronizes it now; use the new wrapper"
        )
        log.info("gradsync: a newer wrapper took parameters %s over; the older wrapper was retired", names)

    # ---- manual backward finalization (torch's DDP API) -----------------------------------

    @property
    def require_manual_backward_finalization(self):
        """Whether each synchronized step ends at :meth:`finalize_backward`
        rather than when backward ends (torch's DDP option of that name)."""
        return self._manual_finalization

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, required):
        if self._open.sync_pending and self._open.arrivals:
            raise StepOrderError(
                "require_manual_backward_finalization changed while a step has gradients: set it before "
                "forward or after the step ended"
            )
        self._manual_finalization = bool(required)

    @property
    def should_finalize_after_backward(self):
        """``True`` in manual finalization: gradsync ends a step after backward
        returns (every gradient of the step must have arrived)."""
        return self._manual_finalization

    def finalize_backward(self):
        """End the synchronized step after backward returned, when
        :attr:`require_manual_backward_finalization` is on: the gradients are
        averaged into ``.grad`` as at the end of an ordinary backward.
        Returns the step's report."""
        self._refuse_if_closed()
        if not self._manual_finalization:
            raise ConfigError(
                "finalize_backward() needs require_manual_backward_finalization = True; without it the step "
                "ends by itself when backward does"
            )
        if not self._open.sync_pending:
            raise StepOrderError(
                "finalize_backward(): no synchronized backward to finalize (none since the last step ended, "
                "or the forward ran under no_sync)"
            )
        return self._finish()

    # ---- copying and pickling (as torch's DDP) ---------------------------------------------

    def __getstate__(self):
        """The module and the settings this wrapper was built with (as torch's
        DDP pickles: no process group, no reducer). Only for a wrapper on the
        default process group, as with torch's DDP."""
        if self.process_group != dist.distributed_c10d._get_default_group():
            raise ConfigError(
                "a gradsync DistributedDataParallel pickles or copies only on the default process group (as "
                "torch's DDP): it cannot rebuild another group; pickle its .module instead"
            )
        settings = dict(self._init_settings, wire_dtype=self._wire_name)
        return {
            "module": self.module,
            "settings": settings,
            "require_backward_grad_sync": self._require_sync,
            "require_forward_param_sync": self.require_forward_param_sync,
            "manual_finalization": self._manual_finalization,
            "training": self.training,
        }

    def __setstate__(self, state):
        """Rebuild a wrapper around the copied or unpickled module on the
        default process group, as torch's DDP rebuilds its reducer. This is
        building a wrapper: collective, so every rank must copy or unpickle
        its wrapper at the same point (in the same order as its other
        wrappers); it broadcasts rank 0's parameters and buffers and starts a
        gloo group and two threads of its own, as the constructor does.
        Steps start again at 0; the original wrapper stays as it was."""
        DistributedDataParallel.__init__(self, state["module"], **state["settings"])
        self._require_sync = state["require_backward_grad_sync"]
        self.require_forward_param_sync = state["require_forward_param_sync"]
        self._manual_finalization = state["manual_finalization"]
        self.train(state["training"])

    def _model_states(self):
        """The wrapped module's parameters and buffers (what replicas share)."""
        return self._shared(itertools.chain(self.module.named_parameters(), self.module.named_buffers()))

    def _shared(self, named):
        """The tensors of ``(name, tensor)`` pairs that are not ignored."""
        ignored = self.parameters_to_ignore
        return [t for n, t in named if n not in ignored]
