"""Make code that builds ``torch.nn.parallel.DistributedDataParallel`` get gradsync.

HF ``Trainer`` (through Accelerate), Lightning's ``ddp`` strategy and many
training scripts construct torch's class themselves. After
:func:`replace_ddp`, constructing torch's ``DistributedDataParallel`` builds
gradsync's instead, however the class was imported (``torch.nn.parallel``,
``torch.nn.parallel.distributed``, a name imported before the call). gradsync's
class is a subclass of torch's, so ``isinstance(model, DistributedDataParallel)``
and unwrapping through ``model.module`` keep working in those libraries.
:func:`restore_ddp` (or leaving the ``with`` block) undoes it.
"""

import contextlib
import logging

import torch

from gradsync._errors import ConfigError
from gradsync.torch.ddp import DistributedDataParallel

log = logging.getLogger("gradsync.torch")

_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel
# What torch's class defined as __new__ before replace_ddp (None: inherited).
_SAVED = []


def replace_ddp(**settings):
    """From now on, ``torch.nn.parallel.DistributedDataParallel(module, ...)``
    builds ``gradsync.torch.DistributedDataParallel(module, ...)``. ``settings``
    are gradsync's own keyword arguments (``timeout``, ``abort_policy``,
    ``wire_dtype``, ``record_timeline``) for the wrappers built that way.
    Returns a context manager that restores torch's class on exit; or call
    :func:`restore_ddp`. Calling it again replaces the settings."""
    unknown = set(settings) - set(DistributedDataParallel.GRADSYNC_SETTINGS)
    if unknown:
        raise ConfigError(
            f"replace_ddp: unknown settings {sorted(unknown)}; use {list(DistributedDataParallel.GRADSYNC_SETTINGS)}"
        )
    if not _SAVED:
        _SAVED.append(_TORCH_DDP.__dict__.get("__new__"))

    def __new__(cls, *args, **kwargs):
        if cls is _TORCH_DDP:
            cls = DistributedDataParallel
            # The instance is gradsync's; Python then runs gradsync's __init__.
        return torch.nn.Module.__new__(cls)

    _TORCH_DDP.__new__ = staticmethod(__new__)
    DistributedDataParallel._replace_settings = dict(settings)
    log.info("gradsync replaces torch.nn.parallel.DistributedDataParallel (settings %s)", settings)
    return _Restorer()


def restore_ddp():
    """Undo :func:`replace_ddp`: torch's class builds torch's DDP again.
    Wrappers built meanwhile stay gradsync's. Does nothing if not replaced."""
    if not _SAVED:
        return
    saved = _SAVED.pop()
    if saved is None:
        del _TORCH_DDP.__new__
    else:
        _TORCH_DDP.__new__ = saved
    DistributedDataParallel._replace_settings = {}


def ddp_replaced():
    """Whether :func:`replace_ddp` is in effect."""
    return bool(_SAVED)


class _Restorer(contextlib.AbstractContextManager):
    """Returned by :func:`replace_ddp`; ``with`` restores torch's class on exit."""

    def __exit__(self, *exc):
        restore_ddp()
        return False
