"""Sharded gradients (ZeRO-2) on the torch wrapper: ``shard_gradients=True``.

One line changes in a DDP script::

    model = DistributedDataParallel(model, shard_gradients=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)   # as before

An optimizer over a sharded wrapper's parameters is converted in place at
its first step (the global step hooks in ``ddp``, ``optimizer.sharded_optimizer_of``):
its groups then step this rank's pieces (``sharding.optimizer``); or build one
with ``model.shard_optimizer(torch.optim.AdamW, lr=1e-4)``. The runtime
reduce-scatters every bucket (the same actors and decisions as unsharded:
recompute, late arrivals, unused parameters, aborts), each rank receives
the averages of its partition (``sharding.partition``), its optimizer
steps that partition only (``sharding.optimizer``) and the updated parameters
are all-gathered. Parameters' ``.grad`` stay ``None``.

Clipping by norm is a collective over every rank's partition:
``model.clip_grad_norm_(max_norm)``, or torch's own functions however they
are reached (``sharding.clip`` redirects them for a sharded wrapper's tensors).

:class:`ShardedSurface` is the wrapper's public sharded API; each method is
a call into the wrapper's one sharded object, ``sharding.sharded.Sharded``
(``model._sharded``, ``None`` when not sharded), which owns all of the
state; this class holds none.
"""

import contextlib
import sys

import torch

from gradsync._errors import ConfigError
from gradsync.torch.sharding import trainer_saves
from gradsync.torch.sharding.materialize import place, target_device
from gradsync.torch.sharding.optimizer import sharded_optimizer_of

_NOT_SHARDED = ("shard_optimizer() needs a wrapper built with shard_gradients=True; this one all-reduces whole "
                "gradients: ")


def placed_meta(module, settings, device_ids):
    """A model built on the meta device (``sharding.materialize``): its
    parameters and buffers replaced by placeholders on the device they
    will live on; returns their forms for ``Sharded``. Only under
    ``shard_parameters``, and not in an elastic job yet."""
    if settings.get("shard_parameters") in (None, False):
        raise ConfigError(
            "the module is on the meta device: materialize its parameters first (model.to_empty(device=...) and "
            "their initialization), or wrap it with shard_parameters=True, which materializes it a unit at a "
            "time so that no rank holds it whole"
        )
    if settings.get("elastic") is not None:
        raise ConfigError(
            "a model on the meta device in an elastic job is not built yet: build it on its device, or "
            "restart the job from a sharded checkpoint (gradsync.torch.checkpoint) on a model built so"
        )
    return place(module, target_device(device_ids))


def install_framework_saves(parameters):
    """The frameworks already imported save a sharded wrapper whole
    (``sharding.trainer_saves``): HF ``Trainer``'s optimizer state, and
    with sharded ``parameters`` Lightning's model and its SWA transfer."""
    trainer = sys.modules.get("transformers.trainer")
    if trainer is not None and hasattr(trainer, "Trainer"):
        # HF Trainer's checkpoints then hold the whole optimizer state, with no callback.
        trainer_saves.install(trainer.Trainer)
    strategies = sys.modules.get("lightning.pytorch.strategies.ddp")
    if parameters and strategies is not None and hasattr(strategies, "DDPStrategy"):
        # Lightning's checkpoints then hold whole parameters.
        trainer_saves.install_lightning(strategies.DDPStrategy)
    averaging = sys.modules.get("lightning.pytorch.callbacks.stochastic_weight_avg")
    if parameters and averaging is not None and hasattr(averaging, "StochasticWeightAveraging"):
        # Its transfer of the averaged weights into the model then writes every rank's pieces.
        trainer_saves.install_lightning_swa(averaging.StochasticWeightAveraging)


class ShardedSurface:
    """The wrapper's sharded API (see the module docs); ``self._sharded``
    is the wrapper's ``Sharded``, or ``None``."""

    _sharded = None

    @property
    def _partition(self):
        """This rank's partition (``sharding.partition.Partition``), or ``None``: not sharded."""
        return self._sharded.partition if self._sharded is not None else None

    @property
    def sharded(self):
        """Whether gradients are sharded (``shard_gradients=True``, or ``shard_parameters=True``)."""
        return self._sharded is not None

    @property
    def parameters_sharded(self):
        """Whether parameters are sharded too (``shard_parameters=True``)."""
        return self._sharded is not None and self._sharded.residence is not None

    @property
    def parameter_bytes(self):
        """Bytes of parameter values this rank keeps between steps: every
        synchronized parameter whole, or, with ``shard_parameters=True``,
        its pieces of them (in an elastic job its buddy's too), which are
        all a released parameter keeps."""
        if self.parameters_sharded:
            return self._sharded.parameter_bytes
        return sum(p.numel() * p.element_size() for p in self._params)

    def parameter_forms(self):
        """Every synchronized parameter's whole shape and dtype, by name, as
        a tensor without data (``meta``), whether or not it is released."""
        return dict(zip(self._names, self._partition.forms))

    def abort_step(self, reason="out_of_memory"):
        """``StepControls.abort_step``; with sharded parameters, a rank that
        aborts before its first forward of the step still takes part in the
        step's parameter gather, as the others' forwards do (nobody waits
        for it); gathered by units, it serves the others' rounds once its
        zeros went out."""
        if self._sharded is not None:
            self._sharded.take_part()
        return super().abort_step(reason)

    def reset(self):
        """``StepControls.reset``; with sharded parameters every rank then
        releases them, whatever the failed step left (gathered or not), so
        that every rank's next forward gathers."""
        step = super().reset()
        self._join_notified = None  # (the step is made again: the joined ranks shadow it again)
        if self._sharded is not None:
            self._sharded.forget()
        return step

    def _shadow_gathers(self):
        """This rank shadows a step of the others (``join``): it takes part
        in that step's parameter gathers (``Sharded.shadow``)."""
        if self._sharded is not None:
            self._sharded.shadow()

    def _gather_whole(self):
        """Every parameter whole from now on (a collective), when sharded
        and released: what a framework that unwraps the module calls."""
        if self._sharded is not None:
            self._sharded.gather_whole()

    @contextlib.contextmanager
    def whole_parameters(self):
        """Within the block every parameter holds its whole values (a
        collective: every rank enters it at the same point), for what reads
        or writes every parameter between steps: ``state_dict()``, an
        evaluation by hand, ``load_state_dict()``. What is written into the
        parameters inside is kept. On a wrapper whose parameters are not
        sharded it does nothing."""
        if self._sharded is None or not self._sharded.whole_begins():
            yield self
            return
        try:
            yield self
        finally:
            self._sharded.whole_ends()

    def shard_optimizer(self, optimizer_class, params=None, **defaults):
        """The optimizer for a sharded wrapper: ``optimizer_class`` (an
        elementwise torch optimizer, e.g. ``torch.optim.AdamW``) over this
        rank's partition of ``params`` (default: every parameter the wrapper
        synchronizes; tensors or groups of them with options, as torch's
        optimizers take), built with ``defaults``. Every rank must build
        the same one (checked: :class:`gradsync.ConfigError` names the
        ranks that differ). See ``gradsync.torch.ShardedOptimizer``.

        ``optimizer_class`` may also be an optimizer already built over the
        model's parameters: it is converted in place (its groups step this
        rank's pieces, its state is sliced to them) and its
        ``ShardedOptimizer`` returned; stepping either is the same. An
        optimizer over a sharded wrapper's parameters that is never given
        here is converted the same way at its first step (so a script, HF
        ``Trainer`` or Lightning that builds its own optimizer needs no
        change), or when an elastic job tracks it."""
        if isinstance(optimizer_class, torch.optim.Optimizer):
            return sharded_optimizer_of(optimizer_class, self) or self._take_over(optimizer_class)
        if self._sharded is None:
            raise ConfigError(_NOT_SHARDED + "build torch's optimizer over model.parameters() as usual")
        return self._sharded.shard_optimizer(optimizer_class, params, defaults)

    def _take_over(self, optimizer):
        """``optimizer`` (built over this wrapper's parameters) converted in
        place to step this rank's pieces, for :meth:`shard_optimizer` and
        :func:`~gradsync.torch.sharding.optimizer.sharded_optimizer_of`: returns its ``ShardedOptimizer``."""
        if self._sharded is None:
            raise ConfigError(_NOT_SHARDED + "step the optimizer as it is")
        return self._sharded.take_over(optimizer)

    def zero_grad(self, set_to_none=True):
        """``Module.zero_grad``; sharded, it also drops (or zeroes) the
        gradients of this rank's pieces, where the averages live (HF
        ``Trainer`` clears gradients through the model, not the optimizer)."""
        super().zero_grad(set_to_none)
        if self._sharded is not None:
            self._sharded.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, params=None):
        """Clip the averaged gradients by their global norm, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does on
        an unsharded model: a sharded wrapper sums every rank's partition
        (a collective: every rank calls it), an unsharded one clips ``.grad``.
        Returns the total norm."""
        params = list(self._params if params is None else params)
        if self._sharded is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        return self._sharded.clip(params, max_norm, norm_type, error_if_nonfinite)

    def join_now(self):
        """This rank has run out of data (see ``StepControls.join_now``).
        Sharded, it still owns its partition: each step of the others it
        shadows, it takes part in their parameter gathers and steps that
        partition with their averages, until every rank has joined."""
        if self._sharded is None:
            return super().join_now()
        return self._sharded.join_now()

    def boundary_passed(self):
        """An elastic job's step boundary passed: the next step makes its
        collectives again, and optimizers built from now on check at once."""
        if self._sharded is not None:
            self._sharded.boundary_passed()

    def run_start_checks(self):
        """An elastic job's first step boundary: the checks its optimizers'
        construction held back, on every first member."""
        if self._sharded is not None:
            self._sharded.run_start_checks()
