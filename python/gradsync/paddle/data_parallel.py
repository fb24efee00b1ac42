"""``DataParallel``: gradsync under Paddle's ``paddle.DataParallel`` interface.

What happens in one step::

    forward          the wrapped layers run; a forward under grad (outside
                     ``no_sync``) asks for a synchronized step
    backward         every parameter's backward hook hands the runtime its
                     whole local gradient so far (token = the hook's firing
                     index in the step: recompute fires a parameter's hook once
                     per recomputed segment, ``param.grad`` growing); buckets
                     are all-reduced while backward goes on (under
                     ``no_sync`` the gradients sum up in ``param.grad`` and
                     the synchronized backward hands over the sum)
    end of backward  when the *outermost* backward returns (``_backward``),
                     the step ends: remaining buckets, control, corrections;
                     the averages are written into each ``param.grad`` in place

So when ``loss.backward()`` returns every ``param.grad`` holds the average,
also for parameters inside ``recompute`` (where ``paddle.DataParallel`` leaves
each rank's own gradient, silently) and parameters some rank did not use.

When a rank cannot finish a step (out of memory), :meth:`DataParallel.abort_step`
skips it on every rank at once; a rank out of data calls
:meth:`DataParallel.join_now`; after a failed collective (a rank gone or
stalled past gloo's 30 s) every rank calls :meth:`DataParallel.reset` and
goes on, on a fresh group (``_comm``).

The step state and its rules are the framework-neutral core's
(``gradsync._core``); this module holds what is Paddle's own: its hooks,
writing averages into ``param.grad``, its groups and its forward.
"""

import logging
import weakref

import paddle
import paddle.distributed as dist
from paddle.distributed import collective

from gradsync._controls import StepControls
from gradsync._core import DataPath, ModelSync, Replica, SyncSettings, check_wire, select_parameters
from gradsync._errors import ConfigError
from gradsync._record import PythonRecord
from gradsync.paddle import _backward
from gradsync.paddle._comm import GLOO_TIMEOUT_S, REFUSED_WIRES, PaddleCommunicator

log = logging.getLogger("gradsync.paddle")

_DTYPES = {paddle.float32: "float32", paddle.float64: "float64", paddle.float16: "float16", paddle.bfloat16: "bfloat16"}
# Wrappers built per set of ranks, in order: every rank builds them in the
# same order, so the n-th wrapper's groups have the same ids everywhere.
_BUILT = {}
# Where a Paddle backward can end without gradsync seeing it.
_UNSEEN_END = "paddle.grad"
_PATH = DataPath(
    buckets="host",
    why="Paddle's gradient hooks and gloo groups are reached from Python (gradsync has no C++ module for Paddle)",
)


class PaddleGrads:
    """The Paddle side of a wrapped model's gradients, for its
    ``gradsync._core.ModelSync``: each hook hands over the parameter's whole
    ``param.grad`` so far (a copy; the highest token wins); averages are
    written into ``param.grad`` in place."""

    def __init__(self, params, session):
        self._params = params
        self._arrive = session.arrive_ptr

    def new_record(self):
        """A record of the next step's firings (Python: Paddle's hooks are Python)."""
        return PythonRecord(len(self._params))

    def on_grad(self, record, index):
        """A parameter's gradient grew (Paddle calls the hook with no argument
        after accumulating into ``param.grad``)."""
        grad = self._params[index].grad
        if grad is None:
            return
        if not record.sync_pending:
            # A micro-batch under no_sync: the sum stays in param.grad.
            record.held[index] = True
            return
        token = record.fired[index]
        record.fired[index] = token + 1
        self._arrive(None, index, token, grad.data_ptr())
        record.arrivals += 1

    def hand_over_held(self, record):
        """Hand over the local sums of parameters only ``no_sync`` micro-batches reached."""
        for index in record.held_unsent():
            grad = self._params[index].grad
            if grad is not None:
                record.fired[index] = 1
                self._arrive(None, index, 0, grad.data_ptr())
                record.arrivals += 1

    def serve_gathers(self):
        """Nothing: Paddle's wrapper shards no parameters."""

    def lost_gather(self):
        """Nothing: Paddle's wrapper shards no parameters."""
        return None

    def write_back(self, result, record):
        """Copy an applied step's averages into ``param.grad``; nothing is lent."""
        for i, p in enumerate(self._params):
            if not result.has(i):
                continue
            if p.grad is None:  # unused on this rank, used on another
                p.grad = paddle.zeros_like(p)
            # Converted to the parameter's type on the way (Paddle's
            # gradients are dense, contiguous and of that type).
            result.copy_into_ptr(i, p.grad.data_ptr())
        return False

    def joined_step(self, result):
        """Nothing is reduced outside the runtime for Paddle; nothing is lent."""
        return False

    def clear(self):
        """Skipped on every rank: no optimizer may apply this step."""
        for p in self._params:
            p.clear_gradient(False)

    def remove_hooks(self):
        """Paddle's backward hooks cannot be removed: each holds the core
        weakly and does nothing once it is closed or gone."""


def _hook(core, grads, index):
    def hook():
        sync = core()
        if sync is not None and sync.closed_why is None:
            grads.on_grad(sync.record, index)

    return hook


class DataParallel(StepControls, paddle.nn.Layer):
    """Data parallelism for ``layers``, in place of ``paddle.DataParallel``.

    Build one per rank after ``paddle.distributed.init_parallel_env()``
    (every rank wraps its models in the same order). ``comm_buffer_size`` caps
    a bucket in MB (Paddle's name, default 25); ``last_comm_buffer_size``,
    ``strategy`` and ``find_unused_parameters`` are accepted and not needed
    (gradsync finds unused parameters and repeated hooks by itself, and
    makes its last three buckets a half, a quarter and an eighth of the cap,
    as Paddle makes its last one small).
    ``group``: the ranks (default: all); gradsync builds gloo groups of its
    own over them.

    gradsync's own settings, as in :class:`gradsync.torch.DistributedDataParallel`:

    * ``abort_policy``: ``"skip"`` (default): a step some rank aborted
      (:meth:`abort_step`) is applied by no rank; ``"partial"``: averaged over
      the ranks that finished, on every rank.
    * ``record_timeline``: keep every step's timeline for :meth:`write_timeline`.
    * ``wire_dtype``: ``"bfloat16"`` sends the data buckets in that type (half
      the bytes; the sum loses precision), ``"float32"`` (default) as they
      are. Control words and corrections always travel exactly.

    A collective waits at most 30 s for the other ranks: Paddle's gloo gives
    up then, and its groups take no other deadline. A rank that does not
    join in time is named in the :class:`gradsync.TimeoutError`; call
    :meth:`reset` on every rank to go on.

    Gradients of float32 and float64 parameters are reduced in their own
    type; float16 and bfloat16 ones in float32 (exact), rounded back. CPU
    parameters only for now.
    """

    _NAME = "DataParallel"
    #: gradsync's own keyword arguments.
    GRADSYNC_SETTINGS = ("abort_policy", "record_timeline", "wire_dtype")

    def __init__(
        self,
        layers,
        strategy=None,
        comm_buffer_size=25,
        last_comm_buffer_size=1,
        find_unused_parameters=False,
        group=None,
        *,
        abort_policy="skip",
        record_timeline=False,
        wire_dtype="float32",
    ):
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError("call paddle.distributed.init_parallel_env() before wrapping")
        store = collective._default_store
        if store is None:
            raise ConfigError(
                "Paddle's job store is missing: start the ranks with paddle.distributed.spawn or "
                "python -m paddle.distributed.launch and call init_parallel_env()"
            )
        if isinstance(layers, DataParallel) or isinstance(layers, paddle.DataParallel):
            raise ConfigError("these layers are already wrapped for data parallelism: wrap the plain layers")
        wire = check_wire(wire_dtype, REFUSED_WIRES)
        named = [(n, p) for n, p in layers.named_parameters() if not p.stop_gradient]
        self._names, self._params = select_parameters(
            named, dtype_name=lambda p: _DTYPES.get(p.dtype), device_of=lambda p: str(p.place), kind=self._NAME
        )
        for name, p in named:
            if not p.place.is_cpu_place():
                raise ConfigError(f"parameter {name!r} is on {p.place}: gradsync.paddle runs on the CPU for now")
        self._layers = layers
        ranks = list(group.ranks) if group is not None else list(range(dist.get_world_size()))
        self._rank = ranks.index(dist.get_rank())
        self._world = len(ranks)
        key = "-".join(map(str, ranks))
        nth = _BUILT[key] = _BUILT.get(key, 0) + 1
        # The runtime's collectives run on a gloo group the communicator
        # creates itself (and re-creates after a reset); model states go
        # over a second one, from this thread.
        comm = PaddleCommunicator(
            store=store, prefix=f"gradsync/{key}/{nth}", nth=nth, rank=self._rank, world=self._world
        )
        self._states = dist.new_group(ranks=ranks, backend="gloo")
        self._ranks = ranks
        self._broadcast_parameters()
        layout = Replica(self._rank, self._world, self._names, [int(p.size) for p in self._params],
                         [_DTYPES[p.dtype] for p in self._params])
        settings = SyncSettings(comm_buffer_size * (1 << 20), GLOO_TIMEOUT_S, abort_policy, record_timeline, wire)
        self._sync = ModelSync(self._NAME, _UNSEEN_END, _PATH, comm, layout, settings)
        grads = PaddleGrads(self._params, self._sync.session)
        core = weakref.ref(self._sync)
        for i, p in enumerate(self._params):
            p._register_backward_hook(_hook(core, grads, i))
        self._sync.attach(grads)
        _backward.watch(self)

    def _broadcast_parameters(self):
        """Every rank starts from the first rank's parameters (as Paddle's DataParallel)."""
        if self._world == 1:
            return
        with paddle.no_grad():
            for p in self._params:
                dist.broadcast(p, src=self._ranks[0], group=self._states)

    def forward(self, *inputs, **kwargs):
        """Run the layer; a backward that reaches its outputs under grad ends a step."""
        self._sync.before_forward(paddle.is_grad_enabled())
        return self._layers(*inputs, **kwargs)

    @staticmethod
    def _placement(p):
        return (p.dtype, str(p.place))

    def state_dict(self, *args, **kwargs):
        """The wrapped layers' state (no wrapper prefix, as Paddle's DataParallel)."""
        return self._layers.state_dict(*args, **kwargs)

    def set_state_dict(self, state_dict, *args, **kwargs):
        """Load ``state_dict`` into the wrapped layers (as Paddle's DataParallel)."""
        return self._layers.set_state_dict(state_dict, *args, **kwargs)

    set_dict = set_state_dict
    load_dict = set_state_dict

    def close(self):
        """Stop gradsync's threads; later use raises ``ClosedError``. The
        parameters' hooks stay registered (Paddle cannot remove them) and do
        nothing from now on."""
        self._sync.close(f"this gradsync {self._NAME} was closed")
        _backward.unwatch(self)
