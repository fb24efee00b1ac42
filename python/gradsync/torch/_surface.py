"""The rest of torch's DDP surface on gradsync's wrapper: what libraries and
training code call on a DDP model besides forward and backward.

:class:`DdpSurface` is mixed into ``gradsync.torch.DistributedDataParallel``
and maps each piece onto gradsync: the accumulation flags Accelerate and
Lightning set, buffer broadcast, torch's built-in comm hooks (the wire
type), the run description Lightning reads, static-graph declarations,
uneven inputs (``join``), manual backward finalization, and copying and
pickling the wrapper. ``model.reducer`` is ``_reducer``'s.
"""

import datetime

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join

from gradsync._errors import ConfigError, StepOrderError
from gradsync.torch import _comm_hooks
from gradsync.torch._join import ShadowStep


class DdpSurface:
    """torch's DDP API beyond forward and backward (see the module docs)."""

    # ---- accumulation and buffers ---------------------------------------------------------

    @property
    def require_backward_grad_sync(self):
        """Whether the next backward ends a synchronized step (``False``
        inside :meth:`no_sync`; Accelerate and Lightning set it directly)."""
        return self._sync.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value):
        self._sync.require_sync = bool(value)

    @property
    def broadcast_buffers(self):
        """Whether rank 0's buffers are sent to every rank before a forward
        that follows a synchronized one (DDP's rule: not after a ``no_sync``
        micro-batch or an eval forward)."""
        return self._broadcast_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self._broadcast_buffers = bool(value)

    # ---- comm hooks and declarations ------------------------------------------------------

    def register_comm_hook(self, state, hook):
        """DDP's comm hooks, where gradsync has an equivalent: torch's
        ``allreduce_hook`` (float32 buckets), ``fp16_compress_hook`` and
        ``bf16_compress_hook`` (buckets travel as float16 / bfloat16). Any
        other hook raises :class:`gradsync.ConfigError`. Call it before the
        first step, on every rank (as with DDP): the ranks agree on the wire
        type again, and ranks that differ fail with a ``DesyncError``."""
        self._sync.set_wire(_comm_hooks.wire_of_hook(state, hook), f"register_comm_hook({hook.__name__})")

    def _register_builtin_comm_hook(self, comm_hook_type):
        """DDP's built-in hook types: ``ALLREDUCE`` and ``FP16_COMPRESS``."""
        self._sync.set_wire(_comm_hooks.wire_of_builtin(comm_hook_type), f"built-in comm hook {comm_hook_type}")

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

    # ---- uneven inputs --------------------------------------------------------------------

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
        """The hook ``torch.distributed.algorithms.Join`` builds on every rank
        when its context begins: the runtime divides the steps inside it by
        the world size (``divide_by_initial_world_size=True``, the default)
        or by the ranks that contributed; on a rank whose inputs ran out, each
        of the hook's calls shadows one step of the other ranks."""
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        self._sync.set_divisor("world" if divide else "contributors")
        return ShadowStep(self)

    @property
    def join_device(self):
        """Where ``Join`` counts the ranks still training (gloo: the CPU)."""
        return torch.device("cpu")

    @property
    def join_process_group(self):
        """The group ``Join`` counts the ranks still training on."""
        return self.process_group

    # ---- manual backward finalization ------------------------------------------------------

    @property
    def require_manual_backward_finalization(self):
        """Whether each synchronized step ends at :meth:`finalize_backward`
        rather than when backward ends (torch's DDP option of that name)."""
        return self._sync.manual_finalization

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, required):
        record = self._sync.record
        if record.sync_pending and record.arrivals:
            raise StepOrderError(
                "require_manual_backward_finalization changed while a step has gradients: set it before "
                "forward or after the step ended"
            )
        self._sync.manual_finalization = bool(required)

    @property
    def should_finalize_after_backward(self):
        """``True`` in manual finalization: gradsync ends a step after backward
        returns (every gradient of the step must have arrived)."""
        return self._sync.manual_finalization

    def finalize_backward(self):
        """End the synchronized step after backward returned, when
        :attr:`require_manual_backward_finalization` is on: the gradients are
        averaged into ``.grad`` as at the end of an ordinary backward.
        Returns the step's report."""
        sync = self._sync
        sync.refuse_if_closed()
        if not sync.manual_finalization:
            raise ConfigError(
                "finalize_backward() needs require_manual_backward_finalization = True; without it the step "
                "ends by itself when backward does"
            )
        if not sync.record.sync_pending:
            raise StepOrderError(
                "finalize_backward(): no synchronized backward to finalize (none since the last step ended, "
                "or the forward ran under no_sync)"
            )
        return sync.finish()

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
        sync = self._sync
        return {
            "module": self.module,
            "settings": dict(self._init_settings, wire_dtype=sync.wire),
            "require_backward_grad_sync": sync.require_sync,
            "require_forward_param_sync": self.require_forward_param_sync,
            "manual_finalization": sync.manual_finalization,
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
        type(self).__init__(self, state["module"], **state["settings"])
        self._sync.require_sync = state["require_backward_grad_sync"]
        self.require_forward_param_sync = state["require_forward_param_sync"]
        self._sync.manual_finalization = state["manual_finalization"]
        self.train(state["training"])


def timeout_seconds(timeout):
    """A ``timeout`` setting (seconds or ``timedelta``; ``None``: 300 s) in seconds."""
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(300.0 if timeout is None else timeout)
