"""Rank-side cases of ``test_bad_input.py``: every misuse gets a clear
exception on the spot, never a crash or a hang."""

import gc

import torch
import torch.nn as nn

import gradsync
from gradsync.torch import DistributedDataParallel as DDP


def expect(exc, fn):
    try:
        fn()
    except exc as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"expected {exc.__name__}")


def misuse(rank, world):
    seen = {}
    # A sparse gradient from an embedding that was dense when wrapped is
    # refused, from backward, naming the parameter; a model with nothing but
    # sparse parameters is refused when wrapped.
    # (One parameter: nothing is handed over before the hook refuses it, so
    # no rank is left in a collective the other never starts.)
    model = nn.Embedding(10, 4).double()
    emb = DDP(model)
    model.sparse = True
    seen["sparse"] = expect(gradsync.GradientLayoutError, lambda: emb(torch.tensor([1, 2])).sum().backward())
    emb.close()
    seen["only_sparse"] = expect(gradsync.ConfigError, lambda: DDP(nn.Embedding(10, 4, sparse=True)))
    # A sparse embedding tied to an output layer gets a dense gradient: named, from the end of backward.
    tied = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 10))
    tied[1].weight = tied[0].weight
    tied_ddp = DDP(tied)
    seen["tied"] = expect(gradsync.GradientLayoutError, lambda: tied_ddp(torch.tensor([1, 2])).sum().backward())
    tied_ddp.close()
    # Parameters on several devices.
    two = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    two[1].to("meta")
    seen["devices"] = expect(gradsync.ConfigError, lambda: DDP(two))
    # Wrapping a wrapper is refused; wrapping the module again takes it over
    # and retires the first wrapper, whose later use is refused.
    lin = nn.Linear(3, 3)
    first = DDP(lin)
    seen["wrapper"] = expect(gradsync.ConfigError, lambda: DDP(first))
    wrapped = DDP(lin)
    seen["retired_forward"] = expect(gradsync.ClosedError, lambda: first(torch.ones(1, 3)))
    first.close()  # closing a retired wrapper does nothing
    # Using the wrapper after close.
    wrapped.close()
    seen["closed_forward"] = expect(gradsync.ClosedError, lambda: wrapped(torch.ones(1, 3)))
    seen["closed_finish"] = expect(gradsync.ClosedError, wrapped.finish_step)
    seen["closed_abort"] = expect(gradsync.ClosedError, wrapped.abort_step)
    # After close the module can be wrapped again.
    again = DDP(lin)
    again(torch.ones(1, 3)).sum().backward()
    seen["rewrapped_step"] = again.last_report.step
    # And so it can once a wrapper it never closed is gone.
    del again
    gc.collect()
    dropped = DDP(lin)
    dropped(torch.ones(1, 3)).sum().backward()
    seen["wrapped_after_drop"] = dropped.last_report.step
    dropped.close()
    # Parameters that cannot be averaged, and nothing to synchronize.
    fp8 = nn.Module()
    fp8.weight = nn.Parameter(torch.zeros(2, 2, dtype=torch.float8_e4m3fn))
    seen["fp8"] = expect(gradsync.ConfigError, lambda: DDP(fp8))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    seen["frozen"] = expect(gradsync.ConfigError, lambda: DDP(frozen))
    # Settings the runtime refuses.
    seen["policy"] = expect(gradsync.ConfigError, lambda: DDP(nn.Linear(2, 2), abort_policy="sometimes"))
    # Converting after wrapping: a no-op conversion is fine, a new dtype is refused.
    converted = DDP(nn.Linear(2, 2))
    converted.to("cpu").float()
    seen["converted"] = expect(gradsync.ConfigError, converted.double)
    converted.close()
    return seen


def native_misuse(rank, world):
    """The native session refuses bad registrations with ConfigError."""

    class NoComm:
        def all_reduce(self, *args):
            raise AssertionError("never reached")

        def reset(self):
            pass

    seen = {}
    seen["lengths"] = expect(gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 0, 1, ["a"], [1, 2], ["float32"]))
    seen["duplicate"] = expect(
        gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 0, 1, ["a", "a"], [1, 1], ["float32"] * 2)
    )
    seen["dtype"] = expect(gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 0, 1, ["a"], [1], ["int8"]))
    seen["timeout"] = expect(
        gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 0, 1, ["a"], [1], ["float32"], timeout_s=0)
    )
    seen["world"] = expect(gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 3, 2, ["a"], [1], ["float32"]))
    seen["divisor"] = expect(
        gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 0, 1, ["a"], [1], ["float32"], divisor="average")
    )
    seen["wire"] = expect(
        gradsync.ConfigError, lambda: gradsync.Session(NoComm(), 0, 1, ["a"], [1], ["float32"], wire_dtype="int8")
    )
    return seen


def unknown_abort_reason(rank, world):
    """An abort reason gradsync does not know is refused on the spot (it used
    to be taken silently for an anonymous code); the step can then be
    aborted with a known reason, on every rank, and nobody blocks."""
    wrapped = DDP(nn.Linear(3, 3))
    wrapped(torch.ones(1, 3)).sum().backward()
    refused = expect(gradsync.ConfigError, lambda: wrapped.abort_step("disk_full"))
    wrapped(torch.ones(1, 3)).sum()
    report = wrapped.abort_step("bad_batch")
    wrapped.close()
    return {"refused": refused, "outcome": report.outcome, "aborted": report.aborted}


def wire_types_that_differ(rank, world, how):
    """Ranks that choose different wire types fail together with a
    ``DesyncError`` naming the odd rank (before, gloo failed on mismatched
    messages): chosen at construction (``"constructor"``) or by a comm hook
    registered on one rank only (``"comm_hook"``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(3)
    if how == "constructor":
        wrapped = DDP(nn.Linear(4, 4), wire_dtype="bfloat16" if rank == 1 else "float32", timeout=20)
    else:
        wrapped = DDP(nn.Linear(4, 4), timeout=20)
        if rank == 1:
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    try:
        wrapped(torch.ones(2, 4)).sum().backward()
    except gradsync.DesyncError as e:
        return {"ranks": e.ranks, "message": str(e)}
    finally:
        wrapped.close()
    return None


def closed_mid_step(rank, world):
    """Rank 0's hook refuses a gradient after the first bucket left (its
    collective waits for rank 1, which never runs a step); each rank then
    closes and drops its wrapper. Returns how long the close and the free
    took and whether the ranks still meet afterwards."""
    import time

    import torch.distributed as dist

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    wrapped = DDP(model, bucket_cap_mb=1e-6, timeout=120)
    if rank == 0:
        model[0].sparse = True
        expect(gradsync.GradientLayoutError, lambda: wrapped(torch.tensor([1, 2])).sum().backward())
        # The bucket's collective reaches gloo's wait for rank 1's end of
        # the pair, which rank 1 never connects.
        time.sleep(2.0)
    else:
        # Rank 1's group is still there when rank 0 connects to it (a
        # group already gone refuses the connection, which fails at once).
        time.sleep(1.0)
    began = time.monotonic()
    wrapped.close()
    took = time.monotonic() - began
    report = wrapped.last_report
    # Freeing the wrapper frees its group, which must not join that wait.
    del wrapped
    gc.collect()
    freed = time.monotonic() - began
    dist.barrier()
    return {"close_s": took, "free_s": freed, "report": report}
