"""gradsync's collectives on torch's c10d engines (python/shim/collectives.cpp),
compiled by ``pip install`` against the installed torch. The runtime's
communicator thread calls the C functions of :func:`table` on an
:class:`Endpoint`'s address, without the interpreter lock; for buckets on
the device plane it also calls them on a :class:`Plane`'s address."""

from typing import Any, Optional

import torch

#: Version of the C function table (the Rust side checks it).
VERSION: int

def table() -> int:
    """Address of the C function table the communicator thread calls."""

class Endpoint:
    """One gloo group (``group``, a ``ProcessGroupGloo``: control words, plan
    agreements, host buckets), the job's store (``store``) where each rank
    counts the collectives it started under ``positions`` + its rank (this
    one is ``rank`` of ``world``), and the device plane's data group
    (``data``: a ``ProcessGroupNCCL`` for CUDA buckets; ``None``: ``group``)."""

    def __init__(
        self,
        group: Any,
        store: Any,
        positions: str,
        rank: int,
        world: int,
        data: Any = None,
        cancel: Optional[Cancel] = None,
        epoch: int = 0,
    ) -> None:
        """``cancel`` and ``epoch``: an elastic job's cancellation, and the
        membership epoch whose break cancels this endpoint's waits."""
    @property
    def address(self) -> int:
        """Where the runtime finds this endpoint (valid while it lives)."""

class Cancel:
    """An elastic job's cancellation of broken membership epochs."""

    def __init__(self) -> None: ...
    def cancel(self, epoch: int) -> None:
        """Every wait of an endpoint of an epoch up to ``epoch`` fails from now on."""
    @property
    def broken(self) -> int:
        """The highest broken epoch (-1: none)."""
    @property
    def address(self) -> int: ...

class StoreClient:
    """A c10d store the runtime's membership protocol calls without the interpreter lock."""

    def __init__(self, store: Any) -> None: ...
    @property
    def address(self) -> int: ...

class Plane:
    """A wrapper's device plane: buckets as torch tensors on ``device``,
    every operation queued on a stream of its own (none on the CPU)."""

    def __init__(self, device: torch.device) -> None: ...
    @property
    def address(self) -> int:
        """Where the runtime finds this plane (valid while it lives)."""
    @property
    def streamed(self) -> bool:
        """Whether the plane has a stream (a device, not the CPU)."""
    @property
    def stream(self) -> Optional[torch.Stream]:
        """The plane's stream (``None`` on the CPU); the C++ hook orders it
        against the caller's stream."""

def bucket_tensor(address: int) -> torch.Tensor:
    """The device-plane bucket at ``address`` (``Step.buckets()``), as a
    tensor sharing its memory."""
