"""HF ``Trainer``'s checkpoints of a sharded optimizer, with nothing to add.

The Trainer saves a checkpoint's optimizer state with
``torch.save(optimizer.state_dict(), ...)`` on the saving rank alone, while
a sharded optimizer's state is spread over every rank and collecting it is
a collective. Every rank does call ``Trainer._save_optimizer_and_scheduler``
(only the saving rank writes), so once a sharded wrapper is built in a
process that imported ``transformers.trainer``, that method is wrapped
(:func:`install`): every rank first collects the whole state (torch's
format) on the ranks that save, and drops it after the save. The Trainer
loads it back with ``optimizer.load_state_dict`` on any world size. This
module imports nothing of ``transformers``: it is given the class.
"""

import functools

import torch

# The Trainer classes whose save was wrapped.
_WRAPPED = set()


def sharded_under(optimizer):
    """The ``ShardedOptimizer`` that steps ``optimizer`` (Accelerate wraps
    it), or ``None``: one never converted has stepped nothing, and its own
    ``state_dict()`` is right."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if getattr(optimizer, "_gradsync_facade", False):
        return optimizer
    return getattr(optimizer, "_gradsync_sharded", None)


def install(trainer_class):
    """Wrap ``trainer_class._save_optimizer_and_scheduler`` (once)."""
    if trainer_class in _WRAPPED or not hasattr(trainer_class, "_save_optimizer_and_scheduler"):
        return
    torch_save = trainer_class._save_optimizer_and_scheduler

    @functools.wraps(torch_save)
    def _save_optimizer_and_scheduler(self, output_dir):
        sharded = sharded_under(getattr(self, "optimizer", None))
        if sharded is None:
            return torch_save(self, output_dir)
        # Every rank calls this; the ranks that save get the whole state.
        sharded.consolidate_state_dict(to=-1 if getattr(self.args, "save_on_each_node", False) else 0)
        try:
            return torch_save(self, output_dir)
        finally:
            sharded.drop_consolidated()

    trainer_class._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
    _WRAPPED.add(trainer_class)


def installed():
    """Whether some Trainer's saves are wrapped."""
    return bool(_WRAPPED)
