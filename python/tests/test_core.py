"""Unit tests of ``gradsync._core.ModelSync`` and ``gradsync._record`` with
fakes: the rules that end, apply, skip and refuse steps, driven directly, as
the scheduler's tests drive the scheduler (no process group, no runtime
threads, no second process)."""

import logging
from types import SimpleNamespace

import pytest

from gradsync import _core
from gradsync._errors import ClosedError, ConfigError, MembershipError, StepFailedError, UnfinishedStepError
from gradsync._record import PythonRecord


class FakeSession:
    """The runtime's ``Session`` as the core calls it: steps end with the
    result it is given (``results``), or raise it."""

    def __init__(self, communicator, rank, world, names, numels, dtypes, **settings):
        self.settings = settings
        self.current_step = 0
        self.results = []
        self.closed = False
        self.wire = None

    def finish(self, step):
        assert step == self.current_step
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        self.current_step += 1
        return result

    def abort(self, step, reason):
        """As ``finish``; the reason is kept (``aborted``)."""
        self.aborted = (step, reason)
        return self.finish(step)

    def begin_finish(self, step):
        """The step's end asked for (``begun``); the next ``finish`` collects it."""
        assert step == self.current_step
        self.begun = ("finish", step)

    def begin_abort(self, step, reason):
        assert step == self.current_step
        self.begun = ("abort", step)

    def set_wire_dtype(self, wire):
        self.wire = wire

    def close(self):
        self.closed = True


class FakeFramework:
    """A framework's part, recording what the core asked of it."""

    def __init__(self, lend=False):
        self.calls = []
        self.lend = lend
        self.records = 0
        #: What ``lost_gather`` answers (a sharded gather failed mid-step).
        self.spoiled = None

    def lost_gather(self):
        return self.spoiled

    def new_record(self):
        self.records += 1
        return PythonRecord(2)

    def hand_over_held(self, record):
        self.calls.append("held")

    def serve_gathers(self):
        # (Served only once the step's end was asked for: nobody's reductions wait for this rank.)
        assert self.session.begun[1] == self.session.current_step, "served before the step's end was asked for"
        self.calls.append("served")

    def write_back(self, result, record):
        self.calls.append(("write", result.report.step))
        return self.lend

    def joined_step(self, report):
        self.calls.append("joined")

    def clear(self):
        self.calls.append("clear")

    def remove_hooks(self):
        self.calls.append("unhooked")


class FakeCommunicator:
    def __init__(self):
        self.abandoned = False
        #: Set by the fixture: the sync whose session must be closed before the groups are let go.
        self.sync = None
        #: Whether ``closed`` came, and whether the session was already closed then.
        self.let_go_after_session = None

    def abandon(self):
        self.abandoned = True

    def closed(self):
        self.let_go_after_session = self.sync.session.closed


class FakeResult:
    """A finished step: its report, whether it applies, whether it was released."""

    def __init__(self, step, applied=True, outcome="applied"):
        self.report = SimpleNamespace(step=step, outcome=outcome, aborted=[1] if outcome == "skipped" else [])
        self.applied = applied
        self.released = False

    def release(self):
        self.released = True


@pytest.fixture
def sync(monkeypatch):
    monkeypatch.setattr(_core, "Session", FakeSession)
    communicator = FakeCommunicator()
    s = _core.ModelSync("Wrapper", "somewhere unseen", _core.DataPath(buckets="host"), communicator,
                        _core.Replica(0, 2, ["a", "b"], [3, 4], ["float32", "float32"]),
                        _core.SyncSettings(bucket_cap_bytes=1 << 20, timeout_s=5.0))
    communicator.sync = s
    framework = FakeFramework()
    s.attach(framework)
    framework.session = s.session
    return s


def synchronized_backward(sync, arrivals=1):
    """A forward under grad, then a backward that handed ``arrivals`` gradients over."""
    assert sync.before_forward(grad_enabled=True)
    sync.record.arrivals = arrivals


def test_the_end_of_a_synchronized_backward_ends_the_step_and_writes_it_back(sync):
    synchronized_backward(sync)
    result = FakeResult(0)
    sync.session.results.append(result)
    sync.end_of_backward()
    assert sync.framework.calls == ["held", "served", ("write", 0)]
    assert result.released, "nothing lent: the buckets go back at once"
    assert sync.last_report is result.report and sync.record.arrivals == 0, "the next step's record is fresh"


def test_a_backward_under_no_sync_ends_nothing(sync):
    with sync.no_sync():
        assert not sync.before_forward(grad_enabled=True)
    sync.end_of_backward()
    assert sync.framework.calls == [] and sync.session.current_step == 0


def test_lent_gradients_are_not_released(sync):
    sync.framework.lend = True
    synchronized_backward(sync)
    result = FakeResult(0)
    sync.session.results.append(result)
    sync.end_of_backward()
    assert not result.released, "views of the buckets keep them"


def test_a_skipped_step_clears_the_gradients_and_says_who_aborted(sync, caplog):
    synchronized_backward(sync)
    sync.session.results.append(FakeResult(0, applied=False, outcome="skipped"))
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        sync.end_of_backward()
    assert sync.framework.calls == ["held", "served", "clear"]
    assert "step 0 skipped: ranks [1] aborted" in caplog.text


def test_manual_finalization_waits_for_finalize_and_refuses_a_forward_before_it(sync):
    sync.manual_finalization = True
    synchronized_backward(sync)
    sync.end_of_backward()
    assert sync.framework.calls == [], "manual: the end of backward does not end the step"
    with pytest.raises(UnfinishedStepError, match="finalize_backward"):
        sync.before_forward(grad_enabled=True)
    with pytest.raises(UnfinishedStepError, match="finalize_backward"):
        sync.raise_if_unfinished("optimizer.step()")


def test_gradients_whose_end_was_not_seen_name_where_and_what_to_call(sync):
    synchronized_backward(sync)
    with pytest.raises(UnfinishedStepError, match="somewhere unseen.*finish_step"):
        sync.raise_if_unfinished("optimizer.step()")
    sync.record.end_queued_for = 7  # a backward that will end the step is running: not unfinished
    sync.raise_if_unfinished("forward")


def test_finish_step_is_a_no_op_without_a_synchronized_step(sync):
    assert sync.finish_step() is None
    assert sync.framework.calls == []


def test_a_failed_step_raises_without_a_membership(sync):
    synchronized_backward(sync)
    sync.session.results.append(StepFailedError("rank 1 timed out"))
    with pytest.raises(StepFailedError, match="rank 1 timed out"):
        sync.end_of_backward()


class FakeMembership:
    """An elastic job's membership: recovers with ``redone`` (a result or None)."""

    def __init__(self, redone):
        self.redone = redone
        self.seen = []

    def recover(self, error):
        self.seen.append(("recover", str(error)))
        return self.redone

    def step_ended(self, report):
        self.seen.append(("ended", report.step))

    def step_applied(self, report):
        self.seen.append(("applied", report.step))


def test_in_an_elastic_job_a_failed_step_is_skipped_on_the_survivors(sync):
    sync.elastic = FakeMembership(redone=None)
    synchronized_backward(sync)
    sync.session.results.append(StepFailedError("rank 1 left"))
    records = sync.framework.records
    assert sync.end_of_backward() is None
    assert sync.elastic.seen == [("recover", "rank 1 left")]
    assert sync.framework.calls == ["held", "served", "clear"] and sync.framework.records == records + 1


def test_in_an_elastic_job_a_step_reduced_again_is_applied_and_told(sync):
    redone = FakeResult(0)
    sync.elastic = FakeMembership(redone=redone)
    synchronized_backward(sync)
    sync.session.results.append(StepFailedError("rank 1 left"))
    sync.end_of_backward()
    assert sync.elastic.seen == [("recover", "rank 1 left"), ("ended", 0), ("applied", 0)]
    assert ("write", 0) in sync.framework.calls


def test_a_rank_whose_gradients_came_from_a_failed_gather_aborts_its_part_of_the_step(sync):
    # Sharded parameters in an elastic job: a member lost during the gathers left this rank's gradients
    # computed from zeros. It ends the step with an abort (never summed again under the partial policy);
    # the lost member fails the step's collectives, and the survivors recover as after any failed step.
    sync.elastic = FakeMembership(redone=None)
    sync.framework.spoiled = "a parameter gather failed (rank 1 left)"
    synchronized_backward(sync)
    sync.session.results.append(StepFailedError("rank 1 left"))
    assert sync.end_of_backward() is None
    assert sync.session.aborted[0] == 0 and sync.elastic.seen == [("recover", "rank 1 left")]
    assert sync.framework.calls == ["held", "clear"]


def test_a_failed_gather_whose_step_still_completes_is_a_broken_membership(sync):
    # No member was lost (the step's own collectives completed) though a gather failed: not guessed at.
    sync.elastic = FakeMembership(redone=None)
    sync.framework.spoiled = "a parameter gather failed (a timeout)"
    synchronized_backward(sync)
    sync.session.results.append(FakeResult(0, applied=False, outcome="skipped"))
    with pytest.raises(MembershipError, match="step 0: a parameter gather failed"):
        sync.end_of_backward()


def test_the_wire_type_is_chosen_before_training_only(sync):
    sync.set_wire("bfloat16", "wire_dtype")
    assert sync.session.wire == "bfloat16"
    synchronized_backward(sync)
    with pytest.raises(ConfigError, match="before the first step"):
        sync.set_wire("float16", "wire_dtype")


def test_close_takes_the_hooks_off_gives_up_waiting_and_refuses_later_use(sync):
    sync.close("closed by the test")
    sync.close("again")  # idempotent: the first reason stays
    assert sync.framework.calls == ["unhooked"]
    assert sync._communicator.abandoned and sync.session.closed
    # The groups are let go only once the session (and its communicator thread) has stopped.
    assert sync._communicator.let_go_after_session is True
    with pytest.raises(ClosedError, match="closed by the test"):
        sync.before_forward(grad_enabled=True)


def test_a_python_record_hands_over_only_what_no_synchronized_backward_reached():
    record = PythonRecord(3)
    record.held[0] = record.held[2] = True
    record.fired[2] = 1
    assert record.held_unsent() == [0]
    assert not record.sync_pending
    record.ask_for_sync()
    assert record.sync_pending and record.end_queued_for is None
