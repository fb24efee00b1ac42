"""Where a sharded model's step stands: one state machine, one writer.

A step of a sharded wrapper goes through phases on every rank::

    IDLE ──received──▶ RECEIVED ──clipped──▶ CLIPPED ──stepped──▶ STEPPED ──gathered──▶ IDLE
      ▲                   │  └─────────────────stepped─────────────▲
      │                cleared (zero_grad before stepping; a dropped step)
      └───────────────────┘
    any ──skipped──▶ SKIPPED      (the step ended skipped on every rank: the update's
                                   collectives, clip norm, found-inf vote and gather,
                                   are not made, so an optimizer step is a no-op
                                   whether or not a rank calls it)

and an elastic job adds the settlement of a change of members
(``sharding.reshard.settle``), which may step the pending averages itself and then
latches :attr:`ShardedStep.settled` until the next step boundary: the step's
remaining collectives are not made (the settlement made them).

:class:`ShardedStep` is the only thing that changes these; the partition,
the optimizer facade, the clip, the settlement and the wrapper call its
verbs (named for what happened) and read its properties. Its unit tests
(``python/tests/test_sharded_step.py``) drive it message by message, as the
scheduler's tests drive the runtime.
"""

import enum


class Phase(enum.Enum):
    """A sharded step's phase (see the module docs)."""

    #: No averages held: before the first step, after a step was gathered or cleared.
    IDLE = "idle"
    #: This step's averages are in the pieces' ``.grad``, not stepped yet.
    RECEIVED = "received"
    #: ... and clipped by the global norm (``clipped`` holds the norm and coefficient).
    CLIPPED = "clipped"
    #: The optimizer stepped the pieces; the parameters' gather is due.
    STEPPED = "stepped"
    #: The last step ended skipped on every rank and no averages arrived since.
    SKIPPED = "skipped"


class ShardedStep:
    """The phase of this rank's sharded step and what the settlement of a
    change of members compares (see the module docs)."""

    def __init__(self, holds=True):
        #: The phase (:class:`Phase`).
        self.phase = Phase.IDLE
        #: Optimizer steps taken with averages (an elastic job compares them
        #: after a change of members: who stepped the step under way).
        self.taken = 0
        #: This step's clipping as asked, ``(max_norm, norm_type, indices)``,
        #: before its collective (a change of members during it settles the clip).
        self.clip_asked = None
        #: This step's clipping as applied, ``(norm, coef)``.
        self.clipped = None
        #: A change of members was settled during this step: the step's
        #: remaining collectives (clip, step, gather) are not made, until
        #: the next step boundary (or until the step is reduced again).
        self.settled = False
        #: The step this rank aborted while the others applied it (the
        #: partial policy: it received their average too, and must step its
        #: partition for them) until its optimizer steps; else ``None``.
        self.owed = None
        #: Whether this rank's pieces hold data (a replacement's hold none
        #: until its first settlement).
        self.holds = holds

    # ---- what a step's phase answers ---------------------------------------------------------

    @property
    def pending(self):
        """The pieces hold this step's averages, not stepped yet."""
        return self.phase in (Phase.RECEIVED, Phase.CLIPPED)

    @property
    def skipped(self):
        """The last step ended skipped everywhere: its update makes no collective."""
        return self.phase is Phase.SKIPPED

    @property
    def quiet(self):
        """No collective of an update is to be made now (a skipped step, or
        one whose change of members was settled)."""
        return self.skipped or self.settled

    # ---- what happened -----------------------------------------------------------------------

    def received(self, owed=None):
        """A step's averages arrived in the pieces. ``owed``: the step's
        number when this rank aborted it and the others applied it."""
        self.phase = Phase.RECEIVED
        self.owed = owed
        self.clip_asked = self.clipped = None

    def cleared(self):
        """The pieces' gradients were dropped before they were stepped (or
        after: nothing of them is pending)."""
        if self.phase is not Phase.SKIPPED:
            self.phase = Phase.IDLE

    def skipped_everywhere(self):
        """The step ended skipped on every rank (an abort, a lost member)."""
        self.phase = Phase.SKIPPED
        self.owed = None

    def asked_to_clip(self, max_norm, norm_type, indices):
        """A clip by the global norm began (before its collective)."""
        if not self.skipped:
            self.clip_asked = (float(max_norm), float(norm_type), tuple(sorted(indices)))

    def clipped_by(self, norm, coef):
        """The pieces' gradients were clipped: total norm ``norm``, scaled by ``coef``."""
        if self.skipped:
            return
        self.clipped = (float(norm), coef)
        if self.phase is Phase.RECEIVED:
            self.phase = Phase.CLIPPED

    def stepping(self):
        """The optimizer is about to step: what this rank owed is paid.
        Returns whether the step is a no-op (it follows a skipped step)."""
        self.owed = None
        return self.skipped

    def stepped(self):
        """The optimizer stepped the pieces: a step taken when they held
        averages; the gather is due."""
        if self.pending:
            self.taken += 1
        self.phase = Phase.STEPPED

    def gathered(self):
        """Every rank's pieces reached the parameters."""
        if self.phase is Phase.STEPPED:
            self.phase = Phase.IDLE

    def settlement_stepped(self):
        """A settlement stepped the pending averages itself."""
        if self.pending:
            self.taken += 1
        self.phase = Phase.IDLE

    def settlement_clipped(self, clipped):
        """A settlement agreed on the step's clipping without stepping here."""
        self.clipped = clipped

    def settled_at(self, taken, latch=True):
        """A change of members was settled: every holder has taken ``taken``
        optimizer steps and this rank now holds its new partitions. ``latch``:
        the step's remaining collectives are not made (not for a refresh of
        the buddy copies after a checkpoint's load)."""
        self.taken = taken
        self.settled = latch
        self.holds = True
        if self.phase is not Phase.SKIPPED:
            self.phase = Phase.IDLE

    def reduced_again(self):
        """The failed step goes on, reduced again among the survivors: it
        clips, steps and gathers as usual."""
        self.settled = False

    def boundary_passed(self):
        """An elastic job's step boundary passed: the next step makes its collectives again."""
        self.settled = False

    def take_owed(self):
        """The step this rank owes (see :attr:`owed`), forgotten; ``None`` if none."""
        owed, self.owed = self.owed, None
        return owed
