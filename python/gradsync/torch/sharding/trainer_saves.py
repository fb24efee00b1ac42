"""HF ``Trainer``'s checkpoints of a sharded optimizer, with nothing to add.

The Trainer saves a checkpoint's optimizer state with
``torch.save(optimizer.state_dict(), ...)`` on the saving rank alone, while
a sharded optimizer's state is spread over every rank and collecting it is
a collective. Every rank does call ``Trainer._save_optimizer_and_scheduler``
(only the saving rank writes), so once a sharded wrapper is built in a
process that imported ``transformers.trainer``, that method is wrapped
(:func:`install`): every rank first collects the whole state (torch's
format) on the ranks that save, and drops it after the save. The Trainer
loads it back with ``optimizer.load_state_dict`` on any world size.
Likewise ``Trainer.save_model``, ``_load_from_checkpoint`` (a resume
after the model was wrapped) and ``_load_best_model``
(``load_best_model_at_end``), which every rank calls: with sharded
parameters the loads run inside ``whole_parameters()``, so a load
reaches every rank's pieces. Where the pieces are served
(``sharding.served``: parameter sharding on the CPU, not elastic) the
saving rank reads the model's ``state_dict()`` and the optimizer's alone,
and the other ranks gather nothing (they hold no more than in training);
elsewhere ``save_model`` runs inside ``whole_parameters()`` and the
optimizer's state is collected, as above. This module imports nothing
of ``transformers``: it is given the class.
"""

import contextlib
import functools
import logging

import torch

from gradsync.torch.sharding import clip as _clip

log = logging.getLogger("gradsync")

# The Trainer classes whose save was wrapped.
_WRAPPED = set()
# The Lightning strategy classes whose checkpoint and teardown were wrapped.
_LIGHTNING = set()


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
        if sharded is None or _read_alone(sharded._partition):
            return torch_save(self, output_dir)
        # Every rank calls this; the ranks that save get the whole state.
        sharded.consolidate_state_dict(to=-1 if getattr(self.args, "save_on_each_node", False) else 0)
        try:
            return torch_save(self, output_dir)
        finally:
            sharded.drop_consolidated()

    trainer_class._save_optimizer_and_scheduler = _save_optimizer_and_scheduler
    # Every rank calls these; with sharded parameters they read or write every parameter.
    for name in ("save_model", "_load_from_checkpoint", "_load_best_model"):
        if hasattr(trainer_class, name):
            setattr(trainer_class, name, _whole_while(getattr(trainer_class, name), "model_wrapped",
                                                      unless_served=name == "save_model"))
    _WRAPPED.add(trainer_class)


def _read_alone(partition):
    """Whether a rank reads ``partition``'s parameters and optimizer state
    alone (its pieces are served: ``sharding.served``)."""
    served = getattr(partition, "served", None)
    return served is not None and served.serves


def _whole_while(method, wrapper, unless_served=False):
    """``method`` (every rank calls it) run with the parameters of the
    wrapper at attribute ``wrapper`` of its object whole meanwhile, when
    they are sharded: gathered on every rank, released after.
    ``unless_served``: not where the pieces are served (a read, which the
    saving rank makes alone)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        ddp = getattr(self, wrapper, None)
        whole = getattr(ddp, "whole_parameters", None)
        if unless_served and _read_alone(getattr(ddp, "_partition", None)):
            whole = None
        with whole() if whole is not None else contextlib.nullcontext():
            return method(self, *args, **kwargs)

    return call


def install_lightning(strategy_class):
    """Lightning with sharded parameters: every rank calls
    ``strategy_class.lightning_module_state_dict`` for a checkpoint (rank 0
    writes) and ``load_model_state_dict`` to resume from one (``fit(...,
    ckpt_path=)``, after the module was wrapped); both are wrapped (once)
    to run inside the wrapper's ``whole_parameters()``. And every rank calls its ``teardown`` at the
    end of ``fit``, which unwraps the module: there the parameters are
    gathered whole first, so the module holds the trained weights after
    ``fit`` as it does under Lightning's DDP."""
    if strategy_class in _LIGHTNING or not hasattr(strategy_class, "lightning_module_state_dict"):
        return
    teardown = strategy_class.teardown

    @functools.wraps(teardown)
    def whole_teardown(self, *args, **kwargs):
        assemble = getattr(getattr(self, "model", None), "_gather_whole", None)
        if assemble is not None:
            try:
                assemble()
            except Exception as error:  # (a failed job tears down too: its own error is the one to see)
                log.warning("gradsync: the parameters could not be gathered whole at teardown: %s", error)
        return teardown(self, *args, **kwargs)

    strategy_class.teardown = whole_teardown
    strategy_class.lightning_module_state_dict = _whole_while(strategy_class.lightning_module_state_dict, "model")
    if hasattr(strategy_class, "load_model_state_dict"):
        strategy_class.load_model_state_dict = _whole_while(strategy_class.load_model_state_dict, "model")
    _LIGHTNING.add(strategy_class)


def install_lightning_swa(callback_class):
    """Lightning's ``StochasticWeightAveraging`` with sharded parameters:
    every rank calls its ``transfer_weights(average, module)`` (at the last
    averaging epoch's end), which writes the averaged weights into the
    module's parameters; wrapped (once) to run inside the
    ``whole_parameters()`` of the live wrapper that holds them, so each
    rank's pieces take what was written (a write into a released parameter
    is refused: ``sharding.released``). Its updates of the average only
    read the module, alone, from every rank's pieces."""
    if callback_class in _LIGHTNING or not hasattr(callback_class, "transfer_weights"):
        return
    transfer = callback_class.transfer_weights

    @functools.wraps(transfer)
    def whole_transfer(src_pl_module, dst_pl_module):
        params = list(dst_pl_module.parameters())
        holders = [w for w in _clip.live() if w.parameters_sharded and w._holds_any(params)]
        with holders[0].whole_parameters() if holders else contextlib.nullcontext():
            return transfer(src_pl_module, dst_pl_module)

    callback_class.transfer_weights = staticmethod(whole_transfer)
    _LIGHTNING.add(callback_class)


def installed():
    """Whether some Trainer's saves are wrapped."""
    return bool(_WRAPPED)
