"""The open step: what a wrapper records about the gradients of the step
being collected, and the hooks that record it.

Two kinds of hooks hand gradients to the runtime, with the same rules
(``DistributedDataParallel._on_grad`` spells them out):

* **native** (the default, when ``pip install`` built ``_arrivals``): a C++
  post hook on each parameter's ``AccumulateGrad`` node, as DDP's reducer has,
  records the arrival in a ``Ledger`` and hands the tensor to the runtime
  without entering Python (python/shim/arrivals.cpp). The step's record lives
  in the ledger; :class:`LedgerStep` shows it to the wrapper.
* **python**: a post-accumulate-grad hook per parameter runs ``_on_grad``;
  the record is a :class:`PythonStep`. Taken for parameters off the CPU
  (their gradients are staged through host memory), when ``_arrivals`` is
  missing or was built against another torch (a warning says which), or on
  request (``GRADSYNC_HOOKS=python``).

Either way the wrapper sees: ``number``, ``arrivals``, ``task_seen``,
``began`` / ``begin_backward(params)`` (which ``.grad`` tensors existed when
backward began: they receive the average), ``outputs()`` (per parameter, the
tensor that must receive the average) and its own ``sync_pending`` and
``end_queued_for``.
"""

import os
import warnings

from gradsync._native import ArrivalSink
from gradsync.torch import _shim


def load_ledger():
    """The ``_arrivals`` module when native hooks can run, else ``None`` (with
    a warning, unless Python hooks were asked for)."""
    if os.environ.get("GRADSYNC_HOOKS", "native") == "python":
        return None
    module, why = _shim.load("arrivals")
    if module is None:
        warnings.warn(
            f"gradsync: gradient hooks run in Python, slower per parameter: {why}. Reinstall gradsync with "
            "torch installed (pip install --no-build-isolation) to build them.",
            RuntimeWarning,
            stacklevel=4,
        )
    return module


class PythonStep:
    """The record of the Python hooks.

    A plain object, replaced at every step: attribute writes on an
    ``nn.Module`` go through ``Module.__setattr__`` (several microseconds), too
    slow for a hook that runs once per gradient."""

    __slots__ = ("number", "fired", "out", "existing", "arrivals", "sync_pending", "task_seen", "end_queued_for")

    def __init__(self, number, params):
        self.number = number
        # Hook firings so far, per parameter: the next firing's token.
        self.fired = [0] * params
        # Per parameter, the tensor of its first firing that must receive the
        # average (see ``_on_grad``); None: a view or a fresh tensor will do.
        self.out = [None] * params
        # ids of the .grad tensors that existed when this step's backward
        # began (the caller may hold them: they must receive the average);
        # None until backward reaches the model.
        self.existing = None
        self.arrivals = 0
        # A forward under grad asked for a synchronized step.
        self.sync_pending = False
        # The autograd task last seen (the check for a new backward pass is one comparison).
        self.task_seen = None
        # The outermost task whose end will end the step.
        self.end_queued_for = None

    @property
    def began(self):
        return self.existing is not None

    def begin_backward(self, params):
        self.existing = {id(g) for g in (p.grad for p in params) if g is not None}

    def outputs(self):
        return self.out


class LedgerStep:
    """The record of the native hooks: the ledger's, plus the wrapper's own
    ``sync_pending`` and ``end_queued_for`` (as :class:`PythonStep`)."""

    __slots__ = ("number", "sync_pending", "end_queued_for", "_ledger")

    def __init__(self, number, ledger):
        ledger.new_step(number)
        self.number = number
        self.sync_pending = False
        self.end_queued_for = None
        self._ledger = ledger

    @property
    def arrivals(self):
        return self._ledger.arrivals

    @property
    def task_seen(self):
        return self._ledger.task_seen

    @task_seen.setter
    def task_seen(self, task):
        self._ledger.task_seen = task

    @property
    def began(self):
        return self._ledger.began

    def begin_backward(self, params):
        self._ledger.begin_backward([p.grad for p in params])

    def outputs(self):
        return self._ledger.outputs()


class Recorder:
    """Makes each step's record and owns the hooks that fill it."""

    def __init__(self, params, viewable, staging, session, on_grad, on_task, on_odd):
        self._count = len(params)
        module = None if staging else load_ledger()
        if module is not None:
            self._ledger = module.Ledger(params, viewable, ArrivalSink.table(), session.arrival_sink(), on_task, on_odd)
            self._handles = [self._ledger]
        else:
            self._ledger = None
            self._handles = [p.register_post_accumulate_grad_hook(on_grad(i)) for i, p in enumerate(params)]

    @property
    def native(self):
        """Whether the native hooks record the arrivals."""
        return self._ledger is not None

    def step(self, number):
        """A fresh record for step ``number``."""
        if self._ledger is not None:
            return LedgerStep(number, self._ledger)
        return PythonStep(number, self._count)

    def remove(self):
        """Take every hook off."""
        for h in self._handles:
            h.remove()
        self._handles = []
