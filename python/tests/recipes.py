"""Whole training loops as libraries write them, run under gradsync and
under torch's DDP (``impl``); the tests compare what each leaves behind."""

import copy

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from cases import Outcome, wrap


class SmallNet(nn.Module):
    """A convolution, BatchNorm (buffers: running statistics and a counter), a
    head; with ``reentrant``, the convolution and BatchNorm run under
    reentrant checkpointing (recomputed in backward, statistics included)."""

    def __init__(self, reentrant=False):
        super().__init__()
        torch.manual_seed(41)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)
        self.reentrant = reentrant

    def forward(self, x):
        if self.reentrant:
            x = checkpoint(lambda t: torch.relu(self.bn(self.conv(t))), x.requires_grad_(), use_reentrant=True)
        else:
            x = torch.relu(self.bn(self.conv(x)))
        return self.head(x.mean((2, 3)))


def images(step, micro, rank):
    g = torch.Generator().manual_seed(1009 * step + 37 * micro + 7919 * rank)
    return torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)


def timm_loop(rank, world, impl, reentrant=False, steps=4, accumulate=3, decay=0.9, sharded=False):
    """timm's train script in small: micro-batches under ``no_sync`` but the
    last, SGD with momentum, an EMA of the model (parameters and buffers,
    ``timm.utils.ModelEmaV2``'s update) after each step, and an eval forward
    through the wrapper every other step. Returns the model's and the EMA's
    state after every step. ``sharded``: gradsync with ``shard_gradients=True``."""
    model = SmallNet(reentrant)
    ema = copy.deepcopy(model).eval()
    wrapped = wrap(model, impl, **({"shard_gradients": True} if sharded else {}))
    # (Sharded, the optimizer is converted at its first step: the script is unchanged.)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    states = []
    with Outcome(impl, wrapped) as outcome:
        for step in range(steps):
            for micro in range(accumulate):
                x, y = images(step, micro, rank)
                if micro < accumulate - 1:
                    with wrapped.no_sync():
                        (loss_fn(wrapped(x), y) / accumulate).backward()
                else:
                    (loss_fn(wrapped(x), y) / accumulate).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
                    e.copy_(e * decay + (1 - decay) * m if e.is_floating_point() else m)
            if step % 2 == 1:
                wrapped.eval()
                with torch.no_grad():
                    wrapped(images(step, 99, rank)[0])
                wrapped.train()
            states.append(
                {
                    **{f"model.{k}": v.clone() for k, v in model.state_dict().items()},
                    **{f"ema.{k}": v.clone() for k, v in ema.state_dict().items()},
                }
            )
    outcome.result.update(states=states)
    return outcome.result


def uneven_with_buffers(rank, world, impl, first_out=0, sharded=False):
    """DDP's uneven-inputs loop (``with model.join():``) on a BatchNorm model,
    rank ``first_out`` running out of data first: buffers before each forward
    come from the highest rank still training, and the joined rank takes part
    in those broadcasts. Returns the model's state after the loop.
    ``sharded``: gradsync with ``shard_gradients=True``."""
    model = SmallNet()
    wrapped = wrap(model, impl, **({"shard_gradients": True} if sharded else {}))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    steps = 2 if rank == first_out else 4
    with Outcome(impl, wrapped) as outcome:
        with wrapped.join():
            for step in range(steps):
                x, y = images(step, 0, rank)
                loss_fn(wrapped(x), y).backward()
                opt.step()
                opt.zero_grad()
    outcome.result.update(state={k: v.clone() for k, v in model.state_dict().items()})
    return outcome.result
