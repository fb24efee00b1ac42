"""Loading gradsync's C++ modules (``_collectives``, ``_arrivals``), which
``pip install`` compiles against the torch installed at the time (see
python/build.rs). A module built against another torch is not loaded."""

import importlib

import torch


def load(name):
    """``(module, None)`` for ``gradsync.torch._<name>``, or ``(None, why)``."""
    try:
        built = importlib.import_module(f"gradsync.torch._{name}_built")
    except ImportError:
        return None, f"gradsync was installed without its C++ module _{name} (no torch or no C++ compiler at build time)"
    if built.TORCH_VERSION != torch.__version__:
        return None, f"its C++ module _{name} was built against torch {built.TORCH_VERSION}, this is {torch.__version__}"
    try:
        return importlib.import_module(f"gradsync.torch._{name}"), None
    except ImportError as e:
        return None, f"its C++ module _{name} does not load ({e})"
