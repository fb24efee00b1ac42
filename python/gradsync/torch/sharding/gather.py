"""A sharded model's parameter gather (and its clip's norm), run by the runtime.

After its optimizer stepped, each rank holds the updated values of its
partition of every bucket; every rank needs every parameter whole before
the next forward. The gather is a collective of the runtime's, like the
buckets' reductions: on its communicator thread, on the data group (NCCL on
the device plane, with no host copy; gloo on the host), under the
collective deadline, its failures classified as a step's are
(``StepFailedError``, which an elastic job recovers from), counted in the
metrics and drawn on the timeline::

    per bucket: buffer = [ chunk of rank 0 | chunk of rank 1 | ... ]   (the runtime's memory)
    this rank writes its pieces into its own chunk ─▶ Session.gather ─▶ every chunk in place
    ─▶ each member parameter reads its values from the buffer

Per bucket, pipelined (:meth:`ParameterGather.start` / :meth:`~ParameterGather.finish`):
bucket b+1 is packed while b is in flight, and b is unpacked while the
later ones are (the caller may compute between the two: a prefetch)::

    start:  pack 0, start 0, pack 1, start 1, ...
    finish: wait 0, unpack 0, wait 1, unpack 1, ...   (every gather waited for, whatever fails)

:class:`ParameterGather` is the one driver of every gather, over either of
the runtime's two engines, which take the same three calls (``buffers``,
``start``, ``wait``): the session's communicator thread (ZeRO-2's gather
after the step, a model gathered whole once per step: :class:`SessionEngine`)
or parameter sharding's gather lane (``gradsync._native.Lane``: a unit's
gathers in forward and backward never queue behind the step's reductions:
:class:`LaneGather`). On the session it keeps the buffers between gathers
(``gradsync._native.Gathers``, one per bucket, allocated again when the
world changes, given back by :meth:`~ParameterGather.drop`); on the lane
each round's buffers go back when it finishes. The session also gathers
every rank's partial gradient norm for a clip by the global norm, and the
found-inf flags of a ``GradScaler`` step (:meth:`ParameterGather.everyone`):
each rank combines the same values in rank order, so the total is bitwise
the same everywhere.
"""

import torch


class SessionEngine:
    """The session's gathers (``gradsync._native.Session``: on its
    communicator thread, under the step's deadline and failure rules) under
    the three calls the driver makes, plus ``run`` (every buffer in one
    gather: what ``Partition.pipelined=False`` measures against)."""

    __slots__ = ("_session",)

    def __init__(self, session):
        self._session = session

    def buffers(self, sizes):
        """Buffers per ``(bucket index or None for the norms, values, float64)``."""
        return self._session.gather_buffers(sizes)

    def start(self, gathers, index):
        """Start gathering buffer ``index`` alone."""
        self._session.gather_start(gathers, index)

    def wait(self, gathers, index):
        """Wait for buffer ``index``'s gather."""
        self._session.gather_wait(gathers, index)

    def run(self, gathers):
        """Gather every buffer of ``gathers`` at once."""
        self._session.gather(gathers)


class ParameterGather:
    """The one driver of a sharded wrapper's gathers (see the module docs).
    ``engine``: the runtime's (:class:`SessionEngine`, or the lane's
    ``Lane``); ``host_tensor(addr, numel, wide)``: a tensor over host memory
    the runtime owns (the C++ hooks' ``host_bucket``); ``plane``: the
    communicator when the buckets live on the device plane (its
    ``bucket_tensor`` and ``plane_stream``), else ``None``; ``keep``: the
    buffers of every bucket are kept between gathers (until :meth:`drop`),
    else each round's go back when it finishes."""

    def __init__(self, engine, host_tensor, plane=None, keep=True):
        self._engine = engine
        self._host_tensor = host_tensor
        self._plane = plane
        self._keep = keep
        #: ``(sizes, Gathers, tensors)`` of the last allocation (``keep``).
        self._held = None
        #: ``(world, Gathers, tensor)`` for every rank's partial norm.
        self._norms = None

    @classmethod
    def of_session(cls, session, host_tensor, plane=None):
        """The driver over ``session``'s gathers, its buffers kept."""
        return cls(SessionEngine(session), host_tensor, plane)

    def buffers(self, sizes):
        """Per bucket, a tensor over its gather buffer (``keep``). ``sizes``:
        per bucket ``(values, float64)``; the same sizes give the same
        buffers (allocated again when they change: another world size)."""
        return self._kept(sizes)[2]

    def _kept(self, sizes):
        """The kept allocation for ``sizes``: ``(sizes, Gathers, tensors)``."""
        sizes = tuple(sizes)
        held = self._held
        if held is None or held[0] != sizes or held[1].lost:
            gathers = self._engine.buffers([(b, n, wide) for b, (n, wide) in enumerate(sizes)])
            self._held = held = (sizes, gathers, self._tensors(gathers))
            # On the device plane the buffers were zeroed on the plane's
            # stream: the caller's writes into them come after that.
            self._caller_waits()
        return held

    def drop(self):
        """Give the buffers of :meth:`buffers` back to the runtime (the next
        call allocates them again): parameter sharding does not keep the
        whole model's worth between its gathers. Nothing may hold a tensor
        of :meth:`buffers` past this. On the device plane the plane's
        stream first waits for the caller's, whose copies out of the
        buffers may still be queued: the caching allocator hands freed
        memory to the next allocation on the plane's stream, which then
        comes after them."""
        if self._held is not None:
            self._plane_waits()
        self._held = None

    def run(self):
        """Gather the buffers of :meth:`buffers` at once: each rank's chunk,
        written before, into every rank's (the session's engine)."""
        self._plane_waits()
        self._engine.run(self._held[1])
        self._caller_waits()

    def start(self, partition, buckets, carries=None):
        """Start gathering ``buckets`` of ``partition`` (this rank's pieces
        packed into its chunk of each; per bucket in ``carries[b]``, a
        narrower dtype, when given: ``Partition.gather_size``) and return
        the round in flight for :meth:`finish`; the caller may compute
        meanwhile (a prefetch). Started in the same order on every rank. A
        failure to start waits for what did start before it is raised."""
        buckets = list(buckets)
        carry = [None if carries is None else carries[b] for b in buckets]
        if self._keep:
            _, gathers, tensors = self._kept(partition.gather_sizes(carries))
            indices, buffers = buckets, [tensors[b] for b in buckets]
        else:
            sizes = [(b, *partition.gather_size(b, c)) for b, c in zip(buckets, carry)]
            gathers = self._engine.buffers(sizes)
            indices, buffers = list(range(len(buckets))), self._tensors(gathers)
            self._caller_waits()
        flight = _Flight(buckets, indices, gathers, buffers, carry)
        try:
            for i, b in enumerate(buckets):
                partition.pack(b, buffers[i], carry[i])
                self._plane_waits()
                self._engine.start(gathers, indices[i])
                flight.started.append(i)
        except BaseException:
            self._settle(flight)
            raise
        return flight

    def finish(self, flight, before_unpack, unpack):
        """Wait for each gather of ``flight`` in order and, when
        ``before_unpack(b)`` says so, ``unpack(b, buffer, carry)`` it into
        its parameters. Every gather is waited for, whatever fails; a
        round's buffers go back at the end (unless kept)."""
        try:
            while flight.started:
                i = flight.started[0]
                keep = before_unpack(flight.buckets[i])
                flight.started.pop(0)
                self._engine.wait(flight.gathers, flight.indices[i])
                self._caller_waits()
                if keep:
                    unpack(flight.buckets[i], flight.buffers[i], flight.carries[i])
        finally:
            self._settle(flight)

    def _settle(self, flight):
        """Wait for what is still out of ``flight`` (the first failure is
        the one raised elsewhere); a round's buffers then go back, after the
        caller's copies out of them."""
        for i in flight.started:
            try:
                self._engine.wait(flight.gathers, flight.indices[i])
            except Exception:  # the first failure is the one raised
                continue
        flight.started.clear()
        if not self._keep:
            self._plane_waits()
        flight.gathers = flight.buffers = None

    def everyone(self, value, rank, world):
        """Every rank's ``value`` (a float64 scalar tensor: a partial
        gradient norm, a found-inf flag), as ``world`` float64 values in
        rank order, on the buffers' device: gathered by the runtime
        (``CollectiveKind::Norm``)."""
        held = self._norms
        if held is None or held[0] != world or held[1].lost:
            gathers = self._engine.buffers([(None, world, True)])
            self._norms = held = (world, gathers, self._tensors(gathers)[0])
            self._caller_waits()
        _, gathers, values = held
        values.zero_()
        values[rank].copy_(value.reshape(()))
        self._plane_waits()
        self._engine.run(gathers)
        self._caller_waits()
        return values.clone()

    def _tensors(self, gathers):
        """Tensors over ``gathers``' buffers."""
        tensors = []
        for _, addr, numel, dtype, on_plane in gathers.entries():
            if on_plane:
                tensors.append(self._plane.bucket_tensor(addr))
            else:
                tensors.append(self._host_tensor(addr, numel, dtype == "float64"))
        return tensors

    def _plane_waits(self):
        """On the device plane, the plane's stream waits for the caller's
        (which wrote this rank's chunk) before a gather."""
        stream = self._plane.plane_stream() if self._plane is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))

    def _caller_waits(self):
        """On the device plane, the caller's stream waits for the plane's
        after a gather (the host does not block)."""
        stream = self._plane.plane_stream() if self._plane is not None else None
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)


class LaneGather(ParameterGather):
    """The driver over parameter sharding's gather lane (``sharding.units``;
    ``lane``: ``gradsync._native.Lane``, its buffers per round), plus the
    lane's rounds and life. ``communicator``: the lane's own
    ``_comm.TorchCommunicator`` (its plane's stream orders the device
    copies); one round at a time::

        needs(words) ─▶ every rank's words summed   (or post(words), then sum_within(tick) until it comes)
        start(partition, buckets) ─▶ finish(flight, ...)   (the caller computes meanwhile: a prefetch)
    """

    def __init__(self, lane, communicator, host_tensor, plane=None):
        super().__init__(lane, host_tensor, plane, keep=False)
        self._lane = lane
        self.communicator = communicator

    def needs(self, words):
        """Open a round: ``words`` summed over every rank."""
        return self._lane.needs(words)

    def post(self, words):
        """Open a round without waiting for its sum (:meth:`sum_within`)."""
        self._lane.post_needs(words)

    def sum_within(self, within_s):
        """The posted round's sum if it comes within ``within_s``, else ``None``."""
        return self._lane.sum_within(within_s)

    def reset(self):
        """After a failed step, on every rank: a new epoch of the lane."""
        self._lane.reset()

    def close(self):
        """Stop the lane: a collective still waiting fails at once."""
        self.communicator.abandon()
        self._lane.close()
        self.communicator.closed()


class _Flight:
    """A round's gathers in flight: its buckets, each one's index among the
    engine's buffers, the buffers, the dtype each carries its values in
    (``None``: its own), and the positions started and not yet waited for."""

    __slots__ = ("buckets", "indices", "gathers", "buffers", "carries", "started")

    def __init__(self, buckets, indices, gathers, buffers, carries):
        self.buckets = buckets
        self.indices = indices
        self.gathers = gathers
        self.buffers = buffers
        self.carries = carries
        self.started = []
