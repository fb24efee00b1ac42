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
                          (or, tagged, the optimizer's state of them: optimizer.state_dict() alone)

The servers answer a read at the reader's version of the pieces only: the
writes every rank makes to them in the same order (optimizer steps taken,
loads, ``whole_parameters()`` blocks), so a rank still inside the step or
the load the reader finished answers once it is through; nothing waits for
a timer. Pieces on a device are not served (the servers copy host memory):
there, every rank reads inside ``model.whole_parameters()``.

A rank that closes its wrapper (or exits) first waits, serving, until every
other rank has closed its own or is gone (bounded by the collective
timeout), so a rank that reads alone at the end of a run (a last save on
rank 0) finds the others' servers still there.
"""

import atexit
import contextlib
import datetime
import logging
import os
import socket
import time
import weakref

import torch

from gradsync._errors import ConfigError
from gradsync._native import PieceReader, PieceServer
from gradsync.torch.sharding.layout import flat_values

log = logging.getLogger("gradsync")

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
        #: How many parameters the optimizer held state for when registered.
        self._state_entries = 0
        #: Writes of the pieces every rank makes besides optimizer steps
        #: (loads, ``whole_parameters()`` blocks): part of the version read.
        self._writes = 0
        #: The last bucket read for :meth:`read_one`: ``(version, {index:
        #: whole tensor})`` (a loop over the parameters reads each bucket once).
        self._last_read = None
        #: Whether this rank's pieces are being written (between
        #: :meth:`writing` and :meth:`written`): no read alone is made then.
        self._writes_now = False
        self._closed = False
        self.register()
        store.set(f"{self._key}/{partition.rank}", self._server.address)
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    @property
    def serves(self):
        """Whether this rank's pieces are served (they are in host memory)."""
        return all(piece.tensor.device.type == "cpu" for piece in self._partition.pieces)

    def register(self):
        """Serve the pieces of the current layout, and the optimizer's state
        of them (call after either changes: a load, the first step)."""
        pieces = self._partition.pieces if self.serves else []
        served = [(piece.param, piece.offset, piece.tensor, "") for piece in pieces]
        state = self._optimizer_state()
        for piece in pieces:
            for key, value in state.get(piece.tensor, {}).items():
                if torch.is_tensor(value) and value.device.type == "cpu" and value.is_contiguous():
                    kind = "tensor" if value.dim() > 0 else "scalar"
                    served.append((piece.param, piece.offset, value, f"{key}|{kind}|{str(value.dtype)[6:]}"))
        self._held = [t for _, _, t, _ in served]
        self._state_entries = len(state)
        self._server.register([(i, offset, t.data_ptr(), t.numel() * t.element_size(), tag)
                               for i, offset, t, tag in served])

    def _optimizer_state(self):
        """The state of the sharded optimizer built last over the partition
        (keyed by piece tensors), or nothing."""
        ref = self._partition.optimizer
        optimizer = ref() if ref is not None else None
        return optimizer.inner.state if optimizer is not None else {}

    def writing(self):
        """The pieces are about to be written: returns once no read copies them."""
        self._last_read = None
        self._server.writing()
        self._writes_now = True

    def written(self):
        """They were written; they are at the step the partition has taken
        (served with the optimizer's state as it is now: a first step made it)."""
        if len(self._optimizer_state()) != self._state_entries:
            self.register()
        self._server.written(self.step)
        self._writes_now = False

    @property
    def mid_update(self):
        """Whether a read alone now would race a step's update: this step's
        averages wait for the optimizer (another rank may have stepped its
        pieces already), or this rank's own step is writing its pieces."""
        return self._partition.sharded_step.pending or self._writes_now

    @property
    def step(self):
        """The version the pieces are at, which a read asks for: optimizer
        steps taken and the other writes every rank makes (:meth:`wrote`)."""
        return self._partition.sharded_step.taken + self._writes

    def everyone_read(self, what):
        """Wait until every rank is here, at the version this rank read at,
        before ``what`` (a load: every rank loads; the end of an averaged
        model's ``applied()``) writes the pieces: no
        rank's read at this version is left to find the pieces at the next
        one (a load needs no collective, so a rank would move on alone).
        A :class:`ConfigError` names the ranks that did not come within
        the collective timeout.

        Each rank counts itself in and the last opens a gate that the
        others wait on: a few store operations per rank, whatever the
        world (waiting on every rank's key cost each rank O(world) of
        them); the ranks' own keys are read only to name the missing."""
        part = self._partition
        base = f"{self._key}/read/{self.step}"
        self._store.set(f"{base}/{part.rank}", "1")
        if self._store.add(f"{base}/count", 1) >= part.world:
            self._store.set(f"{base}/all", "1")
        try:
            self._store.wait([f"{base}/all"], datetime.timedelta(seconds=self._timeout_s))
        except Exception as error:
            missing = [r for r in range(part.world) if not self._store.check([f"{base}/{r}"])]
            raise ConfigError(
                f"{what} under shard_parameters: ranks {missing} did not come to it within {self._timeout_s:.0f} s. "
                "Each rank writes its own pieces there, so every rank calls it, at the same point (as every rank "
                "loads under DDP)"
            ) from error

    def wrote(self):
        """Every rank wrote its pieces outside an optimizer step (a load, a
        ``whole_parameters()`` block), at the same point of its program:
        the version moves on (a read at the new one waits for the ranks
        not through yet)."""
        with self.rewriting():
            pass

    @contextlib.contextmanager
    def rewriting(self):
        """Within the block every rank writes its pieces outside an
        optimizer step, at the same point of its program (an averaged
        model's values swapped in): no read copies them meanwhile, and
        after it they are served at the next version (:meth:`wrote`)."""
        self.writing()
        try:
            yield
        finally:
            self._writes += 1
            self.written()

    def _readers(self):
        """The reader of every other rank's server (made at the first read)."""
        if self._reader is None:
            part = self._partition
            self._reader = PieceReader([None if r == part.rank else self._store.get(f"{self._key}/{r}").decode()
                                        for r in range(part.world)])
        return self._reader

    def read_state(self, indices):
        """The optimizer's state of parameters ``indices``, whole: ``{index:
        {key: tensor of the parameter's values as reals, flat | scalar}}``,
        this rank's pieces' and every other rank's (read at this rank's
        step), each scalar (a step count) from the piece at offset 0. A
        parameter no rank holds state for is left out."""
        part, state = self._partition, self._optimizer_state()
        found = [(part.rank, piece.param, piece.offset, key, value) for piece in part.pieces
                 for key, value in state.get(piece.tensor, {}).items()]
        for rank, i, offset, tag, data in self._readers().read(self.step, list(indices), True, self._timeout_s):
            key, kind, dtype = tag.split("|")
            values = torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype))
            found.append((rank, i, offset, key, values if kind == "tensor" else values.reshape(())))
        whole = {}
        for _, i, offset, key, value in found:
            entry = whole.setdefault(i, {})
            if not torch.is_tensor(value) or value.dim() == 0:
                if offset == 0:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
                continue
            if key not in entry:
                entry[key] = torch.zeros(flat_values(part.forms[i]).numel(), dtype=value.dtype)
            entry[key][offset : offset + value.numel()].copy_(value)
        return whole

    def read_whole(self, indices):
        """Parameters ``indices`` whole, each a new tensor of its own dtype
        and shape: this rank's pieces, and every other rank's read from its
        server at this rank's step, one bucket's parameters at a time."""
        part = self._partition
        self._readers()
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
            for _, i, offset, _, data in self._reader.read(self.step, members, False, self._timeout_s):
                values = torch.frombuffer(bytearray(data), dtype=whole[i].dtype)
                whole[i][offset : offset + values.numel()].copy_(values)
        return {i: _shaped(flat, part.forms[i]) for i, flat in whole.items()}

    def read_one(self, i):
        """Parameter ``i`` whole (as :meth:`read_whole` gives it), read with
        the rest of its bucket, which is kept until the version moves on or
        another bucket is read: a loop over the parameters (a norm log, an
        EMA update, a deep copy) reads each bucket once."""
        if self._last_read is None or self._last_read[0] != self.step or i not in self._last_read[1]:
            bucket = next(layout for layout in self._partition.buckets if i in layout.members)
            self._last_read = None  # (the bucket kept goes first: one bucket whole at a time)
            self._last_read = (self.step, self.read_whole(bucket.members))
        return self._last_read[1][i]

    def close(self):
        """Stop serving, once every other rank closed its own or is gone
        (each rank waits, serving, up to the collective timeout: a rank
        reading alone at the end of a run finds the others' servers; a rank
        whose server no longer answers a connection has exited and is not
        waited for); reads still waiting are told so."""
        if self._closed:
            return
        self._closed = True
        part = self._partition
        try:
            self._store.set(f"{self._key}/closed/{part.rank}", "1")
            self._store.add(f"{self._key}/closed", 1)
            self._until_the_others_closed()
        except Exception as error:  # (the store gone with the rank that held it: nobody is left to read)
            log.debug("gradsync: piece server of rank %d closes before every rank closed its own: %s", part.rank, error)
        self._server.close()
        self._held = []

    def _until_the_others_closed(self):
        """Wait until every other rank closed its server or is gone, at most
        the collective timeout (a shutdown's courtesy). One counter is
        looked at, backing off from 1 ms to a pause that grows with the
        world (as ``_states.meet`` does); when it stalls for a second, the
        ranks not closed yet are found by their keys once (then only among
        those), and a rank whose server no longer answers a connection has
        exited and is not waited for. So a rank makes a few store
        operations a second whatever the world, and looks at each other
        rank at most once (it looked at every rank's key every 50 ms)."""
        part = self._partition
        deadline = time.monotonic() + self._timeout_s
        nap, longest = 0.001, min(0.5, max(0.005, part.world * 50e-6))
        waiting, gone = None, set()
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            closed = int(self._store.add(f"{self._key}/closed", 0))
            if closed + len(gone) >= part.world:
                return
            if closed != seen:
                seen, since = closed, time.monotonic()
            elif time.monotonic() - since >= 1.0:
                candidates = waiting if waiting is not None else [r for r in range(part.world) if r != part.rank]
                waiting = [r for r in candidates if not self._store.check([f"{self._key}/closed/{r}"])]
                gone |= {r for r in waiting
                         if r not in gone and not _answers(self._store.get(f"{self._key}/{r}").decode())}
                since = time.monotonic()
            time.sleep(nap)
            nap = min(2 * nap, longest)


def _answers(address):
    """Whether a piece server listens at ``address`` (``host:port``)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False


def _shaped(flat, form):
    """``flat`` (a parameter's values as reals, row-major) as a tensor of
    ``form``'s shape and dtype."""
    if form.is_complex():
        return torch.view_as_complex(flat.view(*form.shape, 2))
    return flat.view(form.shape)
