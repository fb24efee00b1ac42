"""The framework-neutral core of a wrapped model: one owner of its step state.

``gradsync.torch.DistributedDataParallel`` and ``gradsync.paddle.DataParallel``
each hold one :class:`ModelSync`. It owns everything about the wrapped
model's steps that does not depend on the framework:

* the runtime :class:`gradsync.Session` (built from the selected
  parameters and the settings, which it checks), whose step number is the
  only one: everything else reads it;
* the open step's record (a :class:`gradsync._record.StepRecord` the
  framework makes) and the rules that end a step: a synchronized step ends
  with the outermost backward (or ``finish_step``, ``finalize_backward``),
  ``abort_step`` and ``join`` end it too, an end gradsync could not see is
  an :class:`gradsync.UnfinishedStepError`;
* applying a finished step (written into the gradients, or cleared when no
  rank may apply it), reset, close and retirement, the settings that can
  change between steps (the wire type, the divisor).

What differs per framework is behind :class:`Framework`: how a record is
made, how held gradients are handed over, how results are written back and
gradients cleared, how hooks come off. The wrappers keep only that, plus how
their hooks attach and how their groups are built.
"""

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional, Protocol

from gradsync._errors import ClosedError, ConfigError, MembershipError, StepFailedError, UnfinishedStepError
from gradsync._native import Session, Step, StepReport
from gradsync._record import StepRecord

log = logging.getLogger("gradsync")

#: The gradient element types the runtime reads (it reduces in float32).
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: The types data buckets may travel in (``wire_dtype``).
WIRES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DataPath:
    """Where a wrapped model's buckets live, and why a slower path runs:
    ``buckets`` is ``"host"`` (the runtime's own memory, reduced by gloo) or
    ``"device"`` (torch tensors on the parameters' device, reduced by the
    device's engine: NCCL for CUDA); ``why`` says why a slower path runs
    (``None`` when none does: CUDA gradients staged through host memory, or
    Paddle's hooks and collectives reached from Python)."""

    buckets: str
    why: Optional[str] = None


class Membership(Protocol):
    """What the core tells an elastic job's membership (``gradsync.torch.Elastic``)
    about its wrapped model's steps, and asks of it when a step fails."""

    def recover(self, error: Exception) -> Optional[Step]:
        """A member was lost (``error``, a :class:`gradsync.StepFailedError`):
        agree on who goes on and reconfigure the wrapper for them. Returns
        the failed step reduced again among them, or ``None`` (skip it)."""

    def step_ended(self, report: StepReport) -> None:
        """A step ended on every member (applied or not)."""

    def step_applied(self, report: StepReport) -> None:
        """A step was applied on every member."""


class Framework(Protocol):
    """What a framework wrapper gives its :class:`ModelSync`: how its
    gradients are recorded, handed over, written back and cleared. The core
    decides when each happens."""

    def new_record(self) -> StepRecord:
        """A fresh record for the runtime's next step."""

    def hand_over_held(self, record: StepRecord) -> None:
        """Before a synchronized step ends: hand the runtime the ``.grad`` of
        every parameter that only ``no_sync`` micro-batches reached."""

    def write_back(self, result: Step, record: StepRecord) -> bool:
        """Put an applied step's averages into the gradients; return whether
        views of ``result``'s memory were lent (then it must not be released)."""

    def joined_step(self, result: Step) -> bool:
        """This rank, out of data, took part in ``result``'s step with zeros
        (``shadow_step``): whatever the framework reduces outside the runtime
        it takes part in too. Returns whether views of ``result`` were lent."""

    def clear(self) -> None:
        """A step no rank may apply: leave no gradient an optimizer would step on."""

    def serve_gathers(self) -> None:
        """After the step's end was asked of the runtime and before its
        result is collected: take part in the other ranks' parameter
        gathers still to come in the step (sharded parameters by units), so
        none of them waits for this rank."""

    def lost_gather(self) -> Optional[str]:
        """Why this rank's gradients of the open step cannot be summed (a
        gather of sharded parameters failed mid-step in an elastic job: they
        were computed from zeros), or ``None``."""

    def remove_hooks(self) -> None:
        """Take the gradient hooks off (the wrapper is closed or retired)."""


def select_parameters(named, *, dtype_name, device_of, kind, empty_hint="", dtype_hint=""):
    """The parameters to synchronize from ``(name, parameter)`` pairs (those
    that require grad and have elements, already filtered by the caller),
    checked: at least one, one device, a dtype the runtime averages
    (``dtype_name(p)`` names it, or ``None``). The hints end the messages of
    the first and the last check. Returns ``(names, params)``."""
    if not named:
        raise ConfigError(
            f"the model wrapped by {kind} has no parameter that requires grad{empty_hint}: there is nothing to "
            "synchronize"
        )
    devices = sorted({device_of(p) for _, p in named})
    if len(devices) > 1:
        by_device = {d: [n for n, p in named if device_of(p) == d][:3] for d in devices}
        raise ConfigError(f"parameters live on several devices {by_device}: put the model on one device")
    for name, p in named:
        if dtype_name(p) not in DTYPES:
            raise ConfigError(
                f"parameter {name!r} has dtype {p.dtype}: gradsync averages float32, float64, float16 and bfloat16 "
                f"gradients (torch's complex ones too){dtype_hint}"
            )
    return [n for n, _ in named], [p for _, p in named]


@dataclass(frozen=True)
class Replica:
    """This rank's place in the group and its model's layout, as the runtime
    registers it (every rank must agree on the layout: the plan agreement
    checks it): parameter ``names``, element counts ``numels`` and gradient
    element types ``dtypes`` (see :data:`DTYPES`), in registration order."""

    rank: int
    world: int
    names: list
    numels: list
    dtypes: list


@dataclass(frozen=True)
class SyncSettings:
    """A wrapped model's runtime settings: the bucket cap in bytes, the
    collective deadline in seconds, the abort policy (``"skip"`` or
    ``"partial"``), whether the timeline is kept, the wire type, whether
    each rank keeps only its partition of the buckets (``partitioned``:
    sharded gradients), whether their collective is then a
    reduce-scatter (``reduce_scatter``; else an all-reduce) and whether each
    rank ``r`` also keeps rank ``(r + buddy_stride) % world``'s partition
    (``buddy_stride`` above 0: an elastic sharded job; its roster's), and
    each parameter's gather unit (``units``, parameter sharding: no bucket
    holds two units' parameters; ``None``: one unit)."""

    bucket_cap_bytes: int
    timeout_s: float
    abort_policy: str = "skip"
    record_timeline: bool = False
    wire_dtype: str = "float32"
    partitioned: bool = False
    reduce_scatter: bool = True
    buddy_stride: int = 0
    units: Optional[list] = None


def check_wire(wire, refused=None):
    """``wire`` if it is a wire type gradsync sends and the framework does
    not refuse (``refused``: type -> why); else :class:`ConfigError`."""
    refused = refused or {}
    allowed = [w for w in WIRES if w not in refused]
    if wire not in allowed:
        why = f" ({refused[wire]})" if wire in refused else ""
        raise ConfigError(f"wire_dtype {wire!r}: use one of {allowed}{why}")
    return wire


class ModelSync:
    """One rank's synchronization of one wrapped model (see the module docs).

    ``kind`` names the wrapper in messages; ``unseen_end`` names where this
    framework's backward can end unseen (for :class:`UnfinishedStepError`);
    ``path`` is the :class:`DataPath` the wrapper chose. ``communicator``,
    ``replica`` (a :class:`Replica`) and ``settings`` (:class:`SyncSettings`)
    build the :class:`gradsync.Session` (``membership``: an elastic job's,
    whose joiner flag its votes carry). Call :meth:`attach` with
    the framework's part once its hooks exist (they need :attr:`session`).
    """

    def __init__(self, kind, unseen_end, path, communicator, replica, settings, membership=None):
        self.kind = kind
        self.unseen_end = unseen_end
        self.path = path
        # Told to give up a waiting collective when the wrapper closes (`abandon`).
        self._communicator = communicator
        self.session = Session(
            communicator,
            replica.rank,
            replica.world,
            replica.names,
            replica.numels,
            replica.dtypes,
            bucket_cap_bytes=max(int(settings.bucket_cap_bytes), 1),
            timeout_s=settings.timeout_s,
            abort_policy=settings.abort_policy,
            record_timeline=settings.record_timeline,
            wire_dtype=settings.wire_dtype,
            membership=membership,
            partitioned=settings.partitioned,
            reduce_scatter=settings.reduce_scatter,
            buddy_stride=settings.buddy_stride,
            units=settings.units,
        )
        self.names = replica.names
        self.wire = settings.wire_dtype
        self.abort_policy = settings.abort_policy
        self.framework: Optional[Framework] = None
        self.record: Optional[StepRecord] = None
        #: Whether the next backward under grad ends a synchronized step
        #: (``False`` inside ``no_sync``).
        self.require_sync = True
        #: ``finalize_backward()`` ends each synchronized step (torch's DDP option).
        self.manual_finalization = False
        #: Why later use is refused, once closed or retired.
        self.closed_why: Optional[str] = None
        #: What else stops with the runtime (called once, at :meth:`close`).
        self.on_close = []
        #: The report of the last step that ended.
        self.last_report: Optional[StepReport] = None
        #: An elastic job's :class:`Membership` (``gradsync.torch.Elastic``):
        #: a failed step changes the members instead of raising.
        self.elastic: Optional[Membership] = None

    def attach(self, framework):
        """Start recording steps with the framework's part (hooks in place)."""
        self.framework = framework
        self.record = framework.new_record()

    # ---- state ------------------------------------------------------------------------------

    @property
    def closed(self):
        return self.closed_why is not None

    @property
    def current_step(self):
        """The runtime's open step (the one step number)."""
        return self.session.current_step

    def await_in_flight(self, most, within_s):
        """Whether at most ``most`` of the step's buckets are still in their
        reduction, waiting up to ``within_s`` for it: the current session's
        (an elastic job's change of members starts a new one)."""
        return self.session.await_in_flight(most, within_s)

    def refuse_if_closed(self):
        if self.closed_why is not None:
            raise ClosedError(self.closed_why)

    def raise_if_unfinished(self, before):
        """Refuse ``before`` (a forward, an optimizer step) while gradients
        of a synchronized step wait for an end gradsync could not see."""
        r = self.record
        if self.closed_why is not None or not (r.sync_pending and r.arrivals and r.end_queued_for is None):
            return
        step = self.session.current_step
        if self.manual_finalization:
            raise UnfinishedStepError(
                f"step {step}: require_manual_backward_finalization is on and {before} was called before "
                "model.finalize_backward(): call it once after each synchronized backward"
            )
        raise UnfinishedStepError(
            f"step {step}: gradients arrived from a backward whose end gradsync could not see "
            f"({self.unseen_end}), and {before} was called before the step ended: call model.finish_step() "
            "after that backward, so that the gradients hold the average instead of this rank's own"
        )

    # ---- the step's course ------------------------------------------------------------------

    def before_forward(self, grad_enabled):
        """A forward of the wrapped model begins; returns whether it asks for
        a synchronized step (under grad, outside ``no_sync``)."""
        self.refuse_if_closed()
        self.raise_if_unfinished("forward")
        synced = grad_enabled and self.require_sync
        if synced:
            self.ask_for_sync()
        return synced

    def ask_for_sync(self):
        """The open step ends, averaged, with the outermost backward that
        reaches the model; until then its backward passes hand gradients over."""
        self.record.ask_for_sync()

    def end_of_backward(self):
        """The last backward that reached the model ended: end a synchronized
        step (unless it is finalized by hand)."""
        if self.record.sync_pending and self.closed_why is None and not self.manual_finalization:
            self.finish()

    def finish(self):
        """End the open step: held gradients handed over, the runtime's
        remaining collectives, the result applied. Returns its report."""
        self.framework.hand_over_held(self.record)
        step = self.session.current_step
        spoiled = self.framework.lost_gather()
        try:
            if spoiled is None:
                # The remaining buckets go out first: a peer's reductions never
                # wait for this rank while it serves the peer's gathers.
                self.session.begin_finish(step)
                self.framework.serve_gathers()
                result = self.session.finish(step)
            else:
                # This rank's part of the step is aborted: no survivor may sum it
                # again (partial policy). The lost member fails the step anyway.
                self.session.abort(step, "bad_batch")
                raise MembershipError.of(
                    "broken", f"step {step}: {spoiled}, yet the step's own collectives completed: the gather lane "
                    "failed while every member was present; this should not happen, report it with every rank's log"
                )
        except StepFailedError as error:
            if self.elastic is None:
                raise
            # A member was lost: the survivors agree on who goes on, move to
            # their group, and skip this step on every one of them (or,
            # under the partial policy, apply it reduced among them).
            result = self.elastic.recover(error)
            if result is None:
                self.framework.clear()
                self.new_step()
                return None
        return self.apply(result)

    def finish_step(self):
        """The public ``finish_step``: nothing to do without a synchronized
        step or gradients."""
        self.refuse_if_closed()
        r = self.record
        if not (r.sync_pending or r.arrivals):
            return None
        return self.finish()

    def abort(self, reason):
        self.refuse_if_closed()
        step = self.session.current_step
        # (As in finish: the zeros go out before this rank serves the others' gathers.)
        self.session.begin_abort(step, reason)
        self.framework.serve_gathers()
        return self.apply(self.session.abort(step, reason))

    def join(self):
        self.refuse_if_closed()
        first, steps = self.session.join()
        self.new_step()
        return {"first_step": first, "steps": steps}

    def begin_shadow_step(self):
        """Send this rank's zeros for the others' open step now; the next
        :meth:`shadow_step` collects the step (a joined rank that serves the
        others' parameter gathers first: their reductions never wait for it)."""
        self.raise_if_unfinished("join")
        self.session.begin_shadow_step()

    def shadow_step(self):
        """One step of a rank out of data: zeros for the others' open step.
        The framework sees the step (``joined_step``): a sharded rank steps
        its partition with the others' averages."""
        self.raise_if_unfinished("join")
        result = self.session.shadow_step()
        self.last_report = result.report
        try:
            lent = self.framework.joined_step(result)
        finally:
            self.new_step()
        if not lent:
            result.release()
        return self.last_report

    def reset(self):
        self.refuse_if_closed()
        step = self.session.reset()
        self.new_step()
        return step

    def apply(self, result):
        """Write a finished step into the gradients (or clear them when no
        rank may apply it), open the next step; returns the report."""
        report = result.report
        self.last_report = report
        lent = False
        try:
            if self.elastic is not None:
                self.elastic.step_ended(report)
            if result.applied:
                lent = self.framework.write_back(result, self.record)
                if self.elastic is not None:
                    self.elastic.step_applied(report)
            else:
                self.framework.clear()
                if report.outcome == "skipped":
                    log.warning("gradsync step %d skipped: ranks %s aborted", report.step, report.aborted)
        finally:
            if not lent:
                result.release()
            self.new_step()
        return report

    def new_step(self):
        self.record = self.framework.new_record()

    # ---- settings between steps -------------------------------------------------------------

    def set_wire(self, wire, what):
        """Send data buckets as ``wire`` from the first step (``what`` names
        the call in errors): before the first step, on every rank."""
        if self.session.current_step != 0 or self.record.arrivals:
            raise ConfigError(f"{what} after training started: choose the wire type before the first step")
        self.session.set_wire_dtype(wire)
        self.wire = wire

    def set_divisor(self, divisor):
        """What the sum of every step that has not begun is divided by
        (``"contributors"``, ``"world"``, ...): every rank at the same point."""
        self.session.set_divisor(divisor)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside the block accumulate into the gradients
        without ending a step."""
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def close(self, why):
        """Remove the hooks and stop the runtime; later use raises
        :class:`gradsync.ClosedError` with ``why``."""
        if self.closed_why is not None:
            return
        self.closed_why = why
        if self.framework is not None:
            self.framework.remove_hooks()
        for stop in self.on_close:
            stop()
        self._communicator.abandon()
        self.session.close()
        self._communicator.closed()
