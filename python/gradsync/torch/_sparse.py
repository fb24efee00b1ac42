"""Sparse gradients: ``nn.Embedding`` and ``nn.EmbeddingBag`` built with
``sparse=True``, whose weight's gradient is a sparse COO tensor (the rows a
batch looked up), reduced outside the dense buckets.

A sparse weight gets no gradsync hook. Autograd accumulates its gradient
in ``.grad`` as it does without a wrapper: every contribution once (a lookup
recomputed by activation checkpointing contributes once, a table used twice
twice), and micro-batches under ``no_sync`` keep summing there. When a step
applies, every rank sends its accumulated gradient divided by the step's
divisor (as DDP divides before it sums) and takes the sum: gloo's sparse
all-reduce gathers every rank's indices and values, so the result holds the
union of the rows any rank looked up, identical on every rank. A rank whose
gradients are not in the step (excluded under ``abort_policy="partial"``, or
joined, out of data) sends an empty gradient. A step no rank may apply
clears the sparse gradients with the dense ones.

The sums run on the wrapper's state group (``_states.StateBroadcast``), from
the end of backward, in the same order on every rank.
"""

import torch

from gradsync._errors import ConfigError, GradientLayoutError

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_parameters(module):
    """The ids of ``module``'s parameters whose gradients are sparse by
    construction (DDP's own test: the weight of an embedding module built
    with ``sparse=True``; by identity, as a tied weight has several names)."""
    return {id(sub.weight) for sub in module.modules() if isinstance(sub, _SPARSE_MODULES) and sub.sparse}


class SparseGrads:
    """The sparse parameters of one wrapped model and their reduction."""

    def __init__(self, names, params, states, rank):
        self._names = names
        self._params = params
        # The wrapper's StateBroadcast (its private gloo group).
        self._states = states
        self._rank = rank

    def __bool__(self):
        return bool(self._params)

    def reduce(self, report):
        """Replace every sparse gradient by the step's average (``report``:
        the finished step, which applies; the same on every rank)."""
        mine = self._rank not in report.joined and all(r != self._rank for r, _ in report.aborted)
        for name, p in zip(self._names, self._params):
            grad = p.grad
            if grad is not None and not grad.is_sparse:
                raise GradientLayoutError(
                    f"parameter {name!r} belongs to an embedding built with sparse=True but its gradient is dense: "
                    "its weight is also used densely (tied to an output layer?) or the flag changed after "
                    "wrapping; build the embedding with sparse=False"
                )
            if grad is None or not mine:
                local = torch.sparse_coo_tensor(
                    torch.empty((1, 0), dtype=torch.int64), torch.empty((0, *p.shape[1:]), dtype=p.dtype),
                    p.shape, device=p.device,
                )
            else:
                local = grad.coalesce()
            if report.divisor != 1:
                local = local / report.divisor
            # The state group is gloo's: sums on the CPU.
            total = self._states.sum_sparse(local.cpu()).to(p.device)
            if grad is None and total._nnz() == 0:
                continue  # no rank looked a row up: no gradient, as a dense unused parameter has none
            p.grad = total

    def clear(self):
        for p in self._params:
            p.grad = None


def refuse_in_elastic_job(names):
    """Sparse gradients are not reduced in an elastic job (yet): a member
    lost during their reduction would not be recovered from."""
    if names:
        raise ConfigError(
            f"parameters {sorted(names)[:3]} have sparse gradients (sparse=True), which an elastic job does not "
            "reduce yet: build the embedding with sparse=False"
        )
