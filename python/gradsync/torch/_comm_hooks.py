"""DDP communication hooks, mapped onto gradsync's wire types.

gradsync runs its own collectives in Rust, so it cannot call an arbitrary
Python comm hook per bucket. torch's built-in hooks only choose how a bucket
travels, and each has an exact gradsync equivalent: the data buckets' wire
type (control words and corrections always travel exactly). Anything else is
refused with an error that names what is supported.
"""

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradsync._errors import ConfigError

# A hook, or a built-in hook type, and the wire type it stands for.
_WIRE_OF_HOOK = {
    default_hooks.allreduce_hook: "float32",
    default_hooks.fp16_compress_hook: "float16",
    default_hooks.bf16_compress_hook: "bfloat16",
}
_WIRE_OF_BUILTIN = {
    dist.BuiltinCommHookType.ALLREDUCE: "float32",
    dist.BuiltinCommHookType.FP16_COMPRESS: "float16",
}

SUPPORTED = (
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook (float32 buckets), "
    "fp16_compress_hook (float16 buckets) and bf16_compress_hook (bfloat16 buckets), with state=None; "
    "or the wire_dtype= argument of gradsync's DistributedDataParallel"
)


def _name(hook):
    return getattr(hook, "__qualname__", None) or repr(hook)


def wire_of_hook(state, hook):
    """The wire type ``register_comm_hook(state, hook)`` stands for."""
    wire = _WIRE_OF_HOOK.get(hook)
    if wire is None:
        raise ConfigError(
            f"comm hook {_name(hook)}: gradsync all-reduces in Rust and cannot run a Python comm hook per "
            f"bucket; supported: {SUPPORTED}"
        )
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise ConfigError(f"comm hook {_name(hook)} with state {state!r}: use state=None ({SUPPORTED})")
    return wire


def wire_of_builtin(hook_type):
    """The wire type of a ``dist.BuiltinCommHookType``."""
    wire = _WIRE_OF_BUILTIN.get(hook_type)
    if wire is None:
        raise ConfigError(f"built-in comm hook {hook_type}: supported: {SUPPORTED}")
    return wire
