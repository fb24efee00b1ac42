"""A Lightning run under torchrun: ``Trainer(strategy="ddp", accelerator="cpu",
devices=2)`` on a module that checkpoints one shared block twice (reentrant),
which torch's DDP refuses. ``--impl`` picks the wrapper: ``ddp`` (torch's),
``replace`` (``gradsync.torch.replace_ddp()`` then Lightning's own "ddp"
strategy) or ``strategy`` (``GradsyncDDPStrategy``). Rank 0 prints the wrapper's
class, the spread between replicas, and the difference from a one-process
replay of every rank's batches."""

import argparse
import copy

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import lightning as L
from _report import failures_reported, report

STEPS, BATCH, LR = 6, 4, 0.1


class Shared(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        self.seen = []

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=True)
        h = checkpoint(self.block, torch.tanh(h), use_reentrant=True)
        return self.out(torch.tanh(h))

    def on_train_start(self):
        wrapper = type(self.trainer.strategy.model)
        self.wrapper = f"{wrapper.__module__}.{wrapper.__name__}"

    def training_step(self, batch, _):
        (x,) = batch
        self.seen.append(x.clone())
        return self(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "replace", "strategy"], required=True)
    impl = parser.parse_args().impl
    strategy = "ddp"
    if impl == "replace":
        import gradsync.torch

        gradsync.torch.replace_ddp()
    elif impl == "strategy":
        from gradsync.torch.lightning import GradsyncDDPStrategy

        strategy = GradsyncDDPStrategy()
    model = Shared()
    initial = copy.deepcopy(model)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH * 2, 8, generator=torch.Generator().manual_seed(3)))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with failures_reported(impl):
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))

    def replay(seen):
        ref = copy.deepcopy(initial)
        opt = torch.optim.SGD(ref.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            ref(torch.cat([s[step] for s in seen])).square().mean().backward()
            opt.step()
        return ref.parameters()

    report(model.wrapper, model.parameters(), replay, model.seen)

if __name__ == "__main__":
    main()
