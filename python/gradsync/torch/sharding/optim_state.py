"""A sharded optimizer's state in the two forms it leaves a rank in.

Each rank's optimizer holds state for its pieces only (``sharding.partition``).
Outside, the state takes one of two forms:

* **whole**, torch's own format (:func:`full_state`, :func:`load_full`):
  per parameter, numbered across the groups in order as torch numbers
  them (frozen parameters in the groups count), its state tensors whole;
  collected from every rank's pieces per bucket (a collective), or, under
  parameter sharding, by one rank alone from every rank's piece server
  (:func:`full_state_alone`); loaded on any world size by slicing each
  rank's pieces out of it;
* **sharded**, for ``torch.distributed.checkpoint``
  (:func:`sharded_state_dict`, :func:`load_sharded`): per parameter and
  state key, one flat tensor of the parameter's element count whose shards
  are the ranks' pieces; every rank writes its own, and a load on any world
  size reads, for each rank's pieces, whichever saved pieces overlap them.

Both take ``opt``, a ``ShardedOptimizer``: its ``inner`` optimizer (state
keyed by piece tensors), its ``sharding.partition`` and ``_states`` (the state group
where the collectives travel), and its groups as ``entries`` (per group, a
wrapper parameter index or a frozen tensor, in the order torch numbers them).
"""

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
)
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from gradsync._errors import ConfigError
from gradsync.torch._grads import reals


def kind_of(value):
    """``"tensor"`` for per-element state, ``"scalar"`` for the rest (a step count)."""
    return "tensor" if torch.is_tensor(value) and value.dim() > 0 else "scalar"


def numbering(entries):
    """Every group's entries in torch's numbering, and the number of each
    wrapper parameter index among them: ``(flat entries, {index: number})``."""
    flat = [e for group in entries for e in group]
    return flat, {e: n for n, e in enumerate(flat) if isinstance(e, int)}


def groups_by_number(opt):
    """The optimizer's groups in torch's ``state_dict`` form: options and
    parameter numbers."""
    out, n = [], 0
    for group, entries in zip(opt.inner.param_groups, opt.entries):
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(n, n + len(entries)))})
        n += len(entries)
    return out


def _frozen_state(opt):
    """State the optimizer holds for frozen parameters (loaded with a whole
    state; never made here): ``{number: entry}``, the same on every rank."""
    flat, _ = numbering(opt.entries)
    return {n: dict(opt.inner.state[e]) for n, e in enumerate(flat)
            if not isinstance(e, int) and opt.inner.state.get(e)}


@torch.no_grad()
def full_state(opt):
    """Every rank's pieces of every state tensor, gathered per bucket into
    whole parameters: torch's ``{"state": ..., "param_groups": ...}``. A
    collective: every rank calls it."""
    part, inner = opt._partition, opt.inner
    _, number = numbering(opt.entries)
    # Which keys the state has, and their types, from every rank (a rank may hold no piece).
    kinds = {}
    for piece in part.pieces:
        for key, value in inner.state.get(piece.tensor, {}).items():
            kinds[key] = kind_of(value)
    merged = {}
    for rank_kinds in opt._states.distinct(sorted(kinds.items()) or None):
        merged.update(rank_kinds)
    state = {}
    for b, layout in enumerate(part.buckets):
        for key, kind in sorted(merged.items()):
            if kind == "scalar":
                continue
            mine = part.chunk(b, lambda piece: inner.state.get(piece.tensor, {}).get(key), torch.float64)
            full = opt._states.all_gather(mine)[: layout.numel].split(layout.sizes)
            for i, values in zip(layout.members, full):
                if i in number:
                    p = part.forms[i]
                    like = torch.view_as_real(p) if p.is_complex() else p
                    state.setdefault(number[i], {})[key] = values.to(like.dtype).reshape(like.shape).clone()
    present, scalars = present_and_scalars(opt, number)
    for n, values in scalars.items():
        state.setdefault(n, {}).update(values)
    state = {n: values for n, values in state.items() if n in present}
    state.update(_frozen_state(opt))
    return {"state": dict(sorted(state.items())), "param_groups": groups_by_number(opt)}


@torch.no_grad()
def full_state_alone(opt):
    """:func:`full_state` on this rank alone: every rank's pieces of every
    state tensor read from their piece servers at this rank's step
    (``sharding.served``), nothing asked of the others' training threads
    (nanoGPT's ``if master_process: torch.save({"optimizer":
    optimizer.state_dict(), ...})``)."""
    part = opt._partition
    _, number = numbering(opt.entries)
    state = {}
    for i, entry in part.served.read_state(list(number)).items():
        p = part.forms[i]
        like = torch.view_as_real(p) if p.is_complex() else p
        state[number[i]] = {key: value.to(like.dtype).reshape(like.shape) if kind_of(value) == "tensor" else value
                            for key, value in entry.items()}
    state.update(_frozen_state(opt))
    return {"state": dict(sorted(state.items())), "param_groups": groups_by_number(opt)}


def present_and_scalars(opt, number):
    """Which parameters (by number) have state on some rank (stepped at
    least once), and their scalars (a step count), sent by the rank holding
    each parameter's first piece: the same on every rank (a collective).

    Where every parameter's scalars are alike (one optimizer stepping every
    parameter the same number of times, as nearly always), a member sends a
    byte per parameter twice (the parameters with state, those with
    scalars) and the scalars once (``StateBroadcast.distinct``): nothing
    grows with the world. Only where they differ does every member send its
    own (O(world) a member)."""
    present, scalars = set(), {}
    for i, pieces in opt._partition.of_param.items():
        entry = opt.inner.state.get(pieces[0].tensor, {})
        if i not in number or not entry:
            continue
        present.add(number[i])
        if pieces[0].offset == 0:
            for key, value in entry.items():
                if kind_of(value) == "scalar":
                    scalars.setdefault(number[i], {})[key] = value.clone() if torch.is_tensor(value) else value
    states, count = opt._states, len(numbering(opt.entries)[0])
    try:
        alike = {tuple(sorted((key, _tagged(value)) for key, value in values.items())) for values in scalars.values()}
    except TypeError:  # (a scalar that is not hashable: taken as every rank's, as it is)
        alike = {_MIXED, None}
    agreed = states.distinct(next(iter(alike)) if len(alike) == 1 else (_MIXED if alike else None))
    if len(agreed) > 1 or agreed == [_MIXED]:  # (parameters' scalars differ: every rank's, as they are)
        for rank_present, rank_scalars in states.all_gather_objects((present, scalars)):
            present |= rank_present
            for n, values in rank_scalars.items():
                scalars.setdefault(n, {}).update(values)
        return present, scalars
    bits = torch.zeros(2 * count, dtype=torch.uint8)
    bits[list(present)] = 1
    bits[[count + n for n in scalars]] = 1
    states.reduce(bits, "max")
    present = set(bits[:count].nonzero().flatten().tolist())
    with_scalars = bits[count:].nonzero().flatten().tolist()
    return present, {n: {key: _untagged(value) for key, value in agreed[0]} for n in with_scalars}


#: What a rank offers :meth:`StateBroadcast.distinct` when its parameters' scalars differ.
_MIXED = "mixed"


def _tagged(value):
    """A scalar of an optimizer's state in a form equal on every rank where
    the values are: a 0-d tensor as its dtype, device type and number."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.device.type, value.item())
    return ("value", value)


def _untagged(tagged):
    """The scalar :func:`_tagged` made ``tagged`` of."""
    if tagged[0] == "tensor":
        _, dtype, device, number = tagged
        return torch.tensor(number, dtype=getattr(torch, dtype), device=device)
    return tagged[1]


def _check_groups(opt, saved_groups):
    """Refuse a state whose parameter groups differ from the optimizer's."""
    sizes = [len(g["params"]) for g in saved_groups]
    ours = [len(entries) for entries in opt.entries]
    if sizes != ours:
        names = [[opt._names[e] for e in entries if isinstance(e, int)][:3] for entries in opt.entries]
        raise ConfigError(
            f"the saved optimizer has parameter groups of {sizes} parameters, this one {ours} ({names}): it was "
            "saved for another model or other groups"
        )


@torch.no_grad()
def load_full(opt, state_dict):
    """Load a whole state (from :func:`full_state`, or the unsharded
    optimizer's, over the same parameters in the same groups), on any world
    size: each rank takes its pieces' slices (and a frozen parameter's
    state whole)."""
    part, inner = opt._partition, opt.inner
    groups = state_dict["param_groups"]
    _check_groups(opt, groups)
    flat, _ = numbering(opt.entries)
    index_of = dict(zip([n for g in groups for n in g["params"]], flat))
    loaded = {}
    for n, values in state_dict["state"].items():
        entry_of = index_of.get(int(n)) if not isinstance(n, str) or n.isdigit() else None
        if entry_of is None:
            raise ConfigError(f"optimizer state for parameter {n}, which no group holds")
        if not isinstance(entry_of, int):
            loaded[entry_of] = {k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()}
            continue
        i = entry_of
        p = part.forms[i]
        for piece in part.of_param.get(i, []) + part.buddy_of_param.get(i, []):
            entry = {}
            for key, value in values.items():
                if kind_of(value) == "tensor":
                    if value.numel() != reals(p):
                        raise ConfigError(
                            f"optimizer state {key!r} of parameter {opt._names[i]!r} has {value.numel()} values, "
                            f"the parameter {reals(p)}: it was saved for another model"
                        )
                    values_flat = (torch.view_as_real(value) if value.is_complex() else value).reshape(-1)
                    entry[key] = values_flat[piece.offset : piece.offset + piece.length].clone()
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            loaded[piece.tensor] = entry
    for group, saved_group in zip(inner.param_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    inner.state.clear()
    for tensor, entry in loaded.items():
        inner.state[tensor] = {k: (v.to(tensor.device) if kind_of(v) == "tensor" else v) for k, v in entry.items()}


# ---- the sharded form (torch.distributed.checkpoint) ----------------------------------------


def sharded(blocks, size, dtype, device, rank, group=None):
    """A ``ShardedTensor`` of ``size`` whose shards are ``blocks``: ``(rank,
    offsets, sizes, tensor or None)`` for every rank's block (this rank's,
    ``rank`` of ``group``, with its tensor; the others' as metadata only).
    Placed by global rank, as ``ShardedTensor`` wants (``group``'s rank
    ``r`` is process ``ranks[r]``)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else None
    shards, local = [], []
    for owner, offsets, sizes, tensor in blocks:
        placed = ranks[owner] if ranks is not None else owner
        meta = ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes),
                             placement=f"rank:{placed}/{device.type}")
        shards.append(meta)
        if owner == rank:
            local.append(Shard(tensor, meta))
    properties = TensorProperties(dtype=dtype)
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size(size), tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def flat_sharded(pieces, numel, dtype, device, rank, group=None):
    """A 1-D :func:`sharded` tensor of ``numel`` values whose shards are
    ``pieces``: ``(rank, offset, length, tensor or None)`` for every rank's piece."""
    return sharded([(owner, [offset], [length], tensor) for owner, offset, length, tensor in pieces], [numel],
                   dtype, device, rank, group)


def _template_entries(opt, template):
    """The keys to load, from a checkpoint's metadata (``number -> key ->
    metadata``): per wrapper parameter number, ``key -> (kind, dtype, metadata)``."""
    flat, _ = numbering(opt.entries)
    entries = {}
    for n, keys in template.items():
        if n >= len(flat):
            raise ConfigError(f"the checkpoint holds optimizer state for parameter {n}; this optimizer steps "
                              f"{len(flat)}: it was saved for another model")
        if not isinstance(flat[n], int):
            continue  # (a frozen parameter: no state is saved for it)
        entries[n] = {key: ("scalar" if len(getattr(m, "size", ())) == 0 else "tensor",
                            getattr(getattr(m, "properties", None), "dtype", None), m)
                      for key, m in keys.items()}
    return entries


def _saved_entries(opt, number):
    """The keys to save: per wrapper parameter number with state anywhere,
    ``key -> (kind, dtype)``, and the scalars (a collective)."""
    present, scalars = present_and_scalars(opt, number)
    kinds = {}
    for piece in opt._partition.pieces:
        for key, value in opt.inner.state.get(piece.tensor, {}).items():
            kinds[key] = (kind_of(value), value.dtype if torch.is_tensor(value) else None)
    merged = {}
    for rank_kinds in opt._states.distinct(sorted(kinds.items()) or None):
        merged.update(rank_kinds)
    entries = {
        n: {key: kind for key, kind in merged.items() if key in scalars.get(n, {}) or kind[0] != "scalar"}
        for n in sorted(present)
    }
    return entries, scalars


@torch.no_grad()
def sharded_state_dict(opt, template=None, group=None):
    """This rank's part of the optimizer state, for
    ``torch.distributed.checkpoint``: per parameter number, each state tensor
    as one flat ``ShardedTensor`` of the parameter's element count whose
    shards are every rank's pieces (this rank's hold its values), scalars
    whole; and the parameter groups. Every rank calls it (a collective).
    ``template``: the keys a checkpoint holds (number -> key -> DCP
    metadata), to build an empty state of this layout to load into.
    ``group``: the wrapper's ranks as torch knows them (the shards' placement)."""
    part = opt._partition
    flat, number = numbering(opt.entries)
    if template is None:
        entries, scalars = _saved_entries(opt, number)
    else:
        entries, scalars = _template_entries(opt, template), {}
    state = {}
    for n, keys in entries.items():
        i = flat[n]
        p = part.forms[i]
        mine = {piece.offset: piece for piece in part.of_param.get(i, ())}
        if template is not None and not mine:
            # Nothing of it to load here. (A ShardedTensor without a local
            # shard would be dropped by DCP's loader, which then takes the
            # checkpoint for an old one and refuses it: "Missing key".)
            continue
        out = state[str(n)] = {}
        for key, how in keys.items():
            kind, dtype = how[0], how[1]
            if kind == "scalar":
                if template is None:
                    out[key] = scalars[n][key]
                else:
                    meta = how[2]
                    out[key] = torch.zeros(meta.size, dtype=meta.properties.dtype) if hasattr(meta, "size") else 0
                continue
            pieces = []
            for owner, offset, length in part.every_piece(i):
                local = None
                if owner == part.rank:
                    piece = mine[offset]
                    held = opt.inner.state.get(piece.tensor, {}).get(key) if template is None else None
                    local = held.reshape(-1) if held is not None else torch.zeros(length, dtype=dtype)
                pieces.append((owner, offset, length, local))
            out[key] = flat_sharded(pieces, reals(p), dtype, part.params[i].device, part.rank, group)
    return {"state": state, "param_groups": groups_by_number(opt)}


@torch.no_grad()
def load_sharded(opt, state_dict, copy=True):
    """Load :func:`sharded_state_dict`'s form (filled by
    ``torch.distributed.checkpoint.load``): each piece takes its shard, a
    copy of it, or, not ``copy``, the shard's own tensor (a state dict
    built to be loaded once: no second copy of the state at the peak)."""
    _check_groups(opt, state_dict["param_groups"])
    flat, _ = numbering(opt.entries)
    inner = opt.inner
    inner.state.clear()
    for n, values in state_dict["state"].items():
        i = flat[int(n)]
        for piece in opt._partition.of_param.get(i, ()):
            entry = {}
            for key, value in values.items():
                if hasattr(value, "local_shards"):
                    (shard,) = [s for s in value.local_shards() if s.metadata.shard_offsets[0] == piece.offset]
                    entry[key] = (shard.tensor.clone() if copy else shard.tensor).to(piece.tensor.device)
                else:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
            inner.state[piece.tensor] = entry
    for group, saved in zip(inner.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
