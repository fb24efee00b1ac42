"""Seeing the end of the outermost backward pass in Paddle.

Every backward, the nested ones that recompute (``use_reentrant=True``)
runs inside it included, is a call of ``paddle.base.core.eager.run_backward``
(``Tensor.backward`` and ``paddle.autograd.backward`` go through it; measured
on 3.3.1, docs/paddle.md). gradsync wraps that function once, per process,
with a depth counter: when a depth-1 call begins, every watching wrapper's
step learns that an outermost backward will end it; when it returns, the
wrapper ends the step. Paddle's own "final hook" cannot serve: it runs at
the end of the first backward that ends, a nested one. ``paddle.grad`` does
not go through it; call ``finish_step()`` after it.
"""

import threading
import weakref

from paddle.base import core

# Wrappers whose steps end when an outermost backward returns.
_WAITING = weakref.WeakSet()
_DEPTH = threading.local()
_INSTALLED = []
# What a record's end_queued_for holds while an outermost backward runs.
OUTERMOST = "outermost backward"


def _run_backward(*args, **kwargs):
    depth = getattr(_DEPTH, "n", 0)
    if depth == 0:
        for wrapper in list(_WAITING):
            wrapper._sync.record.end_queued_for = OUTERMOST
    _DEPTH.n = depth + 1
    try:
        result = _INSTALLED[0](*args, **kwargs)
    finally:
        _DEPTH.n = depth
    if depth == 0:
        for wrapper in list(_WAITING):
            wrapper._sync.record.end_queued_for = None
            wrapper._sync.end_of_backward()
    return result


def watch(wrapper):
    """End ``wrapper``'s steps at the end of each outermost backward."""
    if not _INSTALLED:
        _INSTALLED.append(core.eager.run_backward)
        core.eager.run_backward = _run_backward
    _WAITING.add(wrapper)


def unwatch(wrapper):
    """Stop ending ``wrapper``'s steps (it was closed)."""
    _WAITING.discard(wrapper)
