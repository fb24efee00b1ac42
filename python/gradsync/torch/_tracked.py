"""What an elastic job's members hand each other of the objects a script
tracks (``Elastic.track``: the wrapped model, the optimizer, an LR
scheduler, a grad scaler ...).

* A joiner and the members compare a **fingerprint** of them (names,
  shapes, dtypes, optimizer kind) before it is admitted.
* After a change of members, the one furthest on **packs** their state
  (with the step counter and the history) and the others **unpack** it.

A sharded optimizer's state and a parameter-sharded model's pieces are not
in either: they move with the members (``sharding.reshard``), so a joiner
never receives a whole copy.
"""

import hashlib
import io

import torch

from gradsync._errors import MembershipError
from gradsync.torch.sharding.optimizer import converted


def fingerprint(tracked):
    """What a joiner must share with the members: ``tracked``'s (name ->
    object) state layout (names, shapes, dtypes, optimizer kind), as text."""
    digest = hashlib.sha256()
    parts = []
    for name, obj in sorted(tracked.items()):
        kind = type(obj).__name__
        if isinstance(obj, torch.nn.Module):
            state = _state_forms(obj)
            shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in state.items()]
            digest.update(repr(shapes).encode())
            elements = sum(t.numel() for t in state.values())
            parts.append(f"{name}: {kind} with {len(shapes)} tensors, {elements} elements")
        elif sharded := converted(obj):
            groups = [len(entries) for entries in sharded.entries]
            kind = f"sharded {sharded._class.__qualname__}"
            digest.update(repr((kind, groups)).encode())
            parts.append(f"{name}: {kind} over {sum(groups)} parameters")
        elif isinstance(obj, torch.optim.Optimizer):
            groups = [len(g["params"]) for g in obj.param_groups]
            digest.update(repr((kind, groups)).encode())
            parts.append(f"{name}: {kind} over {sum(groups)} parameters")
        else:
            digest.update(kind.encode())
            parts.append(f"{name}: {kind}")
    return "; ".join(parts) + f" [{digest.hexdigest()[:12]}]"


def pack(tracked, step, applied, history):
    """``tracked``'s state (a sharded optimizer's moved with the change of
    members), the step, the steps applied and the history, as bytes."""
    buf = io.BytesIO()
    torch.save({"objects": {n: _state_of(o) for n, o in tracked.items() if not converted(o)},
                "step": step, "applied": applied, "history": history}, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(tracked, data):
    """:func:`pack`'s ``data`` into ``tracked``; returns ``(step, applied,
    history)``. :class:`MembershipError` (``refused``) if the sender
    tracked other objects."""
    state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    for name, obj in tracked.items():
        if converted(obj):
            continue
        if name not in state["objects"]:
            raise MembershipError.of(
                "refused", f"the members sent no state for {name!r}: track the same objects on every process"
            )
        _load_state(obj, state["objects"][name])
    return state["step"], state["applied"], [tuple(h) for h in state["history"]]


def _state_forms(module):
    """``module``'s state dict, or, a wrapper whose parameters are sharded
    (released between steps), its parameters' whole forms and its buffers:
    what a joiner's fingerprint compares, without a gather."""
    if getattr(module, "parameters_sharded", False):
        return {**module.parameter_forms(), **dict(module.module.named_buffers())}
    return module.state_dict()


def _state_of(obj):
    """What a member behind receives of ``obj``: its state dict; of a
    wrapper whose parameters are sharded its buffers only (the pieces of the
    parameters moved with the members, ``sharding.reshard``)."""
    if getattr(obj, "parameters_sharded", False):
        return {"buffers": dict(obj.module.named_buffers())}
    return obj.state_dict()


@torch.no_grad()
def _load_state(obj, state):
    """:func:`_state_of`'s ``state`` into ``obj``."""
    if getattr(obj, "parameters_sharded", False):
        for name, buffer in obj.module.named_buffers():
            buffer.copy_(state["buffers"][name])
        return
    obj.load_state_dict(state)
