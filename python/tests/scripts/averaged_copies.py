"""Averaged copies of a model, written the way torchvision's classification
reference and PyTorch's SWA recipe write them, with ``shard_parameters=True``
the only change (``--impl gradsync``):

* an EMA of ``model_without_ddp = model.module`` (an ``AveragedModel``
  subclass: a deep copy of the module), updated every other iteration from
  the wrapper (``model_ema.update_parameters(model)``), reset during warmup
  (``n_averaged.fill_(0)``);
* ``swa_model = AveragedModel(model)`` (a copy of the wrapper itself), updated
  each epoch from ``swa_start`` on, with ``SWALR`` stepping the rate;
* each epoch a logging callback's weight norms under ``torch.no_grad()``;
  rank 0 alone evaluates the SWA model and saves
  ``{"model": model_without_ddp.state_dict(), "model_ema": ...,
  "swa": ...}`` while the other rank waits in a barrier.

2 CPU ranks; rank 0 prints the averaged models' (and the norms') distance
from a one-process replay, and the checkpoint's (``checkpoint:``)."""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from _report import failures_reported, report
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import SWALR, AveragedModel

EPOCHS, ITERS, WARMUP, SWA_START, LR = 4, 3, 1, 2, 0.05


class ExponentialMovingAverage(AveragedModel):
    """An EMA of a model's parameters and buffers, as torchvision's reference keeps one."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(averaged, current, num_averaged):
            return decay * averaged + (1 - decay) * current

        super().__init__(model, device, ema_avg, use_buffers=True)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


def batch(epoch, i, rank):
    g = torch.Generator().manual_seed(1000 * epoch + 10 * i + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def train(model, model_without_ddp, sum_over=None, rank=0, world=1, rank_zero=True, path=None):
    """The loop: ``model`` trained (its ranks' losses summed in one process
    when ``sum_over`` gives the ranks), the averaged copies kept; returns
    them, the norms logged and the SWA model's evaluation."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model_ema = ExponentialMovingAverage(model_without_ddp, decay=0.8)
    swa_model = AveragedModel(model)
    swa_scheduler = SWALR(optimizer, swa_lr=0.02, anneal_epochs=1)
    norms, evaluated = [], None
    for epoch in range(EPOCHS):
        for i in range(ITERS):
            optimizer.zero_grad()
            for r in sum_over or [rank]:
                x, y = batch(epoch, i, r)
                (nn.functional.mse_loss(model(x), y) / (len(sum_over) if sum_over else 1)).backward()
            optimizer.step()
            if i % 2 == 0:
                model_ema.update_parameters(model)
                if epoch < WARMUP:
                    model_ema.n_averaged.fill_(0)
        with torch.no_grad():
            norms.append(torch.stack([p.norm() for p in model.parameters()]))
        if epoch >= SWA_START:
            swa_model.update_parameters(model)
            swa_scheduler.step()
        if rank_zero:
            with torch.no_grad():
                evaluated = swa_model(batch(99, 0, 0)[0])
            if path is not None:
                torch.save({"model": model_without_ddp.state_dict(), "model_ema": model_ema.state_dict(),
                            "swa": swa_model.state_dict()}, path)
        if path is not None:
            dist.barrier()
    return model_ema, swa_model, torch.stack(norms), evaluated


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "gradsync"], required=True)
    impl = parser.parse_args().impl
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    if impl == "gradsync":
        from gradsync.torch import DistributedDataParallel as GradsyncDDP

        ddp_model = GradsyncDDP(model, shard_parameters=True)
    else:
        ddp_model = DDP(model)
    path = os.path.join(tempfile.gettempdir(), f"averaged-{os.environ['MASTER_PORT']}.pt")
    with failures_reported(impl):
        ema, swa, norms, evaluated = train(ddp_model, ddp_model.module, rank=rank, world=world, rank_zero=rank == 0, path=path)
        got = [*ema.module.parameters(), *ema.module.buffers(), *swa.module.parameters(), norms]
        ref = build()
        ref_ema, ref_swa, ref_norms, ref_eval = train(ref, ref, sum_over=range(world))
        want = [*ref_ema.module.parameters(), *ref_ema.module.buffers(), *ref_swa.module.parameters(), ref_norms]
        if rank == 0:
            saved = torch.load(path, weights_only=True)
            wanted = {"model": ref.state_dict(), "model_ema": ref_ema.state_dict(), "swa": ref_swa.state_dict()}
            off = max((saved[part][key.replace("module.", "module.module.", 1) if part == "swa" else key] - value)
                      .abs().max().item() for part, state in wanted.items() for key, value in state.items()
                      if key != "n_averaged")
            print(f"checkpoint: {off:.1e}", flush=True)
            print(f"evaluated: {(evaluated - ref_eval).abs().max().item():.1e}", flush=True)
            os.remove(path)
    report(f"{type(ddp_model).__module__}.{type(ddp_model).__name__}", got, lambda _: want)
    dist.barrier()
    if impl == "gradsync":
        ddp_model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
