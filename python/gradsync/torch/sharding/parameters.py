"""Parameter sharding (ZeRO-3), first step: where a parameter's whole values stand.

With ``shard_parameters=True`` each rank keeps its pieces of every
parameter in memory of their own (``Layout(own_all=True)``: about ``1 /
world`` of the parameters), and a parameter's whole values exist only
from the forward that needs them to the end of the step::

    the step ends (its averages are in the pieces' .grad, or it was skipped)
      └─▶ release: each piece reads its parameter (what the program wrote into a whole
          parameter is kept), then every parameter's memory is released
    optimizer.step() ─▶ steps the pieces; the parameters stay released, nothing is gathered
    the next forward (training or eval, every rank)
      └─▶ assemble: every bucket gathered, pipelined (the runtime's all-gather,
          ``Partition.gather(everything=True)``), into fresh whole parameters;
          the gather's buffers go back to the runtime at once

This is the residence of a model of one unit (no blocks to cut, or
``shard_parameters=[]``): the parameters are whole through forward and
backward, as under ``shard_gradients=True``, and released between steps.
Units gathered one at a time, before their forward and again before their
backward, on a lane of their own, are ``sharding.units``.

A released parameter holds an empty tensor (``p.data.numel() == 0``) of its dtype
and device: the same ``Parameter`` object, so the optimizer, the hooks and
tied weights keep it; reading its values raises, naming it
(``sharding.released``). The wrapped module's ``state_dict()`` then reads
the whole values alone, on any rank, from every rank's piece server
(``sharding.served``), and its ``load_state_dict()`` writes each rank's
pieces; where the pieces are not served (on a device) both are refused
with what to do (``model.whole_parameters()``, a collective every rank
enters).
"""

import contextlib
import weakref

import torch

from gradsync._errors import ConfigError, StepFailedError
from gradsync.torch.sharding.norm import LOST
from gradsync.torch.sharding.released import PENDING, held, mark_released, mark_whole, refusal


class ShardedParameters:
    """The whole values of a parameter-sharded wrapper's parameters: whole
    or released (see the module docs). ``partition``: the wrapper's
    ``sharding.partition.Partition`` (its pieces own their values). Starts
    whole: the parameters as the program built and loaded them.

    Every rank takes part in one gather per step, whatever its own step
    does: at its first forward, or, when it aborts the step before any
    forward (``abort_step``), there (:meth:`take_part`); so one rank's
    out-of-memory error never leaves the others waiting in a gather."""

    def __init__(self, partition):
        self._partition = partition
        #: Whether every parameter holds its whole values now (read back
        #: from every rank's pieces, or as the program built them).
        self.whole = True
        #: Whether this rank took part in the gather since the parameters were released.
        self.gathered = True
        #: Per parameter, the dtype it is whole in for a step's forward and
        #: backward: its own, or ``param_dtype`` (:meth:`compute_in`).
        #: Between steps and inside ``whole_parameters`` it is whole in its own.
        self.step_dtypes = [form.dtype for form in partition.forms]
        #: Hooks the wrapper's parameters again after one changed dtype (the
        #: wrapper's ``TorchHooks.rehook``; torch then forgets its gradient
        #: accumulator, and the hook with it).
        self.rehook = lambda: None
        #: Whether a parameter changed dtype since the hooks were last made.
        self._flipped = False
        #: Per bucket, the dtype a step's gather carries its values in
        #: (``param_dtype``, when every member computes in it), else ``None``
        #: (the bucket's own); ``None`` for all: none narrower.
        self.carries = None
        #: In an elastic job, the failure of a gather in this membership
        #: epoch (a member lost), or ``None``: from then on the step's
        #: gathers make no collective and leave zeros, so its forward and
        #: backward run to their end (the lost member fails the step's own
        #: collectives, and the members settle). Cleared when they settle
        #: (:meth:`discard`).
        self.broken = None
        #: Whether the module's state dict is being read for its keys while
        #: the values come from the pieces (:meth:`reading_pieces`).
        self._reading_pieces = False
        #: Whether the parameters are whole for one state dict, read from
        #: every rank's piece server by this rank alone (:meth:`state_dict_begins`).
        self._read_alone = False
        #: Whether the pieces were written as a model on the meta device was
        #: materialized (``sharding.materialize``): the parameters hold placeholders.
        self.materialized = False
        #: Whether this rank computed with a parameter left zeros by a
        #: failed gather (not only served one): its gradients of the step
        #: are not summed again by anyone (:meth:`lost_gather`).
        self.spoiled = False

    @torch.no_grad()
    def compute_in(self, dtype):
        """``param_dtype``: the float32 and float64 parameters compute in
        ``dtype`` (a rounded copy of the pieces, gathered for each step),
        their pieces stay in their own dtype (what the optimizer steps, and
        what the average of their gradients is written into). Called while
        wrapping, before the hooks are made, which then see each parameter
        shaped as whole in its step dtype (:meth:`_shaped`: what autograd's
        gradient accumulator keeps); :meth:`hooked` releases them, so the
        first forward already gathers in ``dtype``."""
        part = self._partition
        for i, form in enumerate(part.forms):
            if form.dtype in (torch.float32, torch.float64):
                self.step_dtypes[i] = dtype
        if not self.materialized:  # (else the pieces are written and the parameters hold placeholders)
            part.refresh()
        for i, p in enumerate(part.params):
            mark_whole(p)
            p.data = self._shaped(i)
        self.whole = self.gathered = False
        self.carries = [dtype if all(self.step_dtypes[i] == dtype for i in layout.members) else None
                        for layout in part.buckets]

    def hooked(self, rehook, release):
        """The wrapper made its hooks (after :meth:`compute_in`);
        ``rehook()`` makes them again (:meth:`hook_again`). ``release``:
        every parameter is released now (the hooks were made over whole
        shapes: under ``param_dtype``, or materialized from the meta device)."""
        self.rehook = rehook
        if not release:
            return
        for i, p in enumerate(self._partition.params):
            p.data = torch.empty(0, dtype=self.step_dtypes[i], device=p.device)
            self._mark_released(i)

    def _shaped(self, i):
        """A tensor of parameter ``i``'s whole shape in its step dtype over
        one element (what its gradient accumulator is made from)."""
        p, form = self._partition.params[i], self._partition.forms[i]
        return torch.zeros((), dtype=self.step_dtypes[i], device=p.device).expand(form.shape)

    def hook_again(self):
        """The wrapper's hooks made again if a parameter changed dtype since
        they were (torch forgot its gradient accumulator); every parameter
        is released in its step dtype here. Each is shaped as whole while
        the hooks are made: an accumulator keeps the shape it was made with."""
        if not self._flipped:
            return
        self._flipped = False
        part = self._partition
        memory = [held(p) for p in part.params]
        for i, p in enumerate(part.params):
            mark_whole(p)
            p.data = self._shaped(i)
        try:
            self.rehook()
        finally:
            for i, (p, data) in enumerate(zip(part.params, memory)):
                p.data = data
                if not data.numel():
                    self._mark_released(i)

    def whole_in_own_dtype(self):
        """Whether some parameter is whole in its own dtype now though it
        computes in another (``whole_parameters`` under ``param_dtype``):
        a step's forward releases it first, to gather it in its step dtype.
        (Asked at every forward: without ``param_dtype``, or released, it
        looks at no parameter.)"""
        if self.carries is None or not self.whole:
            return False
        part = self._partition
        return any(p.dtype != self.step_dtypes[i] for i, p in enumerate(part.params) if held(p).numel())

    def rounded(self, i):
        """Whether parameter ``i`` holds a rounded copy of its pieces now
        (whole in a narrower step dtype): never read back into them."""
        return self._partition.params[i].dtype != self._partition.forms[i].dtype

    @torch.no_grad()
    def release(self, step_ended=True):
        """The step ended (or an evaluation, or ``whole_parameters``: not
        ``step_ended``, which changes nothing here): the pieces read their
        parameters (when whole), then every parameter's memory is released
        (each an empty tensor)."""
        part = self._partition
        if self.whole and self.broken is None:  # (after a failed gather they hold zeros)
            part.refresh()
        self._release_every_parameter()
        self.whole = self.gathered = self._read_alone = False

    def _release_every_parameter(self):
        """Every parameter that holds values now released (an empty tensor),
        the hooks made again where a dtype changed."""
        for i, p in enumerate(self._partition.params):
            if held(p).numel():
                self._released(i)
        self.hook_again()

    def _released(self, i):
        """Parameter ``i`` an empty tensor of its step dtype; returns its
        whole tensor (what it held)."""
        p = self._partition.params[i]
        whole = held(p)
        p.data = torch.empty(0, dtype=self.step_dtypes[i], device=p.device)
        self._mark_released(i)
        self._flipped |= whole.dtype != p.dtype
        return whole

    def _mark_released(self, i):
        """Parameter ``i`` (emptied) marked released: a read of its values
        is served alone (:meth:`read_released`) or refused, naming it."""
        part, owner = self._partition, weakref.ref(self)
        mark_released(part.params[i], part.names[i], part.forms[i].shape,
                      lambda what: owner() and owner().read_released(i, what))

    def read_released(self, i, what):
        """Released parameter ``i``'s whole values in its own dtype, read for
        ``what`` (an operation's name) by this rank alone from every rank's pieces (``sharding.served``),
        or ``None`` where they are not served (on a device, after a failed
        gather)."""
        part = self._partition
        served = part.served
        if served is None or not served.serves or self.broken is not None:
            return None
        if served.mid_update:
            raise refusal(part.params[i], what, pending=True)
        return served.read_one(i)

    @torch.no_grad()
    def assemble(self, exact=False):
        """Every rank's pieces into whole parameters (a collective: every
        rank calls it at the same point, as each forward does). Each
        bucket's parameters are allocated once its gather is in flight, in
        their step dtype, or, ``exact``, their own. Nothing to do when the
        parameters are whole. Returns whether it gathered."""
        if self.whole:
            return False
        if self.gathered:
            raise ConfigError(
                "this rank's parameters were gathered for this step and could not all be read back (an error "
                "during the gather, out of memory most likely); the other ranks will not gather again. Call "
                "model.abort_step() and go on with the next step"
            )
        part = self._partition
        self.gathered = True
        if self.broken is None:
            try:
                part.gather(everything=True, before_unpack=lambda b: self._allocate(b, exact),
                            carries=None if exact else self.carries)
            except LOST as error:
                self.lost(error, exact)
            finally:
                # The buffers held the whole model again: back to the runtime until the next gather.
                part.gathering.drop()
        if self.broken is not None:
            if exact:
                raise StepFailedError(f"the parameters could not be gathered whole: {self.lost_gather()}")
            self.spoiled = True
            for b in range(len(part.buckets)):
                self._allocate(b, exact, zeros=True)
        self.whole = True
        part.sharded_step.gathered()
        return True

    def assemble_all(self):
        """Every parameter whole in its own dtype (``whole_parameters``):
        :meth:`assemble`."""
        return self.assemble(exact=True)

    def _allocate(self, b, exact=False, zeros=False):
        """Whole memory for bucket ``b``'s parameters, in their step dtype
        (``exact``: their own); ``zeros``: filled with zeros (a gather that
        failed: :attr:`broken`)."""
        for i in self._partition.buckets[b].members:
            if not held(self._partition.params[i]).numel():
                self._new_whole(i, exact)
                if zeros:
                    held(self._partition.params[i]).zero_()

    def _new_whole(self, i, exact):
        """Parameter ``i`` given new whole memory in its step dtype
        (``exact``: its own), in its form's shape and strides."""
        p, form = self._partition.params[i], self._partition.forms[i]
        dtype = form.dtype if exact else self.step_dtypes[i]
        self._flipped |= dtype != p.dtype
        mark_whole(p)
        p.data = torch.empty_strided(form.shape, form.stride(), dtype=dtype, device=p.device)

    def lost(self, error, exact=False):
        """A gather failed (``error``): in an elastic job a member was lost,
        and this rank goes on to its step's end without collectives on the
        gathers (:attr:`broken`); otherwise, or for ``whole_parameters``
        (``exact``: its values would be saved), it is raised."""
        if self._partition.recover is None:
            raise error
        self.broken = error
        if exact:
            raise StepFailedError(
                f"the parameters could not be gathered whole ({error}): a member was lost. Nothing was read or "
                "written; the job recovers in its next step. Call it again (every member) after that step"
            ) from error

    def lost_gather(self):
        """Why this rank's gradients of the step cannot be summed (a gather
        of the step failed: they were computed from zeros), or ``None``."""
        return f"a parameter gather failed ({self.broken})" if self.spoiled else None

    def discard(self):
        """The members settled after a change (``sharding.reshard``): the
        pieces hold the new layout's values, so every parameter is released
        without reading it back, nothing is owed to anyone's gathers, and
        the next forward gathers on every member."""
        part = self._partition
        for i, p in enumerate(part.params):
            if held(p).numel():
                self._released(i)
        self.whole = self.gathered = self.spoiled = False
        self.broken = None
        self.hook_again()

    def forget(self):
        """After a failed step's reset (every rank): released, whatever
        the failed step left."""
        self.release()

    def forward_begins(self):
        """Nothing: the wrapper's forward gathers every parameter (:meth:`assemble`)."""

    def forward_ended(self):
        """Nothing: the parameters stay whole until the step ends."""

    def serve(self):
        """Nothing to serve: one gather per step, made by every rank's
        first forward (or :meth:`take_part`)."""

    @torch.no_grad()
    def take_part(self):
        """This rank aborts a step before its first forward: it takes part
        in the step's gather as the others' forwards do, reading nothing
        back (the parameters stay released)."""
        if self.gathered:
            return
        part = self._partition
        self.gathered = True
        if self.broken is not None:
            return
        try:
            part.pack_every(part.gathering.buffers(part.gather_sizes(self.carries)), self.carries)
            part.gathering.run()
        except LOST as error:
            self.lost(error)
        finally:
            part.gathering.drop()

    def shadow(self, send_zeros):
        """This rank ran out of data (``join``) and shadows one step of the
        others: it takes part in that step's gather (:meth:`take_part`),
        whatever its own last step left. It reads nothing back, so its next
        forward (once every rank joined, a step of its own) gathers again.
        ``send_zeros()`` sends its zeros for the step: not called here, the
        gather runs on the step's own communicator, before them."""
        self.gathered = False
        self.take_part()
        self.gathered = False

    def refuse_if_released(self, what):
        """Refuse ``what`` (reading or writing every parameter: a state
        dict) while the parameters are released, saying what to do."""
        if self.whole or self._reading_pieces or self._read_alone:
            return
        raise ConfigError(
            f"{what} while the parameters are released: with shard_parameters=True each rank holds only its pieces "
            "between a step's end and the next forward. Enter `with model.whole_parameters():` on every rank "
            "(a collective) and call it inside; what is written into the parameters there is kept"
        )

    def state_dict_begins(self):
        """The wrapped module's ``state_dict()`` begins. While the
        parameters are released, this rank alone makes them whole for it:
        its pieces and every other rank's, read from their runtimes' piece
        servers at this rank's step (``sharding.served``), so rank 0 may
        save alone while the others train on. Refused as
        :meth:`refuse_if_released` says where the pieces are not served
        (on a device) or in the middle of a step."""
        self._whole_alone("state_dict()")

    def state_dict_ended(self):
        """The state dict holds the values read alone: the parameters are
        released again (the state dict keeps its own tensors)."""
        if self._read_alone:
            self._read_alone = False
            self._release_every_parameter()

    def load_begins(self):
        """The wrapped module's ``load_state_dict()`` begins: while the
        parameters are released, whole for it as for a state dict (the
        values a partial load leaves are this step's)."""
        self._whole_alone("load_state_dict()")

    def load_ended(self):
        """The load ended: this rank's pieces take what it wrote, and the
        parameters are released again. Each rank loads its own pieces, so
        every rank loads (as under DDP, where a rank that does not keeps
        other values), and the pieces' version moves on (a read at it waits
        for the ranks whose load is not through)."""
        if self._read_alone:
            self._partition.served.everyone_read("load_state_dict()")
            self._partition.refresh()
            self._partition.served.wrote()
            self.state_dict_ended()

    def evaluates_alone(self):
        """Whether the forward beginning now is an evaluation this rank
        runs alone: without gradients, between steps (every parameter
        released), the pieces served (``sharding.served``). It reads the
        parameters from every rank's piece server (:meth:`assemble_alone`)
        and makes no collective, so the others need not evaluate with it
        (nanoGPT's ``estimate_loss()`` on the master process only)."""
        part = self._partition
        return (not torch.is_grad_enabled() and not self.whole and not self._read_alone and part.served is not None
                and part.served.serves and not any(held(p).numel() for p in part.params))

    def assemble_alone(self):
        """:meth:`evaluates_alone`'s forward begins: every parameter whole,
        read alone (released again at its end). Returns ``True``."""
        self._whole_alone("an evaluation forward")
        return True

    def _whole_alone(self, what):
        """The parameters whole on this rank alone for ``what`` (see
        :meth:`state_dict_begins`); nothing to do when they are whole."""
        part = self._partition
        served = part.served
        if (self.whole or self._reading_pieces or self._read_alone or served is None or not served.serves
                or any(held(p).numel() for p in part.params)):
            self.refuse_if_released(what)
            return
        if served.mid_update:
            raise ConfigError(f"{what} between this step's backward and the end of optimizer.step(), on this rank "
                              f"alone: {PENDING} Call it after optimizer.step(), or inside "
                              "`with model.whole_parameters():` on every rank")
        self.read_alone(range(len(part.params)))
        self._read_alone = True

    def read_alone(self, indices):
        """Parameters ``indices`` made whole from every rank's pieces, read
        by this rank alone from the piece servers (``sharding.served``)."""
        part = self._partition
        for i, tensor in part.served.read_whole(indices).items():
            mark_whole(part.params[i])
            part.params[i].data = tensor

    @contextlib.contextmanager
    def reading_pieces(self):
        """Within the block the wrapped module's ``state_dict()`` and
        ``load_state_dict()`` are not refused while the parameters are
        released: for a sharded checkpoint, which reads the state dict's
        keys and buffers and takes every released parameter's values from
        the pieces (``sharding.model_state``). Refused in the middle of a
        step (some parameters whole, some released): a checkpoint is
        written between steps."""
        part = self._partition
        if not self.whole and any(held(p).numel() for p in part.params):
            raise ConfigError(
                "a sharded checkpoint is written and read between steps (after optimizer.step(), or before "
                "the first forward); some parameters are whole now, inside a step's forward or backward"
            )
        self._reading_pieces = True
        try:
            yield
        finally:
            self._reading_pieces = False
