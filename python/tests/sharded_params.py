"""Parameter sharding (``shard_parameters=True``) cases that run on every
rank of a test world: where the whole parameters stand through a step, and
what a program may do with them between steps."""

import copy

import torch
import torch.nn as nn

from gradsync import ConfigError
from gradsync.torch import DistributedDataParallel as GradsyncDDP

LR = 1e-2


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(20, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 20)).double()


def _batch(step, rank, world):
    """Every rank's batch of ``step`` (rank ``rank``'s when ``rank`` is not ``None``)."""
    x = torch.randn(world * 4, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
    return x if rank is None else x[rank * 4 : (rank + 1) * 4]


def _refused(call):
    """The message of the ``ConfigError`` that ``call()`` raises (``None`` if it does not)."""
    try:
        call()
    except ConfigError as error:
        return str(error)
    return None


def residence(rank, world, steps=3):
    """A parameter-sharded wrapper through ``steps`` steps next to one
    process over the whole batch, with the optimizer built as scripts build
    it (torch's AdamW over ``model.parameters()``, after wrapping). Returns
    what each phase saw: the parameters' element counts after backward and
    after the step, this rank's piece values, the refusals of a state dict
    between steps, an evaluation forward's output against the reference's,
    whether the next training forward gathered again, the largest parameter
    difference, and the state dict read inside ``whole_parameters()``
    against the reference's."""
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapped = GradsyncDDP(copy.deepcopy(reference), shard_parameters=True, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    seen = {"after_backward": [], "after_step": [], "worst": 0.0}
    try:
        for step in range(steps):
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(_batch(step, None, world)), torch.zeros(world * 4, 20)).backward()
            ref_opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(_batch(step, rank, world)), torch.zeros(4, 20)).backward()
            seen["after_backward"].append(sum(p.numel() for p in wrapped.parameters()))
            opt.step()
            seen["after_step"].append(sum(p.numel() for p in wrapped.parameters()))
            with wrapped.whole_parameters():
                for a, b in zip(reference.parameters(), wrapped.module.parameters()):
                    seen["worst"] = max(seen["worst"], (a - b).abs().max().item())
        seen["held"] = sum(piece.tensor.numel() for piece in wrapped._partition.pieces)
        seen["whole"] = sum(p.numel() for p in reference.parameters())
        seen["state_dict"] = _refused(wrapped.state_dict)
        seen["load_state_dict"] = _refused(lambda: wrapped.module.load_state_dict(reference.state_dict()))
        # An evaluation forward between steps gathers; the training forward after it does not again.
        with torch.no_grad():
            x = _batch(steps, rank, world)
            seen["eval"] = (wrapped(x) - reference(x)).abs().max().item()
        before = [p.data_ptr() for p in wrapped.parameters()]
        loss = nn.functional.mse_loss(wrapped(x), torch.zeros(4, 20))
        seen["gathered_again"] = before != [p.data_ptr() for p in wrapped.parameters()]
        loss.backward()
        opt.zero_grad()
        # What is written into whole parameters is kept: inside whole_parameters() (released
        # before it), and while they are whole after a forward.
        with wrapped.whole_parameters(), torch.no_grad():
            wrapped.module[0].weight.mul_(0.5)
            state = wrapped.module.state_dict()
        with torch.no_grad():
            reference[0].weight.mul_(0.5)
            wrapped(x)
            wrapped.module[2].bias.add_(1.0)
            reference[2].bias.add_(1.0)
        seen["state_diff"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()
                                 if k != "2.bias")
        for step in range(steps + 1, steps + 3):
            ref_opt.zero_grad()
            nn.functional.mse_loss(reference(_batch(step, None, world)), torch.zeros(world * 4, 20)).backward()
            ref_opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(_batch(step, rank, world)), torch.zeros(4, 20)).backward()
            opt.step()
        with wrapped.whole_parameters():
            seen["after_writes"] = max((a - b).abs().max().item()
                                       for a, b in zip(reference.parameters(), wrapped.module.parameters()))
    finally:
        wrapped.close()
    return seen


def join_refused(rank, world):
    """``model.join()`` on a parameter-sharded wrapper: the message every rank gets."""
    wrapped = GradsyncDDP(_model(), shard_parameters=True)
    try:
        return _refused(wrapped.join)
    finally:
        wrapped.close()
