"""gradsync in HF ``transformers``' ``Trainer``: checkpoints of a sharded optimizer.

``gradsync.torch.replace_ddp(shard_gradients=True)`` shards the Trainer's
gradients and optimizer state (the Trainer's own optimizer is converted at
its first step). The Trainer saves a checkpoint's optimizer state with
``optimizer.state_dict()`` on the saving rank alone, while a sharded
optimizer's state is spread over every rank: collecting it is a collective.
Add this module's callback and the checkpoints hold the whole state, in
torch's format, which the Trainer loads back on any world size::

    from gradsync.torch.hf import ShardedCheckpoints
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ShardedCheckpoints()])

Without it, a save with sharded gradients raises a ``ConfigError`` that
names this callback. Importing this module needs ``transformers``.
"""

import torch
from transformers import TrainerCallback

from gradsync.torch._sharding import sharded_optimizer_of


def _sharded(optimizer):
    """The ``ShardedOptimizer`` under ``optimizer`` (Accelerate wraps it), or ``None``."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return None if optimizer is None else sharded_optimizer_of(optimizer)


class ShardedCheckpoints(TrainerCallback):
    """Before each checkpoint the Trainer is about to save, every rank
    collects the sharded optimizer's whole state on the saving rank (rank
    0), so its ``state_dict()`` is torch's format; after the save the
    collected copy is dropped."""

    def _collect(self, control, optimizer):
        if control.should_save:
            sharded = _sharded(optimizer)
            if sharded is not None:
                sharded.consolidate_state_dict(to=0)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        """A step ended: collect the state if the Trainer saves now."""
        self._collect(control, optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        """An epoch ended: collect the state if the Trainer saves now."""
        self._collect(control, optimizer)

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        """The checkpoint was written: drop the collected copy."""
        sharded = _sharded(optimizer)
        if sharded is not None:
            sharded.drop_consolidated()
