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
"""

import contextlib
import logging
import sys

import torch

from gradsync._errors import ConfigError, StepFailedError
from gradsync.torch.sharding import clip as _clip
from gradsync.torch.sharding import trainer_saves
from gradsync.torch.sharding.materialize import (
    materialize,
    place,
    refuse_uninitializable,
    target_device,
    unit_modules,
)
from gradsync.torch.sharding.members import ShardedMembers
from gradsync.torch.sharding.optimizer import ShardedOptimizer, sharded_optimizer_of
from gradsync.torch.sharding.parameters import ShardedParameters
from gradsync.torch.sharding.partition import Partition
from gradsync.torch.sharding.served import PieceService
from gradsync.torch.sharding.unit_modules import ModuleHook
from gradsync.torch.sharding.units import UnitResidence

_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel

log = logging.getLogger("gradsync.elastic")

class Sharding(ShardedMembers):
    """The sharded part of ``DistributedDataParallel`` (see the module docs)."""

    _partition = None

    def _place_meta(self, module, settings, device_ids):
        """A model built on the meta device (``sharding.materialize``): its
        parameters and buffers replaced by placeholders on the device they
        will live on; returns their forms for :meth:`_start_sharding`. Only
        under ``shard_parameters``, and not in an elastic job yet."""
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

    def _start_sharding(self, reals, elastic, parameters=False, param_dtype=None, meta=None):
        """Lay this rank's partition over the runtime's plan (after the
        session started); ``reals(p)``: values of ``p`` in a bucket. In an
        ``elastic`` job each rank keeps its buddy's partition too, on
        another node when there is one (``sharding.reshard``).
        ``parameters``: the parameters are sharded too (their pieces own
        their values): ``sharding.units.choose``'s ``(units, names,
        modules)``; with more than one unit they are gathered a unit at a
        time (``sharding.units``, once :meth:`_open_lane` gave them their
        lane), else whole once per step (``sharding.parameters``);
        ``param_dtype``: the dtype their float32 and float64 parameters
        compute in (they are released now: the hooks, made next, see that
        dtype); ``meta``: a model built on the meta device, ``(forms,
        param_init)`` (:meth:`_place_meta`), materialized here a unit at a
        time."""
        if meta is not None:
            built = unit_modules(self.module, parameters[2])
            refuse_uninitializable(built, meta[1])
        self._partition = Partition(
            self._sync.session.plan(), self._params, self._names, self._rank, self._world, reals, self._states,
            buddy_stride=0 if elastic is None else elastic.buddy_stride, own_all=parameters, read=meta is None,
        )
        if parameters:
            units, names, modules = parameters
            self._partition.residence = (UnitResidence(self._partition, units, names, modules, self.module)
                                         if len(names) > 1 else ShardedParameters(self._partition))
            if meta is not None:
                forms, param_init = meta
                materialize(self._partition, self._partition.residence, built, forms, param_init, self._states)
            if param_dtype is not None:
                self._partition.residence.compute_in(param_dtype)
            residence = self._partition.residence
            # (An elastic job's servers follow its members: ShardedMembers._settle_members.)
            self._partition.served = PieceService(
                self._partition, self._store, self._prefix, self._timeout_s,
                epoch=0 if elastic is None else max(elastic.epoch, 0), abandon=self._abandon,
                publish=elastic is None or not elastic.joining,
            )
            self._sync.on_close.append(self._partition.served.close)
            self._direct = []
            handles = [
                # A released parameter is empty: a state dict reads it from every rank's pieces, a load writes them.
                self.module.register_state_dict_pre_hook(ModuleHook(lambda *_: residence.state_dict_begins())),
                self.module.register_state_dict_post_hook(ModuleHook(lambda *_: residence.state_dict_ended())),
                self.module.register_load_state_dict_pre_hook(ModuleHook(lambda *_: residence.load_begins())),
                self.module.register_load_state_dict_post_hook(ModuleHook(lambda *_: residence.load_ended())),
                # The module called itself, not through this wrapper (HF Trainer's evaluation does).
                self.module.register_forward_pre_hook(ModuleHook(self._direct_forward_begins)),
                self.module.register_forward_hook(ModuleHook(self._direct_forward_ends)),
            ]
            # Closed or retired, the wrapper takes them off: a newer wrapper of the module would meet them.
            self._sync.on_close.append(lambda: [handle.remove() for handle in handles])
        if elastic is not None:
            self._partition.recover = elastic.recover
            if not elastic.joining:  # (a joiner's optimizer is checked by the members' fingerprint)
                self._partition.start_checks = []
            # A replacement holds nothing until its first settlement.
            self._partition.sharded_step.holds = not elastic.joining
        _clip.track(self)
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

    @property
    def sharded(self):
        """Whether gradients are sharded (``shard_gradients=True``, or ``shard_parameters=True``)."""
        return self._partition is not None

    @property
    def parameters_sharded(self):
        """Whether parameters are sharded too (``shard_parameters=True``)."""
        return self._partition is not None and self._partition.residence is not None

    @property
    def parameter_bytes(self):
        """Bytes of parameter values this rank keeps between steps: every
        synchronized parameter whole, or, with ``shard_parameters=True``,
        its pieces of them (in an elastic job its buddy's too), which are
        all a released parameter keeps."""
        if self.parameters_sharded:
            return sum(piece.tensor.numel() * piece.tensor.element_size()
                       for piece in self._partition.every_held_piece())
        return sum(p.numel() * p.element_size() for p in self._params)

    def parameter_forms(self):
        """Every synchronized parameter's whole shape and dtype, by name, as
        a tensor without data (``meta``), whether or not it is released."""
        return dict(zip(self._names, self._partition.forms))

    def _shadow_gathers(self):
        """This rank ran out of data (``join``) and shadows a step of the
        others: with sharded parameters it takes part in that step's
        gathers, asking for nothing (``ShardedParameters.shadow``); gathered
        by units, its zeros for the step go out first, so that the others'
        reductions, which a unit's backward may wait for
        (``buckets_in_flight``), never wait for this rank. The shadow step
        that follows collects the step."""
        if self.parameters_sharded:
            self._sync.refuse_if_closed()
            self._partition.residence.shadow(self._sync.begin_shadow_step)

    def abort_step(self, reason="out_of_memory"):
        """``StepControls.abort_step``; with sharded parameters, a rank that
        aborts before its first forward of the step still takes part in the
        step's parameter gather, as the others' forwards do (nobody waits
        for it); gathered by units, it serves the others' rounds once its
        zeros went out (``serve_gathers``)."""
        if self.parameters_sharded:
            self._sync.refuse_if_closed()
            self._partition.residence.take_part()
        return super().abort_step(reason)

    def reset(self):
        """``StepControls.reset``; with sharded parameters every rank then
        releases them, whatever the failed step left (gathered or not), so
        that every rank's next forward gathers."""
        step = super().reset()
        self._join_notified = None  # (the step is made again: the joined ranks shadow it again)
        if self.parameters_sharded:
            self._partition.residence.forget()
        return step

    def _assemble(self):
        """Before a forward: parameter-sharded, the released parameters
        gathered whole (every rank's forward does it at the same point).
        Returns whether it gathered."""
        residence = self._partition.residence if self._partition is not None else None
        if residence is None:
            return False
        residence.forward_begins()
        if torch.is_grad_enabled() and residence.whole_in_own_dtype():
            # Whole in their own dtype (gathered for a framework's teardown): a step computes in param_dtype.
            self._sync.refuse_if_closed()
            residence.release(step_ended=False)
        if residence.whole:
            return False
        self._sync.refuse_if_closed()
        if residence.evaluates_alone():  # (no collective: the others need not evaluate with it)
            return residence.assemble_alone()
        return residence.assemble()

    def _direct_forward_begins(self, module, args):
        """A forward of the wrapped module itself, not through this wrapper
        (HF ``Trainer`` evaluates the bare module): under ``no_grad`` it
        gathers as the wrapper's forward does (every rank evaluates the
        same batches, as DDP's evaluation needs too); with gradients on it
        is refused, saying what to call."""
        if _TORCH_DDP._active_ddp_module is self:
            return
        residence = self._partition.residence
        if torch.is_grad_enabled():
            if residence.whole:
                return
            raise ConfigError(
                "the wrapped module was called directly, with gradients on, while its parameters are sharded "
                "(shard_parameters=True): call the wrapper, model(x), which gathers them and synchronizes the "
                "step; evaluate the module itself under torch.no_grad()"
            )
        self._direct.append(self._assemble())

    def _direct_forward_ends(self, module, args, output):
        """The end of :meth:`_direct_forward_begins`' forward: released again."""
        if _TORCH_DDP._active_ddp_module is self or torch.is_grad_enabled():
            return
        self._release_after(self._direct.pop() if self._direct else False, False)

    def _gather_whole(self):
        """Every parameter whole from now on (a collective), when sharded
        and released: what a framework that unwraps the module calls."""
        residence = self._partition.residence if self._partition is not None else None
        if residence is not None and not residence.whole:
            self._sync.refuse_if_closed()
            residence.assemble_all()

    def _release_after(self, gathered, grad_enabled):
        """After a forward: one without gradients (an evaluation) that
        gathered the parameters releases them again (no backward needs them)."""
        if self._partition is None or self._partition.residence is None:
            return
        if not grad_enabled and self._partition.residence.spoiled:
            log.warning("gradsync elastic: a member was lost during an evaluation forward's parameter gathers: its "
                        "output was computed with zeros where they failed; the job recovers in its next step")
        if gathered and not grad_enabled:
            self._partition.residence.release(step_ended=False)
        else:
            self._partition.residence.forward_ended()

    @contextlib.contextmanager
    def whole_parameters(self):
        """Within the block every parameter holds its whole values (a
        collective: every rank enters it at the same point), for what reads
        or writes every parameter between steps: ``state_dict()``, an
        evaluation by hand, ``load_state_dict()``. What is written into the
        parameters inside is kept. On a wrapper whose parameters are not
        sharded it does nothing."""
        residence = self._partition.residence if self._partition is not None else None
        if residence is not None and residence.spoiled:
            raise StepFailedError(f"the parameters could not be gathered whole: {residence.lost_gather()}")
        if residence is None or residence.whole:
            yield self
            return
        self._sync.refuse_if_closed()
        residence.assemble_all()
        try:
            yield self
        finally:
            residence.release(step_ended=False)
            if self._partition.served is not None:  # (what was written there is read at a new version)
                self._partition.served.wrote()

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
        if self._partition is None:
            raise ConfigError(
                "shard_optimizer() needs a wrapper built with shard_gradients=True; this one all-reduces whole "
                "gradients: build torch's optimizer over model.parameters() as usual"
            )
        self._sync.refuse_if_closed()
        return ShardedOptimizer(self._partition, self._names, self._states, optimizer_class, params,
                                name_of=self._name_of, **defaults)

    def _take_over(self, optimizer):
        """``optimizer`` (built over this wrapper's parameters) converted in
        place to step this rank's pieces, for :meth:`shard_optimizer` and
        :func:`~gradsync.torch.sharding.optimizer.sharded_optimizer_of`: returns its ``ShardedOptimizer``."""
        if self._partition is None:
            raise ConfigError(
                "shard_optimizer() needs a wrapper built with shard_gradients=True; this one all-reduces whole "
                "gradients: step the optimizer as it is"
            )
        self._sync.refuse_if_closed()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in optimizer.param_groups]
        return ShardedOptimizer(self._partition, self._names, self._states, type(optimizer), groups, adopt=optimizer,
                                name_of=self._name_of)

    def _name_of(self, tensor):
        """``tensor``'s name in the wrapped module, for errors."""
        for name, p in self.module.named_parameters():
            if p is tensor:
                return name
        return "(not a parameter of the wrapped module)"

    def zero_grad(self, set_to_none=True):
        """``Module.zero_grad``; sharded, it also drops (or zeroes) the
        gradients of this rank's pieces, where the averages live (HF
        ``Trainer`` clears gradients through the model, not the optimizer)."""
        super().zero_grad(set_to_none)
        if self._partition is not None:
            self._partition.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, params=None):
        """Clip the averaged gradients by their global norm, as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does on
        an unsharded model: a sharded wrapper sums every rank's partition
        (a collective: every rank calls it), an unsharded one clips ``.grad``.
        Returns the total norm."""
        params = list(self._params if params is None else params)
        if self._partition is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        index = self._partition.index_of
        return self._partition.clip({index[id(p)] for p in params if id(p) in index}, max_norm, norm_type,
                                    error_if_nonfinite)

    def join_now(self):
        """This rank has run out of data (see ``StepControls.join_now``).
        Sharded, it still owns its partition: each step of the others it
        shadows, it takes part in their parameter gathers and steps that
        partition with their averages, until every rank has joined."""
        if self._partition is None:
            return super().join_now()
        self._sync.refuse_if_closed()
        first, steps = self._sync.current_step, 0
        while True:
            self._shadow_gathers()
            report = self._sync.shadow_step()
            steps += 1
            if report.outcome == "all_joined":
                return {"first_step": first, "steps": steps}
