"""Sharded checkpoints of a sharded wrapper through ``torch.distributed.checkpoint``.

::

    from gradsync.torch import checkpoint

    checkpoint.save("ckpt/step-1000", model, optimizer)    # every rank: each writes its partition
    ...
    checkpoint.load("ckpt/step-1000", model, optimizer)    # every rank, on any world size

The checkpoint is an ordinary DCP directory: the model's ``state_dict()``
(whole on every rank, written once) under ``"model"``, the optimizer's state
under ``"optimizer"``. Each state tensor of a parameter (AdamW's
``exp_avg``, ``exp_avg_sq``) is saved as one flat tensor of the parameter's
element count, of which each rank writes the pieces it holds
(:meth:`ShardedOptimizer.sharded_state_dict`: a ``ShardedTensor`` whose
shards are the pieces); loading reads, for each rank's pieces under the
current world size and bucket layout, the ranges it needs, whichever ranks
wrote them. Scalars (the step count) and the parameter groups are saved
whole. A checkpoint of other parameters or groups is refused with a
:class:`gradsync.ConfigError` that names what differs.

Without sharding, ``optimizer.consolidate_state_dict(to=0)`` and
``state_dict()`` give torch's own format (see ``ShardedOptimizer``).
"""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from gradsync._errors import ConfigError


def _sharded(model, optimizer):
    """``optimizer``'s ``ShardedOptimizer`` (converted now if it was not yet)."""
    from gradsync.torch._sharding import sharded_optimizer_of

    sharded = sharded_optimizer_of(optimizer, model)
    if sharded is None:
        raise ConfigError("gradsync.torch.checkpoint saves and loads sharded models: build the wrapper with "
                          "shard_gradients=True (an unsharded optimizer saves with torch.save(optimizer.state_dict()))")
    return sharded


def save(checkpoint_id, model, optimizer):
    """Write ``model`` (a sharded ``DistributedDataParallel``) and its
    ``optimizer`` (any optimizer over its parameters, converted) to
    ``checkpoint_id`` (a directory). Every rank calls it."""
    optimizer = _sharded(model, optimizer)
    dcp.save({"model": model.module.state_dict(), "optimizer": optimizer.sharded_state_dict()},
             checkpoint_id=checkpoint_id)


def load(checkpoint_id, model, optimizer):
    """Read ``checkpoint_id`` (written by :func:`save`, on any world size)
    into ``model`` and ``optimizer``. Every rank calls it."""
    optimizer = _sharded(model, optimizer)
    metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    saved = {fqn[len("model."):] for fqn in metadata.state_dict_metadata if fqn.startswith("model.")}
    ours = set(model.module.state_dict())
    if saved != ours:
        missing, extra = sorted(ours - saved)[:3], sorted(saved - ours)[:3]
        raise ConfigError(
            f"{checkpoint_id} holds another model: it lacks {missing or 'nothing'} and has {extra or 'nothing'} "
            "that this model does not; load it into the model it was saved from"
        )
    keys = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        parts = fqn.split(".")
        if parts[:2] == ["optimizer", "state"] and len(parts) == 4:
            keys.setdefault(int(parts[2]), {})[parts[3]] = meta
    state = {"model": model.module.state_dict(), "optimizer": optimizer.sharded_state_dict(template=keys)}
    dcp.load(state, checkpoint_id=checkpoint_id)
    model.module.load_state_dict(state["model"])
    optimizer.load_sharded_state_dict(state["optimizer"])


def flat_sharded(pieces, numel, dtype, device, group=None):
    """A 1-D ``ShardedTensor`` of ``numel`` values whose shards are
    ``pieces``: ``(rank, offset, tensor or None)`` for every rank's piece
    (this rank's with its tensor, the others' as metadata only)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    shards, local = [], []
    for owner, offset, length, tensor in pieces:
        meta = ShardMetadata(shard_offsets=[offset], shard_sizes=[length], placement=f"rank:{owner}/{device.type}")
        shards.append(meta)
        if owner == rank:
            local.append(Shard(tensor, meta))
    properties = TensorProperties(dtype=dtype)
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size([numel]), tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def check_layout(saved_groups, group_sizes, names_of_group):
    """Refuse a checkpoint whose parameter groups differ from the optimizer's."""
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != group_sizes:
        raise ConfigError(
            f"the checkpoint's optimizer has parameter groups of {sizes} parameters, this one {group_sizes} "
            f"({names_of_group}): it was saved for another model or other groups"
        )
