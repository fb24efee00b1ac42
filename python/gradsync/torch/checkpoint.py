"""Sharded checkpoints of a sharded wrapper through ``torch.distributed.checkpoint``.

::

    from gradsync.torch import checkpoint

    checkpoint.save("ckpt/step-1000", model, optimizer)    # every rank: each writes its partition
    ...
    checkpoint.load("ckpt/step-1000", model, optimizer)    # every rank, on any world size

The checkpoint is an ordinary DCP directory: the model's ``state_dict()``
under ``"model"``, the optimizer's state under ``"optimizer"``. With
``shard_parameters=True`` no rank gathers the model for it: each writes the
blocks of its pieces of every parameter (``sharding.model_state``) and
reads back only those of its pieces under the world it loads on, so a model
too big for one rank (built on the meta device) is saved and loaded. The
entries have the parameters' own keys, shapes and dtypes (a complex tensor
as its real view) whichever way the model was held: a checkpoint of
``shard_gradients=True`` (parameters whole on every rank, written once)
loads under ``shard_parameters=True`` and back. Each state tensor of a parameter (AdamW's
``exp_avg``, ``exp_avg_sq``) is saved as one flat tensor of the parameter's
element count, of which each rank writes the pieces it holds
(:meth:`ShardedOptimizer.sharded_state_dict`: a ``ShardedTensor`` whose
shards are the pieces); loading reads, for each rank's pieces under the
current world size and bucket layout, the ranges it needs, whichever ranks
wrote them. Scalars (the step count) and the parameter groups are saved
whole. A checkpoint of other parameters or groups is refused with a
:class:`gradsync.ConfigError` that names what differs.

The ranks are the wrapper's: its ``process_group`` (a subset of the
processes too), or in an elastic job its current members (gradsync makes
torch's default group over them, ``_torch_group``). An elastic job's
checkpoint also keeps where the job stands (``Elastic.progress``: the next
step, the steps applied, their history), and loading it into an elastic job
goes on from there (``Elastic.restore``): the way back after
``MembershipError(kind="shard_lost")``, on however many members remain::

    for step in elastic.steps(total):
        ...
        optimizer.step()
        if step % 500 == 0:
            checkpoint.save(f"ckpt/{step}", model, optimizer)

    # the restarted job, any number of members:
    checkpoint.load("ckpt/1500", model, optimizer)    # before elastic.steps(total): it goes on at step 1501

Without sharding, ``optimizer.consolidate_state_dict(to=0)`` and
``state_dict()`` give torch's own format (see ``ShardedOptimizer``).
"""

import contextlib
import json
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gradsync._errors import CheckpointError, ConfigError
from gradsync.torch.sharding import model_state
from gradsync.torch.sharding.optimizer import sharded_optimizer_of

#: Where an elastic job's progress (``Elastic.progress``, as JSON) lies in the checkpoint.
_PROGRESS = "elastic_progress"


def _sharded(model, optimizer):
    """``optimizer``'s ``ShardedOptimizer`` (converted now if it was not
    yet), or ``None`` without one (the model of a sharded wrapper only)."""
    sharded = None if optimizer is None else sharded_optimizer_of(optimizer, model)
    if getattr(model, "_partition", None) is None or (optimizer is not None and sharded is None):
        raise ConfigError("gradsync.torch.checkpoint saves and loads sharded models: build the wrapper with "
                          "shard_gradients=True (an unsharded optimizer saves with torch.save(optimizer.state_dict()))")
    return sharded


def save(checkpoint_id, model, optimizer=None):
    """Write ``model`` (a sharded ``DistributedDataParallel``) and its
    ``optimizer`` (any optimizer over its parameters, converted; ``None``:
    the model only, e.g. an averaged model inside
    ``ShardedAveragedModel.applied()``) to ``checkpoint_id`` (a
    directory); in an elastic job, where the job stands too. Every rank
    of the wrapper calls it, between steps. With sharded parameters each
    rank writes its pieces: nothing is gathered."""
    optimizer = _sharded(model, optimizer)
    group = model.torch_group()
    with _model_state(model, group, to_load=False) as (module_state, _):
        state = {"model": module_state}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(group=group)
        elastic = model._sync.elastic
        if elastic is not None:
            state[_PROGRESS] = json.dumps(elastic.progress())
        with _failures_raised("writing", checkpoint_id):
            dcp.save(state, checkpoint_id=checkpoint_id, process_group=group)


def load(checkpoint_id, model, optimizer=None):
    """Read ``checkpoint_id`` (written by :func:`save`, on any world size)
    into ``model`` and ``optimizer`` (``None``: the model only); an
    elastic job then goes on at the
    step after the saved one (call it before ``elastic.steps``). Every rank
    of the wrapper calls it, between steps. With sharded parameters each
    rank reads its pieces' values only: nothing is gathered."""
    optimizer = _sharded(model, optimizer)
    group = model.torch_group()
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    with _model_state(model, group, to_load=True) as (module_state, keys):
        saved = {fqn[len("model."):] for fqn in metadata.state_dict_metadata if fqn.startswith("model.")}
        if saved != keys:
            missing, extra = sorted(keys - saved)[:3], sorted(saved - keys)[:3]
            raise ConfigError(
                f"{checkpoint_id} holds another model: it lacks {missing or 'nothing'} and has {extra or 'nothing'} "
                "that this model does not; load it into the model it was saved from"
            )
        template = {}
        for fqn, meta in metadata.state_dict_metadata.items():
            parts = fqn.split(".")
            if parts[:2] == ["optimizer", "state"] and len(parts) == 4:
                template.setdefault(int(parts[2]), {})[parts[3]] = meta
        state = {"model": module_state}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(template=template, group=group)
        elastic = model._sync.elastic
        if elastic is not None and _PROGRESS in metadata.state_dict_metadata:
            state[_PROGRESS] = ""
        # (DCP writes the pieces in place: no other rank's read copies them meanwhile, sharding.served)
        gate = model._partition.writing_pieces() if model._partition is not None else contextlib.nullcontext()
        with _failures_raised("reading", checkpoint_id), gate:
            dcp.load(state, checkpoint_id=checkpoint_id, process_group=group)
    if optimizer is not None:
        optimizer.load_sharded_state_dict(state["optimizer"], copy=False)  # (its tensors are this load's own)
    if _PROGRESS in state:
        elastic.restore(json.loads(state[_PROGRESS]))


@contextlib.contextmanager
def _model_state(model, group, to_load):
    """The wrapped module's state for DCP, and its keys: the module's own
    ``state_dict()`` while its parameters are whole (unsharded, before the
    first step, inside ``whole_parameters``), else every sharded
    parameter as every rank's pieces (``sharding.model_state``). To load
    (``to_load``), every tensor is the module's or a piece's own memory,
    which DCP fills in place; what it replaces in the dict instead (extra
    state) the module takes at the block's end."""
    part = model._partition
    residence = part.residence if part is not None else None
    if residence is None or residence.whole:
        own = model.module.state_dict()
        state = {key: model_state.saved_form(value) for key, value in own.items()}
        yield state, set(own)
        if to_load:
            model.module.load_state_dict({key: own[key] if torch.is_tensor(own[key]) else state[key] for key in own})
        return
    with residence.reading_pieces():
        state, keys = model_state.pieces_state(model.module, part, group, to_load)
        extra = [key for key, value in state.items() if not torch.is_tensor(value)]
        yield state, keys
        if to_load and extra:
            model.module.load_state_dict({key: state[key] for key in extra}, strict=False)


@contextlib.contextmanager
def _failures_raised(doing, checkpoint_id):
    """torch's ``CheckpointException`` (a ``BaseException``) as a
    :class:`gradsync.CheckpointError` naming the failed ranks and the first
    one's error."""
    try:
        with warnings.catch_warnings():
            # The pieces are blocks of no even cut, which a DTensor cannot describe: a ShardedTensor can.
            warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
            yield
    except CheckpointException as e:
        ranks = sorted(e.failures)
        error = e.failures[ranks[0]][0] if ranks else e
        raise CheckpointError(
            f"{doing} the sharded checkpoint {checkpoint_id} failed on ranks {ranks}: rank {ranks[0] if ranks else '?'}:"
            f" {type(error).__name__}: {error}", ranks
        ) from e
