"""Accelerate's and Fabric's documented saves under torchrun, with
``replace_ddp(shard_parameters=True)`` the only change: after three AdamW
steps, ``--library accelerate`` saves ``accelerator.unwrap_model(model)
.state_dict()`` with ``accelerator.save`` on the main process only;
``--library fabric`` saves ``fabric.save(path, {"model": model,
"optimizer": optimizer})`` (written by rank 0). Rank 0 then prints the
largest difference of the saved model (``model:``) and optimizer state
(``optimizer:``, Fabric) from a one-process replay."""

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import gradsync.torch

STEPS, LR = 3, 0.01


def batch(step, rank):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def replay(initial, world):
    ref = copy.deepcopy(initial)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(world):
            (ref(batch(step, r)).square().mean() / world).backward()
        opt.step()
    return ref, opt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=["accelerate", "fabric"], required=True)
    library = parser.parse_args().library
    gradsync.torch.replace_ddp(shard_parameters=True)
    path = os.path.join(tempfile.gettempdir(), f"rank-zero-save-{os.environ['MASTER_PORT']}.pt")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    initial = copy.deepcopy(net)
    if library == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=LR))
        backward, barrier = accelerator.backward, accelerator.wait_for_everyone
    else:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=LR))
        backward, barrier = fabric.backward, fabric.barrier
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        backward(model(batch(step, rank)).square().mean())
        opt.step()
        opt.zero_grad()
    if library == "accelerate":
        barrier()
        if accelerator.is_main_process:
            accelerator.save(accelerator.unwrap_model(model).state_dict(), path)
    else:
        fabric.save(path, {"model": model, "optimizer": opt})
    barrier()
    if rank == 0:
        ref, ref_opt = replay(initial, world)
        saved = torch.load(path, weights_only=True)
        model_state = saved["model"] if library == "fabric" else saved
        print(f"model: {max((model_state[k] - v).abs().max().item() for k, v in ref.state_dict().items()):.1e}")
        if library == "fabric":
            want = ref_opt.state_dict()["state"]
            got = saved["optimizer"]["state"]
            print(f"optimizer: {max((got[n][k] - v).abs().max().item() for n in want for k, v in want[n].items()):.1e}")
        os.remove(path)
    barrier()


if __name__ == "__main__":
    main()
