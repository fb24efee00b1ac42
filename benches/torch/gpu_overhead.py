"""gradsync's cost on one GPU, against torch DDP's, in one process.

    python benches/torch/gpu_overhead.py --model gpt2-small|resnet18 [--steps 40] [--json PATH]

World 1 on one CUDA device (NCCL still runs: a one-rank all-reduce is a
device copy), so what is measured is each wrapper's own overhead over the
same training step without any wrapper. Policies, each its own replica of the
model (same seed), stepped in turn, the order rotating every step:

* ``local``          no wrapper: forward, backward, SGD;
* ``ddp``            torch DDP (NCCL, default settings);
* ``ddp_view``       torch DDP with ``gradient_as_bucket_view=True``;
* ``gradsync``       gradsync's device plane (the default on CUDA);
* ``gradsync_host``  gradsync with ``buckets="host"``: gradients staged
                     through host memory and reduced by gloo.

A step is timed with CUDA events from before the forward to after the
optimizer step, the device synchronized between steps; the first
``--warmup`` steps are left out. The table gives each policy's median step
and its overhead over ``local`` (median of the per-round differences, so
clock drift cancels), and peak allocated memory in a step above what the
replica held before it. Models and batches: ``bench_models.py`` (GPT-2 small
with HF gradient checkpointing, one sequence of ``--tokens-per-rank``
tokens; ResNet-18 with ``--images-per-rank`` images). At the end the
synchronized policies' parameters are compared with ``local``'s.
"""

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402

POLICIES = ("local", "ddp", "ddp_view", "gradsync", "gradsync_host")


def build(policy, base, args):
    """``(model, wrapped, optimizer)`` for ``policy``: a copy of ``base`` under that wrapper."""
    model = copy.deepcopy(base)
    if policy == "local":
        wrapped = model
    elif policy.startswith("ddp"):
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[0], bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=policy == "ddp_view"
        )
    else:
        from gradsync.torch import DistributedDataParallel

        buckets = "host" if policy == "gradsync_host" else "device"
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, buckets=buckets)
    return model, wrapped, torch.optim.SGD(model.parameters(), lr=args.lr)


def main():
    """Run every policy in turn on one GPU, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["gpt2-small", "resnet18"], default="gpt2-small")
    ap.add_argument("--tokens-per-rank", type=int, default=1024)
    ap.add_argument("--images-per-rank", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    args.tiny_params, args.reentrant = 0, False
    if not torch.cuda.is_available():
        sys.exit("gpu_overhead.py measures on a CUDA device, and there is none here")
    policies = args.policies.split(",")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    base = bench_models.make_model(args).to(dev)
    replicas = {p: build(p, base, args) for p in policies}
    times = {p: [] for p in policies}
    peaks = {p: [] for p in policies}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(args.steps):
        x, y = bench_models.batch(args, step, 0)
        data = (x.to(dev), None if y is None else y.to(dev))
        order = policies[step % len(policies):] + policies[: step % len(policies)]
        for p in order:
            model, wrapped, opt = replicas[p]
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            held = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            start.record()
            bench_models.loss_of(args, wrapped, data).backward()
            opt.step()
            end.record()
            torch.cuda.synchronize(dev)
            if step >= args.warmup:
                times[p].append(start.elapsed_time(end) / 1e3)
                peaks[p].append(torch.cuda.max_memory_allocated(dev) - held)
        print(f"step {step + 1}/{args.steps}", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    local = replicas.get("local")
    results = {}
    for p in policies:
        r = {"step_s_median": statistics.median(times[p]), "peak_bytes_median": statistics.median(peaks[p]),
             "step_s": times[p]}
        if "local" in times and p != "local":
            r["overhead_s_median"] = statistics.median(a - b for a, b in zip(times[p], times["local"]))
        if local is not None and p != "local":
            r["max_param_diff_vs_local"] = max(
                (a - b).abs().max().item() for a, b in zip(local[0].parameters(), replicas[p][0].parameters())
            )
        results[p] = r
    n_params = sum(t.numel() for t in base.parameters())
    out = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "model": args.model, "params": n_params, "steps": args.steps - args.warmup, "bucket_mb": args.bucket_mb,
           "command": "python benches/torch/gpu_overhead.py " + " ".join(sys.argv[1:]), "policies": results}
    print(f"{out['device']}, torch {out['torch']}, NCCL {out['nccl']}, {args.model} ({n_params / 1e6:.1f} M parameters), "
          f"world 1, {out['steps']} measured steps")
    print(f"{'policy':<15}{'step ms':>10}{'overhead ms':>13}{'peak MiB':>10}{'param diff':>12}")
    for p, r in results.items():
        over = r.get("overhead_s_median")
        diff = r.get("max_param_diff_vs_local")
        print(f"{p:<15}{r['step_s_median'] * 1e3:>10.2f}{'' if over is None else f'{over * 1e3:+.2f}':>13}"
              f"{r['peak_bytes_median'] / 2**20:>10.0f}{'' if diff is None else f'{diff:.1e}':>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for p, (_, wrapped, _) in replicas.items():
        if hasattr(wrapped, "close") and p.startswith("gradsync"):
            wrapped.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
