"""A sharded model's gradients: each rank's partition of every bucket.

With ``shard_gradients=True`` rank ``r`` keeps the average of its
*partition* of each bucket only (``gradsync._native.partition``: chunks of
``ceil(numel / world)`` values in rank order): NCCL reduce-scatters the
bucket; gloo all-reduces it (cheaper there than its reduce-scatter) and the
runtime keeps the partition, as it does in an elastic job, whose ranks also
keep their buddy's partition (``gradsync._native.held_ranges``, the
runtime's one rule for what a rank keeps). The plan is fixed (reverse
registration order, never rebuilt), so the layout is known before the first
step, on every rank alike::

    bucket b:   | p7 | p6 ........ | p5 | p4 .... |      members back to back
    rank 0:     [=========)                            its partition
    rank 1:               [=========)
    rank 2:                         [=========)
    pieces:     p7, p6[0:k] | p6[k:], p5[..] | ...     where a partition meets a parameter

A **piece** is the part of one parameter inside this rank's partition of
one bucket, in the order of the parameter's elements (row-major, as the
bucket holds its gradient): for a contiguous parameter a flat view of its
own memory (``piece.tensor``), so an optimizer that updates the piece
updates the parameter in place; for one laid out otherwise (``channels_last``,
a transposed view) a tensor of its own (``piece.owned``), read from the
parameter before each optimizer step and written back by the gather. The
runtime keeps only this rank's partition of each bucket once it is
reduced (``actors/src/scheduler/partition.rs``); after a step
:meth:`Partition.receive` hands each piece its averaged gradient as
``piece.tensor.grad`` (a view of the step's partition memory; the views keep
it on loan until they are dropped, as ``zero_grad()`` does). ``.grad`` of
the parameters stays ``None``: no rank holds a whole gradient after backward.

:meth:`Partition.gather` sends every rank's updated pieces to every rank
(an all-gather per bucket, run by the runtime: ``_gather``) after the
optimizer stepped, and
:meth:`Partition.clip` clips by the global norm of the gradients (a sum over
every rank's pieces), never by a rank's local part.
"""

import math
from dataclasses import dataclass

import torch

from gradsync._errors import ConfigError, StepFailedError
from gradsync._native import held_ranges
from gradsync._native import partition as partition_of
from gradsync.torch._sharded_step import ShardedStep

#: What a collective of the sharded step raises when a member is lost: the
#: runtime's gather (``StepFailedError``) or one on the state group (an
#: elastic job recovers from either).
LOST = (RuntimeError, StepFailedError)


def _reals(p):
    """``p`` as reals (a complex tensor as its real and imaginary parts)."""
    t = p.detach()
    return torch.view_as_real(t) if t.is_complex() else t


def _flat(p):
    """``p``'s values as one flat tensor in row-major order: sharing its
    memory when ``p`` is contiguous, a copy otherwise."""
    return _reals(p).reshape(-1)


def write_values(p, values):
    """Write ``values`` (``p``'s elements as reals, row-major) into ``p``,
    whatever its memory layout."""
    t = _reals(p)
    if t.is_contiguous():
        t.view(-1).copy_(values)
    else:
        t.copy_(values.view(t.shape))


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


class Partition:
    """This rank's partition of every bucket of a sharded wrapper's plan
    (see the module docs). ``plan``: the session's ``plan()``; ``params``:
    the wrapper's parameters in registration order; ``reals(p)``: how many
    values of the bucket ``p`` takes; ``states``: the wrapper's state group
    (``_states.StateBroadcast``), where the all-gathers and norms travel;
    ``names``: the parameters' names, for errors."""

    def __init__(self, plan, params, names, rank, world, reals, states, buddy_stride=0):
        self.params = params
        self.names = names
        self.plan = plan
        self.reals = reals
        #: Rank ``r`` also keeps rank ``(r + buddy_stride) % world``'s
        #: partition (an elastic job: a lost rank's partition lives on at its
        #: buddy, on another node when there is one); 0: no buddy copies.
        self.buddy_stride = buddy_stride
        #: The state group of the current membership (``_states.StateBroadcast``).
        self.states = states
        self.lay_out(rank, world)
        #: The sharded optimizer built last over this partition (a weak
        #: reference): a rank out of data steps it for the others (``join``).
        self.optimizer = None
        #: Ranks that had joined (run out of data) in the last step.
        self.joined = []
        #: Where this rank's sharded step stands (``_sharded_step``: its one
        #: writer; everything here and elsewhere calls its verbs).
        self.sharded_step = ShardedStep()
        #: An elastic job's recovery (``Elastic.recover``), called with a
        #: failure of a collective outside backward (clip, step); ``None``:
        #: not elastic, the failure is raised.
        self.recover = None
        #: Where the parameters' gathers run (``_gather.ParameterGather``:
        #: the runtime's), set by the wrapper once its hooks are attached.
        self.gathering = None
        #: Checks that every rank makes once over the state group (that all
        #: built the same sharded optimizer), held until an elastic job's
        #: first step boundary, where a member lost meanwhile is recovered
        #: from (a list until then); ``None``: made at once.
        self.start_checks = None

    @property
    def buddy(self):
        """Whether this rank keeps a buddy partition besides its own."""
        return self.buddy_stride > 0

    def lay_out(self, rank, world, buddy_stride=None):
        """This rank's pieces for ``rank`` of ``world`` (and its buddy's,
        ``buddy_stride`` ranks on: the roster's, after a change of members)."""
        self.rank, self.world = rank, world
        if buddy_stride is not None and self.buddy:
            self.buddy_stride = buddy_stride
        self.buckets = []
        self.pieces = []
        self.buddy_pieces = []
        for b, (numel, members) in enumerate(self.plan):
            sizes = tuple(self.reals(self.params[i]) for i in members)
            (lo, hi, _), *buddy = held_ranges(numel, rank, world, self.buddy_stride)
            chunk = partition_of(numel, 0, world)[1]
            wide = any(self.params[i].dtype in (torch.float64, torch.complex128) for i in members)
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
        #: and every piece this rank holds (what ``_clip`` recognises in a
        #: library's call with an optimizer's parameters).
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.index_of.update((id(piece.tensor), piece.param) for piece in self.every_held_piece())
        #: The pieces that hold their values themselves (parameters that are not contiguous).
        self.owned = [piece for piece in self.every_held_piece() if piece.owned]

    def _pieces_of(self, b, members, sizes, span, held_at):
        """The pieces of bucket ``b`` inside ``span`` (a range of it), whose
        averages lie at ``held_at`` on in the step's buffer."""
        pieces = []
        offset = 0
        for i, size in zip(members, sizes):
            lo, hi = max(offset, span[0]), min(offset + size, span[1])
            if lo < hi:
                p = self.params[i]
                owned = not p.is_contiguous()
                tensor = _flat(p)[lo - offset : hi - offset]
                pieces.append(Piece(i, b, lo, hi - lo, lo - offset, tensor.clone() if owned else tensor,
                                    held_at + lo - span[0], owned))
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
            for rank in range(self.world):
                lo, hi = partition_of(layout.numel, rank, self.world)
                lo, hi = max(lo, start), min(hi, start + size)
                if lo < hi:
                    out.append((rank, lo - start, hi - lo))
        return sorted(out, key=lambda piece: piece[1])

    # ---- a step's averages ------------------------------------------------------------------

    def receive(self, bucket_tensors, result, unused):
        """A finished step's averages into the pieces' ``.grad``:
        ``bucket_tensors`` are the step's partitions of the buckets (tensors
        over its memory, in launch order), ``result`` the runtime's step (the loan the views
        keep alive), ``unused`` the parameters no rank used (their pieces
        get no gradient, as the parameter would get none unsharded). A piece
        whose gradient was not cleared since the last step accumulates, as
        ``.grad`` does. Returns whether views of ``result`` were lent."""
        unused = set(unused)
        lent = False
        bases = []
        for tensor in bucket_tensors:
            # One base per bucket over its memory (not a view: the pieces'
            # views must have it as their base), carrying the loan.
            base = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            base.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))
            base._gradsync_step = result
            bases.append(base)
        for piece in self.every_held_piece():
            if piece.param in unused:
                continue
            average = bases[piece.bucket][piece.held_at : piece.held_at + piece.length]
            held = piece.tensor.grad
            if held is not None:
                # Not cleared since the last step: add, into a tensor of its own.
                if getattr(held, "_base", None) is not None:
                    held = held.clone()
                held.add_(average.to(held.dtype))
                piece.tensor.grad = held
            elif average.dtype == piece.tensor.dtype:
                piece.tensor.grad = average
                lent = True
            else:
                piece.tensor.grad = average.to(piece.tensor.dtype)
        report = result.report
        self.sharded_step.received(owed=report.step if any(r == self.rank for r, _ in report.aborted) else None)
        return lent

    def step_joined(self):
        """This rank ran out of data and shadowed the others' step: step its
        partition with that step's averages and take part in the gather, as
        the others do in their ``optimizer.step()``."""
        optimizer = self.optimizer() if self.optimizer is not None else None
        if optimizer is None:
            raise ConfigError(
                "a rank out of data (join) must step its partition for the others, and no sharded optimizer was "
                "built: build it with model.shard_optimizer(...) before training"
            )
        optimizer.step()
        optimizer.zero_grad()

    def zero_grad(self, set_to_none=True):
        """The pieces' gradients dropped (``set_to_none``) or zeroed."""
        for piece in self.every_held_piece():
            if set_to_none:
                piece.tensor.grad = None
            elif piece.tensor.grad is not None:
                piece.tensor.grad.zero_()

    def clear(self):
        """No piece keeps a gradient (what it held was applied, or must not be)."""
        for piece in self.every_held_piece():
            piece.tensor.grad = None
        self.sharded_step.cleared()

    def skip(self):
        """The step ended skipped on every rank: nothing of it is applied,
        and the collectives of an update are not made (``ShardedStep.skipped``)."""
        self.clear()
        self.sharded_step.skipped_everywhere()

    def refuse_if_owed(self, before):
        """A rank that aborted a step the others applied (partial policy)
        must step its partition before its next step (``before`` names what
        began it): the others wait for it in the parameter gather."""
        step = self.sharded_step.take_owed()
        if step is None:
            return
        raise ConfigError(
            f"rank {self.rank} aborted step {step}, which the other ranks applied (abort_policy='partial': the "
            f"aborting rank receives their average too), and then began a {before} without optimizer.step(): with "
            "shard_gradients=True every rank steps its partition of each applied step and the others wait for it "
            "in the parameter gather. Call optimizer.step() after abort_step under the partial policy, as after "
            "any applied step (or use abort_policy='skip', where nobody steps a step some rank aborted)"
        )

    # ---- after the optimizer stepped ---------------------------------------------------------

    @torch.no_grad()
    def gather(self):
        """Every rank's pieces, updated by its optimizer, into every rank's
        parameters: per bucket, this rank writes its pieces into its chunk
        of the runtime's gather buffer (``BucketLayout.wide``'s precision;
        zeros past its partition), the runtime gathers every chunk
        (``_gather.ParameterGather``), and each member reads its values
        back."""
        if self.world == 1:
            return
        buffers = self.gathering.buffers([(layout.chunk * self.world, layout.wide) for layout in self.buckets])
        for b, (layout, whole) in enumerate(zip(self.buckets, buffers)):
            self.fill_chunk(b, whole[self.rank * layout.chunk : (self.rank + 1) * layout.chunk],
                            lambda piece: piece.tensor)
        self.gathering.run()
        for layout, whole in zip(self.buckets, buffers):
            for i, v in zip(layout.members, whole[: layout.numel].split(layout.sizes)):
                write_values(self.params[i], v)

    def chunk(self, b, value_of, dtype):
        """This rank's chunk of bucket ``b`` (a gather's unit) as a tensor
        of its own, in ``dtype``: see :meth:`fill_chunk`."""
        mine = torch.empty(self.buckets[b].chunk, dtype=dtype)
        self.fill_chunk(b, mine, value_of)
        return mine

    def fill_chunk(self, b, out, value_of):
        """``out`` := this rank's chunk of bucket ``b``: each piece's
        ``value_of(piece)`` (a tensor of the piece's length, or ``None`` for
        zeros) at its place, zeros past its partition."""
        out.zero_()
        start = self.buckets[b].mine[0]
        for piece in self.of_bucket.get(b, ()):
            value = value_of(piece)
            if value is not None:
                at = piece.start - start
                out[at : at + piece.length].copy_(value.reshape(-1))

    @torch.no_grad()
    def refresh(self):
        """The pieces that hold their values themselves read them from their
        parameters (before an optimizer step: whatever changed the
        parameters since, a load or a broadcast, is what the step updates)."""
        for piece in self.owned:
            piece.tensor.copy_(_flat(self.params[piece.param])[piece.offset : piece.offset + piece.length])

    @torch.no_grad()
    def write_owned(self):
        """The pieces that hold their values themselves, just stepped, into
        their parameters (so a parameter always holds what this rank stepped,
        whether or not the gather that follows completes)."""
        by_param = {}
        for piece in self.owned:
            by_param.setdefault(piece.param, []).append(piece)
        for i, pieces in by_param.items():
            flat = _flat(self.params[i])
            for piece in pieces:
                flat[piece.offset : piece.offset + piece.length].copy_(piece.tensor)
            write_values(self.params[i], flat)

    # ---- the global norm ---------------------------------------------------------------------

    @torch.no_grad()
    def clip(self, indices, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """``torch.nn.utils.clip_grad_norm_`` over the whole gradients of the
        parameters ``indices`` (of this wrapper), each rank holding its
        pieces: the norm is a collective over every rank's pieces; the
        pieces' gradients (and its buddy's copies) are scaled in place.
        Returns the total norm (a float64 tensor), the same on every rank.

        After a skipped step nothing is clipped and no collective is made
        (norm 0, as torch's with no gradient): a rank that skipped its clip
        for that step does not hang the others. In an elastic job a member
        lost during the norm's collective is recovered from here
        (``recover``), and once a change of members was settled in this
        step no collective is made: the norm returned is the one the
        settlement clipped with (0 if it clipped nothing)."""
        indices = set(indices)
        step = self.sharded_step
        if not step.settled:
            # (Asked before the collective: a change of members during it settles the clip.)
            step.asked_to_clip(max_norm, norm_type, indices)
            total = self.norm(indices, norm_type)
        if step.settled:
            return torch.tensor(step.clipped[0] if step.clipped else 0.0, dtype=torch.float64)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {float(norm_type)} of the gradients is non-finite, so it cannot be "
                "clipped; set error_if_nonfinite=False to clip anyway"
            )
        coef = self.scale_by_norm(indices, max_norm, total)
        step.clipped_by(total, coef)
        return total

    @torch.no_grad()
    def norm(self, indices, norm_type=2.0):
        """The norm of order ``norm_type`` of the whole averaged gradients of
        the parameters ``indices``: a collective over every rank's pieces
        (none after a skipped step: 0). A member lost meanwhile is
        recovered from in an elastic job (the norm is then meaningless: the
        caller looks at ``sharded_step.settled``)."""
        if self.joined:
            raise ConfigError(
                f"a gradient norm while ranks {self.joined} are out of data (join): the norm is a collective those "
                "ranks do not make; clip only while every rank trains, or train unsharded"
            )
        if self.sharded_step.skipped:
            return torch.zeros((), dtype=torch.float64)
        grads = [piece.tensor.grad for piece in self.pieces
                 if piece.tensor.grad is not None and piece.param in indices]
        try:
            return norm_of(grads, float(norm_type), self.combine)
        except LOST as error:
            if self.recover is None:
                raise
            self.recover(error)
            return torch.zeros((), dtype=torch.float64)

    def combine(self, local, op):
        """This rank's float64 scalar ``local`` combined over every rank by
        ``op`` (``"sum"`` or ``"max"``): every rank's value gathered by the
        runtime (``_gather``), then summed in rank order or maxed, the same
        on every rank."""
        if self.world == 1:
            return local.reshape(())
        everyone = self.gathering.everyone(local, self.rank, self.world)
        return everyone.sum() if op == "sum" else everyone.max()

    def scale_by_norm(self, indices, max_norm, total):
        """Clip the parameters ``indices`` to ``max_norm`` given their total
        norm ``total`` (as ``torch.nn.utils.clip_grads_with_norm_``);
        returns the coefficient."""
        coef = min(float(max_norm) / (float(total) + 1e-6), 1.0)
        self.scale(indices, coef)
        return coef

    def scale(self, indices, coef):
        """Clip: the gradients of the pieces (and buddy copies) of the
        parameters ``indices`` times ``coef`` (when below 1)."""
        if coef < 1.0:
            for piece in self.every_held_piece():
                if piece.tensor.grad is not None and piece.param in indices:
                    piece.tensor.grad.mul_(coef)

    def clamp(self, indices, value):
        """``clip_grad_value_``: the gradients of the pieces (and buddy
        copies) of the parameters ``indices`` clamped to ``[-value, value]``
        (elementwise: each rank clamps what it holds, no collective)."""
        for piece in self.every_held_piece():
            if piece.tensor.grad is not None and piece.param in indices:
                piece.tensor.grad.clamp_(-value, value)


def norm_of(grads, norm_type, combine):
    """The norm of order ``norm_type`` of every rank's ``grads`` (tensors),
    as a float64 tensor. ``combine(local, op)``: this rank's float64 scalar
    ``local`` combined over every rank by ``op`` (``"sum"`` or ``"max"``), a
    collective."""
    zero = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    if norm_type == math.inf:
        return combine(max((g.abs().max().double() for g in grads), default=zero), "max")
    local = sum((g.double().abs().pow(norm_type).sum() for g in grads), zero)
    return combine(local, "sum").pow(1.0 / norm_type)
