"""gradsync for PyTorch.

:class:`DistributedDataParallel` is a drop-in for
``torch.nn.parallel.DistributedDataParallel`` (and a subclass of it): the same
constructor, ``.grad`` averaged when ``loss.backward()`` returns, ``no_sync()``
for gradient accumulation, ``with model.join():`` for uneven inputs, torch's
built-in comm hooks, ``torch.compile`` in either order, plus what DDP cannot
do: reentrant checkpointing, shared weights, parameters unused on some or all
ranks and several forwards per backward, all exact with overlap from the first
step; ``abort_step()`` after an out-of-memory error; errors that name ranks.

Code that builds torch's class itself (HF ``Trainer`` through Accelerate,
Lightning's ``ddp`` strategy) gets gradsync after one line::

    gradsync.torch.replace_ddp()

(:func:`restore_ddp` undoes it; for Lightning there is also
:class:`gradsync.torch.lightning.GradsyncDDPStrategy`.)

Models whose gradients and optimizer state should not be whole on every
rank shard them (ZeRO-2): ``DistributedDataParallel(model,
shard_gradients=True)`` and ``model.shard_optimizer(torch.optim.AdamW, ...)``
(:class:`ShardedOptimizer`; see ``gradsync.torch.sharding.wrapper``);
``shard_parameters=True`` shards the parameters too, released between steps
(``gradsync.torch.sharding.parameters``); their EMA or SWA is
:class:`ShardedAveragedModel`, each rank averaging its pieces.

An elastic job (a lost rank does not end it; a replacement joins) is
:class:`Elastic`, launched with ``python -m gradsync.launch`` (see
:mod:`gradsync.torch.elastic`).
"""

from gradsync.torch._replace import ddp_replaced, replace_ddp, restore_ddp
from gradsync.torch.sharding.averaged import ShardedAveragedModel
from gradsync.torch.sharding.optimizer import ELEMENTWISE, ShardedOptimizer, elementwise
from gradsync.torch.ddp import DistributedDataParallel
from gradsync.torch.elastic import Elastic, MembershipEvent

__all__ = [
    "ELEMENTWISE",
    "DistributedDataParallel",
    "Elastic",
    "MembershipEvent",
    "ShardedAveragedModel",
    "ShardedOptimizer",
    "ddp_replaced",
    "elementwise",
    "replace_ddp",
    "restore_ddp",
]
