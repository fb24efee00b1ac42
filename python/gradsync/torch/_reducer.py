"""``model.reducer``: the part of torch's C++ ``Reducer`` that libraries call.

Torch's DDP keeps its bucketing state in a C++ ``Reducer`` (``model.reducer``),
and libraries reach into it directly:

* Lightning, in manual optimization (``automatic_optimization=False``), calls
  ``reducer._rebuild_buckets()`` and ``reducer.prepare_for_backward(...)``
  before every ``manual_backward`` (one forward, several backward passes),
  and ``reducer._delay_all_reduce()`` after the first one under
  ``static_graph``;
* Accelerate's ``trigger_sync_in_backward`` calls
  ``reducer.prepare_for_backward([])`` to make a backward synchronize after a
  forward run under ``no_sync``;
* torch's own DDP methods that gradsync inherits (``_check_reducer_finalized``,
  ``_set_ddp_runtime_logging_sample_rate``, manual backward finalization)
  forward to it.

:class:`Reducer` answers those calls with what each means under gradsync.
Most mean nothing: gradsync needs no declaration of the graph, finds unused
parameters itself and rebuilds its plan at step boundaries agreed by every
rank. The one that matters is ``prepare_for_backward``: *the next backward
that reaches this model ends a synchronized step*. Any other reducer call
raises :class:`gradsync.ConfigError` (also an ``AttributeError``, so
``hasattr`` probes read ``False``) naming what is supported.
"""

import weakref

from gradsync._errors import ConfigError


class UnsupportedReducerCall(ConfigError, AttributeError):
    """A call on ``model.reducer`` that gradsync has no equivalent for."""


class Reducer:
    """The stand-in for torch's ``model.reducer`` on a gradsync wrapper (see
    the module docs). Holds its wrapper weakly: it never keeps one alive."""

    #: The calls gradsync answers, and what each does under gradsync.
    SUPPORTED = {
        "prepare_for_forward": "nothing (gradsync's forward does what a step needs)",
        "prepare_for_backward": "the next backward that reaches the model ends a synchronized step",
        "_rebuild_buckets": "nothing; returns False (gradsync rebuilds its plan at a step boundary all ranks agree on)",
        "_push_all_rebuilt_params": "nothing (see _rebuild_buckets)",
        "_delay_all_reduce": "nothing (every step already ends, reduced, when the outermost backward does)",
        "_set_static_graph": "nothing (gradsync needs no static graph and overlaps from the first step)",
        "set_logger": "nothing (gradsync reports through last_report and its metrics)",
        "_set_ddp_runtime_logging_sample_rate": "nothing (see set_logger)",
        "_check_reducer_finalized": "raises UnfinishedStepError if gradients wait for a step end gradsync could not see",
        "_set_grads_to_none": "sets every synchronized parameter's .grad to None",
        "_set_manual_finalization_required": "the model's require_manual_backward_finalization",
        "_should_finalize_after_backward": "True in manual finalization (the step ends after backward returns)",
        "_finalize_backward_manual": "the model's finalize_backward()",
        "_register_comm_hook": "the model's register_comm_hook(state, hook)",
        "_register_builtin_comm_hook": "the model's _register_builtin_comm_hook(type)",
    }

    def __init__(self, wrapper):
        self._wrapper = weakref.ref(wrapper)

    def _model(self):
        wrapper = self._wrapper()
        if wrapper is None:
            raise ConfigError("the gradsync DistributedDataParallel this reducer belonged to is gone")
        wrapper._refuse_if_closed()
        return wrapper

    def prepare_for_forward(self):
        """Nothing to prepare: gradsync's forward does what a step needs."""
        self._model()

    def prepare_for_backward(self, outputs=()):
        """The next backward that reaches the model ends a synchronized step:
        its gradients (and those accumulated since the last step ended) are
        averaged over the ranks. ``outputs`` is where torch's DDP would look
        for unused parameters; gradsync finds them itself and ignores it."""
        self._model()._ask_for_sync()

    def _rebuild_buckets(self):
        """``False``: nothing to rebuild now. gradsync rebuilds its plan in
        the order gradients arrive, at a step boundary every rank agrees on."""
        self._model()
        return False

    def _push_all_rebuilt_params(self):
        """Nothing to do (see :meth:`_rebuild_buckets`)."""
        self._model()

    def _delay_all_reduce(self):
        """Nothing to do: torch's DDP all-reduces the first step of a static
        graph after backward; gradsync ends every step, reduced, when the
        outermost backward ends, with overlap from the first step."""
        self._model()

    def _set_static_graph(self):
        """Nothing to do: gradsync needs no declaration of a static graph."""
        self._model()

    def set_logger(self, logger):
        """Nothing to do: gradsync reports through ``last_report`` and metrics."""
        self._model()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate):
        """Nothing to do (see :meth:`set_logger`)."""
        self._model()

    def _check_reducer_finalized(self):
        """Raise :class:`gradsync.UnfinishedStepError` if gradients were
        handed over by a backward whose end gradsync could not see."""
        self._model()._sync.raise_if_unfinished("_check_reducer_finalized()")

    def _set_grads_to_none(self):
        """Set every synchronized parameter's ``.grad`` to ``None``."""
        for p in self._model()._params:
            p.grad = None

    def _set_manual_finalization_required(self, required):
        """The model's ``require_manual_backward_finalization``."""
        self._model().require_manual_backward_finalization = required

    def _should_finalize_after_backward(self):
        """``True`` while manual finalization is on: the step ends after backward returns."""
        return self._model().require_manual_backward_finalization

    def _finalize_backward_manual(self):
        """The model's ``finalize_backward()``."""
        self._model().finalize_backward()

    def _register_comm_hook(self, state, hook):
        """The model's ``register_comm_hook(state, hook)``."""
        self._model().register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type):
        """The model's ``_register_builtin_comm_hook(comm_hook_type)``."""
        self._model()._register_builtin_comm_hook(comm_hook_type)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        supported = ", ".join(sorted(self.SUPPORTED))
        raise UnsupportedReducerCall(
            f"model.reducer.{name}: gradsync runs its own reducer in Rust and has no equivalent of torch's "
            f"Reducer.{name}; the reducer calls gradsync answers are {supported} "
            "(see gradsync.torch._reducer for what each does)"
        )
