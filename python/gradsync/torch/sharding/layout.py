"""Where this rank's pieces of a sharded wrapper's buckets lie.

The runtime owns the rule (``gradsync._native.held_ranges``: this rank's
partition of each bucket, its buddy's, and where each lands in the buffer
the runtime lends for a step's averages; ``gradsync._native.partition``:
every rank's chunk); :class:`Layout` reads it and cuts it at parameter
boundaries into :class:`Piece` s, the unit the optimizer steps::

    bucket b:   | p7 | p6 ........ | p5 | p4 .... |      members back to back
    rank 0:     [=========)                            its partition
    rank 1:               [=========)
    pieces:     p7, p6[0:k] | p6[k:], p5[..] | ...     where a partition meets a parameter

It needs no process group: given a plan and parameters it is the same on
every rank, which is what lets each rank read every other rank's pieces
(:meth:`Layout.every_piece`) without asking.

It also says how a bucket's values go into a gather buffer and back. A
gather buffer holds every rank's chunk of one bucket back to back; this
rank writes its pieces into its own chunk (zeros past its partition), the
collective fills the others', and each member parameter reads its values
back (:meth:`Layout.pack`, :meth:`Layout.unpack`)::

    buffer (words):  [ rank 0's chunk | rank 1's chunk | ... ]
    carried narrower (param_dtype's bfloat16 in float32 words):
                     [ rank 0's chunk, padded to whole words | rank 1's ... ]

The gather that moves the buffers is ``Partition.gather`` and ``sharding.gather``.
"""

import contextlib
from dataclasses import dataclass

import torch

from gradsync._native import held_ranges
from gradsync._native import partition as partition_of


def as_reals(p):
    """``p`` as reals (a complex tensor as its real and imaginary parts)."""
    t = p.detach()
    return torch.view_as_real(t) if t.is_complex() else t


def flat_values(p):
    """``p``'s values as one flat tensor in row-major order: sharing its
    memory when ``p`` is contiguous, a copy otherwise."""
    return as_reals(p).reshape(-1)


def write_values(p, values):
    """Write ``values`` (``p``'s elements as reals, row-major) into ``p``,
    whatever its memory layout."""
    t = as_reals(p)
    if t.is_contiguous():
        t.view(-1).copy_(values)
    else:
        t.copy_(values.view(t.shape))


def _expanded(p):
    """Whether ``p`` is a value expanded to its shape (a model built on the
    meta device holds such placeholders until it is materialized:
    ``sharding.materialize``), whose strides are not its own."""
    return any(stride == 0 and size > 1 for stride, size in zip(p.stride(), p.shape))


@dataclass
class Piece:
    """The part of parameter ``param`` (an index of the wrapper's parameters)
    in this rank's partition of bucket ``bucket``: ``length`` values at
    ``start`` in the bucket, at ``offset`` in the parameter's flat values.
    ``tensor`` views them in the parameter's memory, or, when ``owned``
    (a parameter that is not contiguous), holds them itself; a step's
    averages of them lie at ``held_at`` in the buffer the runtime lends for
    the bucket (its partition, then its buddy's)."""

    param: int
    bucket: int
    start: int
    length: int
    offset: int
    tensor: torch.Tensor
    held_at: int
    owned: bool = False


@dataclass(frozen=True)
class BucketLayout:
    """One bucket of the plan: its element count, members (parameter
    indices, back to back in that order) and their element counts, and the
    chunk each rank receives (``chunk`` values; this rank's is ``mine``);
    ``wide``: it travels in float64 (a float64 or complex128 member), else
    float32, so half types travel exactly."""

    numel: int
    members: tuple
    sizes: tuple
    chunk: int
    mine: tuple
    wide: bool


class Layout:
    """This rank's pieces of every bucket of ``plan`` (the session's
    ``plan()``: per bucket its element count and member parameter indices)
    over ``params`` (the wrapper's parameters in registration order), for
    ``rank`` of ``world``; ``reals(p)``: how many values of a bucket ``p``
    takes; ``buddy_stride``: rank ``r`` also keeps rank ``(r +
    buddy_stride) % world``'s partition (an elastic job: a lost rank's
    partition lives on at its buddy, on another node when there is one);
    0: no buddy copies; ``own_all``: every piece holds its values itself
    (parameter sharding, where the parameters' memory is released between
    uses), not only those of parameters that are not contiguous; not
    ``read``: those pieces start empty (a model on the meta device, whose
    pieces are written as it is materialized)."""

    def __init__(self, plan, params, rank, world, reals, buddy_stride=0, own_all=False, read=True):
        self.params = params
        self.plan = plan
        self.reals = reals
        self.buddy_stride = buddy_stride
        #: Whether every piece holds its values itself (see the class docs).
        self.own_all = own_all
        #: Per parameter, its whole shape, strides and dtype as a tensor
        #: without data (``meta``): what the parameter looks like whether or
        #: not its memory is released (parameter sharding allocates it so again).
        self.forms = [torch.empty(p.shape, dtype=p.dtype, device="meta") if _expanded(p)
                      else torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta") for p in params]
        self.lay_out(rank, world, read=read)

    @property
    def buddy(self):
        """Whether this rank keeps a buddy partition besides its own."""
        return self.buddy_stride > 0

    def lay_out(self, rank, world, buddy_stride=None, read=True):
        """This rank's pieces for ``rank`` of ``world`` (and its buddy's,
        ``buddy_stride`` ranks on: the roster's, after a change of members).
        Pieces that hold their values themselves read them from their
        parameters, unless not ``read`` (parameter sharding after a change
        of members: the parameters are released, and the caller writes the
        pieces)."""
        self.rank, self.world = rank, world
        self._read = read
        if buddy_stride is not None and self.buddy:
            self.buddy_stride = buddy_stride
        self.buckets = []
        self.pieces = []
        self.buddy_pieces = []
        for b, (numel, members) in enumerate(self.plan):
            # (From the forms: a released parameter holds nothing, possibly in another dtype.)
            sizes = tuple(self.reals(self.forms[i]) for i in members)
            (lo, hi, _), *buddy = held_ranges(numel, rank, world, self.buddy_stride)
            chunk = partition_of(numel, 0, world)[1]
            wide = any(self.forms[i].dtype in (torch.float64, torch.complex128) for i in members)
            self.buckets.append(BucketLayout(numel, tuple(members), sizes, chunk, (lo, hi), wide))
            self.pieces += self._pieces_of(b, members, sizes, (lo, hi), 0)
            for lo, hi, at in buddy:
                self.buddy_pieces += self._pieces_of(b, members, sizes, (lo, hi), at)
        #: Per parameter index, and per bucket, its pieces on this rank (its own partition's).
        self.of_param, self.of_bucket = {}, {}
        for piece in self.pieces:
            self.of_param.setdefault(piece.param, []).append(piece)
            self.of_bucket.setdefault(piece.bucket, []).append(piece)
        #: Per parameter index: its pieces in the buddy partition this rank keeps.
        self.buddy_of_param = {}
        for piece in self.buddy_pieces:
            self.buddy_of_param.setdefault(piece.param, []).append(piece)
        #: Per bucket: every piece this rank holds of it, its own and its buddy's.
        self.held_of_bucket = {}
        for piece in self.every_held_piece():
            self.held_of_bucket.setdefault(piece.bucket, []).append(piece)
        #: Per tensor id, the parameter index it stands for: the parameters
        #: and every piece this rank holds (what ``sharding.clip`` recognises in a
        #: library's call with an optimizer's parameters).
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.index_of.update((id(piece.tensor), piece.param) for piece in self.every_held_piece())
        #: The pieces that hold their values themselves (parameters that are not contiguous).
        self.owned = [piece for piece in self.every_held_piece() if piece.owned]
        #: Per bucket, where a step's averages go: ``(piece tensor, where in
        #: the bucket's lent partition, length, parameter index)`` for every
        #: piece held (the C++ write-back's form: ``Ledger.set_pieces``); a
        #: new list at every lay-out, so its holder sees a change by identity.
        self.targets = [[(piece.tensor, piece.held_at, piece.length, piece.param)
                         for piece in self.held_of_bucket.get(b, ())] for b in range(len(self.buckets))]

    def _pieces_of(self, b, members, sizes, span, held_at):
        """The pieces of bucket ``b`` inside ``span`` (a range of it), whose
        averages lie at ``held_at`` on in the step's buffer."""
        pieces = []
        offset = 0
        for i, size in zip(members, sizes):
            lo, hi = max(offset, span[0]), min(offset + size, span[1])
            if lo < hi:
                p = self.params[i]
                owned = self.own_all or not p.is_contiguous()
                if owned and not self._read:
                    tensor = torch.empty(hi - lo, dtype=flat_values(self.forms[i]).dtype, device=p.device)
                else:
                    tensor = flat_values(p)[lo - offset : hi - offset]
                    tensor = tensor.clone() if owned else tensor
                pieces.append(Piece(i, b, lo, hi - lo, lo - offset, tensor, held_at + lo - span[0], owned))
            offset += size
        return pieces

    def every_held_piece(self):
        """This rank's pieces and then its buddy's (what its optimizer steps)."""
        return self.pieces + self.buddy_pieces

    def every_piece(self, i):
        """Every rank's pieces of parameter ``i``: ``(rank, offset in the
        parameter, length)``, by offset (the layout is the same on every rank)."""
        out = []
        for layout in self.buckets:
            if i not in layout.members:
                continue
            at = layout.members.index(i)
            start = sum(layout.sizes[:at])
            size = layout.sizes[at]
            if not size:
                continue
            # Only the ranks whose chunks meet it (chunks of ``layout.chunk``
            # values in rank order): O(its pieces), not O(world).
            for rank in range(start // layout.chunk, (start + size - 1) // layout.chunk + 1):
                lo, hi = partition_of(layout.numel, rank, self.world)
                lo, hi = max(lo, start), min(hi, start + size)
                if lo < hi:
                    out.append((rank, lo - start, hi - lo))
        return sorted(out, key=lambda piece: piece[1])

    def gather_sizes(self, carries=None):
        """Per bucket, its gather buffer's ``(values, float64)``;
        ``carries``: per bucket the dtype its values travel in (see
        :meth:`gather_size`), default the bucket's own."""
        return [self.gather_size(b, None if carries is None else carries[b]) for b in range(len(self.buckets))]

    def gather_size(self, b, carry=None):
        """Bucket ``b``'s gather buffer, ``(values, float64)``: each rank's
        chunk in the bucket's precision, or, ``carry`` (a narrower dtype:
        ``param_dtype``'s rounded copy), in as many of its words as hold
        the chunk in ``carry``: half the bytes for bfloat16 over float32."""
        layout = self.buckets[b]
        return (self._words_per_rank(b, carry) * self.world, layout.wide)

    def _words_per_rank(self, b, carry):
        """Words of bucket ``b``'s gather buffer per rank (see :meth:`gather_size`)."""
        layout = self.buckets[b]
        if carry is None:
            return layout.chunk
        word = 8 if layout.wide else 4
        return -(-layout.chunk * torch.empty((), dtype=carry).element_size() // word)

    def _slots(self, b, whole, carry):
        """Bucket ``b``'s gather buffer ``whole`` as values of ``carry``
        (or its own), and how many of them each rank's chunk is given."""
        if carry is None:
            return whole, self.buckets[b].chunk
        values = whole.view(carry)
        return values, values.numel() // self.world

    def pack_every(self, buffers, carries=None):
        """This rank's pieces into its chunk of every bucket's gather buffer."""
        for b, whole in enumerate(buffers):
            self.pack(b, whole, None if carries is None else carries[b])

    def pack(self, b, whole, carry=None):
        """This rank's pieces of bucket ``b`` into its chunk of ``whole``
        (the bucket's gather buffer; its values in ``carry`` when given,
        rounded to it)."""
        values, stride = self._slots(b, whole, carry)
        chunk = self.buckets[b].chunk
        self.fill_chunk(b, values[self.rank * stride : self.rank * stride + chunk], lambda piece: piece.tensor)

    def unpack(self, b, whole, carry=None):
        """Bucket ``b``'s gathered values ``whole`` (in ``carry`` when
        given) into every one of its member parameters (they were
        released: parameter sharding). Their version counters stay as they
        were: a parameter refilled before its backward is the one autograd
        saved, not a modified one."""
        values, stride = self._slots(b, whole, carry)
        chunk = self.buckets[b].chunk
        if stride != chunk:  # (each rank's chunk padded to whole words: the chunks back to back)
            values = values[: stride * self.world].view(self.world, stride)[:, :chunk].reshape(-1)
        with contextlib.ExitStack() as preserved:
            for i in self.buckets[b].members:
                preserved.enter_context(torch.autograd._unsafe_preserve_version_counter(self.params[i]))
            self._unpack(b, values, everything=True)

    def _unpack(self, b, whole, everything=False):
        """Bucket ``b``'s gathered values ``whole`` into its member
        parameters, in one batched copy, except what this rank's own pieces
        hold already (views of those parameters), unless ``everything``. A
        parameter that is not contiguous is written whole."""
        layout = self.buckets[b]
        lo, hi = (0, 0) if everything else layout.mine
        into, values = [], []
        start = 0
        for i, size in zip(layout.members, layout.sizes):
            p = self.params[i]
            end = start + size
            if not p.is_contiguous():
                write_values(p, whole[start:end])
            else:
                flat = as_reals(p).view(-1)
                # Before this rank's partition, and after it.
                for a, z in ((start, min(end, lo)), (max(start, hi), end)):
                    if a < z:
                        into.append(flat[a - start : z - start])
                        values.append(whole[a:z])
            start = end
        if into:
            torch._foreach_copy_(into, values)

    def chunk(self, b, value_of, dtype):
        """This rank's chunk of bucket ``b`` (a gather's unit) as a tensor
        of its own, in ``dtype``: see :meth:`fill_chunk`."""
        mine = torch.empty(self.buckets[b].chunk, dtype=dtype)
        self.fill_chunk(b, mine, value_of)
        return mine

    def fill_chunk(self, b, out, value_of):
        """``out`` := this rank's chunk of bucket ``b``: each piece's
        ``value_of(piece)`` (a tensor of the piece's length, or ``None`` for
        zeros) at its place, zeros past its partition; one batched copy."""
        lo, hi = self.buckets[b].mine
        out[hi - lo :].zero_()
        into, values = [], []
        for piece in self.of_bucket.get(b, ()):
            value = value_of(piece)
            at = piece.start - lo
            if value is None:
                out[at : at + piece.length].zero_()
            else:
                into.append(out[at : at + piece.length])
                values.append(value.reshape(-1))
        if into:
            torch._foreach_copy_(into, values)
