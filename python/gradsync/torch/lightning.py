"""gradsync in Lightning: a ``DDPStrategy`` whose model wrapper is gradsync's.

Lightning's extension point for DDP is the strategy::

    from gradsync.torch.lightning import GradsyncDDPStrategy
    trainer = lightning.Trainer(strategy=GradsyncDDPStrategy(), accelerator="cpu", devices=2)

It is Lightning's own ``DDPStrategy`` (launching, process group, sampler,
checkpointing, ``no_sync`` during gradient accumulation) with one change: the
model is wrapped in :class:`gradsync.torch.DistributedDataParallel`. The
strategy's keyword arguments are ``DDPStrategy``'s, plus gradsync's own
settings (``timeout``, ``abort_policy``, ``wire_dtype``, ``record_timeline``).
``Trainer(strategy="ddp")`` after :func:`gradsync.torch.replace_ddp` gives the
same. Importing this module needs ``lightning``.
"""

from lightning.pytorch.strategies import DDPStrategy

from gradsync.torch.ddp import DistributedDataParallel


class GradsyncDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with gradsync's ``DistributedDataParallel``."""

    def __init__(self, *args, **kwargs):
        self._gradsync_settings = {k: kwargs.pop(k) for k in DistributedDataParallel.GRADSYNC_SETTINGS if k in kwargs}
        super().__init__(*args, **kwargs)

    def _setup_model(self, model):
        return DistributedDataParallel(
            module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs, **self._gradsync_settings
        )
