"""The wrapped module's state dict as every rank's pieces, for a sharded
checkpoint (``gradsync.torch.checkpoint`` with ``shard_parameters=True``):
no rank gathers the model to save it, or holds it whole to load it.

A released parameter's values live only in the ranks' pieces, each a run of
its flat values in row-major order (``sharding.layout``). A run of a
row-major tensor is a few rectangular blocks (the rest of a row, whole
rows, the start of a row; recursively in more dimensions), each contiguous
in the run::

    shape (4, 5), a piece of flat [7, 16):

        row 1: . . [7 8 9]      block offsets (1, 2) sizes (1, 3)
        row 2: [10 .... 14]     block offsets (2, 0) sizes (1, 5)
        row 3: [15] . . . .     block offsets (3, 0) sizes (1, 1)

so a parameter is saved as a ``ShardedTensor`` of its own shape whose shards
are every rank's blocks (this rank's views of its pieces): a checkpoint
like the one of a model saved whole (the same keys, shapes and dtypes, a
complex parameter as its real view), which DCP reads back in any other
cut, at another world size or into a model held whole. Loading asks for
this rank's blocks, and DCP writes the values straight into its pieces.

Buffers and parameters the wrapper does not shard (frozen ones) are whole
on every rank and saved as they are.
"""

import math

import torch

from gradsync.torch.sharding.layout import as_reals
from gradsync.torch.sharding.optim_state import sharded


def blocks(shape, lo, hi):
    """The flat run ``[lo, hi)`` of a row-major tensor of ``shape`` as
    rectangular blocks, in order: ``[(offsets, sizes)]``, each contiguous
    in the run (see the module docs)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi % inner):
        return [((first, *offsets), (1, *sizes)) for offsets, sizes in blocks(rest, lo - first * inner,
                                                                              hi - first * inner)]
    out = []
    if lo % inner:  # the rest of the first row
        out += [((first, *offsets), (1, *sizes)) for offsets, sizes in blocks(rest, lo % inner, inner)]
        first += 1
    rows_end = hi // inner
    if first < rows_end:  # whole rows
        out.append(((first, *(0 for _ in rest)), (rows_end - first, *rest)))
    if hi % inner:  # the start of the last row
        out += [((rows_end, *offsets), (1, *sizes)) for offsets, sizes in blocks(rest, 0, hi % inner)]
    return out


def _sharded(part, i, mine, group):
    """Parameter ``i`` as it is saved (its shape and dtype; a complex one as
    its real view) as a ``ShardedTensor`` of every rank's blocks (``part``:
    the wrapper's ``Partition``), this rank's views of ``mine`` (offset in
    the parameter -> a flat tensor of that piece's values)."""
    form = as_reals(part.forms[i])
    out = []
    for owner, offset, length in part.every_piece(i):
        at = 0
        for offsets, sizes in blocks(tuple(form.shape), offset, offset + length):
            count = math.prod(sizes)
            out.append((owner, offsets, sizes, mine[offset][at : at + count].view(sizes) if owner == part.rank else None))
            at += count
    return sharded(out, form.shape, form.dtype, part.params[i].device, part.rank, group)


def saved_form(value):
    """A whole state dict entry as it is saved: a complex tensor as its real
    view (as a sharded parameter's pieces hold it), anything else as it is."""
    return torch.view_as_real(value) if torch.is_tensor(value) and value.is_complex() else value


def pieces_state(module, part, group, to_load):
    """``module``'s state dict for DCP with every sharded parameter (released:
    the refusal of ``state_dict()`` is the caller's to lift) as the
    ``ShardedTensor`` of every rank's blocks, this rank's views of its
    pieces (see the module docs); buffers and unsharded parameters as the
    module's own tensors (loaded in place), in :func:`saved_form`. And the
    state dict's keys. ``to_load``: a parameter this rank holds no piece of
    is left out (DCP's loader drops a ``ShardedTensor`` with no local
    shard, then refuses the checkpoint for a missing key)."""
    own = module.state_dict(keep_vars=True)
    state = {}
    for key, value in own.items():
        i = part.index_of.get(id(value))
        if i is None:
            state[key] = saved_form(value.detach() if torch.is_tensor(value) else value)
            continue
        mine = {piece.offset: piece.tensor for piece in part.of_param.get(i, ())}
        if mine or not to_load:
            state[key] = _sharded(part, i, mine, group)
    return state, set(own)
