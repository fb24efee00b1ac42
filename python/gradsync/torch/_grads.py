"""The torch side of a wrapped model's gradients, as its core sees it
(``gradsync._core.Framework``): records, held gradients and the write-back
come from the C++ hook (``_hooks.Hooks``), sparse gradients from
``_sparse.SparseGrads``.

A finished step's averages reach ``.grad`` in C++ (``python/shim/arrivals.cpp``,
``Ledger::write_back``), per parameter:

* a **view** of the step's bucket memory (no copy): for a float32 or float64
  parameter whose ``.grad`` did not exist when the step's backward began, and
  only when no view of an earlier step is still alive (so gradsync never
  keeps more than one extra set of buckets on loan); the views keep the loan
  alive until they are freed (as ``zero_grad()`` does);
* a **copy** into the tensor of the parameter's first hook firing: the
  ``.grad`` the caller already held (it receives the average in place, so
  every reference and view of it sees it) or a fresh one, in its own type.

On the device plane the bucket memory is a torch tensor on the parameters'
device: views and copies are queued on the caller's stream, after it was
made to wait for the reduction; the host never waits for the device.
"""


def reals(p):
    """How many real numbers ``p``'s gradient holds in bucket memory (two
    per complex element: its real and imaginary parts, reduced alike)."""
    return p.numel() * 2 if p.is_complex() else p.numel()


class TorchGrads:
    """The torch side of a wrapped model's gradients (see the module docs).
    ``plane``: the communicator when the buckets are on the device plane."""

    def __init__(self, params, hooks, plane, sparse):
        self._params = params
        self.hooks = hooks
        self._plane = plane
        self._sparse = sparse

    def new_record(self):
        return self.hooks.record()

    def hand_over_held(self, record):
        self.hooks.hand_over_held(record)

    def write_back(self, result, record):
        lent = self.hooks.write_back(result, self._plane)
        if self._sparse:
            self._sparse.reduce(result.report)
        return lent

    def joined_step(self, report):
        """This rank is out of data and shadowed ``report``'s step: it sends
        empty sparse gradients where the others reduce theirs."""
        if self._sparse and report.outcome in ("applied", "partial"):
            self._sparse.reduce(report)

    def clear(self):
        """Skipped on every rank: no optimizer may apply this step."""
        for p in self._params:
            p.grad = None
        self._sparse.clear()

    def remove_hooks(self):
        self.hooks.remove()
