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

A backward through CUDA tensors runs on the engine's worker thread for the
device (a thread torch starts, with no Python caller of its own), while the
thread that called ``backward`` waits in it. There, the frames on this
thread are the *nested* passes (the engine runs a backward called from a
node on the worker itself), and the outermost pass is the one some other
thread is waiting in. :func:`in_outermost_backward` reads both.
"""

import sys
import threading

import torch
from torch.autograd import Variable

_BACKWARD = torch.autograd.backward.__code__
_GRAD = torch.autograd.grad.__code__


def engine_calls(frame=None):
    """The backward passes running on this thread (or on the stack of
    ``frame``), innermost first: ``"backward"`` for ``torch.autograd.backward``
    (``Tensor.backward``), ``"grad"`` for ``torch.autograd.grad``."""
    calls = []
    frame = sys._getframe(1) if frame is None else frame
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
    (and is ``backward``, not ``grad``: ``grad`` does not accumulate ``.grad``).
    On an engine worker thread (CUDA): no pass nested on this thread, and the
    one thread waiting in a pass waits in ``backward`` (with two threads in
    backward at once, the end is not seen, and the step says so)."""
    calls = engine_calls()
    if not isinstance(threading.current_thread(), threading._DummyThread):
        return calls == ["backward"]
    if calls:
        return False
    me = threading.get_ident()
    callers = [engine_calls(f) for tid, f in sys._current_frames().items() if tid != me]
    callers = [c for c in callers if c]
    return len(callers) == 1 and callers[0] == ["backward"]


def current_task():
    """Id of the graph task running on this thread (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def at_end_of_current_task(callback):
    """Run ``callback`` when the graph task running now has finished."""
    Variable._execution_engine.queue_callback(callback)
