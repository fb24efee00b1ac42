"""gradsync in HF ``transformers``' ``Trainer``: checkpoints of a sharded optimizer.

``gradsync.torch.replace_ddp(shard_gradients=True)`` shards the Trainer's
gradients and optimizer state (the Trainer's own optimizer is converted at
its first step), and its checkpoints hold the whole optimizer state, in
torch's format, which the Trainer loads back on any world size: gradsync
wraps the Trainer's save once a sharded wrapper is built
(``sharding.trainer_saves``). Nothing else is needed.

The callback below did that before, and still may be given (it then does
nothing more). Importing this module needs ``transformers``.
"""

from transformers import TrainerCallback

from gradsync.torch.sharding.trainer_saves import installed, sharded_under


class ShardedCheckpoints(TrainerCallback):
    """Before each checkpoint the Trainer is about to save, every rank
    collects the sharded optimizer's whole state on the saving rank (rank
    0), so its ``state_dict()`` is torch's format; after the save the
    collected copy is dropped."""

    def _collect(self, control, optimizer):
        if control.should_save and not installed():
            sharded = sharded_under(optimizer)
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
        sharded = sharded_under(optimizer)
        if sharded is not None and not installed():
            sharded.drop_consolidated()
