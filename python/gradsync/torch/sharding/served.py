"""One rank reads the whole model alone: every rank's pieces are served by
threads of its runtime, not by its training thread.

Between steps each rank of a parameter-sharded wrapper holds only its
pieces. A program that saves on rank 0 only (the DDP tutorial's ``if rank
== 0: torch.save(model.state_dict(), PATH)``, Accelerate's and Fabric's
saves) reads every parameter there while the other ranks are elsewhere: in
their next forward (waiting for rank 0 in its first gather), or still in
``optimizer.step()``. So each rank runs a ``gradsync._native.PieceServer``
over its pieces' memory, and a rank that reads alone asks every other
rank's server for its pieces at its own step::

    every rank, at wrap:  PieceServer(host) ─ register(pieces' memory) ─ its address in the store
    optimizer.step():     writing() ─ the pieces stepped ─ written(steps taken)   (reads wait meanwhile)
    the reader, alone:    PieceReader.read(steps taken, a bucket's parameters) per bucket
                          ─▶ each parameter whole: its own pieces, then every other rank's

The servers answer a read at the reader's step only (``steps taken``, equal
on every rank): a rank still inside the step the reader finished answers
once it has stepped; nothing waits for a timer. Pieces on a device are not
served (the servers copy host memory): there, every rank reads inside
``model.whole_parameters()``.
"""

import os
import socket

import torch

from gradsync._native import PieceReader, PieceServer
from gradsync.torch.sharding.layout import flat_values

#: Set to the IP address this rank's piece server listens on (default: the
#: address this host reaches the job's store from; loopback on one host).
HOST_VARIABLE = "GRADSYNC_PIECES_HOST"


def serving_host(store):
    """The address this rank's server listens on: :data:`HOST_VARIABLE`,
    else the local address facing the store's host (``MASTER_ADDR``),
    else loopback."""
    if os.environ.get(HOST_VARIABLE):
        return os.environ[HOST_VARIABLE]
    target = getattr(store, "host", None) or os.environ.get("MASTER_ADDR")
    if not target or target in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(target), 9))  # (no packet is sent: it picks the route)
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class PieceService:
    """This rank's piece server and its reader of the others' (see the
    module docs). ``partition``: the wrapper's ``Partition``; its pieces on
    the host are served. ``store``, ``prefix``: where the servers' addresses
    are published (the wrapper's own store prefix); ``timeout_s``: how long
    a server may take to answer (the collective timeout)."""

    def __init__(self, partition, store, prefix, timeout_s):
        self._partition = partition
        self._store = store
        self._key = f"{prefix}/pieces"
        self._timeout_s = timeout_s
        self._server = PieceServer(serving_host(store))
        #: The piece tensors registered (held: the server copies their memory).
        self._held = []
        #: The other ranks' servers (made at the first read).
        self._reader = None
        self.register()
        store.set(f"{self._key}/{partition.rank}", self._server.address)

    @property
    def serves(self):
        """Whether this rank's pieces are served (they are in host memory)."""
        return all(piece.tensor.device.type == "cpu" for piece in self._partition.pieces)

    def register(self):
        """Serve the pieces of the current layout (call after it changes)."""
        pieces = self._partition.pieces if self.serves else []
        self._held = [piece.tensor for piece in pieces]
        self._server.register([(piece.param, piece.offset, piece.tensor.data_ptr(),
                                piece.tensor.numel() * piece.tensor.element_size()) for piece in pieces])

    def writing(self):
        """The pieces are about to be written: returns once no read copies them."""
        self._server.writing()

    def written(self):
        """They were written; they are at the step the partition has taken."""
        self._server.written(self._partition.sharded_step.taken)

    def read_whole(self, indices):
        """Parameters ``indices`` whole, each a new tensor of its own dtype
        and shape: this rank's pieces, and every other rank's read from its
        server at this rank's step, one bucket's parameters at a time."""
        part = self._partition
        if self._reader is None:
            addresses = [None if r == part.rank else self._store.get(f"{self._key}/{r}").decode()
                         for r in range(part.world)]
            self._reader = PieceReader(addresses)
        wanted = set(indices)
        whole = {}
        for bucket in part.buckets:
            members = [i for i in bucket.members if i in wanted]
            if not members:
                continue
            for i in members:
                whole[i] = torch.empty_like(flat_values(part.forms[i]), device="cpu")
                for piece in part.of_param.get(i, ()):
                    whole[i][piece.offset : piece.offset + piece.length].copy_(piece.tensor)
            for _, i, offset, data in self._reader.read(part.sharded_step.taken, members, self._timeout_s):
                values = torch.frombuffer(bytearray(data), dtype=whole[i].dtype)
                whole[i][offset : offset + values.numel()].copy_(values)
        return {i: _shaped(flat, part.forms[i]) for i, flat in whole.items()}

    def close(self):
        """Stop serving (reads waiting are told so)."""
        self._server.close()
        self._held = []


def _shaped(flat, form):
    """``flat`` (a parameter's values as reals, row-major) as a tensor of
    ``form``'s shape and dtype."""
    if form.is_complex():
        return torch.view_as_complex(flat.view(*form.shape, 2))
    return flat.view(form.shape)
