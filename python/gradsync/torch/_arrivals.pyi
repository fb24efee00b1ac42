"""gradsync's torch hook in C++ (python/shim/arrivals.cpp), compiled by
``pip install`` against the installed torch: a post hook on each parameter's
``AccumulateGrad`` node hands the gradient to the runtime, the end of the
last backward that reached the model ends the step, and the averages are
written back, all without entering Python per gradient.
``gradsync.torch._hooks`` uses it; see that module."""

from typing import Any, Callable, Optional, Sequence

import torch

#: Version of the runtime's entry table this hook speaks.
VERSION: int

class Ledger:
    """The hook on a wrapper's parameters, the open step's record, the write-back.

    ``table`` is ``gradsync._native.ArrivalSink.table()``, ``sink`` the
    session's ``arrival_sink()``. Called with the interpreter lock:
    ``on_end()`` when the last backward task that reached the model and
    accumulated gradients ended; ``on_sync_asked()`` when backward runs
    through the outputs of a synchronized forward whose step ended;
    ``on_odd(index)`` for a gradient the runtime cannot read (sparse, or on
    another device), and should raise. ``staging``: gradients on a device go
    through host memory; ``device_plane``: they are handed over as they are;
    ``plane_stream``: the device plane's stream."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        table: int,
        sink: Any,
        on_end: Callable[[], None],
        on_sync_asked: Callable[[], None],
        on_odd: Callable[[int], None],
        staging: bool = False,
        device_plane: bool = False,
        plane_stream: Optional[torch.Stream] = None,
    ) -> None: ...
    def remove(self) -> None:
        """Take the hooks off; later gradients stay in ``.grad``."""
    def rehook(self) -> None:
        """Hook the parameters' gradient accumulators again: ``p.data = ...``
        of another dtype makes torch forget a parameter's accumulator, and
        with it the hook. Gradients are still handed over in the dtype each
        parameter had when the hooks were made (cast when they differ)."""
    def new_step(self) -> None:
        """Start recording the runtime's next step."""
    def give_held(self) -> None:
        """Hand over the ``.grad`` of parameters only ``no_sync`` micro-batches reached."""
    sync: bool
    """Whether backward hands gradients over (else they accumulate in ``.grad``)."""
    def watch(self, outputs: Sequence[torch.Tensor], synced: bool) -> int:
        """See backward reach these output tensors; returns the nodes hooked."""
    def reached(self) -> None:
        """Backward reached the model (a forward recomputed inside it)."""
    def write_back(self, buckets: Sequence[tuple[torch.Tensor, Sequence[int]]], loan: Any,
                   unused: Sequence[int]) -> bool:
        """A finished step's averages into ``.grad``; whether views of ``loan`` were lent."""
    @property
    def open_task(self) -> Optional[int]:
        """A backward task that reached the model and still runs (None: none)."""
    @property
    def arrivals(self) -> int:
        """Gradients handed over this step."""

def host_bucket(address: int, numel: int, wide: bool) -> torch.Tensor:
    """A host bucket the runtime lends (``Step.buckets()``) as a float32
    (``wide``: float64) tensor over its memory, which it does not own."""
