"""What every torchrun test script prints at its end, the same way, so the
tests read it the same way: a failure as ``rank R: IMPL failed: Error:
message``, or on rank 0 the wrapper's class, the spread between the replicas'
parameters and their distance from a one-process replay."""

import contextlib
import sys

import torch
import torch.distributed as dist


@contextlib.contextmanager
def failures_reported(impl):
    """Run the training; an exception becomes one line and exit status 1
    (torch's DDP refusing is a result the tests record)."""
    try:
        yield
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"rank {dist.get_rank()}: {impl} failed: {type(e).__name__}: {first}", flush=True)
        sys.exit(1)


def report(wrapper, params, replay, batches=None):
    """Collective: gather ``params`` from every rank (and ``batches``, what
    this rank trained on, if given); rank 0 prints the wrapper's class name
    ``wrapper``, the spread between replicas, and the distance from the
    parameters ``replay(every_ranks_batches)`` returns."""
    params = list(params)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    every = None
    if batches is not None:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, batches)
    if dist.get_rank() == 0:
        print(f"wrapper: {wrapper}", flush=True)
        print(f"replicas: {max((g - gathered[0]).abs().max().item() for g in gathered):.1e}", flush=True)
        diff = max((a - b).abs().max().item() for a, b in zip(replay(every), params))
        print(f"reference: {diff:.1e}", flush=True)


def leave():
    """End the job as torch asks programs to end: destroy the default group.

    Without it, the interpreter may finalize while one of gloo's worker
    threads still holds the last collective's tensors (``report``'s gather,
    done on this rank while rank 0 replays): dropping them needs the
    interpreter lock, and a thread that asks for it during finalization
    aborts the process ("terminate called without an active exception",
    pytorch/pytorch PR 179291; about one run in four of a Fabric loop)."""
    if dist.is_initialized():
        dist.destroy_process_group()
