"""Type stubs of gradsync's native extension (the Rust runtime)."""

from os import PathLike
from typing import Any, Optional, Protocol, Union

class Communicator(Protocol):
    """A Python communicator a :class:`Session` runs its collectives through
    (Paddle's, ``gradsync.paddle._comm``; torch's wrapper passes its C++
    engine instead), called on the communicator thread: ``all_reduce`` sums
    ``numel`` values of ``dtype`` at ``addr`` in place across the ranks and
    multiplies them by ``factor``, within ``timeout_s``; it returns ``None``,
    or ``(message, ranks behind)`` when the collective failed. ``reset``
    starts a new epoch (on a fresh group; ``rank`` and ``world`` are read
    after it)."""

    rank: int
    world: int
    def all_reduce(self, addr: int, numel: int, dtype: str, factor: float, timeout_s: float) -> Optional[tuple[str, list[int]]]: ...
    def reset(self) -> None: ...

class StepReport:
    """What one rank learned about one step (identical outcome on every rank)."""

    step: int
    rank: int
    outcome: str
    aborted: list[tuple[int, str]]
    contributors: int
    joined: list[int]
    arrivals: int
    duplicates: int
    rejected: int
    rejections: list[str]
    late_arrivals: int
    corrected: list[int]
    divisor: int
    """What the step's sum was divided by (1 for a step that does not apply)."""
    corrections: int
    unused_local: int
    unused_everywhere: list[int]
    buckets_launched: int
    buckets_launched_before_finish: int
    buckets_done_before_finish: int
    bytes_launched: int
    exposed_comm_s: float
    comm_busy_s: float
    admit: bool
    """A process waits to join (an elastic job): every rank admits it at this step boundary."""
    def to_dict(self) -> dict[str, Any]: ...

class Step:
    """A finished step: its report and, when it applies, the averaged gradients."""

    @property
    def report(self) -> StepReport: ...
    @property
    def applied(self) -> bool: ...
    def has(self, param: int) -> bool: ...
    def copy_into_ptr(self, param: int, addr: int) -> bool: ...
    def buckets(self) -> list[tuple[int, int, list[int], str, int]]:
        """Every bucket as ``(address, numel, members, dtype, start)``: the
        buffer holds the bucket from offset ``start`` on (a partitioned
        session's: this rank's partition; else 0)."""
    def release(self) -> None: ...

class Gathers:
    """A sharded wrapper's gather buffers, one per bucket, owned by the runtime."""

    def entries(self) -> list[tuple[Optional[int], int, int, str, bool]]:
        """``(bucket index or None for the norms, address, values, element
        type, on the device plane)`` per buffer."""
    @property
    def lost(self) -> bool:
        """A gather took the buffers and never gave them back: do not use them again."""

class Lane:
    """Parameter sharding's gather lane: a communicator thread of its own
    over ``communicator`` (a group apart from the session's), so gathers in
    forward and backward never queue behind the step's reductions."""

    def __init__(self, communicator: Communicator, rank: int, world: int, *, timeout_s: float = ...,
                 in_flight: int = ...) -> None: ...
    def needs(self, words: list[int]) -> list[int]:
        """Open a round: ``words`` summed over every rank."""
    def post_needs(self, words: list[int]) -> None:
        """Open a round without waiting for its sum (:meth:`sum_within` takes it)."""
    def sum_within(self, within_s: float) -> Optional[list[int]]:
        """The posted round's sum if it comes within ``within_s``, else ``None``."""
    def buffers(self, sizes: list[tuple[int, int, bool]]) -> Gathers:
        """Gather buffers in the lane's store: per ``(bucket, values, float64)``."""
    def start(self, gathers: Gathers, index: int) -> None:
        """Start gathering buffer ``index`` (this rank's chunk written)."""
    def wait(self, gathers: Gathers, index: int) -> None:
        """Wait for the oldest gather started, buffer ``index``."""
    def reset(self) -> None:
        """After a failure, on every rank: a new epoch of the lane's group."""
    def close(self) -> None:
        """Stop the lane's thread."""

class PieceServer:
    """This rank's server of its parameter pieces: threads of the runtime
    that answer other ranks' :class:`PieceReader` at their step, so one
    rank reads the whole model alone (``sharding.pieces``)."""

    def __init__(self, host: str) -> None: ...
    @property
    def address(self) -> str:
        """``host:port``, where readers reach it."""
    def register(self, pieces: list[tuple[int, int, int, int, str]]) -> None:
        """Serve ``(parameter, offset, host address, bytes, tag)`` pieces from
        now on (tag ``""``: the values; else a state of them, by name); their
        memory must live until the next call or :meth:`close`."""
    def writing(self) -> None:
        """The pieces are about to be written: returns once no copy runs."""
    def written(self, steps: int) -> None:
        """They were written and are at step ``steps``."""
    def close(self) -> None:
        """Stop serving; reads waiting are told so."""

class PieceReader:
    """One rank's reader of the other ranks' :class:`PieceServer` s."""

    def __init__(self, servers: list[Optional[str]]) -> None: ...
    def read(self, steps: int, params: list[int], tagged: bool,
             timeout_s: float) -> list[tuple[int, int, int, str, bytes]]:
        """Every other rank's pieces of ``params`` at step ``steps`` (their
        tagged ones, or their values): ``(rank, parameter, offset, tag, bytes)`` each."""

class Residency:
    """One rank's residency protocol of parameter sharding by units: the
    hooks report events, :meth:`next_command` says what to do (tuples named
    by their first item: ``("release", u)``, ``("post", words)``,
    ``("await_sum",)``, ``("await_sum_or_reductions", most)``,
    ``("await_reductions", most, patient)``, ``("gather", asked, keep)``,
    ``("finish_gather", keep)``, ``("zeros", keep)``), :meth:`answer` takes
    what came of those that wait."""

    def __init__(self, names: list[str], needs: list[list[int]], world: int, *, prefetch: bool = ...) -> None: ...
    def forward_begins(self, unit: int, recompute: bool) -> int:
        """A forward of ``unit`` begins; its call id."""
    def forward_ends(self, unit: int, recompute: bool) -> Optional[int]:
        """A forward of ``unit`` ended: the call whose backward comes, or ``None``."""
    def backward_begins(self, call: int, wait: Optional[int] = ...) -> None:
        """``call``'s backward begins (after at most ``wait`` buckets in flight)."""
    def backward_ends(self, call: int) -> None:
        """``call``'s backward ended."""
    def forward_ended(self) -> None:
        """The wrapper's forward returned."""
    def assemble(self) -> None:
        """The wrapper's forward begins: the root unit whole."""
    def assemble_all(self) -> None:
        """Every unit whole (``whole_parameters``)."""
    def released(self, unit: int) -> None:
        """The driver released ``unit`` itself."""
    def serve(self) -> None:
        """This rank's step ended: serve the others' rounds until every rank serves."""
    def serve_again(self) -> None:
        """Serve the others' step whatever this rank's last step left (``join``)."""
    def reset(self, step_ended: bool) -> None:
        """Every unit released; ``step_ended``: its order is learned."""
    def forget(self) -> None:
        """After a failed step's reset on every rank: nothing owed."""
    def settled(self, world: int) -> None:
        """The members settled on a new lane of ``world`` ranks."""
    def next_command(self) -> Optional[tuple]:
        """The next command, or ``None`` when nothing is left."""
    def answer(self, kind: str, value: object = ...) -> None:
        """``"sum"`` (a list), ``"settled"`` (a bool), ``"started"``,
        ``"gathered"``, ``"out_of_memory"`` or ``"lost"``."""
    def state(self, unit: int) -> str:
        """``"released"``, ``"arriving"``, ``"prefetched"`` or ``"whole"``."""
    def whole_units(self) -> list[int]: ...
    @property
    def broken(self) -> bool: ...
    @property
    def learned(self) -> list[int]: ...
    @property
    def prefetch(self) -> bool: ...
    def set_prefetch(self, on: bool) -> None: ...
    def counts(self) -> tuple[int, list[int], int, int, int]:
        """``(rounds, gathers per unit, most_whole, prefetched, polls)``."""

class Session:
    """One rank's gradient synchronizer over ``communicator``."""

    def __init__(
        self,
        communicator: Communicator,
        rank: int,
        world: int,
        names: list[str],
        numels: list[int],
        dtypes: list[str],
        *,
        bucket_cap_bytes: int = ...,
        timeout_s: float = ...,
        abort_policy: str = ...,
        divisor: Optional[Union[str, int]] = ...,
        record_timeline: bool = ...,
        param_shards: int = ...,
        in_flight: int = ...,
        reorder_buckets: bool = ...,
        wire_dtype: str = ...,
        membership: Optional[Membership] = ...,
        partitioned: bool = ...,
        reduce_scatter: bool = ...,
        buddy_stride: int = ...,
        units: Optional[list[int]] = ...,
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    def plan(self) -> list[tuple[int, list[int]]]:
        """The bucket plan as registered, in launch order: per bucket its
        element count and members (parameter indices, back to back)."""
    @property
    def current_step(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def arrive_ptr(self, step: Optional[int], param: int, token: int, addr: int) -> None:
        """Hand over a copy of ``param``'s whole local gradient so far, read
        from ``addr``, for ``step`` (``None``: the open step)."""
    def arrival_sink(self) -> ArrivalSink:
        """The entry through which ``gradsync.torch``'s C++ hooks hand gradients over."""
    def finish(self, step: int) -> Step: ...
    def gather_buffers(self, sizes: list[tuple[Optional[int], int, bool]]) -> Gathers:
        """Buffers for a sharded model's gathers: per ``(bucket index,
        values, float64)``, one of that many values where the buckets live
        (a bucket index of ``None``: every rank's partial gradient norm)."""
    def gather(self, gathers: Gathers) -> None:
        """Gather every rank's chunk into ``gathers``' buffers (this rank's
        written first); waits with the interpreter released."""
    def gather_start(self, gathers: Gathers, index: int) -> None:
        """Start gathering buffer ``index`` of ``gathers`` alone and return
        at once (several may be in flight, started in the same order on
        every rank)."""
    def gather_wait(self, gathers: Gathers, index: int) -> None:
        """Wait for the gather of buffer ``index`` that ``gather_start``
        began; a failure raises as a failed step does."""
    def abort(self, step: int, reason: Union[str, int]) -> Step: ...
    def begin_finish(self, step: int) -> None:
        """The first half of :meth:`finish`: what is left launched, the
        agreement under way; the next :meth:`finish` collects the result."""
    def begin_abort(self, step: int, reason: Union[str, int]) -> None:
        """The first half of :meth:`abort`; the next :meth:`abort` collects it."""
    def join(self) -> tuple[int, int]: ...
    def shadow_step(self) -> Step:
        """Contribute zeros to the other ranks' open step (one step of
        ``join``); the step lends the averages the others got."""
    def begin_shadow_step(self) -> None:
        """Send this rank's zeros for the other ranks' open step now; the
        next :meth:`shadow_step` collects the step (a joined rank serves the
        others' parameter gathers in between)."""
    def reset(self) -> int:
        """After a failed step, on every rank: agree on the step to continue at."""
    def resume(self, rank: int, world: int, buddy_stride: int = ...) -> tuple[int, Optional[Step]]:
        """An elastic job's members changed (this process is ``rank`` of
        ``world`` now, keeping buddy copies ``buddy_stride`` ranks on): agree among them on the step to continue at; with it,
        under the partial policy, the failed step reduced again among them
        (``None``: skipped on every member)."""
    def set_divisor(self, divisor: Union[str, int]) -> None:
        """Divide every step that has not begun by ``divisor`` (``"contributors"``,
        ``"world"``, ``"sum"`` or an integer); every rank at the same point."""
    def set_wire_dtype(self, wire: str) -> None:
        """Send data buckets as ``wire`` (before the first bucket, on every rank)."""
    def progress(self) -> dict[str, int]: ...
    def await_in_flight(self, in_flight_at_most: int, within_s: float) -> bool:
        """Back-pressure: wait until at most ``in_flight_at_most`` of the current step's buckets are still in their
        collective (or the step failed or ended), at most ``within_s`` seconds; whether that point was reached."""
    def write_timeline(self, path: Union[str, PathLike[str]]) -> int: ...
    def close(self) -> None: ...

class Membership:
    """One process's membership in an elastic job (the runtime's protocol
    over the job's store: a ``_collectives.StoreClient`` of torch's store, or
    an :class:`EtcdClient`; see ``gradsync.torch.elastic``). Rosters are dicts
    with ``epoch``, ``members`` (ids in rank order), ``nodes`` (each
    member's node, by rank), ``lost``, ``joined``, ``joiners_seen`` and
    ``buddy_stride`` (rank ``r`` keeps the buddy copy of rank
    ``(r + buddy_stride) % world``'s partition); failures raise
    ``gradsync.MembershipError``."""

    def __init__(
        self,
        table: int,
        client: Any,
        monitor_client: Any,
        cancel: Any,
        prefix: str,
        me: int,
        *,
        liveness_s: float = ...,
        beat_s: float = ...,
        suspect_grace_s: float = ...,
        admission_s: float = ...,
        min_members: int = ...,
        node: int = ...,
        probe_host: Optional[str] = ...,
    ) -> None: ...
    def start(self, initial: list[int], nodes: list[int]) -> dict[str, Any]:
        """Start as one of the job's first members (``initial``, in rank order; ``nodes``: each one's node)."""
    def request_join(self, fingerprint: str) -> dict[str, Any]:
        """Ask to join; wait until admitted (or refused)."""
    def gather(self, within_s: float) -> tuple[str, list[int]]:
        """Before the current epoch's groups are built: arrive, and wait (on the
        store) until every member has (``("all", [])``), the epoch broke
        (``("broken", [])``), or ``within_s`` passed (``("missing", members)``)."""
    def recover(self, suspects: list[int]) -> dict[str, Any]:
        """The current epoch lost members: agree on the next roster with the survivors."""
    def admit(self, fingerprint: str) -> dict[str, Any]:
        """Admit the waiting joiners whose fingerprint matches (every member, same boundary)."""
    def expel(self, odd: list[int], why: str) -> dict[str, Any]:
        """Go on without ``odd`` (a desync right after a change); one of them gets kind ``"refused"``."""
    def end(self) -> None:
        """The training loop ended: processes waiting to join are told so."""
    @property
    def roster(self) -> dict[str, Any]: ...
    @property
    def me(self) -> int: ...
    @property
    def broken(self) -> Optional[int]:
        """The highest epoch the liveness monitor saw broken."""
    def silent(self) -> list[int]:
        """The peers this process watches whose heartbeats stopped."""
    def close(self) -> None:
        """Stop the liveness monitor and the probe listener (the process leaves the job)."""
    @staticmethod
    def obituary(table: int, client: Any, prefix: str, member: int) -> None:
        """Record that ``member``'s process was reaped (the supervisor calls it)."""
    @staticmethod
    def members_left(table: int, client: Any, prefix: str) -> list[int]:
        """The newest roster's members that no obituary names (the supervisor reads it)."""
    @staticmethod
    def give_up(table: int, client: Any, prefix: str, why: str) -> None:
        """No member is left: waiting joiners end with kind ``"no_members"``."""

class EtcdClient:
    """A client of an etcd cluster (v3, its JSON gateway over plain HTTP),
    every key under ``prefix``; an elastic job's store (``client`` of
    :class:`Membership`). Failures raise ``gradsync.MembershipError``."""

    def __init__(self, endpoints: str, prefix: str = "", timeout_s: float = 30.0) -> None: ...
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> Optional[bytes]:
        """The value at ``key``, or ``None`` (never waits)."""
    def add(self, key: str, delta: int) -> int:
        """Add ``delta`` to the integer at ``key`` (absent: 0); the new value."""
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (empty: absent); what it holds afterwards."""
    def delete(self, key: str) -> bool: ...
    def count(self) -> int:
        """Keys under this client's prefix."""
    def wait(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every key appeared within ``timeout_s``."""
    @property
    def endpoints(self) -> str: ...

class ArrivalSink:
    """A session's arrival entry for the C++ hooks (``gradsync.torch._arrivals``);
    keep it alive while hooks may call it."""

    @property
    def address(self) -> int:
        """The address the hooks pass to the entry table's ``give``."""
    @staticmethod
    def table() -> int:
        """The address of the entry table (static)."""
    def raise_refusal(self) -> None:
        """Raise the refusal the last ``give`` kept (``RejectedError`` or ``ClosedError``)."""

def install_prometheus(addr: str, allow_remote: bool = False) -> None: ...
def version() -> str: ...
def held_ranges(numel: int, rank: int, world: int, buddy_stride: int) -> list[tuple[int, int, int]]:
    """What ``rank`` of ``world`` keeps of a bucket of ``numel`` values:
    ``[(start, end, at)]``, each a range of the bucket and where it begins
    in the buffer a step lends; its own partition first, then its buddy's
    (with a ``buddy_stride`` above 0). The runtime's rule."""

def sources(numel: int, places: list[Optional[tuple[int, int, int]]]) -> list[tuple[int, int, Optional[int]]]:
    """Where each value of a bucket of ``numel`` values comes from after a
    change of members, from every member's old place ``(rank, world,
    buddy_stride)`` (``None``: it holds nothing): ``[(start, end,
    source)]`` covering the bucket, each source a member's index (an owner
    first, else a buddy), ``None`` where nobody holds it."""

def partition(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s partition ``(start, end)`` of a bucket of ``numel``
    values reduce-scattered over ``world`` ranks."""
def wait_for_closing() -> None:
    """Wait until every session dropped without ``close`` has stopped its
    threads (registered with ``atexit`` by the package)."""
