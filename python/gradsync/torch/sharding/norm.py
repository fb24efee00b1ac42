"""Clipping a sharded model's gradients by their global norm.

No rank holds a whole gradient, so a norm is a collective: each rank sums
(or maxes) over its own pieces, the runtime gathers every rank's partial
value (``sharding.gather.ParameterGather.everyone``, a
``CollectiveKind::Norm``), and every rank combines them in rank order, so
the total is bitwise the same everywhere. :class:`Clipping` is that half
of a :class:`~gradsync.torch.sharding.partition.Partition`; :func:`norm_of`
the arithmetic, shared with the elastic settlement (``sharding.reshard``).
"""

import math

import torch

from gradsync._errors import ConfigError, StepFailedError

#: What a collective of the sharded step raises when a member is lost: the
#: runtime's gather (``StepFailedError``) or one on the state group (an
#: elastic job recovers from either).
LOST = (RuntimeError, StepFailedError)


class Clipping:
    """The global-norm half of a ``Partition``: it reads the partition's
    ``pieces``, ``every_held_piece()``, ``sharded_step``, ``joined``,
    ``world``, ``rank``, ``gathering`` and ``recover``."""

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
        runtime (``sharding.gather``), then summed in rank order or maxed, the same
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
