"""Which modules are parameter sharding's units (``shard_parameters=``),
and where each unit's forward is seen.

``True`` takes the children of the model's largest ``ModuleList`` or
``Sequential`` (by parameters; a transformer's layers; with none, one
unit); a list names the modules; ``[]`` is one unit, the whole model. Unit 0, the root, holds every parameter no unit
holds; a parameter two units hold belongs to the first::

    choose(model, params, True) ─▶ (each parameter's unit, the units' names, the unit modules)
    entries(unit module)        ─▶ the modules whose forward hooks gather it

and what ``sharding.units`` keeps per unit: :class:`Unit` (its
parameters, buckets and needs) and :class:`BackwardEnds` (the hook that
sees a unit's backward end). Every hook gradsync puts on a module is a
:class:`ModuleHook`: a copy of the module (``copy.deepcopy``, an EMA
model, ``torch.save(model.module)``) carries it inert, a plain module of
its own, never a copy of the wrapper.
"""

import torch

from gradsync._errors import ConfigError


def choose(module, params, listed):
    """Each parameter's unit (a list parallel to ``params``, the wrapper's
    parameters) and each unit's name: ``listed`` modules (``True``: the
    children of the largest ``ModuleList`` or ``Sequential``); unit 0 is
    the root (what no listed module holds). A parameter two units hold
    belongs to the first; listed modules must not nest."""
    if listed is True:
        listed = _blocks(module)
    elif isinstance(listed, torch.nn.Module) and not isinstance(listed, (torch.nn.ModuleList, torch.nn.Sequential)):
        listed = [listed]
    elif isinstance(listed, (list, tuple, torch.nn.ModuleList, torch.nn.Sequential)):
        listed = list(listed)
    else:
        raise ConfigError(
            f"shard_parameters={listed!r}: give True (each block of the model's largest ModuleList or Sequential "
            "is a unit) or the modules to gather one at a time (a list, or a ModuleList of blocks)"
        )
    names = {id(m): n for n, m in module.named_modules()}
    for m in listed:
        if not isinstance(m, torch.nn.Module) or id(m) not in names:
            raise ConfigError(
                f"shard_parameters: {type(m).__name__} is not a submodule of the wrapped model; list the modules "
                "to gather one at a time (e.g. model.transformer.h), or pass True for the model's blocks"
            )
    for i, m in enumerate(listed):
        inner = {id(s) for s in m.modules()} - {id(m)}
        for other in listed[i + 1:]:
            if id(other) in inner or id(m) in {id(s) for s in other.modules()}:
                raise ConfigError(
                    f"shard_parameters: units {names[id(m)]!r} and {names[id(other)]!r} nest; list modules "
                    "that do not contain each other"
                )
    owner = {}
    for u, m in enumerate(listed, start=1):
        for p in m.parameters():
            owner.setdefault(id(p), u)
    units = [owner.get(id(p), 0) for p in params]
    return units, ["(root)"] + [names[id(m)] for m in listed], list(listed)


def _blocks(module):
    """The children of the largest ``ModuleList`` or ``Sequential`` (by
    parameters) that has at least two children with parameters; else none:
    one unit, the whole model (the model's own children are not taken: a
    root forward that reads a child's weight itself, a tied head, would
    read it released)."""
    best, most = [], 0
    for m in module.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            children = [c for c in m.children() if any(True for _ in c.parameters())]
            size = sum(p.numel() for c in children for p in c.parameters())
            if len(children) >= 2 and size > most:
                best, most = children, size
    return best


def entries(module):
    """Where a unit's forward is seen: the module itself, or, for a
    container that is never called (``ModuleDict``, ``ModuleList``), its
    submodules that are."""
    if type(module).forward is not torch.nn.Module.forward:
        return [module]
    return [e for child in module.children() for e in entries(child)]


class Unit:
    """One unit as the driver knows it: its parameters (indices into the
    partition's), its buckets, and the units a forward of it needs whole
    (itself, and those owning a weight it shares). What keeps it whole is
    the runtime's (``gradsync._native.Residency``)."""

    __slots__ = ("index", "name", "params", "buckets", "needs")

    def __init__(self, index, name):
        self.index = index
        self.name = name
        #: Its parameters, by index into ``Partition.params``.
        self.params = []
        #: The buckets that hold them (no bucket holds another unit's).
        self.buckets = []
        #: Units that must be whole while it runs: itself first.
        self.needs = [index]


class BackwardEnds(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once every gradient
    of those inputs is computed: the unit's backward has ended."""

    @staticmethod
    def forward(ctx, ended, *tensors):
        """The tensors, unchanged; ``ended()`` is called by the backward."""
        ctx.ended = ended
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        """Every gradient of the unit's inputs is here: its backward ended."""
        ctx.ended()
        return (None, *grads)


class ModuleHook:
    """A hook gradsync puts on a module (``fn``, called as the module
    calls it) that a copy of the module does not carry along: a deep copy
    or a pickle of the module holds an inert hook instead (the wrapper's
    state, which ``fn`` refers to, stays the wrapper's alone)."""

    __slots__ = ("fn", "_from_public_api")  # (torch marks its state dict post hooks so)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        """``fn``'s answer (the module calls its hooks with their arguments)."""
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        """An inert hook: the copy is a plain module."""
        return _Inert()

    def __reduce__(self):
        """Pickled as an inert hook."""
        return (_Inert, ())


class _Inert:
    """What a copy of a module holds for one of gradsync's hooks: nothing happens."""

    def __call__(self, *args, **kwargs):
        return None
