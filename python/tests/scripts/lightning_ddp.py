"""A Lightning run under torchrun: ``Trainer(strategy="ddp", accelerator="cpu",
devices=2)`` on a module that checkpoints one shared block twice (reentrant),
which torch's DDP refuses. ``--impl`` picks the wrapper: ``ddp`` (torch's),
``replace`` (``gradsync.torch.replace_ddp()`` then Lightning's own "ddp"
strategy) or ``strategy`` (``GradsyncDDPStrategy``); ``--shard``: gradsync
with ``shard_gradients=True`` (nothing else changes: the optimizer
``configure_optimizers`` returns steps this rank's partition), and a
checkpoint saved through Lightning holds the whole optimizer state;
``--clip``: ``gradient_clip_val`` and ``accumulate_grad_batches=2`` (Lightning
clips the optimizer's parameters: sharded, this rank's pieces). Rank 0
prints the wrapper's class, the spread between replicas, and the difference
from a one-process replay of every rank's batches."""

import argparse
import contextlib
import copy
import os
import tempfile

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import lightning as L
from _report import failures_reported, leave, report

STEPS, BATCH, LR = 6, 4, 0.1
#: ``--clip``: the clip norm (below every step's gradient norm) and the micro-batches per step.
MAX_NORM, ACCUMULATE = 0.01, 2


class Shared(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        self.seen = []
        # (Sharded runs checkpoint the optimizer: momentum gives it state to compare.)
        self.momentum = 0.0

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
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ddp", "replace", "strategy"], required=True)
    parser.add_argument("--shard", action="store_true", help="gradsync's shard_gradients=True")
    parser.add_argument("--shard-parameters", action="store_true", help="gradsync's shard_parameters=True")
    parser.add_argument("--clip", action="store_true", help="gradient_clip_val and accumulate_grad_batches=2")
    args = parser.parse_args()
    micro = ACCUMULATE if args.clip else 1
    args.shard = args.shard or args.shard_parameters
    impl, sharded = args.impl, ({"shard_gradients": True} if args.shard else {})
    if args.shard_parameters:
        sharded = {"shard_parameters": True}
    strategy = "ddp"
    if impl == "replace":
        import gradsync.torch

        gradsync.torch.replace_ddp(**sharded)
    elif impl == "strategy":
        from gradsync.torch.lightning import GradsyncDDPStrategy

        strategy = GradsyncDDPStrategy(**sharded)
    model = Shared()
    model.momentum = 0.9 if args.shard else 0.0
    initial = copy.deepcopy(model)
    data = torch.utils.data.TensorDataset(
        torch.randn(STEPS * micro * BATCH * 2, 8, generator=torch.Generator().manual_seed(3)))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=MAX_NORM if args.clip else None, accumulate_grad_batches=micro,
    )
    with failures_reported(impl):
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=BATCH))

    saved = None
    if args.shard:
        # Lightning's checkpoint (every rank calls it; rank 0 writes): the whole optimizer state.
        path = os.path.join(tempfile.gettempdir(), f"gradsync-lightning-{os.environ.get('MASTER_PORT')}.ckpt")
        trainer.save_checkpoint(path)
        if trainer.global_rank == 0:
            checkpoint = torch.load(path, weights_only=False)
            saved, saved_weights = checkpoint["optimizer_states"][0], checkpoint["state_dict"]
            os.remove(path)
    replayed = {}

    def replay(seen):
        ref = copy.deepcopy(initial)
        opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=model.momentum)
        for step in range(STEPS):
            opt.zero_grad()
            for m in range(micro):
                # Lightning divides each micro-batch's loss by the micro-batches per step.
                (ref(torch.cat([s[step * micro + m] for s in seen])).square().mean() / micro).backward()
            if args.clip:
                norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
                assert norm > MAX_NORM, f"step {step}: the replay's norm {norm} is not clipped"
            opt.step()
        replayed["state"] = opt.state_dict()
        return ref.parameters()

    # With sharded parameters every rank gathers them whole to read them (a collective).
    with getattr(trainer.strategy.model, "whole_parameters", contextlib.nullcontext)():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    report(model.wrapper, params.values(), replay, model.seen)
    if saved is not None:
        off = max((saved_weights[n] - p).abs().max().item() for n, p in params.items())
        print(f"checkpointed weights: {off:.1e} from the parameters", flush=True)
    if saved is not None:
        want = replayed["state"]["state"]
        diff = max((saved["state"][n]["momentum_buffer"] - want[n]["momentum_buffer"]).abs().max().item()
                   for n in want)
        assert sorted(saved["state"]) == sorted(want), (sorted(saved["state"]), sorted(want))
        print(f"checkpointed optimizer state: {diff:.1e} from the replay's", flush=True)
    leave()

if __name__ == "__main__":
    main()
