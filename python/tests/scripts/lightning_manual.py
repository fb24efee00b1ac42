"""Lightning manual optimization under torchrun: Lightning's GAN recipe
(``automatic_optimization=False``, two optimizers, two ``manual_backward``
calls per ``training_step``) on 2 CPU ranks. In manual optimization Lightning
drives torch's ``model.reducer`` itself (``prepare_for_backward`` before each
``manual_backward``; ``_delay_all_reduce`` after the first under
``static_graph``). ``--impl`` picks the wrapper: ``ddp`` (torch's),
``replace`` (``gradsync.torch.replace_ddp()`` then Lightning's "ddp") or
``strategy`` (``GradsyncDDPStrategy``); ``--static-graph`` passes
``static_graph=True`` and ``--find-unused`` ``find_unused_parameters=True``
(which torch's DDP needs here: the discriminator's backward reaches no
generator parameter). Rank 0 prints the wrapper's class, the spread between
replicas, and the difference from a one-process replay of every rank's
batches."""

import argparse
import copy

import torch
import torch.nn as nn

import lightning as L
from _report import failures_reported, leave, report
from lightning.pytorch.strategies import DDPStrategy

STEPS, BATCH, LR = 5, 4, 0.05


class Gan(L.LightningModule):
    """A generator and a discriminator, each with its own optimizer: the
    discriminator steps on real and generated samples, then the generator
    steps through the discriminator (Lightning's documented recipe)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen = []

    def losses(self, real, noise):
        fake = self.generator(noise)
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        return d_loss, fake

    def on_train_start(self):
        wrapper = type(self.trainer.strategy.model)
        self.wrapper = f"{wrapper.__module__}.{wrapper.__name__}"

    def training_step(self, batch, _):
        real, noise = batch
        self.seen.append([real.clone(), noise.clone()])
        g_opt, d_opt = self.optimizers()
        d_loss, fake = self.losses(real, noise)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = -self.discriminator(self.generator(noise)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.generator.parameters(), lr=LR),
            torch.optim.SGD(self.discriminator.parameters(), lr=LR),
        )


def replay(initial, batches):
    """One process, every rank's batch of each step concatenated: the same
    two optimizer steps per training step."""
    model = copy.deepcopy(initial)
    g_opt = torch.optim.SGD(model.generator.parameters(), lr=LR)
    d_opt = torch.optim.SGD(model.discriminator.parameters(), lr=LR)
    for real, noise in batches:
        d_loss, _ = model.losses(real, noise)
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        g_loss = -model.discriminator(model.generator(noise)).mean()
        g_opt.zero_grad()
        g_loss.backward()
        g_opt.step()
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "replace", "strategy"], required=True)
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--find-unused", action="store_true")
    parser.add_argument("--shard", action="store_true", help="gradsync's shard_gradients=True (two optimizers)")
    parser.add_argument("--shard-parameters", action="store_true",
                        help="gradsync's shard_parameters=True (ZeRO-3: the generator's layers are units, the "
                             "discriminator the root; each step ends inside the wrapper's forward)")
    args = parser.parse_args()
    options = {"static_graph": args.static_graph, "find_unused_parameters": args.find_unused}
    sharded = {"shard_gradients": True} if args.shard else {}
    if args.shard_parameters:
        sharded = {"shard_parameters": True}
    if args.impl == "replace":
        import gradsync.torch

        gradsync.torch.replace_ddp(**sharded)
        strategy = DDPStrategy(**options)
    elif args.impl == "strategy":
        from gradsync.torch.lightning import GradsyncDDPStrategy

        strategy = GradsyncDDPStrategy(**options, **sharded)
    else:
        strategy = DDPStrategy(**options)
    model = Gan()
    initial = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    rows = STEPS * BATCH * 2
    data = torch.utils.data.TensorDataset(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=2 * STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with failures_reported(args.impl):
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))

    def replay_all(every):
        return replay(initial, [[torch.cat(parts) for parts in zip(*steps)] for steps in zip(*every)]).parameters()

    report(model.wrapper, model.parameters(), replay_all, model.seen)
    leave()

if __name__ == "__main__":
    main()
