"""A released parameter is loud: reading its values raises, naming it.

Between its uses a sharded parameter (``shard_parameters``) is an empty
tensor on each rank: the same ``Parameter`` object (the optimizer, the
hooks and tied weights keep it), its values in the ranks' pieces. A read
of those values would silently get nothing (a weight norm of 0.0 logged
after ``optimizer.step()``) or fail deep in autograd (an L2 penalty summed
after the forward). So while released, its class is
:class:`ReleasedParameter`, whose ``__torch_function__`` refuses every
operation on its values with a :class:`gradsync.ReleasedParameterError`
naming it and saying what to do; what is not a read of values goes
through as for any parameter::

    released ─▶ p.__class__ = ReleasedParameter   p.norm(), p * 2, p.detach(), copy.deepcopy(p) ─▶ error
                                                  p.shape, p.size(), p.numel(), p.dim(), p.ndim ─▶ the whole parameter's
                                                  p.grad, p.requires_grad_(), p.register_hook ─▶ as before
    whole    ─▶ p.__class__ = Parameter           every operation as usual (no cost: the class is torch's)

So a count of the model's parameters (``sum(p.numel() for p in
model.parameters())``, HF's ``num_parameters()``, Lightning's summary)
and a check of a weight's shape are right between steps too. What the
parameter's memory holds now is ``p.data`` (a plain tensor: empty while
released); gradsync asks that (``p.data.numel()``), as torch's own C++
does. ``stride()`` and ``is_contiguous()`` are the empty tensor's.

Only plain ``torch.nn.Parameter`` objects change class (a subclass of a
library's is left as it is). The check costs nothing on a whole parameter
and nothing on any other tensor.
"""

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten

from gradsync._errors import ReleasedParameterError

#: Operations on a released parameter that do not read its values: they run
#: as on any parameter (besides every attribute read or write, ``.grad``,
#: ``.data``, ``.requires_grad``, ...; but its shape: :data:`_SHAPED`).
_NOT_READS = frozenset({
    "stride", "storage_offset", "untyped_storage", "is_complex", "is_floating_point",
    "element_size", "is_contiguous", "get_device", "data_ptr", "requires_grad_", "retain_grad",
    "register_hook", "register_post_accumulate_grad_hook", "__hash__", "__eq__", "__repr__", "__format__",
    "_is_view", "__setstate__",
})


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
        reads no values (``_NOT_READS``, attributes), else refuse it."""
        name = getattr(func, "__name__", "")
        if name == "__get__":
            shaped = _SHAPED_PROPERTIES.get(getattr(getattr(func, "__self__", None), "__name__", None))
            if shaped is not None and type(args[0]) is ReleasedParameter:
                return shaped(args[0].__dict__["_gradsync_shape"])
        elif name in _SHAPED and args and type(args[0]) is ReleasedParameter:
            return _SHAPED[name](args[0].__dict__["_gradsync_shape"], *args[1:], **(kwargs or {}))
        if name in ("__get__", "__set__", "__delete__") or name in _NOT_READS:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, ReleasedParameter))
        raise refusal(released, name)

    def __deepcopy__(self, memo):
        """Refused: a copy would hold no values."""
        raise refusal(self, "deepcopy")

    def __reduce_ex__(self, proto):
        """Refused: a pickle would hold no values."""
        raise refusal(self, "pickle")


def refusal(p, what):
    """The error for ``what`` (an operation's name) on released parameter ``p``."""
    name = p.__dict__.get("_gradsync_name", "?")
    error = ReleasedParameterError(
        f"{what} of parameter {name!r}, which is released: with shard_parameters each rank holds only its pieces "
        "between a step's end and the next forward, and a unit's parameters between its forward and its backward. "
        "Read it inside `with model.whole_parameters():` on every rank (a collective), or, inside a step, "
        "in the forward of the module that holds it"
    )
    error.parameter = name
    return error


def mark_released(p, name, shape):
    """``p`` (just emptied) refuses reads of its values; ``name`` names it,
    and it answers for its ``shape`` (the whole parameter's)."""
    if type(p) is torch.nn.Parameter:
        p._gradsync_name = name
        p._gradsync_shape = torch.Size(shape)
        p.__class__ = ReleasedParameter


def mark_whole(p):
    """``p`` holds its values again: a plain ``Parameter``."""
    if type(p) is ReleasedParameter:
        p.__class__ = torch.nn.Parameter
