"""Finding the tensors in a model's outputs, without touching them.

The wrapper must know when backward reaches the model's outputs (to watch
that backward's end and end the step when it ends). The C++ hook learns it
from a pre hook on the autograd node that produced each output tensor
(``_hooks.Hooks.watch``): the node runs in backward before any gradient of
the model's parameters is final. The outputs themselves are returned as
they are (same objects, same types, no view, no copy), so the caller may
modify them in place, keep them in a ``ModelOutput`` or a dataclass, or mix
them with non-tensors.
"""

import dataclasses
from collections.abc import Mapping

import torch

# Containers nested deeper than this are not searched (outputs are shallow).
_MAX_DEPTH = 6


def tensors_in(output, depth=0):
    """The tensors in ``output``: itself, or inside tuples, lists, mappings
    (``ModelOutput`` is one) and dataclasses, recursively."""
    if isinstance(output, torch.Tensor):
        yield output
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(output, Mapping):
        items = output.values()
    elif isinstance(output, (tuple, list)):
        items = output
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = (getattr(output, f.name, None) for f in dataclasses.fields(output))
    else:
        return
    for item in items:
        yield from tensors_in(item, depth + 1)
