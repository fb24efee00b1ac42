"""A training script that ends without closing its wrapper, after steps of
two backward passes through one forward (``retain_graph=True``).
``--wrapper dropped``: the wrapper goes out of scope before the end (the
garbage collector closes it in the background); ``alive``: it is still
referenced when the interpreter shuts down. Either way the process must
exit 0, as under torch's DDP. Run under torchrun, 2 ranks.

The second backward used to open a step that never ended, holding ``.grad``
tensors whose Python objects only the interpreter can free; releasing them
from the runtime's threads during shutdown aborted the process
("terminate called without an active exception")."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsync.torch import DistributedDataParallel

KEPT = []


def train(keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        out = wrapped(torch.randn(8, 8))
        out.mean().backward(retain_graph=True)
        out.square().mean().backward()
        opt.step()
    if keep:
        KEPT.append(wrapped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wrapper", choices=["dropped", "alive"], required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    train(keep=args.wrapper == "alive")
    print(f"rank {dist.get_rank()}: trained, leaving without close()", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
