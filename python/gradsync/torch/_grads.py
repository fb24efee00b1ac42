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


import torch


def reals(p):
    """How many real numbers ``p``'s gradient holds in bucket memory (two
    per complex element: its real and imaginary parts, reduced alike)."""
    return p.numel() * 2 if p.is_complex() else p.numel()


class TorchGrads:
    """The torch side of a wrapped model's gradients (see the module docs).
    ``plane``: the communicator when the buckets are on the device plane;
    ``partition``: a sharded wrapper's ``sharding.partition.Partition`` (the
    averages go to its pieces, ``.grad`` stays ``None``)."""

    def __init__(self, params, hooks, plane, sparse, partition=None):
        self._params = params
        self.hooks = hooks
        self._plane = plane
        self._sparse = sparse
        self._partition = partition

    def new_record(self):
        return self.hooks.record()

    def hand_over_held(self, record):
        self.hooks.hand_over_held(record)

    def serve_gathers(self):
        residence = self._partition.residence if self._partition is not None else None
        if residence is not None:
            residence.serve()

    def lost_gather(self):
        residence = self._partition.residence if self._partition is not None else None
        return None if residence is None else residence.lost_gather()

    def write_back(self, result, record):
        if self._partition is not None:
            return self._write_partition(result)
        lent = self.hooks.write_back(result, self._plane)
        if self._sparse:
            self._sparse.reduce(result.report)
        return lent

    def _write_partition(self, result):
        """A sharded step: this rank's partition into its pieces' ``.grad``."""
        buckets = self.hooks.buckets(result, self._plane)
        if self._plane is not None and self._plane.plane_stream() is not None:
            # The caller's stream reads the buckets after the plane's reductions.
            stream = self._plane.plane_stream()
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        layout = self._partition.buckets
        if len(buckets) != len(layout) or any(
            tuple(m) != b.members or start != b.mine[0] for (_, m, start), b in zip(buckets, layout)
        ):
            raise RuntimeError(
                "gradsync: a sharded step's buckets are not its plan's (a gradsync bug, please report it)"
            )
        for p in self._params:
            p.grad = None
        part = self._partition
        part.joined = list(result.report.joined)
        lent = self.hooks.write_pieces([t for t, _, _ in buckets], result, part.targets)
        part.received(result)
        return lent

    def joined_step(self, result):
        """This rank is out of data and shadowed ``result``'s step: it sends
        empty sparse gradients where the others reduce theirs, and a sharded
        rank receives its partition's averages and steps them with its
        optimizer, as the others step theirs (it still owns that partition).
        Returns whether views of ``result`` were lent."""
        report = result.report
        applies = report.outcome in ("applied", "partial")
        if self._sparse and applies:
            self._sparse.reduce(report)
        if self._partition is None or not applies:
            return False
        # What its last own step left in the pieces was applied then; the
        # others zeroed theirs before this step: hold their average only.
        self._partition.clear()
        lent = self._write_partition(result)
        self._partition.step_joined()
        return lent

    def clear(self):
        """Skipped on every rank: no optimizer may apply this step."""
        for p in self._params:
            p.grad = None
        if self._partition is not None:
            self._partition.skip()
        self._sparse.clear()

    def remove_hooks(self):
        self.hooks.remove()
