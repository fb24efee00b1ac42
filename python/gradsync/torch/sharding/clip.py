"""torch's gradient clipping, right for sharded gradients whichever way a
program reaches it.

A sharded wrapper's parameters have no ``.grad`` (each rank holds the
averages of its pieces), so torch's ``clip_grad_norm_`` would find no
gradient and clip nothing, and called with an optimizer's parameters (the
pieces, as Lightning's and Fabric's precision plugins pass them) it would
clip by a rank's local norm. Both are silent. So once the first sharded
wrapper is built, torch's functions are redirected here:

* ``clip_grad_norm_`` (and the deprecated ``clip_grad_norm``),
  ``get_total_norm``, ``clip_grads_with_norm_`` and ``clip_grad_value_``,
  called with tensors of a sharded wrapper (its parameters, or the pieces
  of its optimizer's groups, or, for ``get_total_norm``, the pieces'
  gradients) compute the norm over every rank's pieces (a collective:
  every rank calls it, as every rank calls torch's under DDP) and clip the
  pieces; every other call is torch's own, unchanged.

The redirection replaces the function each of torch's exported wrappers
calls (they are ``_no_grad`` wrappers around the real function), so a
reference taken before gradsync was imported, ``from torch.nn.utils import
clip_grad_norm_`` at the top of a script, is redirected too. Where torch's
functions are not built that way (another torch version), torch's module
attributes are replaced instead and a warning says that earlier
references are not covered.
"""

import logging
import weakref

import torch
import torch.nn.utils.clip_grad as _torch_clip

from gradsync._errors import ConfigError

log = logging.getLogger("gradsync.torch")

# Sharded wrappers alive in this process (each has ``_sync`` and ``sharding.partition``).
_SHARDED = weakref.WeakSet()
# torch's own functions (the undecorated ones), by name, once redirected.
_TORCH = {}


def track(wrapper):
    """``wrapper`` (a sharded ``DistributedDataParallel``) is alive: its
    tensors are clipped here; the redirection is installed once."""
    _SHARDED.add(wrapper)
    if not _TORCH:
        _install()


def live():
    """The sharded wrappers alive and open in this process."""
    return [w for w in list(_SHARDED) if not w._sync.closed and w._partition is not None]


def _partitions():
    return [w._partition for w in live()]


def _split(tensors, of_grad=False):
    """``tensors`` as ``(partition, parameter indices, others)``: the
    sharded wrapper they belong to (``None`` if none), which of its
    parameters they stand for, and the rest. ``of_grad``: the tensors are
    gradients (``get_total_norm``): a piece's gradient stands for its
    parameter."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    found, others = {}, []
    for part in _partitions():
        index = part.index_of
        if of_grad:
            index = {id(piece.tensor.grad): piece.param for piece in part.every_held_piece()
                     if piece.tensor.grad is not None}
        hits = {index[id(t)] for t in tensors if id(t) in index}
        if hits:
            found[id(part)] = (part, hits, index)
    if not found:
        return None, set(), tensors
    if len(found) > 1:
        raise ConfigError(
            "gradient clipping got tensors of several sharded wrappers: one norm over several models is not "
            "computed; clip each model by itself (model.clip_grad_norm_)"
        )
    ((part, indices, index),) = found.values()
    others = [t for t in tensors if id(t) not in index]
    return part, indices, others


def _refuse_mixed(others, of_grad=False):
    """Tensors of a sharded wrapper came with others that have gradients."""
    mixed = others if of_grad else [t for t in others if t.grad is not None]
    if mixed:
        raise ConfigError(
            "gradient clipping got tensors of a sharded gradsync wrapper together with others that have "
            "gradients: one norm over both is not computed; clip the wrapper's with model.clip_grad_norm_ and "
            "the others by themselves"
        )


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch's ``clip_grad_norm_``; for a sharded wrapper's parameters (or
    its optimizer's pieces) the global norm over every rank's pieces, by
    which the pieces are clipped (a collective)."""
    part, indices, others = _split(parameters)
    if part is None:
        return _TORCH["clip_grad_norm_"](others, max_norm, norm_type, error_if_nonfinite, foreach)
    _refuse_mixed(others)
    return part.clip(indices, max_norm, norm_type, error_if_nonfinite)


def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch's ``get_total_norm``; for the gradients of a sharded wrapper's
    pieces, the global norm of their parameters' gradients (a collective)."""
    part, indices, others = _split(tensors, of_grad=True)
    if part is None:
        return _TORCH["_get_total_norm"](others, norm_type, error_if_nonfinite, foreach)
    _refuse_mixed(others, of_grad=True)
    total = part.norm(indices, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {float(norm_type)} of the gradients is non-finite")
    return total


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """torch's ``clip_grads_with_norm_``; a sharded wrapper's parameters (or
    pieces) have their pieces scaled."""
    part, indices, others = _split(parameters)
    if part is None:
        return _TORCH["_clip_grads_with_norm_"](others, max_norm, total_norm, foreach)
    _refuse_mixed(others)
    part.scale_by_norm(indices, max_norm, total_norm)
    return None


def clip_grad_value_(parameters, clip_value, foreach=None):
    """torch's ``clip_grad_value_``; a sharded wrapper's parameters (or
    pieces) have their pieces clamped (elementwise: no collective)."""
    part, indices, others = _split(parameters)
    if part is None:
        return _TORCH["clip_grad_value_"](others, clip_value, foreach)
    _refuse_mixed(others)
    part.clamp(indices, float(clip_value))
    return None


#: torch's exported name -> gradsync's replacement.
_REPLACEMENTS = {
    "clip_grad_norm_": clip_grad_norm_,
    "_get_total_norm": get_total_norm,
    "_clip_grads_with_norm_": clip_grads_with_norm_,
    "clip_grad_value_": clip_grad_value_,
}


def _cell_of(wrapper):
    """The closure cell of torch's ``_no_grad`` ``wrapper`` that holds the
    function it calls, or ``None`` when it is not built that way."""
    inner = getattr(wrapper, "__wrapped__", None)
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            if cell.cell_contents is inner and inner is not None:
                return cell
        except ValueError:  # an empty cell
            continue
    return None


def _install():
    """Redirect torch's clipping functions here (see the module docs)."""
    cells = {name: _cell_of(getattr(_torch_clip, name, None)) for name in _REPLACEMENTS}
    if all(cell is not None for cell in cells.values()):
        for name, cell in cells.items():
            _TORCH[name] = cell.cell_contents
            cell.cell_contents = _REPLACEMENTS[name]
        return
    log.warning(
        "gradsync: this torch's clipping functions are not built as gradsync expects; torch.nn.utils' names are "
        "replaced instead, and a reference taken before the first sharded wrapper was built (from "
        "torch.nn.utils import clip_grad_norm_) clips nothing: call it through torch.nn.utils or the wrapper"
    )
    public = {"_get_total_norm": "get_total_norm", "_clip_grads_with_norm_": "clip_grads_with_norm_"}
    for name, replacement in _REPLACEMENTS.items():
        _TORCH[name] = getattr(_torch_clip, name)
        setattr(_torch_clip, name, replacement)
        setattr(torch.nn.utils, public.get(name, name), replacement)
