"""Rank-side cases of ``test_faults.py``: a rank out of memory, uneven
inputs, a stalled rank and reset, and what a run reports (report, timeline,
Prometheus, the bfloat16 wire).

Run as ``python faults.py CASE IMPL OUT_DIR [KEY=VALUE ...]``: spawns 2 gloo
ranks that run ``CASE`` under ``IMPL``; each rank writes its outcome to
``OUT_DIR/rank{r}.json``. Settings are JSON values (``abort_policy="partial"``).
"""

import json
import os
import sys
import time
import urllib.request

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

WORLD = 2


class OutOfMemory(PyLayer):
    """Identity whose backward raises ``MemoryError`` when armed (what a
    device out of memory in backward looks like to the training loop)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if OutOfMemory.armed:
            raise MemoryError("simulated: out of memory. Tried to allocate 2.00 GiB")
        return g


def batch(step, rank, rows=4, dim=8, dtype="float64"):
    return paddle.to_tensor(np.random.RandomState(100 * step + rank).randn(rows, dim).astype(dtype))


class Net(paddle.nn.Layer):
    def __init__(self, dtype="float64"):
        super().__init__()
        paddle.seed(19)
        paddle.set_default_dtype(dtype)
        self.a = paddle.nn.Linear(8, 16)
        self.b = paddle.nn.Linear(16, 1)
        paddle.set_default_dtype("float32")

    def forward(self, x):
        return self.b(OutOfMemory.apply(paddle.tanh(self.a(x))))


def local_grads(step, ranks, dtype="float64"):
    """Each rank's own gradients at ``step`` (one process, the same initial model)."""
    out = []
    for r in ranks:
        net = Net(dtype)
        net(batch(step, r, dtype=dtype)).sum().backward()
        out.append([p.grad.numpy().copy() for p in net.parameters()])
    return out


def max_diff(model, want):
    return max(float(np.abs(p.grad.numpy() - w).max()) for p, w in zip(model.parameters(), want))


def average(grads):
    return [sum(gs) / len(grads) for gs in zip(*grads)]


def wrap(net, impl, **settings):
    if impl == "gradsync":
        import gradsync.paddle as gp

        return gp.DataParallel(net, **settings)
    return paddle.DataParallel(net)


def oom(rank, impl, oom_rank=1, oom_step=1, steps=3, **settings):
    """Rank ``oom_rank`` runs out of memory in backward at ``oom_step`` and
    skips the step in an ``except``, as training loops do. Per step: what
    this rank saw, how long the step took, and how far ``param.grad`` is
    from the average over the ranks that finished."""
    model = wrap(Net(), impl, **settings)
    seen = []
    try:
        for step in range(steps):
            model.clear_gradients()
            t0 = time.monotonic()
            OutOfMemory.armed = rank == oom_rank and step == oom_step
            try:
                if impl == "workaround":
                    with model.no_sync():
                        model(batch(step, rank)).sum().backward()
                    from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients

                    fused_allreduce_gradients(list(model.parameters()), None)
                else:
                    model(batch(step, rank)).sum().backward()
                outcome = model.last_report.outcome if impl == "gradsync" else "applied"
            except Exception as e:  # Paddle re-raises the hook's MemoryError as its own type
                if "simulated: out of memory" not in str(e):
                    raise
                OutOfMemory.armed = False
                outcome = model.abort_step("out_of_memory").outcome if impl == "gradsync" else "skipped locally"
            took = time.monotonic() - t0
            grads_none = all(p.grad is None for p in model.parameters())
            finished = [r for r in range(WORLD) if not (r == oom_rank and step == oom_step)]
            want = {"applied": range(WORLD), "partial": finished}.get(outcome)
            diff = None if want is None or grads_none else max_diff(model, average(local_grads(step, want)))
            seen.append({"step": step, "outcome": outcome, "seconds": took, "max_diff": diff, "grads_none": grads_none})
            _progress(rank, seen[-1])
    except Exception as e:
        if impl == "gradsync":
            raise
        # Paddle's own: what broke, after which steps.
        return {"status": "error", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", "steps": seen}
    if impl == "gradsync":
        model.close()
    return {"steps": seen}


def uneven(rank, impl, batches=(3, 1)):
    """Rank 1 has one batch, rank 0 three: rank 1 joins when out of data,
    and rank 0's later steps are averaged over rank 0 alone."""
    model = wrap(Net(), impl)
    worst, contributors = 0.0, []
    for step in range(batches[rank]):
        model.clear_gradients()
        model(batch(step, rank)).sum().backward()
        live = [r for r in range(WORLD) if batches[r] > step]
        worst = max(worst, max_diff(model, average(local_grads(step, live))))
        contributors.append(model.last_report.contributors)
    joined = model.join_now()
    model.close()
    return {"max_diff": worst, "contributors": contributors, "joined": joined}


def stalled(rank, impl, stalled_rank=1, stall_s=36.0):
    """Rank ``stalled_rank`` stops for longer than gloo's 30 s during step 1.
    The other rank's step fails naming it; both reset, and step 2 is exact."""
    import gradsync

    model = wrap(Net(), impl)
    model(batch(0, rank)).sum().backward()
    if rank == stalled_rank:
        time.sleep(stall_s)
    t0 = time.monotonic()
    error = None
    try:
        model.clear_gradients()
        model(batch(1, rank)).sum().backward()
    except gradsync.StepFailedError as e:
        error = e
    waited = time.monotonic() - t0
    restart = model.reset()
    model.clear_gradients()
    model(batch(2, rank)).sum().backward()
    diff = max_diff(model, average(local_grads(2, range(WORLD))))
    model.close()
    return {"error": type(error).__name__ if error else None, "message": str(error) if error else None,
            "missing": getattr(error, "missing_ranks", None), "waited": waited, "restart": restart, "max_diff": diff}


def observed(rank, impl, out_dir, port, wire_dtype="float32", dtype="float32"):
    """Three steps with the timeline on; rank 0 serves Prometheus. Returns
    the last report, the timeline's size, the scraped metrics and how far
    the gradients are from the average (``wire_dtype`` bfloat16: rounded)."""
    import gradsync

    if rank == 0 and port:
        gradsync.install_prometheus(f"127.0.0.1:{port}")
    refused = None
    try:
        wrap(Net(dtype), impl, wire_dtype="float16")
    except gradsync.ConfigError as e:
        refused = str(e)
    model = wrap(Net(dtype), impl, record_timeline=True, wire_dtype=wire_dtype, comm_buffer_size=0.0005)
    for step in range(3):
        model.clear_gradients()
        model(batch(step, rank, dtype=dtype)).sum().backward()
    diff = max_diff(model, average(local_grads(2, range(WORLD), dtype)))
    scale = max(float(np.abs(g).max()) for g in average(local_grads(2, range(WORLD), dtype)))
    path = os.path.join(out_dir, f"timeline-{rank}.json")
    events = model.write_timeline(path)
    with open(path) as f:
        trace_events = len(json.load(f)["traceEvents"])
    scraped = None
    if rank == 0 and port:
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    report = model.last_report.to_dict()
    model.close()
    return {"report": report, "events": events, "trace_events": trace_events, "scraped": scraped,
            "max_diff": diff, "scale": scale, "grad_dtype": str(model.parameters()[0].grad.dtype), "refused": refused}


def _progress(rank, what):
    print(f"rank {rank}: {json.dumps(what)}", flush=True)


def main(case, impl, out_dir, settings):
    dist.init_parallel_env()
    rank = dist.get_rank()
    fn = {"oom": oom, "uneven": uneven, "stalled": stalled, "observed": observed}[case]
    extra = {"out_dir": out_dir} if case == "observed" else {}
    try:
        result = {"status": "ok", **fn(rank, impl, **extra, **settings)}
    except Exception as e:
        result = {"status": "error", "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    _progress(rank, result)


if __name__ == "__main__":
    case, impl, out_dir = sys.argv[1:4]
    settings = {k: json.loads(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
    dist.spawn(main, args=(case, impl, out_dir, settings), nprocs=WORLD, backend="gloo")
