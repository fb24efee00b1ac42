"""The open step's record: what a wrapper knows about the step its gradients
are being collected for, between the runtime's step ends.

The runtime owns the step number (``Session.current_step``); the record
holds what only the wrapper sees: how often each parameter's hook fired
(each firing's index is its token), whether backward passes hand gradients
over (a synchronized step) or leave them in ``.grad`` (micro-batches under
``no_sync``), and whether a backward that will end the step is running.

:class:`StepRecord` is what the core reads. torch's record lives in its C++
hook (``python/shim/arrivals.cpp``, shown by ``gradsync.torch._hooks.LedgerRecord``);
:class:`PythonRecord` is the record of hooks written in Python (Paddle's).
A record serves one step: the core asks its framework for a fresh one when
a step ends.
"""

from typing import Optional, Protocol


class StepRecord(Protocol):
    """The open step, as the core reads it."""

    @property
    def sync_pending(self) -> bool:
        """Whether backward passes hand gradients over and the end of
        backward ends the step (a forward under grad outside ``no_sync``,
        or ``prepare_for_backward``); ``False``: they accumulate in ``.grad``."""

    @property
    def end_queued_for(self) -> Optional[object]:
        """A running backward whose end will end the step, or ``None``."""

    @property
    def arrivals(self) -> int:
        """Gradients handed to the runtime in this step."""

    def ask_for_sync(self) -> None:
        """The step is synchronized from now on (see ``sync_pending``)."""


class PythonRecord:
    """The record of hooks written in Python (see the module docs).

    A plain object with slots, replaced at every step: a hook runs once per
    gradient, and attribute writes on a framework module cost several
    microseconds; on this object they cost tens of nanoseconds."""

    __slots__ = ("fired", "arrivals", "sync_pending", "end_queued_for", "held")

    def __init__(self, params):
        # Hand-overs so far, per parameter: the next one's token.
        self.fired = [0] * params
        self.arrivals = 0
        self.sync_pending = False
        # Set by the framework while an outermost backward runs.
        self.end_queued_for = None
        # Per parameter: a no_sync micro-batch left its gradient in .grad.
        self.held = [False] * params

    def ask_for_sync(self):
        """The step is synchronized from now on."""
        self.sync_pending = True

    def held_unsent(self):
        """Parameters a no_sync micro-batch reached and no synchronized
        backward did: their ``.grad`` holds this rank's sum, to hand over."""
        return [i for i, (held, fired) in enumerate(zip(self.held, self.fired)) if held and not fired]
