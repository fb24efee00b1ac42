"""The PyTorch DDP tutorial's checkpoint demo, as the tutorial writes it,
with ``shard_parameters=True`` the only change (``--impl gradsync``): rank
0 alone saves ``ddp_model.state_dict()`` with ``torch.save`` while the
other ranks wait in a barrier, every rank loads it back with
``load_state_dict``, and training goes on. Here it saves after two steps
of training and trains two more after the load. 2 CPU ranks; rank 0
prints the wrapper's class, the spread between replicas and the difference
from a one-process replay."""

import argparse
import contextlib
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from _report import failures_reported, report
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 0.05


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)


def train_step(ddp_model, optimizer, step, rank):
    loss_fn = nn.MSELoss()
    optimizer.zero_grad()
    inputs, labels = batch(step, rank)
    loss_fn(ddp_model(inputs), labels).backward()
    optimizer.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "gradsync"], required=True)
    impl = parser.parse_args().impl
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ToyModel()
    initial = copy.deepcopy(model)
    if impl == "gradsync":
        from gradsync.torch import DistributedDataParallel as GradsyncDDP

        ddp_model = GradsyncDDP(model, shard_parameters=True)
    else:
        ddp_model = DDP(model)
    optimizer = optim.SGD(ddp_model.parameters(), lr=LR)
    CHECKPOINT_PATH = os.path.join(tempfile.gettempdir(), f"model-{os.environ['MASTER_PORT']}.checkpoint")
    with failures_reported(impl):
        for step in range(2):
            train_step(ddp_model, optimizer, step, rank)
        if rank == 0:
            # All processes should see same parameters as they all start from same
            # random parameters and gradients are synchronized in backward passes.
            # Therefore, saving it in one process is sufficient.
            torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)
        # Use a barrier() to make sure that process 1 loads the model after process 0 saves it.
        dist.barrier()
        ddp_model.load_state_dict(torch.load(CHECKPOINT_PATH, weights_only=True))
        for step in range(2, 4):
            train_step(ddp_model, optimizer, step, rank)
        dist.barrier()
        if rank == 0:
            os.remove(CHECKPOINT_PATH)

    def replay(_):
        ref = copy.deepcopy(initial)
        ref_opt = optim.SGD(ref.parameters(), lr=LR)
        for step in range(4):
            ref_opt.zero_grad()
            for r in range(world):
                inputs, labels = batch(step, r)
                (nn.MSELoss()(ref(inputs), labels) / world).backward()
            ref_opt.step()
        return ref.parameters()

    whole = ddp_model.whole_parameters() if impl == "gradsync" else contextlib.nullcontext()
    with whole:
        report(f"{type(ddp_model).__module__}.{type(ddp_model).__name__}", model.parameters(), replay)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
