"""Unit tests of ``gradsync._gloo`` with fakes: which ranks a failed
collective names, and what a communicator reports of a failure (no process
group, no second process). The classification itself is the runtime's
(actors/src/failure.rs, with its own unit tests)."""

from gradsync._gloo import CTYPES, AddressArrays, GlooCommunicator

# gloo's message as torch 2.x prints it: reported as it is, never parsed.
TORCH_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation to complete"


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
    message, behind = ranks[0].failure(RuntimeError("first line\n" + TORCH_TIMEOUT), 3)
    assert behind == [1, 3]
    assert message == TORCH_TIMEOUT, "the last line of gloo's message, as it is"
    # Judged against the failed collective's position, not the latest one.
    assert ranks[0].failure(RuntimeError(TORCH_TIMEOUT), 2)[1] == []
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
    assert c.failure(RuntimeError(TORCH_TIMEOUT), 1)[1] == []


def test_an_empty_message_is_named_by_its_type():
    c = Communicator(store=FakeStore(), prefix="m", rank=0, world=2)
    assert c.failure(KeyError(), 1)[0] == "KeyError"


def test_address_arrays_view_memory_by_type_and_reuse_their_types():
    import ctypes

    values = (ctypes.c_double * 3)(1.5, 2.5, 3.5)
    arrays = AddressArrays()
    view = arrays.at(ctypes.addressof(values), 3, "float64")
    assert list(view) == [1.5, 2.5, 3.5]
    assert type(arrays.at(ctypes.addressof(values), 3, "float64")) is type(view)
    assert set(CTYPES) >= {"float32", "float64", "int64", "bfloat16", "float16"}
