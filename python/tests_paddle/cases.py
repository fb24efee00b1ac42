"""Rank-side cases for ``test_paddle.py``: each case trains a model on this
rank's batch under ``impl`` and compares ``param.grad`` with one process on
every rank's batch (gradients / world), in float64 (Paddle's gloo sums
float64; gradsync reduces in float32, so its figures show float32's rounding).

``impl``: ``"gradsync"`` (gradsync.paddle.DataParallel), ``"paddle"``
(``paddle.DataParallel``), ``"workaround"`` (``no_sync`` for the backward,
then ``fused_allreduce_gradients``: Paddle's documented workaround for
recompute, with no overlap).

Run as ``python cases.py OUT.json``: spawns 2 gloo ranks that run every case
under every impl; rank 0 writes ``{case: {impl: outcome}}`` to OUT.json.
"""

import contextlib
import json
import sys
import traceback

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils import recompute

WORLD = 2
IMPLS = ("gradsync", "paddle", "workaround")


def batch(step, rank, rows=3, dim=8):
    x = paddle.to_tensor(np.random.RandomState(1000 * step + rank).randn(rows, dim))
    x.stop_gradient = False  # recompute produces parameter gradients only then
    return x


class Net(paddle.nn.Layer):
    """Two Linears and a tied embedding-like matrix, arranged by ``case``."""

    def __init__(self, case, rank):
        super().__init__()
        paddle.seed(7)
        paddle.set_default_dtype("float64")
        self.case, self.rank = case, rank
        self.a = paddle.nn.Linear(8, 8)
        self.b = paddle.nn.Linear(8, 4)
        self.tied = self.create_parameter([8, 8])
        self.extra = paddle.nn.Linear(8, 8)  # used by some ranks only in "unused_on_one_rank"
        paddle.set_default_dtype("float32")

    def forward(self, x):
        c = self.case
        if c == "plain":
            h = self.a(x)
        elif c == "recompute_once":
            h = recompute(self.a, x)
        elif c == "recompute_twice":
            h = recompute(self.a, recompute(self.a, x))
        elif c == "tied_inside_and_outside_recompute":
            h = recompute(lambda t: paddle.tanh(paddle.matmul(t, self.tied)), x)
            h = paddle.matmul(h, self.tied, transpose_y=True)
        elif c == "unused_on_one_rank":
            h = self.a(x)
            if self.rank == 0:
                h = self.extra(h)
        else:
            raise AssertionError(c)
        return self.b(paddle.tanh(h))


CASES = ("plain", "recompute_once", "recompute_twice", "tied_inside_and_outside_recompute",
         "unused_on_one_rank", "two_forwards_one_backward", "no_sync_accumulation")
# What each case is, for the table.
DESCRIPTIONS = {
    "plain": "no recompute",
    "recompute_once": "a Linear in recompute",
    "recompute_twice": "the same Linear in two recomputed segments",
    "tied_inside_and_outside_recompute": "a weight used inside recompute and outside (tied)",
    "unused_on_one_rank": "a Linear rank 1 does not use (Paddle: find_unused_parameters=True)",
    "two_forwards_one_backward": "two forwards, one backward (Linear recomputed twice)",
    "no_sync_accumulation": "no_sync for one micro-batch, then one synchronized (Linear recomputed twice)",
}


def loss_of(model, case, step, rank):
    if case == "two_forwards_one_backward":
        return model(batch(step, rank)).mean() + model(batch(step + 50, rank)).mean()
    return model(batch(step, rank)).mean()


def reference(case, step):
    """param.grad of one process on every rank's batches, / world (per rank's model for unused)."""
    grads = None
    for r in range(WORLD):
        net = Net(_model_case(case), r)
        micro = 2 if case == "no_sync_accumulation" else 1
        for m in range(micro):
            (loss_of(net, case, step + 100 * m, r) / WORLD).backward()
        got = {n: (p.grad.numpy().copy() if p.grad is not None else np.zeros(p.shape)) for n, p in net.named_parameters()}
        grads = got if grads is None else {n: grads[n] + got[n] for n in grads}
    return grads


def _model_case(case):
    return "recompute_twice" if case in ("two_forwards_one_backward", "no_sync_accumulation") else case


def run(case, impl, rank):
    import gradsync.paddle as gp
    from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

    if case == "unused_on_one_rank" and impl == "workaround":
        # Measured: fused_allreduce_gradients with a gradient missing on one
        # rank mismatches gloo's buffers and aborts both processes.
        return {"status": "not run", "error": "gloo aborts the process (a parameter without a gradient on one rank)"}
    net = Net(_model_case(case), rank)
    if impl == "gradsync":
        model = gp.DataParallel(net)
    else:
        # Without find_unused_parameters, Paddle's DataParallel aborts the
        # process there (gloo: "op.preamble.length <= op.nbytes").
        model = paddle.DataParallel(net, find_unused_parameters=case == "unused_on_one_rank")
    try:
        step = 0
        micro = (step, step + 100) if case == "no_sync_accumulation" else (step,)
        for m, at in enumerate(micro):
            # Every micro-batch but the last under no_sync; the workaround's all of them.
            local = impl == "workaround" or m < len(micro) - 1
            with model.no_sync() if local else contextlib.nullcontext():
                loss_of(model, case, at, rank).backward()
        if impl == "workaround":
            fused_allreduce_gradients(list(net.parameters()), None)
        want = reference(case, step)
        diff = 0.0
        for n, p in net.named_parameters():
            g = p.grad.numpy() if p.grad is not None else np.zeros(p.shape)
            diff = max(diff, float(np.abs(g - want[n]).max()))
        return {"status": "ok", "max_diff": diff}
    except Exception as e:
        return {"status": "raises", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}",
                "trace": traceback.format_exc()[-1500:] if impl == "gradsync" else None}
    finally:
        if impl == "gradsync":
            model.close()


def main(out):
    dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    for case in CASES:
        results[case] = {}
        for impl in IMPLS:
            results[case][impl] = run(case, impl, rank)
            dist.barrier()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    dist.spawn(main, args=(sys.argv[1],), nprocs=WORLD, backend="gloo")
