"""gradsync for PyTorch.

:class:`DistributedDataParallel` is a drop-in for
``torch.nn.parallel.DistributedDataParallel``: the same constructor, ``.grad``
averaged when ``loss.backward()`` returns, ``no_sync()`` for gradient
accumulation, plus what DDP cannot do: reentrant checkpointing, shared
weights, parameters unused on some or all ranks and several forwards per
backward, all exact with overlap from the first step; ``abort_step()`` after an
out-of-memory error; ``join()`` for uneven inputs; errors that name ranks.
"""

from gradsync.torch.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
