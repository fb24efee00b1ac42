"""gradsync's collectives on torch's gloo engine (python/shim/collectives.cpp),
compiled by ``pip install`` against the installed torch. The runtime's
communicator thread calls the C functions of :func:`table` on an
:class:`Endpoint`'s address, without the interpreter lock."""

from typing import Any

#: Version of the C function table (the Rust side checks it).
VERSION: int

def table() -> int:
    """Address of the C function table the communicator thread calls."""

class Endpoint:
    """One gloo group (``group``, a ``ProcessGroupGloo``) and the store
    (``store``) this rank's position ``epoch:seq`` is written to under
    ``key`` before each collective."""

    def __init__(self, group: Any, store: Any, key: str, epoch: int) -> None: ...
    @property
    def address(self) -> int:
        """Where the runtime finds this endpoint (valid while it lives)."""
    def set_wire(self, wire: int) -> None:
        """Send later data buckets as 0 float32, 1 bfloat16 or 2 float16."""
