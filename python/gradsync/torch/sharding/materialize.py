"""A model built on the meta device, materialized a unit at a time.

A model too big for one rank's memory is built without memory
(``with torch.device("meta"): model = Net()``) and wrapped with
``shard_parameters=True``; no rank ever holds it whole::

    wrap ─▶ every meta parameter and buffer replaced by a placeholder on the
            target device (a one-element zero expanded to its shape: no memory),
            the same object wherever it is tied
    the runtime's plan, the partition's pieces (empty, on the target device)
    per unit, root first:
        its modules' parameters and buffers given whole memory
        ─▶ each module initialized (``param_init(module)``, default its own
           ``reset_parameters()``) ─▶ rank 0's values broadcast to every rank
        ─▶ each rank copies its pieces (and its buddy's) out ─▶ placeholders again
    the hooks are made on the placeholders; then every parameter is released

So the most a rank holds at once is one unit whole, and every rank's pieces
come from rank 0's initialization, as DDP's broadcast of rank 0's module
makes every replica rank 0's. The numbers are not those of the same model
built on the CPU with the same seed (each unit draws in its own order).
Buffers are kept whole (they are not sharded); a buffer computed in the
module's constructor (a rotary table) is lost on the meta device and must be
set by ``param_init``.
"""

import torch

from gradsync._errors import ConfigError
from gradsync.torch.sharding.layout import flat_values


def on_meta(module):
    """Whether every parameter of ``module`` is on the meta device (a mix
    is parameters on several devices, refused as such: a module's
    initialization would overwrite the ones that hold values)."""
    meta = [p.is_meta for p in module.parameters()]
    return bool(meta) and all(meta)


def target_device(device_ids):
    """Where a meta model's parameters are materialized: DDP's
    ``device_ids[0]``, else the current CUDA device when there is one,
    else the CPU."""
    if device_ids:
        first = device_ids[0]
        return torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def placeholder(form, device):
    """No memory, ``form``'s shape and dtype, on ``device``: one zero
    expanded (what a parameter holds between its materialization and its
    hooks, and what autograd's accumulator is made from)."""
    return torch.zeros((), dtype=form.dtype, device=device).expand(form.shape)


@torch.no_grad()
def place(module, device):
    """Replace every meta parameter and buffer of ``module`` by a
    :func:`placeholder` on ``device`` (a new ``Parameter``: a meta tensor's
    data cannot be swapped for another device's), the same new object
    wherever the old one was tied. Returns ``{id(placeholder): meta form}``."""
    forms, new = {}, {}
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new:
                    data = placeholder(t, device)
                    made = torch.nn.Parameter(data, requires_grad=t.requires_grad) if table is m._parameters else data
                    new[id(t)] = made
                    forms[id(made)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                table[name] = new[id(t)]
    return forms


def unit_modules(module, listed):
    """Per unit (0: the root, then ``listed``), the modules it initializes:
    each module goes to the first listed module that is it or holds it,
    else to the root."""
    owner = {}
    for u, m in enumerate(listed, start=1):
        for sub in m.modules():
            owner.setdefault(id(sub), u)
    out = [[] for _ in range(len(listed) + 1)]
    for m in module.modules():
        out[owner.get(id(m), 0)].append(m)
    return out


def _resets(unit):
    """The modules of ``unit`` with a ``reset_parameters()``."""
    return [m for m in unit if callable(getattr(m, "reset_parameters", None))]


def refuse_uninitializable(modules, param_init):
    """Without ``param_init``, every module of each unit of ``modules``
    (:func:`unit_modules`) with parameters or buffers of its own must be
    initialized by its own ``reset_parameters()`` or one of a module above
    it in the unit: else :class:`ConfigError` (its memory would be left
    uninitialized), before anything is built."""
    if param_init is not None:
        return
    for unit in modules:
        covered = {id(sub) for m in _resets(unit) for sub in m.modules()}
        for m in unit:
            own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
            if own and id(m) not in covered:
                raise ConfigError(
                    f"a {type(m).__name__} built on the meta device has no reset_parameters(), nor a module above "
                    "it: give DistributedDataParallel(..., param_init=fn), fn(module) initializing a module's own "
                    "parameters and buffers in place (HF models: param_init=model._init_weights)"
                )


def _initialize(unit, param_init):
    """Initialize ``unit``'s modules, children before their parents (as
    ``module.apply`` does: a parent's initialization of its children, HF's
    scaled projections, comes last): ``param_init(module)`` on every one,
    or each one's ``reset_parameters()`` where it has one."""
    if param_init is not None:
        for m in reversed(unit):
            param_init(m)
        return
    for m in reversed(_resets(unit)):
        m.reset_parameters()


@torch.no_grad()
def materialize(partition, residence, modules, forms, param_init, states):
    """Every unit of ``modules`` (:func:`unit_modules`) in turn: whole, initialized
    (``param_init``), rank 0's values broadcast on ``states`` (the wrapper's
    state group), this rank's pieces copied out, placeholders again (see the
    module docs). ``forms``: :func:`place`'s. Parameters gradsync does not
    synchronize (frozen, ignored) and buffers stay whole. A parameter tied
    across units is materialized again by each (the last initialization wins)."""
    index = {id(p): i for i, p in enumerate(partition.params)}
    pending = dict(forms)  # (what holds a placeholder now: its form)
    replaced = {}  # (a buffer's placeholder: the tensor that replaced it)
    for unit in modules:
        tensors = []
        for m in unit:
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None and id(t) in replaced:
                        table[name] = replaced[id(t)]
                        continue
                    if t is None or id(t) not in pending:
                        continue
                    form = pending.pop(id(t))
                    whole = torch.empty(form.shape, dtype=form.dtype, device=t.device)
                    if table is m._parameters:
                        t.data = whole
                    else:
                        replaced[id(t)] = table[name] = whole
                    tensors.append(table[name])
        if not tensors:
            continue
        _initialize(unit, param_init)
        states.broadcast(tensors)
        for t in tensors:
            i = index.get(id(t))
            if i is None:
                continue  # (not synchronized: kept whole)
            values = flat_values(t)
            for piece in partition.of_param.get(i, []) + partition.buddy_of_param.get(i, []):
                piece.tensor.copy_(values[piece.offset : piece.offset + piece.length])
            t.data = placeholder(partition.forms[i], t.device)
            pending[id(t)] = partition.forms[i]
    residence.whole = residence.gathered = False
    residence.materialized = True
