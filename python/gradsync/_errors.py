"""gradsync's exceptions.

Every error the runtime reports keeps the runtime's message verbatim (it says
what happened and what to do next) and carries attributes naming the ranks
and steps involved::

    GradsyncError
    ├── ConfigError (ValueError)        bad registration or setting
    ├── RejectedError (ValueError)      a gradient the runtime refused (.reason)
    ├── GradientLayoutError (ValueError) a gradient gradsync cannot read (sparse)
    ├── StepOrderError                  a step ended out of order or twice
    ├── UnfinishedStepError             gradients handed over, the step never ended
    ├── ClosedError                     used after close()
    ├── MembershipError                 an elastic job could not change its members (.kind)
    ├── CheckpointError                 a sharded checkpoint was not written or read (.ranks)
    ├── ReleasedParameterError          a sharded parameter's values read while released (.parameter)
    └── StepFailedError                 the step is lost: reset() on every rank (.step)
        ├── TimeoutError (TimeoutError) a rank missed the deadline (.missing_ranks)
        ├── PeerGoneError               a rank left (.peer)
        ├── DesyncError                 ranks disagree (.ranks, .groups, .majority)
        ├── CommunicationError          the collective library failed
        └── PoisonedError               an earlier step failed and no reset followed
"""

import builtins


class GradsyncError(Exception):
    """Base class of every gradsync error."""


class ConfigError(GradsyncError, ValueError):
    """A registration or a setting gradsync refuses (duplicate names, bad policy, ...)."""


class RejectedError(GradsyncError, ValueError):
    """A gradient the runtime refused; ``reason`` names why (``"future_step"``, ...)."""

    reason: str = ""


class GradientLayoutError(GradsyncError, ValueError):
    """A gradient gradsync cannot read as dense memory (sparse gradients)."""


class StepOrderError(GradsyncError):
    """A step was ended out of order, twice, or while an earlier result waits to be collected."""


class UnfinishedStepError(GradsyncError):
    """Gradients were handed over and the step never ended before a forward or
    an optimizer step: ``require_manual_backward_finalization`` is on and
    ``finalize_backward()`` was not called, or (Paddle) a ``paddle.grad``
    backward needs ``finish_step()``."""


class ClosedError(GradsyncError):
    """The wrapper or session was closed."""


class MembershipError(GradsyncError):
    """An elastic job could not change its members, and this process cannot
    go on in it. ``kind`` says why: ``"no_quorum"`` (fewer survivors than the
    job's ``Elastic(min_members=...)``), ``"left_out"`` (the others went on
    without this process: exit, a replacement can join), ``"refused"`` (a
    joiner with another model or optimizer, or whose collectives differed
    from the members' right after it was admitted), ``"store"`` (the
    membership store is unreachable), ``"ended"`` (the job finished before a
    joiner was admitted), ``"no_members"`` (every member of the job is gone:
    nothing to join), ``"broken"`` (this process's membership broke where it
    could not agree on a new one: a member lost again and again, or while
    building the wrapper), ``"shard_lost"`` (a sharded job lost a rank
    together with the rank holding its buddy copy: restart from a
    checkpoint), ``"deadline"``, ``"malformed"``.
    ``gradsync.torch.elastic.exit_status(error)`` is the exit status the
    supervisor reads."""

    kind = None

    @classmethod
    def of(cls, kind, message):
        """A ``MembershipError`` of ``kind`` saying ``message``."""
        error = cls(message)
        error.kind = kind
        return error


class CheckpointError(GradsyncError):
    """A sharded checkpoint (``gradsync.torch.checkpoint``) could not be
    written or read; ``ranks`` are the ranks whose part failed, and the
    message gives the first one's error. (torch's own ``CheckpointException``
    is a ``BaseException``, which ``except Exception`` does not catch; this
    is an ordinary exception, chained to it.)"""

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


class ReleasedParameterError(GradsyncError, RuntimeError):
    """A parameter of a ``shard_parameters`` wrapper had its values read
    while it is released (each rank holds only its pieces: between steps,
    or between its unit's forward and backward); ``parameter`` names it.
    Read it inside ``with model.whole_parameters():`` (every rank), or,
    inside a step, in its unit's forward."""

    parameter: str = ""


class StepFailedError(GradsyncError):
    """The step failed on every rank and its gradients are lost; call ``reset()``
    on every rank (or close) before the next step. ``step`` names the step."""

    step = None


class TimeoutError(StepFailedError, builtins.TimeoutError):
    """A rank did not join a collective before the deadline; ``missing_ranks``
    names the ranks that never contributed (where they can be told)."""

    missing_ranks: "list[int]" = []
    collective = None


class PeerGoneError(StepFailedError):
    """A rank left the communicator (its process ended); ``peer`` names it."""

    peer = None


class DesyncError(StepFailedError):
    """Ranks registered different models (or bucket caps, or policies); ``ranks``
    are the odd ones out, ``groups`` every group of agreeing ranks, and
    ``majority`` says whether one group outnumbers the others."""

    ranks: "list[int]" = []
    groups: "list[list[int]]" = []
    majority = False


class CommunicationError(StepFailedError):
    """The collective library (gloo, NCCL) reported an error."""

    collective = None


class PoisonedError(StepFailedError):
    """An earlier step failed on this rank and ``reset()`` has not been called."""
