"""A released parameter reads right, alone, or is loud: never an empty read.

Between its uses a sharded parameter (``shard_parameters``) is an empty
tensor on each rank: the same ``Parameter`` object (the optimizer, the
hooks and tied weights keep it), its values in the ranks' pieces. A read
of those values would silently get nothing (a weight norm of 0.0 logged
after ``optimizer.step()``) or fail deep in autograd (an L2 penalty summed
after the forward). So while released, its class is
:class:`ReleasedParameter`, whose ``__torch_function__`` sees every
operation on it::

    released ─▶ p.__class__ = ReleasedParameter
        p.shape, p.size(), p.numel(), p.dim(), p.ndim      ─▶ the whole parameter's
        p.grad, p.requires_grad_(), p.register_hook        ─▶ as before
        p.norm(), p.detach(), p.cpu(), print(p), copy.deepcopy(p), torch.save(p)
            under torch.no_grad() (or of a parameter that needs no gradient),
            where the pieces are served  ─▶ the op on its whole values, read by this
                                            rank alone from every rank's pieces
                                            (``sharding.served``), a bucket at a time
        the same with autograd on        ─▶ error: no gradient could reach the pieces
        a write (p.copy_(x), p.mul_(...), p[0] = 1), or a write of a read's result
                                         ─▶ error: the pieces are written by every rank
    whole    ─▶ p.__class__ = Parameter   every operation as usual (no cost: the class is torch's)

So a logging callback's weight norms, an EMA copy of ``model.module``
(``copy.deepcopy``, ``AveragedModel(model.module)`` and its updates) and
``torch.save(model.module)`` are right between steps, on any rank alone,
with nothing else added; a read the pieces cannot serve (on a device,
after a failed gather) raises a :class:`gradsync.ReleasedParameterError` naming
the parameter and what to do, as before.

What a served read returns is a :class:`ReadCopy`: the values of the
version it was read at (the optimizer steps taken), not a view of the
parameter. A write into it would be lost with the copy, so it raises
too; ops on it give plain tensors (a view of it, ``p.detach().view(-1)``,
stays a ``ReadCopy``).

A parameter count (``sum(p.numel() for p in model.parameters())``, HF's
``num_parameters()``, Lightning's summary) and a check of a weight's
shape are right between steps too, at no cost. ``p.data`` is what the
parameter's memory holds now, the empty tensor (a :class:`ReleasedData`:
its ``numel()`` is 0), whose value reads are served as ``p``'s are
(``p.data.norm()``, a hand-written EMA's ``ema.data.add_(p.data, ...)``)
and whose writes are refused (``p.data.normal_()`` would write nothing);
gradsync itself asks :func:`held`, as torch's own C++ does.
``stride()`` and ``is_contiguous()`` are the empty tensor's.

Only plain ``torch.nn.Parameter`` objects change class (a subclass of a
library's is left as it is). The check costs nothing on a whole parameter
and nothing on any other tensor.
"""

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten, tree_map

from gradsync._errors import ReleasedParameterError

#: Operations on a released parameter that do not read its values: they run
#: as on any parameter (besides every attribute read or write, ``.grad``,
#: ``.data``, ``.requires_grad``, ...; but its shape: :data:`_SHAPED`).
_NOT_READS = frozenset({
    "stride", "storage_offset", "untyped_storage", "is_complex", "is_floating_point",
    "element_size", "is_contiguous", "get_device", "data_ptr", "requires_grad_", "retain_grad",
    "register_hook", "register_post_accumulate_grad_hook", "__hash__", "__eq__", "__format__",
    "_is_view", "__setstate__", "_has_compatible_shallow_copy_type",
})

#: Reads that make no autograd graph, served with autograd on too.
_NO_GRAPH = frozenset({"detach", "__repr__", "item", "tolist", "numpy", "__deepcopy__", "__reduce_ex__"})

#: In-place operators that write their first argument (besides every
#: ``name_`` method and an ``out=`` argument).
_IN_PLACE = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})

#: ``name_`` methods that write no values.
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})


#: What a released parameter answers as the whole parameter would, from its
#: whole shape: methods, and properties (``p.shape``, ``p.ndim``).
_SHAPED = {
    "numel": lambda shape: shape.numel(),
    "nelement": lambda shape: shape.numel(),
    "dim": len,
    "size": lambda shape, dim=None: shape if dim is None else shape[dim],
}
_SHAPED_PROPERTIES = {"shape": lambda shape: shape, "ndim": len}


class ReleasedParameter(torch.nn.Parameter):
    """A ``Parameter`` whose values are released (see the module docs)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Answer ``func`` from the whole shape (``_SHAPED``), run it if it
        reads no values (``_NOT_READS``, attributes), else run it on the
        whole values read alone (``_served``)."""
        name = getattr(func, "__name__", "")
        # (For a property's __get__ / __set__: the property's name.)
        attribute = getattr(getattr(func, "__self__", None), "__name__", None)
        if name == "__get__":
            shaped = _SHAPED_PROPERTIES.get(attribute)
            if shaped is not None and type(args[0]) is ReleasedParameter:
                return shaped(args[0].__dict__["_gradsync_shape"])
            if attribute == "data" and type(args[0]) is ReleasedParameter:
                return _released_data(args[0])
        elif name in _SHAPED and args and type(args[0]) is ReleasedParameter:
            return _SHAPED[name](args[0].__dict__["_gradsync_shape"], *args[1:], **(kwargs or {}))
        elif name == "__set__" and attribute == "data":
            # ``p.data = x`` (``module.to()``, ``.float()``: ``param.data = param.float()``) would leave
            # the parameter whole with values its pieces do not hold; gradsync marks it whole first.
            if args[1] is args[0]:
                return None
            raise refusal(args[0], "setting .data (module.to(), module.float(), ...)", writes=True)
        if name in ("__get__", "__set__", "__delete__") or name in _NOT_READS:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return _served(func, name, args, kwargs or {})

    def __repr__(self):
        """The whole values, read alone where they are served; else what it
        is (a repr never raises: a debugger or a log prints it)."""
        try:
            return repr(torch.nn.Parameter(_read(self, "repr").as_subclass(torch.Tensor), self.requires_grad))
        except Exception:  # (refused, or a rank's server gone: what it is, not why)
            return f"Parameter {self.__dict__.get('_gradsync_name', '?')!r} (released, shape {tuple(self.shape)})"

    def __deepcopy__(self, memo):
        """A whole ``Parameter`` of its own (an EMA copy of the module), read
        alone; refused where the pieces are not served."""
        if id(self) not in memo:
            copy = torch.nn.Parameter(_read(self, "deepcopy").clone(), requires_grad=self.requires_grad)
            memo[id(self)] = copy
        return memo[id(self)]

    def __reduce_ex__(self, proto):
        """Pickled as a whole ``Parameter`` (``torch.save`` of the module),
        read alone; refused where the pieces are not served."""
        whole = torch.nn.Parameter(_read(self, "pickle").clone(), requires_grad=self.requires_grad)
        return whole.__reduce_ex__(proto)


class ReadCopy(torch.Tensor):
    """The values of a released parameter read alone, at the version the
    pieces were at (see the module docs): ops on it give plain tensors (its
    views stay copies); a write into it raises, naming the parameter."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Run ``func`` as on a plain tensor, unless it writes a copy."""
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        written = next((t for t in _written(name, args, kwargs) if isinstance(t, ReadCopy)), None)
        if written is not None:
            raise refusal(written, name, writes=True)
        with DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        copies = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ReadCopy)]
        return tree_map(lambda t: _as_copy_if_view(t, copies), out) if copies else out

    def __deepcopy__(self, memo):
        """A plain tensor of its own."""
        return torch.Tensor.clone(self.as_subclass(torch.Tensor))

    def __reduce_ex__(self, proto):
        """Pickled as a plain tensor."""
        return self.as_subclass(torch.Tensor).clone().__reduce_ex__(proto)


class ReleasedData(torch.Tensor):
    """``p.data`` of a released parameter ``p``: the empty tensor its memory
    holds (its ``numel()``, ``shape`` and ``dim()`` are the empty
    tensor's), whose value reads are served as ``p``'s are (``p.data.norm()``,
    ``ema.data.add_(p.data, alpha=...)``) and whose writes are refused
    (``p.data.normal_()`` would write nothing). Once ``p`` is whole again, a
    ``ReleasedData`` kept from before is a plain empty tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Run ``func`` as on the empty tensor if it reads no values, else
        on the owner's whole values read alone; refuse a write."""
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in ("__get__", "__set__", "__delete__") or name in _NOT_READS or name in _EMPTY_AS_IT_IS:
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        written = next((t for t in _written(name, args, kwargs) if _owner(t) is not None), None)
        if written is not None:
            raise refusal(_owner(written), f"{name} of its .data", writes=True)

        def value(t):
            if not isinstance(t, ReleasedData):
                return t
            owner = _owner(t)
            return _read(owner, name) if owner is not None else t.as_subclass(torch.Tensor)

        return func(*tree_map(value, args), **tree_map(value, kwargs))


#: What ``p.data`` of a released parameter answers as the empty tensor it
#: is, besides what reads no values (``_NOT_READS``): its size, and new
#: tensors shaped like it.
_EMPTY_AS_IT_IS = frozenset({
    "numel", "nelement", "dim", "size", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
    "empty_like", "zeros_like", "ones_like", "full_like",
})


def _released_data(p):
    """``p.data`` of released parameter ``p``: a :class:`ReleasedData`."""
    with DisableTorchFunctionSubclass():
        data = p.data
    view = data.as_subclass(ReleasedData)
    view._gradsync_owner = p
    return view


def _owner(t):
    """The parameter ``t`` is the ``.data`` of, while it is released, or ``None``."""
    owner = t.__dict__.get("_gradsync_owner") if isinstance(t, ReleasedData) else None
    return owner if type(owner) is ReleasedParameter else None


def held(p):
    """What parameter ``p``'s memory holds now: ``p.data`` as torch's own
    C++ sees it (empty while released), a plain tensor (not the
    :class:`ReleasedData` a program gets, whose reads are served)."""
    with DisableTorchFunctionSubclass():
        return p.data


def _served(func, name, args, kwargs):
    """``func`` run with each released parameter among its arguments
    replaced by its whole values, read alone (a :class:`ReadCopy`).
    Refused where it writes one, where autograd would record it (no
    gradient could reach the pieces) and where the pieces are not served."""
    released = [t for t in tree_flatten((args, kwargs))[0] if type(t) is ReleasedParameter]
    written = next((t for t in _written(name, args, kwargs) if type(t) is ReleasedParameter), None)
    if written is not None:
        raise refusal(written, name, writes=True)
    if name not in _NO_GRAPH and torch.is_grad_enabled():
        graphed = next((p for p in released if p.requires_grad), None)
        if graphed is not None:
            raise refusal(graphed, name, graphed=True)
    copies = {id(p): _read(p, name) for p in released}
    out = func(*tree_map(lambda t: copies.get(id(t), t), args), **tree_map(lambda t: copies.get(id(t), t), kwargs))
    # An op that gives its input back (``p.to(p.device)``, ``p.contiguous()``) gives the parameter back,
    # as torch does: ``module.to(device)`` on the device it is on changes nothing.
    return next((p for p in released if copies[id(p)] is out), out)


def _read(p, what):
    """Released parameter ``p``'s whole values, read alone for ``what`` (an
    operation's name), as a :class:`ReadCopy`; or the refusal its owner
    gives, where they are not served."""
    read = p.__dict__.get("_gradsync_read")
    whole = read(what) if read is not None else None
    if whole is None:
        raise refusal(p, what)
    copy = whole.as_subclass(ReadCopy)
    copy._gradsync_name = p.__dict__.get("_gradsync_name", "?")
    return copy


def _written(name, args, kwargs):
    """The tensors ``name`` (called with ``args``, ``kwargs``) writes into:
    an in-place method's or operator's first argument (a list of them for
    ``_foreach_*_``), and ``out=``."""
    out = kwargs.get("out")
    written = list(tree_flatten(out)[0]) if out is not None else []
    in_place = name in _IN_PLACE or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES)
    if in_place and args:
        written += tree_flatten(args[0])[0]
    return written


def _as_copy_if_view(t, copies):
    """``t``, a :class:`ReadCopy` if it shares memory with one of ``copies``
    (a view: a write into it would be lost too), else as it is."""
    if not isinstance(t, torch.Tensor) or isinstance(t, ReadCopy) or not t.numel():
        return t
    ptr = t.untyped_storage().data_ptr()
    source = next((c for c in copies if c.untyped_storage().data_ptr() == ptr), None)
    if source is None:
        return t
    view = t.as_subclass(ReadCopy)
    view._gradsync_name = source.__dict__.get("_gradsync_name", "?")
    return view


def refusal(p, what, writes=False, graphed=False, pending=False):
    """The error for ``what`` (an operation's name) on released parameter
    ``p`` (or a read copy of it): a read that cannot be served, a write
    (``writes``), a read autograd would record (``graphed``), or a read
    between the step's backward and ``optimizer.step()`` (``pending``)."""
    name = p.__dict__.get("_gradsync_name", "?")
    whole = "inside `with model.whole_parameters():` on every rank (a collective)"
    if pending:
        message = (f"{what} of parameter {name!r}, which is released, between this step's backward and the end of "
                   f"optimizer.step(): {PENDING} Read it after optimizer.step() (served alone), or {whole}")
    elif writes:
        message = (f"{what} writes parameter {name!r}, which is released (or a copy of its values read alone): with "
                   f"shard_parameters the values live in every rank's pieces, so write them {whole}, where what is "
                   "written into the parameters is kept")
    elif graphed:
        message = (f"{what} of parameter {name!r}, which is released, with autograd on: no gradient could reach its "
                   "pieces. Read it under `torch.no_grad()` (served alone between steps), or, inside a step, in the "
                   f"forward of the module that holds it, or {whole}")
    else:
        message = (f"{what} of parameter {name!r}, which is released: with shard_parameters each rank holds only its "
                   "pieces between a step's end and the next forward, and a unit's parameters between its forward "
                   "and its backward, and here the other ranks' pieces are not served (pieces on a device, or a "
                   f"gather of this membership failed). Read it {whole}, or, inside a step, in the forward of the module that holds it")
    error = ReleasedParameterError(message)
    error.parameter = name
    return error


#: Why no rank reads alone while its step's averages wait for the optimizer.
PENDING = ("the other ranks may have stepped their pieces already (they need nothing more of this rank), so the "
           "values this rank would read are gone there.")


def mark_released(p, name, shape, read=None):
    """``p`` (just emptied) reads alone or refuses reads of its values;
    ``name`` names it, and it answers for its ``shape`` (the whole
    parameter's). ``read(what)`` gives its whole values read alone for
    ``what`` (an operation's name), or ``None`` where they are not served
    now (or raises the refusal that says why not)."""
    if type(p) is torch.nn.Parameter:
        p._gradsync_name = name
        p._gradsync_shape = torch.Size(shape)
        p._gradsync_read = read
        p.__class__ = ReleasedParameter


def mark_whole(p):
    """``p`` holds its values again: a plain ``Parameter``."""
    if type(p) is ReleasedParameter:
        p.__class__ = torch.nn.Parameter
