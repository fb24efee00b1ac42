"""Loading gradsync's C++ modules (``_collectives``, ``_arrivals``), which
``pip install`` compiles against the torch installed at the time (see
python/build.rs), and choosing a wrapper's data path with them. A module
built against another torch is not loaded."""

import importlib
import warnings

import torch

from gradsync._core import DataPath
from gradsync._errors import ConfigError


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


def data_path(device, buckets):
    """Where a wrapper of parameters on ``device`` keeps its buckets
    (``buckets``: the user's ``buckets`` setting, or None), and gradsync's
    C++ modules. Returns ``(path, arrivals module, collectives module)``.

    CPU parameters: host buckets; ``buckets="device"`` runs the device
    plane on CPU tensors (what CI checks of it). CUDA parameters: the device
    plane (buckets on the GPU, NCCL), or, with ``buckets="host"``, gradients
    staged through host memory and summed by gloo (a warning says so).
    Without the C++ modules nothing runs: they are gradsync's hook and
    collectives, as DDP's reducer is DDP's."""
    if buckets not in (None, "host", "device"):
        raise ConfigError(f"buckets={buckets!r}: use 'device' (on the parameters' device) or 'host' (host memory)")
    collectives, missing = load("collectives")
    arrivals, arrivals_missing = load("arrivals")
    why = missing or arrivals_missing
    if why is not None:
        raise ConfigError(
            f"gradsync.torch cannot run: {why}. Its C++ modules are built when gradsync is installed with torch "
            "present: install torch first, then reinstall gradsync (pip install --no-build-isolation "
            "--force-reinstall gradsync)"
        )
    if buckets is None:
        buckets = "device" if device.type == "cuda" else "host"
    if buckets == "device":
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"buckets on {device}: gradsync's device plane runs on CUDA; pass buckets='host'")
        return DataPath(buckets="device"), arrivals, collectives
    if device.type == "cpu":
        return DataPath(buckets="host"), arrivals, collectives
    why = (
        f"gradients of parameters on {device} are staged through host memory and reduced by gloo (two copies "
        "across the bus and a CPU sum per gradient), "
        + ("because gradsync's device plane runs on CUDA only" if device.type != "cuda" else "as buckets='host' asks")
        + "; buckets='device' keeps CUDA gradients on the GPU and reduces them with NCCL"
    )
    warnings.warn(f"gradsync: {why}", RuntimeWarning, stacklevel=4)
    return DataPath(buckets="host", why=why), arrivals, collectives
