"""Where a wrapper's host time goes in a training step, gradsync against torch
DDP with ``gradient_as_bucket_view`` (the cheapest DDP) and no wrapper, world 1.

    python benches/torch/host_profile.py [--device cuda] [--model gpt2-small|tiny] [--steps 30] [--profile]
                                         [--json docs/data/host/tiny.json]

On a launch-bound model (GPT-2 small on one H100) host time is step time, so
this is where a wrapper's overhead shows. Per policy it prints the host time
of forward and of backward per step (medians), the host microseconds per gradient
(backward over the parameters that get one) and, for gradsync, the part of
backward spent ending the step (``ModelSync.finish``); ``--profile`` adds torch.profiler's busiest operations and
CUDA calls (self CPU time over 5 steps); ``--json`` writes the numbers
(the docs' host-time table is drawn from them). The policies run twice
each, alternating, so a drifting machine shows as a spread.
"""

import argparse
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402

from gradsync import _core  # noqa: E402
from gradsync.torch import DistributedDataParallel as GradsyncDDP  # noqa: E402

#: The repository (commands are recorded relative to it).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Host seconds spent in instrumented gradsync functions, by label.
SPENT = collections.defaultdict(float)


def instrument(cls, name, label):
    """Add the host time of every call of ``cls.name`` to ``SPENT[label]``."""
    inner = getattr(cls, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    setattr(cls, name, timed)


def sync(device):
    """Wait for the device (a no-op on the CPU), so host clocks bracket finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(policy, args, device):
    """Train ``policy``'s replica for warm-up plus ``--steps`` steps and print its line (and profile)."""
    model = bench_models.make_model(args).to(device)
    if policy == "gradsync":
        wrapped = GradsyncDDP(model)
    elif policy == "none":
        wrapped = model
    else:
        ids = [device.index or 0] if device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(i):
        data = tuple(None if t is None else t.to(device) for t in bench_models.batch(args, i, 0))
        opt.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        loss = bench_models.loss_of(args, wrapped, data)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        sync(device)
        return t1 - t0, t2 - t1

    for i in range(args.warmup):
        step(i)
    SPENT.clear()
    times = [step(args.warmup + i) for i in range(args.steps)]
    n = len(times)
    parts = "  ".join(f"{k} {v / n * 1e3:.2f}" for k, v in SPENT.items())
    # Medians: this is a shared machine, and a step that another process
    # interrupted says nothing about the wrapper.
    forward, backward = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    grads = sum(1 for p in model.parameters() if p.requires_grad)
    print(f"{policy:<9} forward {forward * 1e3:7.2f} ms  "
          f"backward {backward * 1e3:7.2f} ms  ({backward / grads * 1e6:5.2f} us per gradient, {grads})  {parts}",
          flush=True)
    row = {"policy": policy, "forward_s": forward, "backward_s": backward, "gradients": grads,
           **{k: v / n for k, v in SPENT.items()}}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for i in range(5):
                step(i)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if policy == "gradsync":
        wrapped.close()
    return row


def main():
    """Parse the arguments, start a one-rank world, run each policy twice, alternating."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--model", choices=["gpt2-small", "resnet18", "tiny"], default="gpt2-small",
                    help="tiny: --tiny-params parameters of 16 values (overhead per gradient)")
    ap.add_argument("--tiny-params", type=int, default=2000)
    ap.add_argument("--tokens-per-rank", type=int, default=1024)
    ap.add_argument("--images-per-rank", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's busiest operations")
    ap.add_argument("--json", help="write the numbers (and the command) to this file")
    args = ap.parse_args()
    args.reentrant = False
    if args.model != "tiny":
        args.tiny_params = 0
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: pass --device cpu")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:29551", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), **kwargs)
    instrument(_core.ModelSync, "finish", "end of step")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.model} on {name}, world 1, {args.steps} steps; host ms per step (median)", flush=True)
    rows = [run(policy, args, device) for policy in ("none", "ddp_view", "gradsync", "none", "ddp_view", "gradsync")]
    dist.destroy_process_group()
    if args.json:
        record = {"command": "python " + " ".join([os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]]), "device": name,
                  "model": args.model, "tiny_params": args.tiny_params, "tokens": args.tokens_per_rank,
                  "steps": args.steps, "torch": torch.__version__, "python": platform.python_version(), "runs": rows}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
