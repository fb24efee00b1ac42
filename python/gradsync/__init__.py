"""gradsync: exact, overlapped gradient all-reduce for data-parallel training.

The runtime (Rust, ``gradsync._native``) all-reduces gradients while backward
runs and stays exact when activation recompute, shared weights, unused
parameters or repeated forwards make gradient hooks fire twice, late, or never.

PyTorch users want :class:`gradsync.torch.DistributedDataParallel`, a drop-in
for ``torch.nn.parallel.DistributedDataParallel``::

    from gradsync.torch import DistributedDataParallel as DDP
    model = DDP(model)

This package also offers the exceptions (see :mod:`gradsync._errors`), the
per-step report, the :class:`DataPath` a wrapper reports, and the
Prometheus exporter. An elastic job (a lost rank does not end it) is
:class:`gradsync.torch.Elastic` under ``python -m gradsync.launch``. Paddle users want :class:`gradsync.paddle.DataParallel`.
"""

import atexit

from gradsync._core import DataPath
from gradsync._errors import (
    CheckpointError,
    ClosedError,
    CommunicationError,
    ConfigError,
    DesyncError,
    GradientLayoutError,
    GradsyncError,
    MembershipError,
    PeerGoneError,
    PoisonedError,
    RejectedError,
    ReleasedParameterError,
    StepFailedError,
    StepOrderError,
    TimeoutError,
    UnfinishedStepError,
)
from gradsync._native import Session, Step, StepReport, install_prometheus, version, wait_for_closing

__version__ = version()

# A session dropped without close() stops its threads in the background; the
# program waits for them before the interpreter shuts down (see closing.rs).
atexit.register(wait_for_closing)

__all__ = [
    "CheckpointError",
    "ClosedError",
    "CommunicationError",
    "ConfigError",
    "DataPath",
    "DesyncError",
    "GradientLayoutError",
    "GradsyncError",
    "MembershipError",
    "PeerGoneError",
    "PoisonedError",
    "RejectedError",
    "ReleasedParameterError",
    "Session",
    "Step",
    "StepFailedError",
    "StepOrderError",
    "StepReport",
    "TimeoutError",
    "UnfinishedStepError",
    "install_prometheus",
    "version",
]
