"""What a sharded wrapper's settings mean, checked before anything is built.

``DistributedDataParallel`` reads its sharding settings here: which
settings a sharded wrapper refuses (:func:`refuse`), the dtype a
parameter-sharded step computes in (``param_dtype``: :func:`param_dtype_of`),
how units pace their memory (``buckets_in_flight``, ``prefetch_units``:
:func:`pacing_of`) and whether a bucket's collective is a reduce-scatter
(:func:`scatters`). Each refusal is a :class:`gradsync.ConfigError` saying
what to set instead.
"""

import torch

from gradsync._errors import ConfigError

#: Whether a sharded wrapper's buckets are reduce-scattered on gloo too. Off:
#: gloo's reduce-scatter costs more than its all-reduce (24 MB over 4 CPU
#: ranks: 72 ms against 65 ms; a sharded step's backward 330 ms against 255
#: ms), so on gloo each rank all-reduces and keeps its partition; NCCL's
#: reduce-scatter moves half an all-reduce's bytes and is used. The tests
#: turn it on to check the reduce-scatter path on CPU.
GLOO_REDUCE_SCATTER = False


def scatters(path, device):
    """Whether a sharded wrapper's bucket collective is a reduce-scatter
    (see :data:`GLOO_REDUCE_SCATTER`): on the device plane of a CUDA device
    (NCCL), or anywhere when the tests ask for it."""
    return GLOO_REDUCE_SCATTER or (path.buckets == "device" and device.type == "cuda")


def refuse(settings, sparse_names):
    """The settings a sharded wrapper cannot take (yet), refused before
    anything is built."""
    if sparse_names:
        # Name the setting the program set: shard_parameters shards the gradients too.
        units = settings.get("shard_parameters")
        setting = "shard_gradients=True" if units in (None, False) else f"shard_parameters={units!r}"
        raise ConfigError(
            f"{setting} and sparse gradients ({sparse_names[:3]}): sharding partitions dense buckets; "
            "build the embeddings with sparse=False"
        )
    if settings.get("param_dtype") is not None and settings.get("elastic") is not None:
        raise ConfigError(
            "param_dtype in an elastic job is not built yet: the parameters are released when the model is "
            "wrapped, before the job's first step boundary sends rank 0's values to every member. Leave param_dtype "
            "unset (shard_parameters=True works in an elastic job) and compute in bfloat16 with torch.autocast"
        )


#: ``param_dtype``'s values, by name.
_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def param_dtype_of(settings):
    """The dtype a parameter-sharded wrapper's float32 and float64
    parameters compute in (``param_dtype``), or ``None``: their own."""
    value = settings.get("param_dtype")
    if value is None:
        return None
    if settings.get("shard_parameters") in (None, False):
        raise ConfigError(
            "param_dtype is the dtype of the copy a step gathers from the sharded parameters: it needs "
            "shard_parameters=True. For an unsharded model compute in half precision with torch.autocast"
        )
    dtype = _PARAM_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype not in _PARAM_DTYPES.values():
        raise ConfigError(
            f"param_dtype {value!r}: use torch.bfloat16 or torch.float16 (the pieces, their gradients' average "
            "and the optimizer stay in the parameters' own dtype)"
        )
    return dtype


#: ``buckets_in_flight`` when a model with blocks does not set it, by the
#: type of its device, so that no rank holds more whole buckets than FSDP2
#: would: on a CUDA device one unit's bucket may still reduce (on the
#: communicator's stream) while the next unit's backward computes, as
#: FSDP2's reduce-scatter stream does; elsewhere (the CPU, where the
#: reductions share the cores with backward and FSDP2's reduce-scatter
#: blocks it) none. A communicator that lags never holds every unit's
#: bucket whole at once. ``benches/torch/sharded_step.py`` times both.
BUCKETS_IN_FLIGHT = {"cuda": 1}


def pacing_of(settings, units, device_type="cpu"):
    """How a parameter-sharded wrapper's units pace their memory:
    ``(buckets_in_flight, prefetch_units)``. ``buckets_in_flight``: the most
    buckets still in their reduction when a unit's backward begins, or
    ``None`` (unless given, on a model with blocks on a ``device_type``
    device: :data:`BUCKETS_IN_FLIGHT`'s, else 0); ``prefetch_units``:
    whether the next unit is gathered while one computes
    (``sharding.units``). Both need units to act on."""
    blocks = bool(units) and len(units[1]) >= 2
    in_flight = settings.get("buckets_in_flight", BUCKETS_IN_FLIGHT.get(device_type, 0) if blocks else None)
    prefetch = settings.get("prefetch_units", True)
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0):
        raise ConfigError(
            f"buckets_in_flight={in_flight!r}: give a whole number, 0 or more (0: each unit's gradients are "
            "reduced before the next unit's backward; None: no limit)"
        )
    if not isinstance(prefetch, bool):
        raise ConfigError(f"prefetch_units={prefetch!r}: True (gather the next unit while one computes) or False")
    asked = [name for name, set_ in (("buckets_in_flight", in_flight is not None), ("prefetch_units", not prefetch))
             if set_]
    if asked and not blocks:
        raise ConfigError(
            f"{asked[0]} paces the gathers and reductions of units, a block at a time: it needs "
            "shard_parameters=True on a model with blocks (or shard_parameters=[block, ...])"
        )
    return in_flight, prefetch
