"""A Lightning Fabric loop under torchrun, written as Fabric's docs write it:
``fabric.setup(model, optimizer)``, gradient accumulation with
``fabric.no_backward_sync``, ``fabric.clip_gradients(model, optimizer,
max_norm=...)`` (Fabric clips the optimizer's parameters: with
``shard_gradients=True``, this rank's pieces), AdamW. ``--impl``: ``ddp``
(torch's) or ``gradsync`` (``replace_ddp()``, ``--shard``: with
``shard_gradients=True``). Rank 0 prints the wrapper, the spread between
replicas, the distance from a one-process replay, and how far the clip
norms Fabric returned are from the replay's."""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import lightning as L
from _report import failures_reported, leave, report

STEPS, MICRO, BATCH, LR, MAX_NORM = 4, 2, 4, 1e-2, 0.05


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "gradsync"], required=True)
    parser.add_argument("--shard", action="store_true", help="gradsync's shard_gradients=True")
    args = parser.parse_args()
    if args.impl == "gradsync":
        import gradsync.torch

        gradsync.torch.replace_ddp(shard_gradients=args.shard)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    model = build()
    initial = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    data = torch.randn(STEPS, MICRO, world * BATCH, 8, generator=torch.Generator().manual_seed(7))
    norms = []
    with failures_reported(args.impl):
        for step in range(STEPS):
            for m in range(MICRO):
                x = data[step, m, rank * BATCH : (rank + 1) * BATCH]
                with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
                    fabric.backward(model(x).square().mean() / MICRO)
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
    replayed = {}

    def replay(_):
        ref = copy.deepcopy(initial)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        replayed["norms"] = []
        for step in range(STEPS):
            opt.zero_grad()
            for m in range(MICRO):
                for r in range(world):
                    (ref(data[step, m, r * BATCH : (r + 1) * BATCH]).square().mean() / MICRO / world).backward()
            replayed["norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
            opt.step()
        return ref.parameters()

    wrapper = type(model._forward_module)
    report(f"{wrapper.__module__}.{wrapper.__name__}", model.parameters(), replay)
    if dist.get_rank() == 0:
        off = max(abs(a - b) / b for a, b in zip(norms, replayed["norms"]))
        clipped = sum(b > MAX_NORM for b in replayed["norms"])
        print(f"clip norms: {off:.1e} from the replay's (relative), {clipped} of {STEPS} steps clipped", flush=True)
    leave()


if __name__ == "__main__":
    main()
