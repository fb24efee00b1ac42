"""The sharded step's state machine (``gradsync.torch.sharding.step``),
driven message by message as a rank's step sends them: no process group,
no model."""

import pytest

from gradsync.torch.sharding.step import Phase, ShardedStep


def test_an_applied_step_goes_received_clipped_stepped_gathered_and_counts_once():
    step = ShardedStep()
    assert step.phase is Phase.IDLE and not step.pending
    step.received()
    assert step.phase is Phase.RECEIVED and step.pending and step.clip_asked is None
    step.asked_to_clip(1.0, 2, {3, 1})
    assert step.clip_asked == (1.0, 2.0, (1, 3))
    step.clipped_by(4.0, 0.25)
    assert step.phase is Phase.CLIPPED and step.pending and step.clipped == (4.0, 0.25)
    assert step.stepping() is False, "an applied step is not a no-op"
    step.stepped()
    assert step.phase is Phase.STEPPED and not step.pending and step.taken == 1
    step.gathered()
    assert step.phase is Phase.IDLE and step.taken == 1


def test_a_second_optimizer_step_without_averages_counts_nothing():
    step = ShardedStep()
    step.received()
    step.stepped()
    step.gathered()
    step.stepped()  # (optimizer.step() again, no backward in between)
    step.gathered()
    assert step.taken == 1


def test_a_skipped_step_makes_no_collective_and_its_clip_records_nothing():
    step = ShardedStep()
    step.received()
    step.skipped_everywhere()
    assert step.skipped and step.quiet and not step.pending
    step.asked_to_clip(1.0, 2.0, {0})
    step.clipped_by(0.0, 1.0)
    assert step.clip_asked is None and step.clipped is None
    assert step.stepping() is True, "the optimizer step after a skipped step is a no-op"
    step.cleared()
    assert step.skipped, "zero_grad after a skipped step keeps it skipped"
    step.received()
    assert not step.skipped and step.pending, "the next averages end it"


def test_the_step_a_rank_aborted_and_the_others_applied_is_owed_until_it_steps():
    step = ShardedStep()
    step.received(owed=7)
    assert step.owed == 7
    step.stepping()
    assert step.take_owed() is None, "stepping pays it"
    step.received(owed=8)
    assert step.take_owed() == 8 and step.take_owed() is None, "a refusal reports it once"
    step.received(owed=9)
    step.skipped_everywhere()
    assert step.owed is None, "a step skipped everywhere owes nothing"


def test_a_settlement_latches_until_the_boundary_or_a_reduction_again():
    step = ShardedStep(holds=False)
    step.received()
    step.settlement_clipped((2.0, 0.5))
    step.settlement_stepped()
    assert step.taken == 1 and step.phase is Phase.IDLE and step.clipped == (2.0, 0.5)
    step.settled_at(5)
    assert step.settled and step.quiet and step.holds and step.taken == 5
    step.reduced_again()
    assert not step.settled
    step.settled_at(5)
    step.boundary_passed()
    assert not step.settled and not step.quiet


def test_a_refresh_after_a_load_does_not_latch():
    step = ShardedStep()
    step.settled_at(3, latch=False)
    assert not step.settled and step.taken == 3


@pytest.mark.parametrize("before", ["received", "skipped"])
def test_a_settlement_keeps_a_skipped_step_skipped_and_ends_a_pending_one(before):
    step = ShardedStep()
    step.received()
    if before == "skipped":
        step.skipped_everywhere()
    step.settled_at(2)
    assert step.skipped == (before == "skipped") and not step.pending
