"""The settlement of a change of members in a sharded elastic job
(``gradsync.torch.sharding.reshard``), driven directly: who sends which values, and
what each survivor does with a step in flight, from what every member said.

The other members are described by hand (``everyone``); this process holds a
real partition and sharded optimizer over a small model on a one-rank state
group, so each decision's local effect (a step taken, dropped or clipped) is
observed on real tensors. The end-to-end runs are in
``test_elastic_sharded.py``.
"""

import random
import threading
from types import SimpleNamespace

import pytest
import torch

import gradsync
from gradsync.torch._states import StateBroadcast
from gradsync.torch.sharding import reshard
from gradsync.torch.sharding.partition import Partition
from gradsync.torch.sharding.reshard import Sources, _merged, _settle_step, runs, settle, transfers
from gradsync.torch.sharding.standing import Standing, places_of, record, survey
from gradsync._native import held_ranges
from gradsync.torch.sharding.optimizer import ShardedOptimizer


class OneRank:
    """A state group of one rank: every collective is the identity."""

    def everyones(self, values):
        return torch.tensor([list(values)], dtype=torch.int64)

    def all_gather_objects(self, value):
        return [value]

    def reduce(self, tensor, op):
        return tensor

    extremes = StateBroadcast.extremes

    def broadcast_object(self, value, root):
        return value

    def broadcast(self, tensors, root=0):
        pass

    def exchange(self, sends, receives, tag=0):
        assert not sends and not receives, "one rank sends nothing"

    def exchange_objects(self, sends, receives, tag=0):
        assert not sends and not receives, "one rank sends nothing"
        return {}

    def all_gather(self, mine):
        return mine.clone()


def member(rank, world, taken=3, ready=False, clipped=None, asked=None, holds=True, stride=1):
    return {"holds": holds, "rank": rank, "world": world, "stride": stride, "taken": taken, "ready": ready,
            "clipped": clipped, "asked": asked}


def test_every_value_comes_from_its_owner_while_the_owner_lives():
    everyone = [member(r, 3) for r in range(3)]
    assert runs(9, everyone) == [(0, 3, 0), (3, 6, 1), (6, 9, 2)]


def test_a_lost_ranks_values_come_from_its_buddy_the_rank_before_it():
    # Rank 1 of 3 lost: the survivors are old ranks 0 and 2 (new members 0, 1).
    everyone = [member(0, 3), member(2, 3)]
    assert runs(9, everyone) == [(0, 6, 0), (6, 9, 1)]


def test_values_nobody_holds_have_no_source():
    # Ranks 1 and 2 of 4 lost: partition 2 lived on both.
    everyone = [member(0, 4), member(3, 4)]
    assert runs(8, everyone) == [(0, 4, 0), (4, 6, None), (6, 8, 1)]
    alone = [member(0, 4, stride=0), member(3, 4, stride=0)]
    assert runs(8, alone)[1] == (2, 6, None), "without buddies a lost rank's partition is gone"


def test_buddies_two_ranks_on_survive_a_lost_node():
    # Ranks 0, 1 on node 0 and 2, 3 on node 1 (stride 2: rank r keeps rank r + 2's partition). Node 1 lost.
    everyone = [member(0, 4, stride=2), member(1, 4, stride=2)]
    assert runs(8, everyone) == [(0, 2, 0), (2, 4, 1), (4, 6, 0), (6, 8, 1)]
    # With the next rank as buddy (stride 1) the same loss takes partition 3 and its copy.
    assert (6, 8, None) in runs(8, [member(0, 4), member(1, 4)])


@pytest.mark.parametrize("old_world,lost,joined,stride", [(4, [1], 0, 1), (8, [3], 0, 2), (16, [0, 9], 0, 4),
                                                          (5, [], 1, 1), (64, [17], 0, 1), (7, [2], 2, 3)])
@pytest.mark.parametrize("numel", [1, 10, 97, 1000])
def test_each_member_moves_what_it_holds_point_to_point_not_the_model(old_world, lost, joined, stride, numel):
    # The move broadcast every run of every bucket to every member: each member received the whole
    # model's values and state, in a broadcast per run (O(world) collectives per bucket). Now each
    # new holder receives its new partitions from their sources, and nothing else.
    survivors = [member(r, old_world, stride=stride) for r in range(old_world) if r not in lost]
    everyone = survivors + [member(0, 0, holds=False, stride=stride) for _ in range(joined)]
    world = len(everyone)
    new_stride = min(stride, world - 1)
    layout = Sources(places_of(everyone))
    plans = [transfers(numel, layout, r, world, new_stride) for r in range(world)]
    for r, (sends, receives) in enumerate(plans):
        wanted = sorted((lo, hi) for lo, hi, _ in held_ranges(numel, r, world, new_stride) if lo < hi)
        got = sorted(span for spans in receives.values() for span in spans)
        assert _merged(got) == _merged(wanted), f"member {r} receives {receives}, holds {wanted}"
        for source, spans in receives.items():
            assert plans[source][0].get(r) == spans, f"{source} -> {r}: sends {plans[source][0].get(r)}, {spans}"
        assert all(plans[dst][1].get(r) == spans for dst, spans in sends.items()), f"member {r}: {sends}"
        # What a member sends is what it held: its old partition and its buddy's, at most.
        sent = sum(hi - lo for dst, spans in sends.items() for lo, hi in spans if dst != r)
        assert sent <= 4 * (numel // old_world + 1), (r, sent, numel)
        # A few peers whatever the world: each old partition overlaps at most three new ones, two holders each.
        assert len(sends) <= 12 and len(receives) <= 6, f"member {r} exchanges with {sends} and {receives}"


@pytest.mark.parametrize("seed", range(4))
def test_the_sources_looked_up_by_old_rank_are_the_sweeps(seed):
    # Each member swept every bucket's holders (O(world log world) a bucket, 16 ms at 10,000 members, for
    # each of a model's hundreds of buckets); with one old layout a table by old rank, built once, answers
    # for the few old partitions a member's values span. Random losses, joiners and strides: the same
    # lost values, the same sources, the same plans as the sweep's.
    rng = random.Random(seed)
    compared = 0
    for _ in range(250):
        old_world = rng.randint(1, 24)
        old_stride = rng.randint(0, old_world - 1)
        gone = set(rng.sample(range(old_world), rng.randint(0, old_world - 1)))
        places = [(r, old_world, old_stride) for r in range(old_world) if r not in gone] + [None] * rng.randint(0, 2)
        rng.shuffle(places)
        world = len(places)
        stride = rng.randint(0, world - 1)
        numel = rng.choice([1, 3, 10, 97, 1000])
        looked_up, swept = Sources(places), Sources(places, sweep=True)
        assert looked_up.lost(numel) == swept.lost(numel), (places, numel)
        if swept.lost(numel) is not None:
            continue
        compared += 1
        for r in range(world):
            assert looked_up.sourced_by(numel, r) == swept.sourced_by(numel, r), (places, numel, r)
            assert transfers(numel, looked_up, r, world, stride) == transfers(numel, swept, r, world, stride), \
                (places, numel, r, stride)
    assert compared > 50


def test_a_replacement_sends_nothing_and_mixed_layouts_are_read_as_held():
    # A member that moved to the 2-rank layout already, one still in the 3-rank one, and a replacement.
    everyone = [member(0, 2), member(2, 3), member(0, 1, holds=False)]
    # Rank 0 of 2 holds both halves; rank 2 of 3 owns [8, 12): owners first.
    assert runs(12, everyone) == [(0, 8, 0), (8, 12, 1)]
    everyone = [member(1, 2), member(2, 3), member(0, 1, holds=False)]
    assert runs(12, everyone) == [(0, 12, 0)]  # rank 1 of 2 holds its half and rank 0's


@pytest.fixture
def sharded():
    """A partition of one rank over a 2-parameter model, its SGD optimizer,
    and this step's averages in its pieces (pending, not stepped)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.float64)) for n in (3, 2)]
    part = Partition([(5, [1, 0])], params, ["a", "b"], 0, 1, lambda p: p.numel(), OneRank(), None,
                     buddy_stride=1)
    optimizer = ShardedOptimizer(part, ["a", "b"], OneRank(), torch.optim.SGD, None, lr=0.5)
    for piece in part.pieces:
        piece.tensor.grad = torch.full((piece.length,), 2.0, dtype=torch.float64)
    part.sharded_step.received()
    part.sharded_step.taken = 3
    return part, optimizer, [p.detach().clone() for p in params]


def _settle(part, optimizer, others):
    step = part.sharded_step
    me = member(0, 1, taken=step.taken, ready=step.pending, clipped=step.clipped, asked=step.clip_asked)
    everyone = [me, *others]
    dropped, taken = _settle_step(part, optimizer, OneRank(), 0, Standing.of(everyone), Sources(places_of([me])))
    assert taken == step.taken, "every holder ends on the steps this one took"
    return dropped


def test_a_survivor_behind_one_that_stepped_steps_now_with_its_clipping(sharded):
    part, optimizer, before = sharded
    dropped = _settle(part, optimizer, [member(1, 2, taken=4, clipped=(8.0, 0.25), asked=(1.0, 2.0, (0, 1)))])
    assert not dropped and part.sharded_step.taken == 4 and not part.sharded_step.pending
    for p, b in zip(part.params, before):
        assert torch.equal(p.detach(), b - 0.5 * 2.0 * 0.25), "stepped with the other's coefficient"
    assert part.sharded_step.clipped == (8.0, 0.25)


def test_a_step_nobody_stepped_is_dropped_where_some_never_got_the_averages(sharded):
    part, optimizer, before = sharded
    dropped = _settle(part, optimizer, [member(1, 2, taken=3, ready=False)])
    assert dropped and part.sharded_step.taken == 3 and not part.sharded_step.pending
    assert all(piece.tensor.grad is None for piece in part.pieces)
    assert all(torch.equal(p.detach(), b) for p, b in zip(part.params, before))


def test_a_step_every_survivor_holds_is_taken_with_the_norm_computed_among_them(sharded):
    part, optimizer, before = sharded
    part.sharded_step.asked_to_clip(1.0, 2.0, (0, 1))  # this rank was in clip_grad_norm_ when the member was lost
    dropped = _settle(part, optimizer, [member(1, 2, taken=3, ready=True)])
    assert not dropped and part.sharded_step.taken == 4
    norm = (5 * 2.0**2) ** 0.5  # one rank: its pieces are the whole gradient
    coef = 1.0 / (norm + 1e-6)
    assert part.sharded_step.clipped == pytest.approx((norm, coef))
    for p, b in zip(part.params, before):
        assert torch.allclose(p.detach(), b - 0.5 * 2.0 * coef, rtol=0, atol=1e-15)


@pytest.mark.parametrize("other", [member(1, 2, taken=5), member(1, 2, taken=2, ready=False)])
def test_survivors_that_cannot_meet_on_one_step_are_an_error_not_a_guess(sharded, other):
    part, optimizer, _ = sharded
    part.sharded_step.cleared()
    if other["taken"] == 2:
        part.sharded_step.taken = 3  # this one stepped; the other never received the averages
    with pytest.raises(gradsync.MembershipError, match="should not happen"):
        _settle(part, optimizer, [other])


def test_a_lost_shard_names_the_two_ranks_and_says_what_to_do(sharded, monkeypatch):
    part, optimizer, _ = sharded
    part.rank, part.world = 0, 4  # as if this process were rank 0 of 4, rank 3 the other survivor
    monkeypatch.setattr(reshard, "survey", lambda part, *_: Standing.of([record(part), member(3, 4)]))
    with pytest.raises(gradsync.MembershipError) as caught:
        settle(part, OneRank(), 0, 2)
    assert caught.value.kind == "shard_lost"
    assert "ranks [1, 2]" in str(caught.value) and "checkpoint" in str(caught.value)


class ThreadStates:
    """One member's state group in a world of threads: each collective
    meets every member's call (``reduce``, ``all_gather_objects``,
    ``broadcast_object``; ``extremes`` is the real one, over ``reduce``),
    counting the gathers of every member's record."""

    extremes = StateBroadcast.extremes

    def __init__(self, world, rank):
        self._world, self._rank = world, rank

    def _meet(self, value):
        world = self._world
        world.slots[self._rank] = value
        world.barrier.wait()
        everyone = list(world.slots)
        world.barrier.wait()
        return everyone

    def reduce(self, tensor, op):
        everyone = torch.stack(self._meet(tensor.clone()))
        tensor.copy_(everyone.sum(0) if op == "sum" else everyone.max(0).values)
        return tensor

    def all_gather_objects(self, value):
        self._world.gathers += 1
        return self._meet(value)

    def broadcast_object(self, value, root):
        return self._meet(value)[root]


def _surveyed(members):
    """Every member's :func:`survey` of ``members`` (its ``(old rank, old
    world, stride)`` or ``None``, and its step), run on threads in new rank
    order; returns them and how many record gathers were made."""
    world = SimpleNamespace(slots=[None] * len(members), barrier=threading.Barrier(len(members)), gathers=0)
    parts = [SimpleNamespace(rank=(place or (0, 1, 1))[0], world=(place or (0, 1, 1))[1],
                             buddy_stride=(place or (0, 1, 1))[2],
                             sharded_step=SimpleNamespace(holds=place is not None, **step))
             for place, step in members]
    got = [None] * len(members)

    def run(r):
        got[r] = survey(parts[r], ThreadStates(world, r), r, len(members))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return got, Standing.of([record(p) for p in parts]), world.gathers // len(members)


def _steps(rng, n):
    top = rng.randint(3, 5)
    out = []
    for _ in range(n):
        taken = rng.choice([top, top, top - 1, top - 2])
        clipped = rng.choice([None, None, (rng.random(), rng.random())])
        asked = clipped and (1.0, 2.0, tuple(rng.sample(range(9), 3))) or rng.choice([None, (1.0, 2.0, (0, 4))])
        out.append({"taken": taken, "pending": rng.random() < 0.7, "clipped": clipped, "clip_asked": asked})
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_standing_reduced_in_a_few_words_is_what_every_record_gathered_says(seed):
    rng = random.Random(seed)
    old_world = rng.randint(3, 70)  # (past one word of the bitmap)
    stride = rng.randint(1, old_world - 1)
    lost = set(rng.sample(range(old_world), rng.randint(1, 2)))
    places = [(r, old_world, stride) for r in range(old_world) if r not in lost] + [None] * rng.randint(0, 2)
    got, expected, gathers = _surveyed(list(zip(places, _steps(rng, len(places)))))
    assert all(g == expected for g in got), "every member reads the same standing, the gathered one"
    assert gathers == 0, "survivors in order, one layout: no member's record is gathered"


@pytest.mark.parametrize("how", ["a survivor laid out anew", "ranks out of the old order"])
def test_a_standing_the_reductions_cannot_tell_is_gathered_record_by_record(how):
    rng = random.Random(how)
    places = [(r, 6, 1) for r in (0, 1, 3, 4, 5)] + [None]
    if how == "a survivor laid out anew":
        places[2] = (2, 5, 1)  # (a change during a change: it had moved to the layout of 5)
    else:
        places[1], places[2] = places[2], places[1]
    got, expected, gathers = _surveyed(list(zip(places, _steps(rng, len(places)))))
    assert all(g == expected for g in got)
    assert gathers == 1, how
