"""What only a GPU can check of the device plane, run on every rank of a
test world (``test_gpu.py``): stream ordering and memory against DDP.

Each rank uses GPU ``rank`` (modulo the GPUs there: more ranks than GPUs
share them, as ``cases.share_gpus`` sets NCCL up for; the memory
comparison runs one rank per GPU). Every rank trains on the same batch, so the
average over the ranks is each rank's own gradient and a model trained
without any wrapper is the reference, bitwise at world 1.
"""

import copy

import torch
import torch._dynamo  # noqa: F401  (torch's DDP reads torch._dynamo.utils, imported lazily)
import torch.distributed as dist
import torch.nn as nn

from cases import share_gpus
from gradsync.torch import DistributedDataParallel as GradsyncDDP


class Slow(torch.autograd.Function):
    """Identity whose backward first keeps the current stream busy for a
    while: every gradient behind it is produced late on that stream, so a
    bucket packed without waiting for its producer would read stale memory."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(100_000_000)  # about 50 ms of GPU cycles
        return g


def _device_of(rank, world):
    """This rank's GPU, made current: GPU ``rank`` modulo the GPUs there
    (ranks sharing one get NCCL's settings for it, ``cases.share_gpus``).
    Indexing by rank alone failed on rank 1 of 2 sharing one GPU, and left
    rank 0 waiting in its collective."""
    gpus = torch.cuda.device_count()
    if world > gpus:
        share_gpus()
    torch.cuda.set_device(rank % gpus)
    return torch.device("cuda", rank % gpus)


def _layers(dev, width=2048, depth=4):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(dev)


def stream_order(rank, world, side_stream, steps=4):
    """Train a plain model and a gradsync one side by side, each step's
    ``optimizer.step()`` queued right after ``backward()`` with no host
    synchronization, on the default stream or on a side stream (gradients
    produced there). Returns the largest parameter difference at the end."""
    dev = _device_of(rank, world)
    base = _layers(dev)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    wrapped = GradsyncDDP(model, bucket_cap_mb=8)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, wrapped)]
    x = torch.randn(256, 2048, device=dev)
    stream = torch.cuda.Stream(dev) if side_stream else torch.cuda.current_stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(steps):
            for m, opt in zip((ref, wrapped), opts):
                opt.zero_grad()
                Slow.apply(m(x)).square().mean().backward()
                opt.step()
    torch.cuda.synchronize(dev)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    identical = all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    path = wrapped.path
    wrapped.close()
    return {"max_diff": diff, "identical": identical, "buckets": path.buckets, "why": path.why}


def peak_of(rank, world, policy, bucket_mb=25, steps=3):
    """Peak and held device memory over ``steps`` training steps of 4
    Linear(4096, 4096) layers (256 MiB of float32 parameters) under
    ``policy``: ``"local"`` (no wrapper), ``"ddp"`` / ``"ddp_bucket_view"``
    (torch's DDP on NCCL, without / with ``gradient_as_bucket_view``) or
    ``"gradsync"`` (the device plane). Bytes above what the process held
    before the model was built: run each policy in a fresh process."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    nccl = dist.new_group(backend="nccl") if policy.startswith("ddp") else None
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = _layers(dev, 4096)
    if policy == "local":
        wrapped = model
    elif policy == "gradsync":
        wrapped = GradsyncDDP(model, bucket_cap_mb=bucket_mb)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[rank], process_group=nccl,
                                                      bucket_cap_mb=bucket_mb,
                                                      gradient_as_bucket_view=policy == "ddp_bucket_view")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 4096, device=dev)
    for _ in range(steps):
        opt.zero_grad()
        wrapped(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(dev)
    out = {"peak": torch.cuda.max_memory_allocated(dev) - before, "held": torch.cuda.memory_allocated(dev) - before,
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    if policy == "gradsync":
        wrapped.close()
    return out
