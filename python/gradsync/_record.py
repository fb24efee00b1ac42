"""The open step's record: what a wrapper knows about the step its gradients
are being collected for, between the runtime's step ends.

The runtime owns the step number (``Session.current_step``); the record
holds what only the wrapper sees: which parameters' hooks fired and how
often (each firing's index is its token), the tensors that must receive the
average, whether backward passes hand gradients over (a synchronized step)
or leave them in ``.grad`` (micro-batches under ``no_sync``), and where the
outermost backward ends.

:class:`StepRecord` is the interface; :class:`PythonRecord` is the record of
hooks written in Python (Paddle's, and torch's where the C++ hooks cannot
run). torch's C++ hooks keep the same record in C++
(``python/shim/arrivals.cpp``) behind ``gradsync.torch._hooks.LedgerRecord``.
A record serves one step: the core asks its framework for a fresh one when a
step ends.
"""

from typing import Optional, Protocol, Sequence


class StepRecord(Protocol):
    """The open step, as the core and the framework wrappers read it."""

    #: Whether backward passes hand gradients over and the outermost one ends
    #: the step (a forward under grad outside ``no_sync``, or
    #: ``prepare_for_backward``); ``False``: they accumulate in ``.grad``.
    sync_pending: bool
    #: The outermost autograd task whose end will end the step (torch), or ``None``.
    end_queued_for: Optional[int]
    #: The autograd task last seen (a new one means a new backward pass).
    task_seen: Optional[int]

    @property
    def arrivals(self) -> int:
        """Gradients handed to the runtime in this step."""

    @property
    def began(self) -> bool:
        """Whether the synchronized backward has begun (``begin_backward`` ran)."""

    def begin_backward(self, grads: Sequence[object]) -> None:
        """Backward begins: these ``.grad`` tensors (``None`` allowed) exist
        and are the caller's: they receive the average in place."""

    def outputs(self) -> Sequence[object]:
        """Per parameter, the tensor that must receive the average, or ``None``."""

    def ask_for_sync(self) -> None:
        """The step is synchronized from now on (see ``sync_pending``)."""


class PythonRecord:
    """The record of Python hooks (see the module docs).

    A plain object with slots, replaced at every step: a hook runs once per
    gradient, and attribute writes on a framework module cost several
    microseconds; on this object they cost tens of nanoseconds."""

    __slots__ = ("fired", "out", "existing", "arrivals", "sync_pending", "task_seen", "end_queued_for", "held")

    def __init__(self, params):
        # Hand-overs so far, per parameter: the next one's token.
        self.fired = [0] * params
        # Per parameter, the tensor of its first hand-over that must receive
        # the average (None: a view of bucket memory or a fresh tensor will do).
        self.out = [None] * params
        # ids of the .grad tensors that existed when the synchronized backward
        # began (the caller may hold them: they receive the average); None
        # until it begins.
        self.existing = None
        self.arrivals = 0
        self.sync_pending = False
        self.task_seen = None
        self.end_queued_for = None
        # Per parameter: a no_sync micro-batch left its gradient in .grad.
        self.held = [False] * params

    @property
    def began(self):
        return self.existing is not None

    def begin_backward(self, grads):
        self.existing = {id(g) for g in grads if g is not None}

    def outputs(self):
        return self.out

    def ask_for_sync(self):
        """The step is synchronized from now on; the record of which ``.grad``
        tensors the caller holds starts anew at the synchronized backward."""
        if not self.sync_pending:
            self.sync_pending = True
            self.existing = None

    def held_unsent(self):
        """Parameters a no_sync micro-batch reached and no synchronized
        backward did: their ``.grad`` holds this rank's sum, to hand over."""
        return [i for i, (held, fired) in enumerate(zip(self.held, self.fired)) if held and not fired]
