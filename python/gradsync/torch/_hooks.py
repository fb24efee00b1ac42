"""How a torch model's gradients reach the runtime and come back: the C++
hook (``python/shim/arrivals.cpp``), as the wrapper holds it.

One hook, as DDP's reducer has: a C++ post hook on each parameter's
``AccumulateGrad`` node records the arrival in a ``Ledger``, hands the
tensor to the runtime (staged through host memory first when the buckets
are there and the gradient is not), watches every autograd task that
reaches the model and ends the step when the last of them ends, and writes
the averages back into ``.grad``. Python is not entered per gradient; it is
entered once per step, to end it (``on_end``).

In a synchronized backward each firing moves the gradient out of ``.grad``
and hands it over (one additive contribution; its token is the parameter's
hand-over count in the step), keeping the tensor that must receive the
average: the caller's own ``.grad``, or one a bucket view cannot replace. In
a backward under ``no_sync`` the gradient stays in ``.grad``, where autograd
sums the micro-batches as under DDP; the synchronized backward's first
firing then hands over the whole sum, and :meth:`Hooks.hand_over_held` the
``.grad`` of a parameter that backward never reached.

:class:`LedgerRecord` shows the ledger's record of the open step to the
core as a :class:`gradsync._record.StepRecord`.
"""

import torch

from gradsync._errors import GradientLayoutError
from gradsync._native import ArrivalSink
from gradsync.torch import _outputs


class LedgerRecord:
    """The ledger's record of the open step, as a
    :class:`gradsync._record.StepRecord`. Making one starts the ledger's
    next step."""

    __slots__ = ("_ledger",)

    def __init__(self, ledger):
        ledger.new_step()
        self._ledger = ledger

    @property
    def sync_pending(self):
        return self._ledger.sync

    @property
    def end_queued_for(self):
        return self._ledger.open_task

    @property
    def arrivals(self):
        return self._ledger.arrivals

    def ask_for_sync(self):
        self._ledger.sync = True


class Hooks:
    """The C++ hook on a wrapped model's parameters (see the module docs).

    ``arrivals`` is the loaded ``_arrivals`` module; ``on_end()`` ends the
    step (the wrapper's ``ModelSync.end_of_backward``), ``on_sync_asked()``
    asks for a synchronized step when a second backward runs through the
    outputs of a synchronized forward. Both are weak: hooks live as long as
    the parameters and must not keep a dropped wrapper alive. ``staging``:
    gradients on a device go through host memory; ``plane_stream``: the
    device plane's stream, when the buckets are there."""

    def __init__(self, arrivals, names, params, device, session, on_end, on_sync_asked, *, staging,
                 device_plane, plane_stream=None):
        self._names = names
        self._params = params
        self._device = device
        self._ledger = arrivals.Ledger(
            params, ArrivalSink.table(), session.arrival_sink(), on_end, on_sync_asked, self._odd_gradient,
            staging=staging, device_plane=device_plane, plane_stream=plane_stream,
        )
        self._host_bucket = arrivals.host_bucket
        #: The sharded layout's targets the C++ side holds (``write_pieces``).
        self._targets = None

    def record(self):
        """A fresh record for the runtime's next step."""
        return LedgerRecord(self._ledger)

    def hand_over_held(self, record):
        """Hand over the ``.grad`` of parameters only ``no_sync`` micro-batches reached."""
        self._ledger.give_held()

    def watch(self, output, synced):
        """See backward reach the tensors of ``output`` (a forward's result,
        searched as ``_outputs.tensors_in`` does); ``synced``: that forward
        asked for a synchronized step."""
        tensors = [t for t in _outputs.tensors_in(output) if t.grad_fn is not None]
        if tensors:
            self._ledger.watch(tensors, synced)

    def reached(self):
        """Backward reached the model: a forward recomputed inside it."""
        self._ledger.reached()

    def write_back(self, result, plane):
        """Put ``result``'s averages into ``.grad`` (in C++: views of its
        buckets or copies, see ``arrivals.cpp``). ``plane``: the
        communicator whose device plane holds the buckets, else ``None``.
        Returns whether views were lent (then ``result`` must not be
        released: the views release it when they die)."""
        buckets = [(tensor, members) for tensor, members, _start in self.buckets(result, plane)]
        return self._ledger.write_back(buckets, result, list(result.report.unused_everywhere))

    def write_pieces(self, tensors, result, targets):
        """Put a sharded step ``result``'s averages into its pieces' ``.grad``
        (in C++, under the same loan guard as :meth:`write_back`):
        ``tensors``, each bucket's partition; ``targets``, the layout's
        (``sharding.layout.Layout.targets``, handed to the C++ side again
        when the layout changed). Returns whether views were lent."""
        if targets is not self._targets:
            self._ledger.set_pieces(targets)
            self._targets = targets
        return self._ledger.write_pieces(tensors, result, list(result.report.unused_everywhere))

    def buckets(self, result, plane):
        """``result``'s buckets as ``(tensor over its memory, members, start)``,
        in launch order: the tensor holds the bucket from offset ``start`` on
        (a sharded step's: this rank's partition). ``plane``: as for
        :meth:`write_back`."""
        if plane is None:
            return [(self._host_bucket(addr, numel, dtype == "float64"), members, start)
                    for addr, numel, members, dtype, start in result.buckets()]
        return [(plane.bucket_tensor(addr), members, start)
                for addr, _numel, members, _dtype, start in result.buckets()]

    def remove(self):
        """Take the hooks off; later gradients stay in ``.grad``."""
        self._ledger.remove()

    def rehook(self):
        """Hook the parameters again after one changed dtype (torch then
        forgets its gradient accumulator, and the hook with it)."""
        self._ledger.rehook()

    def _odd_gradient(self, index):
        """The hook met a gradient the runtime cannot read."""
        raise self.layout_error(index, self._params[index].grad)

    def layout_error(self, index, grad):
        """The error for parameter ``index``'s gradient ``grad``, which the runtime cannot read."""
        if grad.layout != torch.strided:
            return GradientLayoutError(
                f"parameter {self._names[index]!r} has a {grad.layout} gradient but was dense when wrapped: "
                "gradsync reduces the sparse gradients of embeddings built with sparse=True; set it before wrapping"
            )
        return GradientLayoutError(
            f"parameter {self._names[index]!r} has a gradient on {grad.device}, and gradsync was built for "
            f"parameters on {self._device}: move the module before wrapping it, not after"
        )
