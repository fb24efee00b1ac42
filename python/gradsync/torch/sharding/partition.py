"""A sharded model's gradients: each rank's partition of every bucket.

With ``shard_gradients=True`` rank ``r`` keeps the average of its
*partition* of each bucket only: NCCL reduce-scatters the bucket; gloo
all-reduces it (cheaper there than its reduce-scatter) and the runtime
keeps the partition, as it does in an elastic job, whose ranks also keep
their buddy's partition (``actors/src/scheduler/partition.rs``). Where the
partitions meet the parameters is the :class:`~gradsync.torch.sharding.layout.Layout`
(pieces); a :class:`Partition` is that layout plus a step's life::

    backward ─▶ the runtime keeps this rank's partition of each bucket
    write-back (C++, Ledger.write_pieces) ─▶ each piece's .grad: its averages (a view of the step's
             memory while no earlier step is on loan, else a copy); received ─▶ the step moves on
    clip     ─▶ the global norm over every rank's pieces (the runtime's gather of partial norms)
    optimizer.step() over the pieces (views of the parameters: updated in place)
    gather   ─▶ every rank's updated pieces into every rank's parameters (the runtime's all-gather)

``.grad`` of the parameters stays ``None``: no rank holds a whole gradient
after backward. Where the step stands is :class:`~gradsync.torch.sharding.step.ShardedStep`.
"""

import contextlib
import weakref

import torch

from gradsync._errors import ConfigError
from gradsync.torch.sharding.layout import Layout, flat_values, write_values
from gradsync.torch.sharding.norm import Clipping
from gradsync.torch.sharding.step import ShardedStep


class Partition(Layout, Clipping):
    """This rank's partition of every bucket of a sharded wrapper's plan
    (see the module docs). ``plan``: the session's ``plan()``; ``params``:
    the wrapper's parameters in registration order; ``reals(p)``: how many
    values of the bucket ``p`` takes; ``states``: the wrapper's state group
    (``_states.StateBroadcast``), where the all-gathers and norms travel;
    ``gathering``: the runtime's gathers (``sharding.gather.ParameterGather``);
    ``names``: the parameters' names, for errors. In an elastic job
    ``recover`` is its recovery, ``start_checks`` a list (the optimizers'
    checks wait for the first boundary) and ``holds`` whether this rank
    holds a partition yet (a replacement does not before its first
    settlement)."""

    def __init__(self, plan, params, names, rank, world, reals, states, gathering, buddy_stride=0, own_all=False,
                 read=True, recover=None, start_checks=None, holds=True):
        super().__init__(plan, params, rank, world, reals, buddy_stride, own_all, read)
        self.names = names
        #: The state group of the current membership (``_states.StateBroadcast``).
        self.states = states
        #: The sharded optimizer built last over this partition (a weak
        #: reference): a rank out of data steps it for the others (``join``).
        self.optimizer = None
        #: The ``ShardedAveragedModel`` s over this partition (weak
        #: references), in the order they were built: their pieces'
        #: averages move with the pieces at a change of members
        #: (``sharding.reshard.settle``).
        self.averaged = []
        #: Ranks that had joined (run out of data) in the last step.
        self.joined = []
        #: Where this rank's sharded step stands (``sharding.step``: its one
        #: writer; everything here and elsewhere calls its verbs).
        self.sharded_step = ShardedStep(holds)
        #: An elastic job's recovery (``Elastic.recover``), called with a
        #: failure of a collective outside backward (clip, step); ``None``:
        #: not elastic, the failure is raised.
        self.recover = recover
        #: Whether :meth:`gather` pipelines its buckets (start each as soon
        #: as it is packed, unpack each while the later ones are in flight);
        #: off, one gather of every bucket (the benchmarks' baseline).
        self.pipelined = True
        #: Where the parameters' gathers run (``sharding.gather.ParameterGather``:
        #: the runtime's).
        self.gathering = gathering
        #: Under parameter sharding (``shard_parameters=True``), where the
        #: parameters' whole values stand (``sharding.parameters.ShardedParameters``):
        #: released at the end of each step, gathered by the next forward;
        #: ``None``: the parameters are always whole (ZeRO-2). Set once, by
        #: the owner of this partition (``sharding.sharded.Sharded``).
        self.residence = None
        #: Under parameter sharding outside elastic jobs, this rank's piece
        #: server and its reader of the others' (``sharding.served``): a rank
        #: reads the whole model alone from them; ``None``: not served. Set
        #: once, by the owner of this partition (``sharding.sharded.Sharded``).
        self.served = None
        #: Checks that every rank makes once over the state group (that all
        #: built the same sharded optimizer), held until an elastic job's
        #: first step boundary, where a member lost meanwhile is recovered
        #: from (a list until then); ``None``: made at once.
        self.start_checks = start_checks
        #: Whether the pieces hold an averaged model's values now (inside
        #: ``ShardedAveragedModel.applied()``): an optimizer step is refused.
        self.averaged_applied = False
        #: The gradients the last optimizer step applied, by parameter index
        #: (weak references: a gradient dropped since is gone from here too),
        #: so a second optimizer whose first step would apply them again is
        #: refused (:meth:`applied_again`).
        self._applied = {}

    # ---- a step's averages ------------------------------------------------------------------

    def received(self, result):
        """The runtime's step ``result`` was written into the pieces'
        ``.grad`` (by the C++ write-back, ``Ledger.write_pieces``, over
        :attr:`targets`): the sharded step moves on, owing its partition's
        update if this rank aborted a step the others applied."""
        report = result.report
        self.sharded_step.received(owed=report.step if any(r == self.rank for r, _ in report.aborted) else None)
        if self.residence is not None:
            self.residence.release()

    def step_joined(self):
        """This rank ran out of data and shadowed the others' step: step its
        partition with that step's averages and take part in the gather, as
        the others do in their ``optimizer.step()``."""
        optimizer = self.optimizer() if self.optimizer is not None else None
        if optimizer is None:
            raise ConfigError(
                "a rank out of data (join) must step its partition for the others, and no sharded optimizer was "
                "built: build it with model.shard_optimizer(...) before training"
            )
        optimizer.step()
        optimizer.zero_grad()

    def applied(self, indices):
        """An optimizer step applied the gradients of the pieces of
        ``indices`` (parameter indices): remembered for :meth:`applied_again`."""
        for i in indices:
            self._applied[i] = [weakref.ref(piece.tensor.grad) for piece in self.of_param.get(i, ())
                                if piece.tensor.grad is not None]

    def applied_again(self, indices):
        """The names of the parameters of ``indices`` whose pieces still hold
        a gradient an earlier optimizer step applied, untouched since. An
        optimizer seen for the first time cannot have cleared them: before
        its first step it steps the whole parameters, whose ``.grad`` stays
        ``None`` under sharding, so its ``zero_grad()`` reaches no piece."""
        stale = []
        for i in sorted(indices):
            held = {id(piece.tensor.grad) for piece in self.of_param.get(i, ()) if piece.tensor.grad is not None}
            if any(ref() is not None and id(ref()) in held for ref in self._applied.get(i, ())):
                stale.append(self.names[i])
        return stale

    def zero_grad(self, set_to_none=True):
        """The pieces' gradients dropped (``set_to_none``) or zeroed."""
        self._applied = {}
        for piece in self.every_held_piece():
            if set_to_none:
                piece.tensor.grad = None
            elif piece.tensor.grad is not None:
                piece.tensor.grad.zero_()

    def clear(self):
        """No piece keeps a gradient (what it held was applied, or must not be)."""
        self._applied = {}
        for piece in self.every_held_piece():
            piece.tensor.grad = None
        self.sharded_step.cleared()

    def skip(self):
        """The step ended skipped on every rank: nothing of it is applied,
        and the collectives of an update are not made (``ShardedStep.skipped``)."""
        self.clear()
        self.sharded_step.skipped_everywhere()
        if self.residence is not None:
            self.residence.release()

    def refuse_if_owed(self, before):
        """A rank that aborted a step the others applied (partial policy)
        must step its partition before its next step (``before`` names what
        began it): the others wait for it in the parameter gather."""
        step = self.sharded_step.take_owed()
        if step is None:
            return
        raise ConfigError(
            f"rank {self.rank} aborted step {step}, which the other ranks applied (abort_policy='partial': the "
            f"aborting rank receives their average too), and then began a {before} without optimizer.step(): with "
            "shard_gradients=True every rank steps its partition of each applied step and the others wait for it "
            "in the parameter gather. Call optimizer.step() after abort_step under the partial policy, as after "
            "any applied step (or use abort_policy='skip', where nobody steps a step some rank aborted)"
        )

    # ---- after the optimizer stepped ---------------------------------------------------------

    @torch.no_grad()
    def gather(self, everything=False, before_unpack=None, carries=None):
        """Every rank's pieces, updated by its optimizer, into every rank's
        parameters: per bucket, this rank writes its pieces into its chunk
        of the runtime's gather buffer (``BucketLayout.wide``'s precision;
        zeros past its partition), the runtime gathers every chunk
        (``sharding.gather.ParameterGather``), and each member reads back
        the values other ranks stepped (its part in this rank's partition is
        the piece the optimizer stepped in place). Pipelined: each bucket's
        gather starts as soon as its chunk is written, and a bucket is read
        back while the later ones are in flight; the copies of a bucket are
        one batched copy (``torch._foreach_copy_``: a few kernels on a GPU,
        not one per parameter). Every gather is done when this returns.
        ``everything``: every value is read back, this rank's own too (the
        parameters were released and hold nothing of it: parameter sharding);
        ``before_unpack(b)`` is called before bucket ``b`` is read back (once
        its gather is in flight: what allocates the parameters then);
        ``carries``: per bucket the dtype its values travel in (``everything``
        only: :meth:`gather_size`)."""
        before_unpack = before_unpack or (lambda b: None)
        if self.world == 1:
            if everything:  # (every piece is this rank's: into the parameters, no buffer)
                for b in range(len(self.buckets)):
                    before_unpack(b)
                self.write_owned()
            return
        if not self.pipelined:
            self._gather_at_once(everything, before_unpack, carries)
            return
        flight = self.gathering.start(self, range(len(self.buckets)), carries)
        self.gathering.finish(flight, lambda b: before_unpack(b) or True,
                              lambda b, whole, carry: self._read_back(b, whole, everything, carry))

    def _gather_at_once(self, everything, before_unpack, carries):
        """:meth:`gather` without the pipeline: every chunk written, one
        gather of every bucket, every parameter read back (what
        ``pipelined=False`` measures against)."""
        buffers = self.gathering.buffers(self.gather_sizes(carries))
        carries = carries or [None] * len(buffers)
        self.pack_every(buffers, carries)
        self.gathering.run()
        for b, whole in enumerate(buffers):
            before_unpack(b)
            self._read_back(b, whole, everything, carries[b])

    def _read_back(self, b, whole, everything, carry):
        """Bucket ``b``'s gathered buffer into its parameters: every value
        (``everything``, into released parameters: :meth:`unpack`) or the
        other ranks' (ZeRO-2)."""
        if everything:
            self.unpack(b, whole, carry)
        else:
            self._unpack(b, whole)

    @torch.no_grad()
    def refresh(self):
        """The pieces that hold their values themselves read them from their
        parameters (before an optimizer step: whatever changed the
        parameters since, a load or a broadcast, is what the step updates).
        A parameter whole in another dtype than its own (a rounded copy:
        ``param_dtype``) is not read back."""
        with self.writing_pieces():
            for piece in self.owned:
                if self.params[piece.param].dtype != self.forms[piece.param].dtype:
                    continue
                piece.tensor.copy_(flat_values(self.params[piece.param])[piece.offset : piece.offset + piece.length])

    @contextlib.contextmanager
    def writing_pieces(self):
        """Within the block the pieces are written: no other rank's read of
        them copies meanwhile (``sharding.served``), and they are served
        again after it at the step taken."""
        if self.served is None:
            yield
            return
        self.served.writing()
        try:
            yield
        finally:
            self.served.written()

    @torch.no_grad()
    def write_owned(self):
        """The pieces that hold their values themselves, just stepped, into
        their parameters (so a parameter always holds what this rank stepped,
        whether or not the gather that follows completes)."""
        by_param = {}
        for piece in self.owned:
            by_param.setdefault(piece.param, []).append(piece)
        for i, pieces in by_param.items():
            flat = flat_values(self.params[i])
            for piece in pieces:
                flat[piece.offset : piece.offset + piece.length].copy_(piece.tensor)
            write_values(self.params[i], flat)
