"""``DataParallel``: gradsync under Paddle's ``paddle.DataParallel`` interface.

What happens in one step::

    forward          the wrapped layers run; a forward under grad (outside
                     ``no_sync``) asks for a synchronized step
    backward         every parameter's backward hook hands the runtime its
                     whole local gradient so far (token = the hook's firing
                     index in the step: recompute fires a parameter's hook once
                     per recomputed segment, ``param.grad`` growing); buckets
                     are all-reduced while backward goes on
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
"""

import logging
import weakref

import paddle
import paddle.distributed as dist
from paddle.distributed import collective

from gradsync import _accumulate
from gradsync._errors import ConfigError, UnfinishedStepError
from gradsync._native import Session
from gradsync._wrapper import StepControls
from gradsync.paddle import _backward
from gradsync.paddle._comm import GLOO_TIMEOUT_S, PaddleCommunicator

log = logging.getLogger("gradsync.paddle")

_DTYPES = {paddle.float32: "float32", paddle.float64: "float64", paddle.float16: "float16", paddle.bfloat16: "bfloat16"}
# Wire types of the data buckets. float16 is not one: Paddle's gloo sums it to inf.
_WIRES = ("float32", "bfloat16")
# Wrappers built per set of ranks, in order: every rank builds them in the
# same order, so the n-th wrapper's groups have the same ids everywhere.
_BUILT = {}


class _OpenStep:
    """The step gradients are being collected for (replaced at every step)."""

    __slots__ = ("number", "fired", "arrivals", "sync_pending")

    def __init__(self, number, params):
        self.number = number
        # Hook firings so far, per parameter: the next firing's token.
        self.fired = [0] * params
        self.arrivals = 0
        # A forward under grad (outside no_sync) asked for a synchronized step.
        self.sync_pending = False


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

    Gradients of float32 parameters are reduced as they are; float64,
    float16 and bfloat16 ones are converted to float32 for the reduction and
    back (float64 loses precision beyond float32). CPU parameters only for now.
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
        if wire_dtype not in _WIRES:
            why = " (Paddle's gloo sums float16 to inf)" if wire_dtype == "float16" else ""
            raise ConfigError(f"wire_dtype {wire_dtype!r}: use one of {list(_WIRES)}{why}")
        named = [(n, p) for n, p in layers.named_parameters() if not p.stop_gradient]
        if not named:
            raise ConfigError("the layers have no trainable parameter: there is nothing to synchronize")
        for name, p in named:
            if p.dtype not in _DTYPES:
                raise ConfigError(f"parameter {name!r} has dtype {p.dtype}: only floating-point gradients are averaged")
            if not p.place.is_cpu_place():
                raise ConfigError(f"parameter {name!r} is on {p.place}: gradsync.paddle runs on the CPU for now")
        self._layers = layers
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        ranks = list(group.ranks) if group is not None else list(range(dist.get_world_size()))
        self._rank = ranks.index(dist.get_rank())
        self._world = len(ranks)
        key = tuple(ranks)
        nth = _BUILT[key] = _BUILT.get(key, 0) + 1
        # The runtime's collectives run on a gloo group the communicator
        # creates itself (and re-creates after a reset); model states go
        # over a second one, from this thread.
        self._comm = PaddleCommunicator(store=store, nth=nth, rank=self._rank, world=self._world, wire_dtype=wire_dtype)
        self._states = dist.new_group(ranks=ranks, backend="gloo")
        self._ranks = ranks
        self._broadcast_parameters()
        self._session = Session(
            self._comm,
            self._rank,
            self._world,
            self._names,
            [int(p.size) for p in self._params],
            [_DTYPES[p.dtype] for p in self._params],
            bucket_cap_bytes=max(int(comm_buffer_size * (1 << 20)), 1),
            timeout_s=GLOO_TIMEOUT_S,
            abort_policy=abort_policy,
            record_timeline=record_timeline,
        )
        self._open = _OpenStep(0, len(self._params))
        self._require_sync = True
        self._closed = False
        self.last_report = None
        # Paddle's backward hooks cannot be removed: each holds the wrapper
        # weakly and does nothing once it is closed or gone.
        ref = weakref.ref(self)
        for i, p in enumerate(self._params):
            p._register_backward_hook(_hook(ref, i))
        _backward.watch(self)

    def _broadcast_parameters(self):
        """Every rank starts from the first rank's parameters (as Paddle's DataParallel)."""
        if self._world == 1:
            return
        with paddle.no_grad():
            for p in self._params:
                dist.broadcast(p, src=self._ranks[0], group=self._states)

    # ---- forward, hooks, the end of backward ------------------------------------------------

    def forward(self, *inputs, **kwargs):
        self._refuse_if_closed()
        self._raise_if_unfinished("forward")
        if self._require_sync and paddle.is_grad_enabled():
            self._open.sync_pending = True
        return self._layers(*inputs, **kwargs)

    def _on_grad(self, index):
        """A parameter's gradient grew (Paddle calls the hook with no argument
        after accumulating into ``param.grad``): hand over the whole local
        gradient so far (a copy; a later firing of the same parameter in the
        same step replaces it, as its token says)."""
        if self._closed:
            return
        grad = self._params[index].grad
        if grad is None:
            return
        step = self._open
        token = step.fired[index]
        step.fired[index] = token + 1
        self._session.arrive_ptr(step.number, index, token, grad.data_ptr())
        step.arrivals += 1

    def _end_of_backward(self):
        step = self._open
        if step.sync_pending and not self._closed:
            self._finish()

    def _apply_result(self, result):
        """Write a finished step's averages into ``param.grad`` (or clear the
        gradients of a step no rank may apply); returns its report."""
        report = result.report
        self.last_report = report
        try:
            if result.applied:
                for i, p in enumerate(self._params):
                    if not result.has(i):
                        continue
                    if p.grad is None:  # unused on this rank, used on another
                        p.grad = paddle.zeros_like(p)
                    # Converted to the parameter's type on the way (Paddle's
                    # gradients are dense, contiguous and of that type).
                    result.copy_into_ptr(i, p.grad.data_ptr())
            else:
                # Skipped on every rank: no optimizer may apply this step.
                for p in self._params:
                    p.clear_gradient(False)
                if report.outcome == "skipped":
                    log.warning("gradsync step %d skipped: ranks %s aborted", report.step, report.aborted)
        finally:
            result.release()
            self._new_step()
        return report

    def _new_step(self):
        self._open = _OpenStep(self._session.current_step, len(self._params))

    def _raise_if_unfinished(self, before):
        step = self._open
        if step.arrivals and not _backward.in_backward() and step.sync_pending:
            raise UnfinishedStepError(
                f"step {step.number}: gradients arrived from a backward whose end gradsync could not see "
                f"(paddle.grad), and {before} was called before the step ended: call model.finish_step() "
                "after that backward"
            )

    # ---- the rest of Paddle's DataParallel surface ---------------------------------------------

    @staticmethod
    def _placement(p):
        return (p.dtype, str(p.place))

    def no_sync(self):
        """Accumulate gradients over several backward passes; the first
        backward outside the context ends the step with the sum."""
        return _accumulate.no_sync(self)

    def state_dict(self, *args, **kwargs):
        """The wrapped layers' state (no wrapper prefix, as Paddle's DataParallel)."""
        return self._layers.state_dict(*args, **kwargs)

    def set_state_dict(self, state_dict, *args, **kwargs):
        return self._layers.set_state_dict(state_dict, *args, **kwargs)

    set_dict = set_state_dict
    load_dict = set_state_dict

    def close(self):
        """Stop gradsync's threads; later use raises ``ClosedError``. The
        parameters' hooks stay registered (Paddle cannot remove them) and do
        nothing from now on."""
        if not self._closed:
            self._closed = True
            _backward.unwatch(self)
            self._session.close()


def _hook(ref, index):
    def hook():
        wrapper = ref()
        if wrapper is not None:
            wrapper._on_grad(index)

    return hook

