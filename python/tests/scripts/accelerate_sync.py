"""Accelerate's ``trigger_sync_in_backward`` under torchrun, as its docstring
shows it: two forwards under ``accelerator.no_sync(model)``, the first loss's
backward accumulates locally, the second's runs inside
``accelerator.trigger_sync_in_backward(model)`` and synchronizes (Accelerate
calls ``model.reducer.prepare_for_backward([])`` there). 2 CPU ranks;
``--impl`` picks ``ddp`` (torch's) or ``gradsync`` (``replace_ddp()`` before
``accelerator.prepare``). Rank 0 prints the wrapper's class, the spread
between replicas and the difference from a one-process replay."""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from _report import failures_reported, report
from accelerate import Accelerator

STEPS, ROWS, LR = 4, 4, 0.05


def batches(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 8, generator=g)


def loss_of(out):
    return out.square().mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "gradsync"], required=True)
    impl = parser.parse_args().impl
    if impl == "gradsync":
        import gradsync.torch

        gradsync.torch.replace_ddp()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    initial = copy.deepcopy(net)
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    rank, world = dist.get_rank(), dist.get_world_size()
    with failures_reported(impl):
        for step in range(STEPS):
            input_a, input_b = batches(step, rank)
            with accelerator.no_sync(model):
                loss_a = loss_of(model(input_a))
                loss_b = loss_of(model(input_b))
            accelerator.backward(loss_a)
            with accelerator.trigger_sync_in_backward(model):
                accelerator.backward(loss_b)
            opt.step()
            opt.zero_grad()

    def replay(_):
        ref = copy.deepcopy(initial)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for step in range(STEPS):
            ref_opt.zero_grad()
            for r in range(world):
                for x in batches(step, r):
                    (loss_of(ref(x)) / world).backward()
            ref_opt.step()
        return ref.parameters()

    report(f"{type(model).__module__}.{type(model).__name__}", net.parameters(), replay)
    # A clean exit: gloo's threads aborted the process now and then when the
    # interpreter tore the default group down unannounced (torch's DDP run),
    # or when one rank tore it down while rank 0 still computed the replay.
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
