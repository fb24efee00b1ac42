"""Lightning's ``StochasticWeightAveraging`` callback on a module that logs
its weights' norm inside ``training_step`` (which Lightning runs inside
``optimizer.step(closure)``), under torchrun with 2 CPU ranks:
``--impl ddp`` (torch's) or ``--impl gradsync``
(``replace_ddp(shard_parameters=True)``, nothing else changed). Rank 0
saves the trained (averaged) parameters and the logged norms to ``--out``."""

import argparse

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import StochasticWeightAveraging


class Logged(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.norms = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        (x,) = batch
        loss = self(x).square().mean()
        with torch.no_grad():  # (a weight-norm log, as callbacks and modules write them)
            self.norms.append(float(sum(p.norm() for p in self.parameters())))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "gradsync"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.impl == "gradsync":
        import gradsync.torch

        gradsync.torch.replace_ddp(shard_parameters=True)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(3)))
    model = Logged()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=4, logger=False,
                        callbacks=[StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2)],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()], "norms": model.norms}, args.out)
        print(f"{args.impl}: saved", flush=True)


if __name__ == "__main__":
    main()
