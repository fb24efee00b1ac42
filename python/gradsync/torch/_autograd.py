"""Where backward ends: finding the outermost backward pass from inside it.

A step must end when the *outermost* backward returns, never at the end of a
nested one (reentrant checkpointing runs a nested ``torch.autograd.backward``
for every segment, and the gradients of the outer pass are not all in yet).
PyTorch runs a callback at the end of a graph task when it is queued from
code running inside that task (``queue_callback``), but it does not say
whether that task is nested. The Python stack does: every backward pass that
is running on this thread has a ``torch.autograd.backward`` (or
``torch.autograd.grad``) frame. Exactly one ``backward`` frame means the code
runs in the outermost pass, and a callback queued there runs when that pass
ends, after every nested one.
"""

import sys

import torch
from torch.autograd import Variable

_BACKWARD = torch.autograd.backward.__code__
_GRAD = torch.autograd.grad.__code__


def engine_calls():
    """The backward passes running on this thread, innermost first:
    ``"backward"`` for ``torch.autograd.backward`` (``Tensor.backward``),
    ``"grad"`` for ``torch.autograd.grad``."""
    calls = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _BACKWARD:
            calls.append("backward")
        elif code is _GRAD:
            calls.append("grad")
        frame = frame.f_back
    return calls


def in_outermost_backward():
    """Whether this code runs in a backward pass that is not nested in another
    (and is ``backward``, not ``grad``: ``grad`` does not accumulate ``.grad``)."""
    return engine_calls() == ["backward"]


def current_task():
    """Id of the graph task running on this thread (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def at_end_of_current_task(callback):
    """Run ``callback`` when the graph task running now has finished."""
    Variable._execution_engine.queue_callback(callback)
