"""An elastic job: a lost rank does not end it, and a replacement joins it.

Launch with gradsync's supervisor (it hosts the store that holds the job's
membership, so the store outlives every training process, and it starts a
replacement for a worker that dies)::

    python -m gradsync.launch --nproc 4 --rejoin train.py

The training script::

    elastic = gradsync.torch.Elastic()                       # this process's membership
    model = DistributedDataParallel(net, elastic=elastic)    # no init_process_group needed
    optimizer = torch.optim.AdamW(model.parameters())
    elastic.track(model=model, optimizer=optimizer)          # what a joiner receives
    for step in elastic.steps(total):
        x, y = shard(step, elastic.rank, elastic.world)      # rank and world may change
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

What happens:

* **A member is lost** (its process killed at any point, or its host gone
  silent): the step in flight fails on every survivor (a closed socket at
  once; a silent host when the liveness monitor's window passes; the monitor
  cancels the collectives of that membership epoch). Inside ``backward()``
  the survivors agree on one new roster through the store (the runtime's
  protocol: ``gradsync._native.Membership``), move to a fresh group, and the
  step is skipped on every survivor (``.grad`` cleared, so the optimizer step
  does nothing), or, under ``abort_policy="partial"``, reduced again among
  the survivors from the contributions each kept (``.grad`` holds their exact
  average; skipped instead if any survivor had already applied the step or
  could not contribute all of it); ``backward()`` returns normally. No process restarts, no
  checkpoint is read. A loss can show at the step boundary instead (the
  buffer broadcast): that member recovers there. At the next step boundary
  the survivors compare where each stands, ``(steps applied, next step)``;
  if any two differ (the lost member died while some survivors had applied
  the step and others had not, or between two steps, so that one survivor
  recovered at the boundary while the others failed and skipped the next
  step), everyone takes the state of the one furthest on: the survivors are
  always bitwise identical, and on the same step.
* **Slow is not dead**: each peer's liveness window adapts to the pauses
  seen between its heartbeats (``liveness_s`` is the floor), and an
  agreement waits for a member whose heartbeat still moves, so a loaded
  machine does not lose healthy members.
* **A process joins** (a replacement the supervisor started): it asks the
  store; the members' monitors see it and say so in the next step's control
  vote; after that step every member admits it at the same boundary, and a
  member sends it the tracked state (model, optimizer, anything with
  ``state_dict``), the step counter and the history over gloo. The members
  stall for one step boundary plus that transfer. A joiner whose
  collectives differ from the members' in its first step (another bucket
  size, say) is sent away: a membership event, not the job's end.
* **Buffers** (``broadcast_buffers=True``, DDP's default) are sent from
  rank 0 at each step boundary instead of inside ``forward()``, where a
  member lost during the broadcast is recovered from like any other.
* **The divisor**: each step averages over the ranks present (default), or,
  with ``fixed_global_batch=True``, over the job's first world size (the
  global batch stays constant if each rank's batch grows to match).

:attr:`Elastic.events` lists every change (:class:`MembershipEvent`); the
``logging`` logger ``gradsync.elastic`` reports each.
"""

import dataclasses
import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

from gradsync._errors import ConfigError, DesyncError, MembershipError, StepFailedError
from gradsync._native import Membership
from gradsync.torch import _shim
from gradsync.torch._job import (  # noqa: F401  (ENV_*, EXIT_* and exit_status: this module's public names)
    ENV_FIRST, ENV_HOST, ENV_JOB, ENV_JOIN, ENV_MEMBER, ENV_NODE, ENV_NODES, ENV_STORE, EXIT_LEFT, EXIT_REFUSED,
    connect, env, exit_status, first_nodes, probe_host,
)
from gradsync.torch.etcd import is_etcd
from gradsync.torch._tracked import fingerprint, pack, unpack
from gradsync.torch.sharding.optimizer import sharded_optimizer_of

log = logging.getLogger("gradsync.elastic")

# A membership change that fails again (another member lost meanwhile) is retried this often.
_RECOVERY_ATTEMPTS = 8


@dataclasses.dataclass(frozen=True)
class MembershipEvent:
    """One change of an elastic job's members, as this process saw it.

    ``kind`` is ``"lost"``, ``"joined"`` or ``"refused"`` (members sent
    away because their collectives differed from the others' right after a
    change, e.g. a joiner with another bucket size: ``lost`` names them);
    ``step`` the step in flight (lost, refused: skipped on every survivor)
    or the boundary (joined); ``epoch`` the new membership epoch; ``lost``
    and ``joined`` member ids; ``rank`` and
    ``world`` this process's new place; ``seconds`` from the failure (or the
    admission) to the new group's first agreement; ``time`` when that
    agreement came (``time.time()``)."""

    kind: str
    step: int
    epoch: int
    lost: list
    joined: list
    rank: int
    world: int
    seconds: float
    time: float


class Elastic:
    """This process's membership in an elastic job (see the module docs).

    ``liveness_s``: a member whose heartbeat stops this long is lost (a host
    gone silent; a killed process is seen at once); the floor of each
    member's window, which grows with the pauses seen between its beats on
    a loaded machine. ``fixed_global_batch``:
    divide every step's sum by the job's first world size instead of the
    ranks present. ``timeout``: how long a store operation or a state
    transfer may take (seconds). ``beat_s``: how often the liveness monitor
    beats and looks at its peers (keep it well below ``liveness_s``).
    ``min_members``: after a loss, the job goes on only with at least this
    many members (default 1: any members that reach the store and one
    another go on; the store decides, so two sides of a partition never
    both do); fewer end it with ``MembershipError(kind="no_quorum")``.
    ``start_timeout_s``: how long the members of an epoch wait for one
    another before building its groups (a first member that never started,
    its host lost at start-up); those missing then are lost, as in training
    (one whose heartbeat stops is lost at once)."""

    def __init__(self, *, liveness_s=1.0, fixed_global_batch=False, timeout=300.0, beat_s=0.1, min_members=1,
                 start_timeout_s=300.0):
        address = env(ENV_STORE)
        self.job = env(ENV_JOB)
        self.member = env(ENV_MEMBER, int)
        self.first_world = env(ENV_FIRST, int)
        self.joining = os.environ.get(ENV_JOIN) == "1"
        self.fixed_global_batch = bool(fixed_global_batch)
        self.timeout_s = float(timeout)
        self.start_timeout_s = float(start_timeout_s)
        shim, why = _shim.load("collectives")
        if shim is None:
            raise ConfigError(f"an elastic job needs gradsync's C++ modules, and {why}")
        #: The job's store: the supervisor's ``TCPStore``, or an :class:`gradsync.torch.etcd.EtcdStore`.
        self.store, client, monitor_client = connect(shim, address, timeout, liveness_s)
        self._etcd = is_etcd(address)
        self._host = os.environ.get(ENV_HOST, "127.0.0.1")
        # Each epoch's rendezvous store under etcd (kept, as the groups built on it are).
        self._epoch_stores = []
        self.cancel = shim.Cancel()
        if isinstance(min_members, bool) or not isinstance(min_members, int) or min_members < 1:
            raise ConfigError(f"min_members={min_members!r}: use a whole number of members, 1 or more")
        #: The node this process runs on (its supervisor's).
        self.node = env(ENV_NODE, int) if ENV_NODE in os.environ else 0
        self.membership = Membership(
            shim.table(), client, monitor_client, self.cancel,
            f"{self.job}/membership", self.member, liveness_s=liveness_s, beat_s=beat_s,
            min_members=min_members, node=self.node, probe_host=probe_host(address),
        )
        #: The next step to run (the data position); a joiner receives it.
        self.step = 0
        #: Steps applied (a joiner receives it).
        self.applied = 0
        #: ``(step, world, contributors, ranks)`` of every applied step, in order
        #: (a joiner receives it): ``world`` and ``ranks`` as the step's batches
        #: were drawn (the ranks whose gradients are in the sum; a step reduced
        #: again after a loss names the survivors' ranks before it).
        self.history = []
        #: Every membership change this process saw.
        self.events = []
        self._reported = 0
        self._tracked = {}
        self._ddp = None
        # A joiner's state counts for nothing until it received the members'.
        self._fresh = self.joining
        # Whether the members compare (and may exchange) state at the next boundary.
        self._sync_pending = False
        # The admission a step's report asked for, answered once.
        self._admitted_after = None
        # When this process asked to join (its event waits for the members' state).
        self._join_began = None
        self._roster = None
        # A failed step reduced again among the survivors: (world, ranks) it was drawn with.
        self._redone_from = None
        # No step has ended since the last change of members: a desync now is
        # the change's doing (a joiner that differs), answered by sending the
        # odd members away instead of ending the job.
        self._unproven = False
        # The wrapper's parameters are sent from rank 0 at the first boundary
        # (DDP does it in its constructor; here a member lost meanwhile is
        # recovered from).
        self._send_parameters = not self.joining
        if not self.joining:
            self._roster = self.membership.start(list(range(self.first_world)), first_nodes(self.first_world))

    # ---- where this process stands ---------------------------------------------------------

    @property
    def rank(self):
        """This process's rank in the current membership."""
        return 0 if self._roster is None else self._roster["members"].index(self.member)

    @property
    def world(self):
        """Number of members now."""
        return 1 if self._roster is None else len(self._roster["members"])

    @property
    def buddy_stride(self):
        """Where a sharded job keeps buddy copies: rank ``r`` keeps rank
        ``(r + buddy_stride) % world``'s partition too (the roster picks it
        so that the copies sit on another node when there is one)."""
        return 1 if self._roster is None else self._roster["buddy_stride"]

    @property
    def is_member(self):
        """Whether this process belongs to the job (a joiner: once admitted)."""
        return self._roster is not None

    @property
    def epoch(self):
        """The membership epoch (0: the job's first members; +1 per change)."""
        return -1 if self._roster is None else self._roster["epoch"]

    def prefix(self, what):
        """The store prefix of ``what``'s groups in the current membership
        epoch (identical on every member)."""
        return f"{self.job}/{what}/m{self.epoch if self._roster else f'joiner{self.member}'}"

    # ---- what the training script calls ----------------------------------------------------

    def track(self, **objects):
        """Objects whose ``state_dict()`` a joiner receives (the wrapped
        model, the optimizer, an LR scheduler, a grad scaler ...), by name."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
            if isinstance(obj, torch.optim.Optimizer):
                # An optimizer over a sharded wrapper's parameters steps sharded from now on
                # (a change of members moves its state before its first step).
                sharded_optimizer_of(obj)
            self._tracked[name] = obj

    def steps(self, total):
        """The steps of the training loop, from the one this process is at
        (a joiner: the members') to ``total``. Each boundary first admits
        waiting processes and equalizes state after a membership change.
        A joiner that the job ended before admitting yields nothing. A
        process the job cannot keep gets :class:`gradsync.MembershipError`
        (from here or from ``backward()``): see its ``kind``."""
        if self._ddp is None:
            raise ConfigError("wrap the model with DistributedDataParallel(module, elastic=this) before steps()")
        if self.joining and not self._join():
            return
        while True:
            self._boundary()
            if self.step >= total:
                self.membership.end()
                return
            yield self.step
            self.step += 1

    def changes(self):
        r"""The membership changes since the last call (:class:`MembershipEvent`\ s):
        call it at the top of each step to log them or re-shard data."""
        news = self.events[self._reported:]
        self._reported = len(self.events)
        return news

    def progress(self):
        """Where the job stands, as a checkpoint keeps it
        (``gradsync.torch.checkpoint.save`` does): the next step to run
        (the one after the current step if it was applied, else the current
        one again), the steps applied and their history. Call it between
        steps or after ``optimizer.step()``."""
        applied_now = bool(self.history) and self.history[-1][0] == self.step
        return {"step": self.step + 1 if applied_now else self.step, "applied": self.applied,
                "history": [list(h) for h in self.history]}

    def restore(self, progress):
        """Go on from :meth:`progress` (a job restarted from a checkpoint,
        on any number of members; ``gradsync.torch.checkpoint.load`` does
        it): :meth:`steps` continues at its step. Every member calls it, before
        the loop."""
        self.step, self.applied = int(progress["step"]), int(progress["applied"])
        self.history = [tuple(h) for h in progress["history"]]
        self._fresh = False

    def close(self):
        """Leave the job (stops the liveness monitor)."""
        self.membership.close()

    # ---- what the wrapper and its core call (gradsync._core.Membership) ---------------------

    def attach(self, ddp):
        """Called by the wrapper built with ``elastic=self``: ``(store,
        prefix, rank, world)`` for its groups."""
        if self._ddp is not None:
            raise ConfigError("an Elastic handle synchronizes one wrapped model; build one wrapper per job")
        self._ddp = ddp
        if self._roster is not None:
            self._gather()
        return self._groups_store(), self.prefix("model"), self.rank, self.world

    def _gather(self):
        """Before the first groups are built (gloo's rendezvous waits for
        every rank and cannot be given up): each member says it arrived and
        waits, on the store, for the others (the runtime's
        ``Membership.gather``: the last to arrive opens the epoch's gate). A
        member whose heartbeat stops (the liveness monitor breaks the
        epoch, which opens the gate too), or that has not arrived within
        ``start_timeout_s`` (it never started: its host was lost at
        start-up), is lost: the others agree on a roster without it, as in
        training, and gather again."""
        while True:
            began = time.monotonic()
            epoch, members = self.epoch, list(self._roster["members"])
            while True:
                left = self.start_timeout_s - (time.monotonic() - began)
                state, missing = self.membership.gather(max(0.0, min(10.0, left)))
                if state == "all":
                    return
                if state == "broken" or left <= 10.0:
                    break
                log.warning("gradsync elastic: member %d waits for members %s to start (%.0f s of at most %.0f s)",
                            self.member, missing, time.monotonic() - began, self.start_timeout_s)
            log.warning("gradsync elastic: members %s did not reach epoch %d's groups; the others go on without them",
                        missing or "(lost meanwhile)", epoch)
            t = time.perf_counter()
            self._roster = self.membership.recover(missing)
            self._event("lost", sorted(set(members) - set(self._roster["members"])), [], t)

    def _groups_store(self):
        """The c10d store this epoch's process groups rendezvous on: the
        job's ``TCPStore``; under etcd (which torch's process groups cannot
        use directly: they clone their store, and a Python store cannot be
        cloned) a ``TCPStore`` the epoch's rank 0 hosts, its address
        published in etcd. Losing that process breaks the epoch anyway."""
        if not self._etcd:
            return self.store
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self._roster is None or self.rank == 0:  # (a joiner's own groups until admitted: unpublished)
            store = dist.TCPStore(self._host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            if self._roster is not None:
                self.store.set(f"{self.job}/rendezvous/{self.epoch}", f"{self._host}:{store.port}")
        else:
            key, epoch = f"{self.job}/rendezvous/{self.epoch}", self.epoch
            deadline = time.monotonic() + self.timeout_s
            while not self.store.check([key]):
                broken = self.membership.broken
                if broken is not None and broken >= epoch:
                    raise MembershipError.of("broken", f"epoch {epoch} broke before its rendezvous was published")
                if time.monotonic() > deadline:
                    raise MembershipError.of(
                        "deadline", f"epoch {epoch}'s rendezvous was not published within {self.timeout_s:.0f} s"
                    )
                time.sleep(0.01)
            host, _, port = self.store.get(key).decode().rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        self._epoch_stores.append(store)
        return store

    def step_ended(self, report):
        """Called by the wrapper's core: a step ended on every member (applied or not)."""
        self._unproven = False

    def step_dropped(self):
        """Called by a sharded wrapper settling a change of members: the
        step this process counted applied is dropped on every member (some
        survivors never received its averages, and none had stepped it)."""
        self.applied -= 1
        self.history.pop()

    def step_applied(self, report):
        """Called by the wrapper's core: a step was applied on every member."""
        self.applied += 1
        world, ranks = self._redone_from or (self.world, list(range(self.world)))
        self._redone_from = None
        self.history.append((self.step, world, report.contributors, ranks))

    def recover(self, error):
        """Called by the wrapper's core (and at a boundary): the step in
        flight (or a boundary's transfer) failed (``error``):
        agree on the new members and move to their group. Returns the failed
        step reduced again among them (partial policy, when every member
        could), or ``None``: the caller skips the step.

        A :class:`gradsync.DesyncError` right after a change of members
        (no step ended since) is the change's doing: every member saw the
        same odd ranks in the same vote, so they go on without them (a
        joiner that differs is refused: ``MembershipError(kind="refused")``
        on its side). Later, a desync is the program's and is raised."""
        began = time.perf_counter()
        drawn = list(self._roster["members"])
        before = set(drawn)
        kind, roster = "lost", None  # (roster: already decided)
        suspects = [drawn[error.peer]] if getattr(error, "peer", None) is not None else []
        if isinstance(error, DesyncError):
            if not self._unproven:
                raise error
            odd = [drawn[r] for r in error.ranks]
            log.warning("gradsync elastic: right after a change of members, members %s issued other collectives "
                        "than the rest (%s); going on without them", odd, error)
            kind, roster = "refused", self.membership.expel(odd, f"right after it was admitted: {error}")
        for _ in range(_RECOVERY_ATTEMPTS):
            roster = roster or self.membership.recover(suspects)
            try:
                redone = self._move(roster)
                break
            except (StepFailedError, RuntimeError, MembershipError) as again:  # another member lost during the change
                if getattr(again, "kind", None) == "shard_lost":
                    raise
                log.warning("gradsync elastic: epoch %d failed while forming (%s); agreeing again", roster["epoch"], again)
                roster, suspects = None, []
        else:
            raise MembershipError.of("broken", f"the members could not form a group after {_RECOVERY_ATTEMPTS} attempts")
        lost = sorted(before - set(self._roster["members"]))
        self._event(kind, lost, [], began)
        if redone is not None:
            self._redone_from = (len(drawn), [drawn.index(m) for m in self._roster["members"]])
        return redone

    def _move(self, roster):
        """Adopt ``roster``: the wrapper is reconfigured for the new epoch
        (its one seam, ``reconfigure``), which returns the failed step if
        the new members reduced it again."""
        self._roster = roster
        self._unproven = True
        redone = self._ddp.reconfigure(store=self._groups_store(), prefix=self.prefix("model"), rank=self.rank,
                                       world=self.world, epoch=roster["epoch"], buddy_stride=self.buddy_stride)
        self._sync_pending = True
        return redone

    def _event(self, kind, lost, joined, began):
        event = MembershipEvent(kind, self.step, self.epoch, lost, joined, self.rank, self.world,
                                time.perf_counter() - began, time.time())
        self.events.append(event)
        log.warning("gradsync elastic: step %d: members %s %s; epoch %d, this process is rank %d of %d (%.3f s)",
                    event.step, lost or joined, kind, event.epoch, event.rank, event.world, event.seconds)

    # ---- boundaries: admission and state ----------------------------------------------------

    def fingerprint(self):
        """What a joiner must share with the members: the tracked objects'
        state layout (names, shapes, dtypes, optimizer kind), as text."""
        return fingerprint(self._tracked)

    def _join(self):
        """A replacement asks to join and waits for the members' boundary;
        returns whether it joined (``False``: the job ended first)."""
        began = time.perf_counter()
        log.warning("gradsync elastic: member %d asks to join the job", self.member)
        try:
            roster = self.membership.request_join(self.fingerprint())
        except MembershipError as e:
            if e.kind != "ended":
                raise
            log.warning("gradsync elastic: the job ended before member %d was admitted", self.member)
            return False
        self.joining = False
        try:
            self._move(roster)
        except (RuntimeError, StepFailedError) as error:  # a member lost while this process was admitted
            log.warning("gradsync elastic: a member was lost while member %d was admitted (%s)", self.member, error)
            self.recover(error)
        # Logged once the members' state (and step) arrived, at the first boundary.
        self._join_began = began
        return True

    def abandoned(self):
        """Called by the wrapper's state transfers while they wait: why one
        of this epoch should stop waiting (the liveness monitor broke the
        epoch), or ``None``."""
        broken = self.membership.broken
        if broken is not None and broken >= self.epoch:
            return f"membership epoch {self.epoch} broke (a member went silent)"
        return None

    def _boundary(self):
        """Before each step: admit joiners, equalize state after a change
        (the members agree on the step itself, so none can run step s+1
        while another runs s), and send rank 0's parameters (the first
        boundary) and buffers (DDP does those in its constructor and each
        forward; here a member lost during them is recovered from, and every
        member redoes the boundary: one that failed in it makes the others
        fail in their next collective, and they meet in the equalization)."""
        for _ in range(_RECOVERY_ATTEMPTS):
            try:
                self._admit()
                changed = self._sync_pending
                if changed:
                    self._equalize()
                    self._sync_pending = False
                if self._send_parameters:
                    self._ddp.run_start_checks()
                    self._ddp.broadcast_module_states()
                    self._send_parameters = False
                # Buffers follow DDP's rule (sent after a synchronized forward);
                # after a change every member sends or receives them alike,
                # whatever its last forward was (a joiner has had none).
                self._ddp.broadcast_buffers(force=changed)
                self._ddp.boundary_passed()
                break
            except (RuntimeError, StepFailedError) as error:  # a member lost during the admission or transfer
                log.warning("gradsync elastic: a member was lost at the step %d boundary (%s)", self.step, error)
                self.recover(error)
        else:
            raise MembershipError.of(
                "broken", f"the members could not settle at step {self.step} in {_RECOVERY_ATTEMPTS} attempts"
            )
        if self._join_began is not None:
            self._event("joined", [], [self.member], self._join_began)
            self._join_began = None

    def _admit(self):
        """Admit the processes the last step's vote said are waiting (once per step)."""
        report = self._ddp.last_report
        if report is None or not report.admit or self._admitted_after == report.step:
            return
        self._admitted_after = report.step
        began = time.perf_counter()
        roster = self.membership.admit(self.fingerprint())
        if roster["joined"]:
            self._move(roster)
            self._event("joined", [], roster["joined"], began)

    def _equalize(self):
        """After a change: the members compare where each stands, as
        ``(steps applied, next step)`` (a joiner: nothing), and if any two
        differ, every member takes the state, the step and the history of
        the one furthest on (the most steps applied, then the furthest
        step; under the partial policy the earliest). Steps can differ with
        equal counts: a member that failed at a boundary (the buffer
        broadcast) had not started the step the others then failed and
        skipped; under the partial policy that step is run again by every
        member instead of skipped. On the wrapper's state group (the
        training thread's, never the communicator's)."""
        states = self._ddp.state_group
        mine = (0, 0) if self._fresh else (self.applied + 1, self.step + 1)
        # Reductions of a few words, not a word per member: O(1) bytes a member at any world.
        highest, lowest = states.extremes(mine)
        if highest == lowest:
            return
        applied = highest[0]
        # Among the members furthest on, the furthest step; under the
        # partial policy the earliest: a member that failed at the boundary
        # (a buffer broadcast) had not begun the step the others then failed
        # and skipped, and under this policy no step the survivors can
        # finish is skipped: they all run it (at the new world) instead.
        ahead = mine[0] == applied
        if self._ddp._sync.abort_policy == "partial":
            step = states.extremes([mine[1] if ahead else 2**62])[1][0]
        else:
            step = states.extremes([mine[1] if ahead else -1])[0][0]
        best = (applied, step)
        # The lowest rank standing there gives its state.
        source = -states.extremes([-self.rank if mine == best else -self.world])[0][0]
        payload = pack(self._tracked, self.step, self.applied, self.history) if self.rank == source else None
        data = states.broadcast_bytes(payload, source)
        if mine != best:
            self.step, self.applied, self.history = unpack(self._tracked, data)
            self._fresh = False
            log.warning("gradsync elastic: took rank %d's state (%d bytes): step %d, %d steps applied",
                        source, data.numel(), self.step, self.applied)
