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

In an elastic job the servers follow the members: after each change of
members every member serves the pieces it holds now (its own and its
buddy copy, ``sharding.reshard``), publishes its address under the new
membership, and counts its version from the new epoch (a joiner serves
from its first settlement). A member lost while another reads alone (its
server refuses the connection, or stays silent while the liveness monitor
breaks the epoch) is read from the member that holds its buddy copy,
stepped with it, so the read is the same; the others' next boundary
re-shards as usual. Only a member lost together with its buddy ends the
read, with ``MembershipError(kind="shard_lost")``.
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

from gradsync._errors import ConfigError, MembershipError, PeerGoneError
from gradsync._native import PieceReader, PieceServer
from gradsync.torch.sharding.layout import flat_values

log = logging.getLogger("gradsync")

#: Set to the IP address this rank's piece server listens on (default: the
#: address this host reaches the job's store from; loopback on one host).
HOST_VARIABLE = "GRADSYNC_PIECES_HOST"

#: A buddy copy's pieces are registered under their parameter's index with
#: this bit set, apart from the holder's own pieces of the same parameter:
#: a read asks a holder for them only when their owner is lost.
BUDDY = 1 << 31

#: A version counts the membership epoch above this many bits of steps
#: (optimizer steps and other writes within the epoch): a member behind the
#: reader's epoch (still settling) is behind its version too.
EPOCH_SHIFT = 40

#: In an elastic job a read waits for a silent server this long at a time,
#: then asks whether the liveness monitor broke the epoch (a member gone
#: silent), instead of waiting out the collective timeout at once.
LOOK_S = 1.0


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
    a server may take to answer (the collective timeout). In an elastic
    job: ``epoch``, the membership epoch; ``abandon``, the job's question
    whether the epoch broke (a member gone silent); ``publish``: whether the
    address is published now (a joiner's is, at its first settlement:
    :meth:`moved`)."""

    def __init__(self, partition, store, prefix, timeout_s, epoch=0, abandon=None, publish=True):
        self._partition = partition
        self._store = store
        self._key = f"{prefix}/pieces"
        self._timeout_s = timeout_s
        self._epoch = epoch
        self._abandon = abandon
        self._server = PieceServer(serving_host(store))
        #: The piece tensors registered (held: the server copies their memory).
        self._held = []
        #: The other ranks' servers (made at the first read).
        self._reader = None
        #: How many parameters the optimizer held state for when registered.
        self._state_entries = 0
        #: Writes of the pieces every rank makes besides optimizer steps
        #: (loads, ``whole_parameters()`` blocks) in this epoch: part of the version read.
        self._writes = 0
        #: The last bucket read for :meth:`read_one`: ``(version, {index:
        #: whole tensor})`` (a loop over the parameters reads each bucket once).
        self._last_read = None
        #: Whether this rank's pieces are being written (between
        #: :meth:`writing` and :meth:`written`): no read alone is made then.
        self._writes_now = False
        #: Ranks of this membership found lost by a read alone (read from their buddy copies since).
        self._lost = set()
        self._closed = False
        self.register()
        self._server.written(self.step)
        if publish:
            store.set(f"{self._key}/{partition.rank}", self._server.address)
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def moved(self, store, prefix, epoch):
        """The members changed (an elastic job's settlement moved the
        pieces): serve the pieces held now under the new membership's
        ``prefix`` of ``store``, at the new ``epoch``'s first version (or,
        settled inside an optimizer step, at the version it ends at)."""
        self._store, self._key, self._epoch = store, f"{prefix}/pieces", epoch
        self._reader, self._last_read, self._writes, self._lost = None, None, 0, set()
        self._server.writing()  # (no copy of the registered memory runs while it is replaced)
        self.register()
        store.set(f"{self._key}/{self._partition.rank}", self._server.address)
        if not self._writes_now:
            self._server.written(self.step)

    @property
    def serves(self):
        """Whether this rank's pieces are served (they are in host memory)."""
        return all(piece.tensor.device.type == "cpu" for piece in self._partition.every_held_piece())

    def register(self):
        """Serve the pieces of the current layout, and the optimizer's state
        of them (call after either changes: a load, the first step); a
        buddy copy's under :data:`BUDDY` keys."""
        part = self._partition
        owned = [(piece, piece.param) for piece in part.pieces] + [(piece, piece.param | BUDDY)
                                                                 for piece in part.buddy_pieces]
        owned = owned if self.serves else []
        served = [(key, piece.offset, piece.tensor, "") for piece, key in owned]
        state = self._optimizer_state()
        for piece, param_key in owned:
            for key, value in state.get(piece.tensor, {}).items():
                if torch.is_tensor(value) and value.device.type == "cpu" and value.is_contiguous():
                    served.append((param_key, piece.offset, value, _state_tag(key, value)))
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
        steps taken and the other writes every rank makes (:meth:`wrote`),
        counted within the membership epoch (above :data:`EPOCH_SHIFT` bits)."""
        return (self._epoch << EPOCH_SHIFT) + self._partition.sharded_step.taken + self._writes

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

    def _read(self, indices, tagged):
        """Every other rank's pieces of parameters ``indices`` (``tagged``:
        their optimizer state, else their values) at this rank's version:
        ``[(rank, index, offset, tag, bytes)]``, a lost member's from the
        holder of its buddy copy (see the module docs)."""
        deadline = time.monotonic() + self._timeout_s
        lost = self._lost
        while True:
            look = self._timeout_s if self._abandon is None else min(LOOK_S, max(0.001, deadline - time.monotonic()))
            try:
                return self._read_without(lost, indices, tagged, look)
            except PeerGoneError as error:
                self._reader = None  # (its connections may hold answers not read: made anew)
                if self._abandon is None or not self._partition.buddy:
                    raise
                (rank,) = error.ranks
                address = self._store.get(f"{self._key}/{rank}").decode()
                if not _answers(address) or self._abandon():
                    lost.add(rank)
                    log.warning("gradsync: rank %d was lost during a read alone; its pieces are read from its buddy "
                                "copy", rank)
                elif time.monotonic() >= deadline:
                    raise
            except ConfigError as error:
                if self._abandon is None or getattr(error, "ahead", None) is None:
                    raise
                raise MembershipError.of(
                    "broken", "the members changed while this rank read the model alone (a member is in a later "
                    f"membership than this one): read again after the next step boundary ({error})"
                ) from error

    def _read_without(self, lost, indices, tagged, look_s):
        """:meth:`_read` once, each server given ``look_s``: from every other
        rank but those ``lost``, whose pieces come from their buddy copies."""
        part = self._partition
        if not lost:
            if self._reader is None:
                self._reader = PieceReader([None if r == part.rank else self._store.get(f"{self._key}/{r}").decode()
                                            for r in range(part.world)])
            return self._reader.read(self.step, list(indices), tagged, look_s)
        holders = {rank: (rank - part.buddy_stride) % part.world for rank in lost}
        if any(holder in lost for holder in holders.values()):
            (rank, holder) = next((r, h) for r, h in holders.items() if h in lost)
            raise MembershipError.of(
                "shard_lost", f"ranks {sorted({rank, holder})} were lost together while this rank read the model "
                f"alone, and with them both copies of partition {rank}: restart the job from its last sharded "
                "checkpoint (gradsync.torch.checkpoint.save/load)"
            )
        addresses = [None if r == part.rank or r in lost else self._store.get(f"{self._key}/{r}").decode()
                     for r in range(part.world)]
        found = PieceReader(addresses).read(self.step, list(indices), tagged, look_s)
        copies = [addresses[r] if r in holders.values() else None for r in range(part.world)]
        if any(copies):
            asked = [i | BUDDY for i in indices]
            found += [(rank, i & ~BUDDY, offset, tag, data)
                      for rank, i, offset, tag, data in PieceReader(copies).read(self.step, asked, tagged, look_s)]
        if part.rank in holders.values():
            found += self._own_buddy_copy(indices, tagged)
        return found

    def _own_buddy_copy(self, indices, tagged):
        """This rank's buddy copy of ``indices`` (its owner is lost), as a
        server would send it."""
        part, state = self._partition, self._optimizer_state()
        found = []
        for i in indices:
            for piece in part.buddy_of_param.get(i, ()):
                if not tagged:
                    found.append((part.rank, i, piece.offset, "", _bytes_of(piece.tensor)))
                    continue
                for key, value in state.get(piece.tensor, {}).items():
                    if torch.is_tensor(value):
                        found.append((part.rank, i, piece.offset, _state_tag(key, value), _bytes_of(value)))
        return found

    def read_state(self, indices):
        """The optimizer's state of parameters ``indices``, whole: ``{index:
        {key: tensor of the parameter's values as reals, flat | scalar}}``,
        this rank's pieces' and every other rank's (read at this rank's
        step), each scalar (a step count) from the piece at offset 0. A
        parameter no rank holds state for is left out."""
        part, state = self._partition, self._optimizer_state()
        found = [(part.rank, piece.param, piece.offset, key, value) for piece in part.pieces
                 for key, value in state.get(piece.tensor, {}).items()]
        for rank, i, offset, tag, data in self._read(list(indices), True):
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
            for _, i, offset, _, data in self._read(members, False):
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
            # (A member whose epoch broke, left out by the others, has nobody to serve: it goes at once.)
            if self._abandon is None or not self._abandon():
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
        while time.monotonic() < deadline and (self._abandon is None or not self._abandon()):
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


def _state_tag(key, value):
    """The tag a piece's optimizer state ``key`` (tensor ``value``) is
    served under: its key, kind and dtype (``read_state`` reads them back)."""
    return f"{key}|{'tensor' if value.dim() > 0 else 'scalar'}|{str(value.dtype)[6:]}"


def _bytes_of(tensor):
    """``tensor``'s values as they lie in memory (any dtype)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _shaped(flat, form):
    """``flat`` (a parameter's values as reals, row-major) as a tensor of
    ``form``'s shape and dtype."""
    if form.is_complex():
        return torch.view_as_complex(flat.view(*form.shape, 2))
    return flat.view(form.shape)
