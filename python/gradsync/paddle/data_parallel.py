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
"""

import weakref

import paddle
import paddle.distributed as dist

from gradsync import _accumulate
from gradsync._errors import ClosedError, ConfigError, UnfinishedStepError
from gradsync._native import Session
from gradsync.paddle import _backward
from gradsync.paddle._comm import PaddleCommunicator

_DTYPES = {paddle.float32: "float32", paddle.float64: "float64", paddle.float16: "float16", paddle.bfloat16: "bfloat16"}


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


class DataParallel(paddle.nn.Layer):
    """Data parallelism for ``layers``, in place of ``paddle.DataParallel``.

    Build one per rank after ``paddle.distributed.init_parallel_env()``
    (every rank wraps its models in the same order). ``comm_buffer_size`` caps
    a bucket in MB (Paddle's name, default 25); ``last_comm_buffer_size``,
    ``strategy`` and ``find_unused_parameters`` are accepted and not needed
    (gradsync finds unused parameters and repeated hooks by itself).
    ``group``: the ranks (default: all); gradsync builds gloo groups of its
    own over them. ``timeout``: seconds a step may wait for the other ranks.

    Gradients of float32 parameters are reduced as they are; float64,
    float16 and bfloat16 ones are converted to float32 for the reduction and
    back. CPU parameters only for now.
    """

    def __init__(
        self,
        layers,
        strategy=None,
        comm_buffer_size=25,
        last_comm_buffer_size=1,
        find_unused_parameters=False,
        group=None,
        timeout=300.0,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise ConfigError("call paddle.distributed.init_parallel_env() before wrapping")
        if isinstance(layers, DataParallel) or isinstance(layers, paddle.DataParallel):
            raise ConfigError("these layers are already wrapped for data parallelism: wrap the plain layers")
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
        # Two groups of gradsync's own, built on every rank in the same order:
        # one for the runtime's collectives (its communicator thread), one for
        # model states (this thread).
        self._comm = PaddleCommunicator(dist.new_group(ranks=ranks, backend="gloo"))
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
            timeout_s=float(timeout),
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
        if self._closed:
            raise ClosedError("this gradsync DataParallel was closed")
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

    def finish_step(self):
        """End the step now: needed only after ``paddle.grad`` (which gradsync
        cannot see end). Returns the step's report, or ``None`` if nothing
        was pending."""
        if self._closed:
            raise ClosedError("this gradsync DataParallel was closed")
        step = self._open
        if not (step.sync_pending or step.arrivals):
            return None
        return self._finish()

    def _finish(self):
        step = self._open
        result = self._session.finish(step.number)
        report = result.report
        self.last_report = report
        try:
            if result.applied:
                for i, p in enumerate(self._params):
                    if not result.has(i):
                        continue
                    if p.grad is None:  # unused on this rank, used on another
                        p.grad = paddle.zeros_like(p)
                    if p.grad.dtype == paddle.float32:
                        result.copy_into_ptr(i, p.grad.data_ptr())
                    else:
                        host = paddle.zeros(p.shape, dtype="float32")
                        result.copy_into_ptr(i, host.data_ptr())
                        with paddle.no_grad():
                            p.grad.copy_(host.astype(p.grad.dtype), False)
            else:
                for p in self._params:
                    p.clear_gradient(False)
        finally:
            result.release()
            self._open = _OpenStep(self._session.current_step, len(self._params))
        return report

    def _raise_if_unfinished(self, before):
        step = self._open
        if step.arrivals and not _backward.in_backward() and step.sync_pending:
            raise UnfinishedStepError(
                f"step {step.number}: gradients arrived from a backward whose end gradsync could not see "
                f"(paddle.grad), and {before} was called before the step ended: call model.finish_step() "
                "after that backward"
            )

    # ---- the rest of Paddle's DataParallel surface ---------------------------------------------

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

    session = property(lambda self: self._session, doc="The underlying :class:`gradsync.Session`.")

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

