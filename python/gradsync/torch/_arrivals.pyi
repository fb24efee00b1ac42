"""gradsync's gradient hooks in C++ (python/shim/arrivals.cpp), compiled by
``pip install`` against the installed torch: a post hook on each parameter's
``AccumulateGrad`` node hands the gradient to the runtime without entering
Python. ``gradsync.torch._hooks`` uses it; see that module."""

from typing import Any, Callable, Optional, Sequence

import torch

#: Version of the runtime's entry table these hooks speak.
VERSION: int

class Ledger:
    """The hooks on a wrapper's parameters and the open step's arrivals.

    ``table`` is ``gradsync._native.ArrivalSink.table()``, ``sink`` the
    session's ``arrival_sink()``. ``on_task()`` is called (with the
    interpreter lock) when a hook runs in an autograd task other than
    ``task_seen``; ``on_odd(index)`` for a gradient the runtime cannot read
    (sparse, or on a device without ``device_plane``), and should raise."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        viewable: Sequence[bool],
        table: int,
        sink: Any,
        on_task: Callable[[], None],
        on_odd: Callable[[int], None],
        device_plane: bool = False,
    ) -> None: ...
    def remove(self) -> None:
        """Take the hooks off; later gradients stay in ``.grad``."""
    def new_step(self, number: int) -> None:
        """Start recording step ``number``."""
    def begin_backward(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Backward begins: these ``.grad`` tensors receive the average."""
    def outputs(self) -> list[Optional[torch.Tensor]]:
        """Per parameter, the tensor that must receive the average, or None."""
    @property
    def began(self) -> bool:
        """Whether ``begin_backward`` was called this step."""
    @property
    def arrivals(self) -> int:
        """Gradients handed over this step."""
    @property
    def task_seen(self) -> Optional[int]:
        """The autograd task last seen (None: none this step)."""
    @task_seen.setter
    def task_seen(self, task: Optional[int]) -> None: ...
