"""How a torch model's gradients reach the runtime: the gradient hooks, the
record of the open step they fill, and the ``.grad`` tensors held under
``no_sync``.

One path is taken per wrapper, chosen when it is built (and reported by
``wrapped.path``):

* **native** (the product): a C++ post hook on each parameter's
  ``AccumulateGrad`` node, as DDP's reducer has, records the arrival in a
  ``Ledger`` and hands the tensor to the runtime without entering Python
  (``python/shim/arrivals.cpp``). The step's record lives in the ledger;
  :class:`LedgerRecord` shows it to the core.
* **python**: a post-accumulate-grad hook per parameter runs
  :meth:`Hooks.on_grad`; the record is a :class:`gradsync._record.PythonRecord`.
  Taken only where it is needed: CUDA parameters with ``buckets="host"``
  (their gradients are staged through host memory) and a build without the
  C++ module (``gradsync.torch._shim`` says why).

Either way, in a synchronized backward each firing moves the gradient out
of ``.grad`` and hands it over (one additive contribution; its token is the
parameter's hand-over count in the step), keeping the tensor that must
receive the average: the caller's own ``.grad``, or one a bucket view
cannot replace. In a backward under ``no_sync`` the gradient stays in
``.grad``, where autograd sums the micro-batches as under DDP; the
synchronized backward's first firing then hands over the whole sum, and
:meth:`Hooks.hand_over_held` the ``.grad`` of a parameter that backward
never reached.
"""

import torch

from gradsync._errors import GradientLayoutError
from gradsync._native import ArrivalSink
from gradsync._record import PythonRecord

_STRIDED = torch.strided
_current_task = torch._C._current_graph_task_id


class LedgerRecord:
    """The native hooks' record of the open step (the ledger's), as a
    :class:`gradsync._record.StepRecord`. Making one starts the ledger's
    next step."""

    __slots__ = ("_ledger",)

    def __init__(self, ledger):
        ledger.new_step()
        self._ledger = ledger

    @property
    def sync_pending(self):
        return self._ledger.sync

    @property
    def end_queued_for(self):
        return self._ledger.end_queued_for

    @end_queued_for.setter
    def end_queued_for(self, task):
        self._ledger.end_queued_for = task

    @property
    def task_seen(self):
        return self._ledger.task_seen

    @task_seen.setter
    def task_seen(self, task):
        self._ledger.task_seen = task

    @property
    def arrivals(self):
        return self._ledger.arrivals

    @property
    def began(self):
        return self._ledger.began

    def begin_backward(self, grads):
        self._ledger.begin_backward(list(grads))

    def outputs(self):
        return self._ledger.outputs()

    def ask_for_sync(self):
        self._ledger.sync = True


class Hooks:
    """The gradient hooks on a wrapped model's parameters, and the maker of
    each step's record (see the module docs).

    ``core`` is a weak reference to the wrapper's ``ModelSync`` (hooks live
    as long as the parameters and must not keep a dropped wrapper alive);
    ``ledger_module`` is the loaded ``_arrivals`` module for the native path,
    or ``None``; ``on_task()`` runs when a hook sees a new autograd task."""

    def __init__(self, core, names, params, viewable, staging, device, session, ledger_module, on_task,
                 device_plane=False):
        self._core = core
        self._names = names
        self._params = params
        self._viewable = viewable
        self._staging = staging
        self._device = device
        self._give = session.give
        self._on_task = on_task
        if ledger_module is not None:
            self._ledger = ledger_module.Ledger(
                params, viewable, ArrivalSink.table(), session.arrival_sink(), on_task, self._odd_gradient,
                device_plane,
            )
            self._handles = [self._ledger]
        else:
            self._ledger = None
            self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]

    def record(self):
        """A fresh record for the runtime's next step."""
        if self._ledger is not None:
            return LedgerRecord(self._ledger)
        return PythonRecord(len(self._params))

    def hand_over_held(self, record):
        """Hand over the ``.grad`` of parameters only ``no_sync`` micro-batches reached."""
        if self._ledger is not None:
            self._ledger.give_held()
            return
        for index in record.held_unsent():
            grad = self._params[index].grad
            if grad is not None:
                self._hand_over(record, index, self._params[index], grad)

    def remove(self):
        """Take every hook off; later gradients stay in ``.grad``."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, index):
        core = self._core

        def hook(param):
            sync = core()
            if sync is not None and sync.closed_why is None:
                self.on_grad(sync.record, index, param)

        return hook

    def on_grad(self, record, index, param):
        """The Python hooks' hot path, one call per gradient (the native
        hooks do the same in C++): keep lookups to a minimum."""
        grad = param.grad
        if grad is None:
            return
        if grad.layout is not _STRIDED:
            raise self.layout_error(index, grad)
        if _current_task() != record.task_seen:
            self._on_task()
        if not record.sync_pending:
            # A micro-batch under no_sync: autograd keeps summing into .grad.
            record.held[index] = True
            return
        self._hand_over(record, index, param, grad)

    def _hand_over(self, record, index, param, grad):
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
        fired = record.fired
        token = fired[index]
        existing = record.existing
        if token == 0 and (not self._viewable[index] or (existing is not None and id(grad) in existing)):
            # This tensor receives the average: the caller's own .grad, or a
            # gradient whose type or layout a bucket view cannot have.
            record.out[index] = grad
        fired[index] = token + 1
        self._give(None, index, token, given, given.data_ptr())
        record.arrivals += 1

    def _odd_gradient(self, index):
        """A native hook met a gradient the runtime cannot read."""
        raise self.layout_error(index, self._params[index].grad)

    def layout_error(self, index, grad):
        if grad.layout is not _STRIDED:
            return GradientLayoutError(
                f"parameter {self._names[index]!r} has a {grad.layout} gradient but was dense when wrapped: "
                "gradsync reduces the sparse gradients of embeddings built with sparse=True; set it before wrapping"
            )
        return GradientLayoutError(
            f"parameter {self._names[index]!r} has a gradient on {grad.device}, and gradsync was built for "
            f"parameters on {self._device}: move the module before wrapping it, not after"
        )
