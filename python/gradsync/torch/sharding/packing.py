"""How a bucket's values are written into a gather buffer and read back.

A gather buffer holds every rank's chunk of one bucket back to back; this
rank writes its pieces into its own chunk (zeros past its partition), the
collective fills the others', and each member parameter reads its values
back::

    buffer (words):  [ rank 0's chunk | rank 1's chunk | ... ]
    carried narrower (param_dtype's bfloat16 in float32 words):
                     [ rank 0's chunk, padded to whole words | rank 1's ... ]

:class:`Packing` is a part of ``sharding.partition.Partition`` (it reads
the layout's buckets, pieces and parameters); the gather that moves the
buffers is ``Partition.gather`` and ``sharding.gather``.
"""

import contextlib

import torch

from gradsync.torch.sharding.layout import as_reals, write_values


class Packing:
    """Writing this rank's pieces into gather buffers and reading gathered
    buffers into parameters (see the module docs), for ``Partition``."""

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
