"""Unit tests of ``gradsync._gloo`` with fakes: how a gloo error becomes the
runtime's failure, and which ranks a failed collective names (no process
group, no second process)."""

import pytest

from gradsync._gloo import CTYPES, AddressArrays, GlooCommunicator, collective_failure

# gloo's messages as torch 2.x and Paddle 3.x print them (the last line is what counts).
TORCH_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation to complete"
PADDLE_TIMEOUT = "(PreconditionNotMet) ... TIMEOUT self_rank = 1 pair_rank = 0"
PEER_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


@pytest.mark.parametrize(
    "message, behind, kind, missing, peer",
    [
        (TORCH_TIMEOUT, [2], "timeout", [2], None),
        ("first line\n" + PADDLE_TIMEOUT, [0, 3], "timeout", [0, 3], None),
        ("Application timeout caused pair closure", [], "timeout", [], None),
        (PEER_CLOSED, [1], "peer_gone", [], 1),
        # A closed connection with two ranks behind cannot say which one went: a backend error naming both.
        (PEER_CLOSED, [1, 2], "backend", [], None),
        ("Broken pipe", [], "backend", [], None),
        ("unsupported tensor type", [], "backend", [], None),
    ],
)
def test_a_gloo_error_becomes_the_runtimes_failure(message, behind, kind, missing, peer):
    failed = collective_failure(RuntimeError(message), "step 3 bucket 0", behind)
    assert failed.kind == kind
    assert failed.missing == missing and failed.peer == peer
    assert str(failed).startswith("step 3 bucket 0: "), str(failed)
    if kind == "backend" and behind:
        assert f"ranks {behind} had not reached it" in str(failed)


def test_an_empty_message_is_named_by_its_type():
    failed = collective_failure(KeyError(), "step 0 control", [])
    assert failed.kind == "backend" and "KeyError" in str(failed)


class FakeStore:
    """A store's ``add`` over a dict, as c10d's and Paddle's stores count."""

    def __init__(self, broken=False):
        self.counts = {}
        self.broken = broken

    def add(self, key, amount):
        if self.broken:
            raise RuntimeError("store unreachable")
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


class Communicator(GlooCommunicator):
    def _new_group(self):
        pass


def test_a_failed_collective_names_the_ranks_whose_count_is_behind():
    store = FakeStore()
    ranks = [Communicator(store=store, prefix="m", rank=r, world=4) for r in range(4)]
    # Rank 0 started 3 collectives, ranks 1 and 3 two, rank 2 three.
    for r, n in enumerate([3, 2, 3, 2]):
        for _ in range(n):
            mine = ranks[r]._mark()
    failed = ranks[0].failure(RuntimeError(TORCH_TIMEOUT), "step 1 bucket 2", 3)
    assert failed.kind == "timeout" and failed.missing == [1, 3]
    # Judged against the failed collective's position, not the latest one.
    assert ranks[0].failure(RuntimeError(TORCH_TIMEOUT), "step 1 bucket 1", 2).missing == []
    assert mine == 2


def test_a_new_epoch_counts_from_zero():
    store = FakeStore()
    a, b = (Communicator(store=store, prefix="m", rank=r, world=2) for r in range(2))
    a._mark()
    a._mark()
    a.reset()
    b.reset()
    # a's two collectives of the old epoch do not count in the new one.
    assert a._mark() == 1
    assert b._behind(1) == [] and b._behind(2) == [0]


def test_an_unreachable_store_names_nobody():
    c = Communicator(store=FakeStore(broken=True), prefix="m", rank=0, world=3)
    assert c.failure(RuntimeError(TORCH_TIMEOUT), "step 0 control", 1).missing == []


def test_address_arrays_view_memory_by_type_and_reuse_their_types():
    import ctypes

    values = (ctypes.c_double * 3)(1.5, 2.5, 3.5)
    arrays = AddressArrays()
    view = arrays.at(ctypes.addressof(values), 3, "float64")
    assert list(view) == [1.5, 2.5, 3.5]
    assert type(arrays.at(ctypes.addressof(values), 3, "float64")) is type(view)
    assert set(CTYPES) >= {"float32", "float64", "int64", "bfloat16", "float16"}
