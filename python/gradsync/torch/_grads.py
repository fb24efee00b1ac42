"""How a finished step's averaged gradients reach ``.grad``.

The runtime hands back a finished step as a ``Gradients`` object: the
step's bucket memory, on loan until it is released. :class:`GradWriter`
decides, per parameter, between

* a **view** of that bucket memory (no copy): for a float32 or float64 CPU parameter
  whose ``.grad`` did not exist when the step's backward began (the hook
  kept no tensor for it in ``step.out``), and only
  when no view of an earlier step is still alive (so gradsync never keeps
  more than one extra set of buckets on loan); each view keeps the loan
  alive until it is freed (as ``zero_grad()`` does);
* a **copy** into the tensor of the parameter's first hook firing: the
  ``.grad`` the caller already held (it receives the average in place, so
  every reference and view of it sees it) or a fresh one.

On the device plane the bucket memory is a torch tensor on the parameters'
device (the communicator's ``bucket_tensor``): views and copies are torch
ops queued on the caller's stream, after the caller's stream was made to
wait for the reduction (``leave``); the host never waits for the device.

It owns the layouts and host staging tensors it caches between steps.
:class:`TorchGrads` is the torch side of a wrapped model as the core sees
it (``gradsync._core.Framework``): the hooks, the writer, clearing.
"""

import itertools
import weakref

import torch

from gradsync._gloo import AddressArrays


# The element types of bucket memory (float64 parameters have float64 buckets).
_BUCKET_TYPES_BY_NAME = {"float32": torch.float32, "float64": torch.float64}
_BUCKET_TYPES = tuple(_BUCKET_TYPES_BY_NAME.values())


def reals(p):
    """How many real numbers ``p``'s gradient holds in bucket memory (two
    per complex element: its real and imaginary parts, reduced alike)."""
    return p.numel() * 2 if p.is_complex() else p.numel()


class GradWriter:
    """Writes each finished step's averaged gradients into ``params``' ``.grad``."""

    def __init__(self, params, staging, plane=None):
        self._params = params
        # Gradients travel through host memory (a CUDA module on the gloo path).
        self._staging = staging
        # The communicator when the buckets are on the device plane, else None.
        self._plane = plane
        # Per parameter: may its average be a view of the bucket memory?
        self.viewable = [not staging and p.dtype in _BUCKET_TYPES and p.is_contiguous() for p in params]
        # Per bucket (its members, which a plan rebuilt in gradient order
        # changes): member sizes, the shape of each view (None: flat already)
        # and each member's offset (``_layout``).
        self._layouts = {}
        # ctypes arrays over the step's bucket memory.
        self._arrays = AddressArrays()
        # Per parameter: the host tensor its average is staged in (non-contiguous or CUDA grads).
        self._host = {}
        # The last step whose gradients were lent as views (a weak reference:
        # alive while any of those views is).
        self._lent = None

    def write_back(self, result, out, unused):
        """Put ``result``'s averages into ``.grad``. ``out``: per parameter,
        the tensor that must receive its average (the caller's own ``.grad``,
        or one a view cannot replace), else None; ``unused``: parameters no
        rank used. Returns whether views were lent (then ``result`` must not
        be released: the views release it when they die)."""
        params = self._params
        if self._plane is not None:
            return self._write_device(result, out, unused)
        if self._lent is None or self._lent() is None:
            lent, copied = self._view(result, out, unused)
        else:
            lent, copied = False, range(len(params))
        for i in copied:
            if result.has(i):
                self._copy(result, i, params[i], out[i])
        if lent:
            self._lent = weakref.ref(result)
        return lent

    def _view(self, result, out, unused):
        """Lend views; returns whether any was lent, and the parameters left to copy."""
        lent, copied = False, []
        params, viewable = self._params, self.viewable
        for addr, numel, members, dtype in result.buckets():
            sizes, shapes, _offsets = self._layout(members)
            array = self._arrays.at(addr, numel, dtype)
            array._gradsync_step = result  # the loan lives as long as any view of it
            views = torch.frombuffer(array, dtype=_BUCKET_TYPES_BY_NAME[dtype]).split(sizes)
            for i, shape, view in zip(members, shapes, views):
                if viewable[i] and out[i] is None and i not in unused:
                    params[i].grad = view if shape is None else view.view(shape)
                    lent = True
                else:
                    copied.append(i)
        return lent, copied

    def _write_device(self, result, out, unused):
        """:meth:`write_back` for buckets on the device plane: views of the bucket
        tensors where allowed (set in C++, the loan carried once per bucket),
        else copies, all queued on the caller's stream behind the reduction."""
        self._plane.leave()
        params, viewable = self._params, self.viewable
        may_lend = self._lent is None or self._lent() is None
        lent = False
        for addr, _numel, members, _dtype in result.buckets():
            sizes, _shapes, offsets = self._layout(members)
            bucket = self._plane.bucket_tensor(addr)
            lend_params, lend_offsets = [], []
            for i, size, offset in zip(members, sizes, offsets):
                if i in unused or not result.has(i):
                    continue
                p = params[i]
                if may_lend and viewable[i] and out[i] is None:
                    lend_params.append(p)
                    lend_offsets.append(offset)
                    continue
                grad = out[i]
                if grad is None:
                    grad = p.grad if p.grad is not None else torch.empty_like(p, memory_format=torch.preserve_format)
                p.grad = grad
                target = torch.view_as_real(grad) if grad.is_complex() else grad
                target.copy_(bucket.narrow(0, offset, size).view(target.shape))
            if lend_params:
                self._plane.lend(bucket, lend_params, lend_offsets, result)
                lent = True
                if bucket.is_cuda:
                    # The caching allocator must not reuse the bucket's memory before
                    # what the caller queued on its stream has read the views.
                    bucket.record_stream(torch.cuda.current_stream(bucket.device))
        if lent:
            self._lent = weakref.ref(result)
        return lent

    def _layout(self, members):
        """A bucket's layout, cached: each member's size, view shape (None:
        flat already) and offset in the bucket."""
        key = tuple(members)
        layout = self._layouts.get(key)
        if layout is None:
            params = [self._params[i] for i in members]
            # A complex parameter's slice is twice as long (it is copied, never lent as a view).
            sizes = [reals(p) for p in params]
            shapes = [None if p.dim() == 1 else p.shape for p in params]
            layout = self._layouts[key] = (sizes, shapes, list(itertools.accumulate(sizes, initial=0)))
        return layout

    def _copy(self, result, index, p, grad):
        """Copy ``p``'s average into ``grad`` (its first firing's tensor, of
        its own type and layout), and make that ``p.grad``."""
        if grad is None:  # unused on this rank, used on another
            grad = p.grad if p.grad is not None else torch.empty_like(p, memory_format=torch.preserve_format)
        p.grad = grad
        if not self._staging and grad.is_contiguous():
            result.copy_into_ptr(index, grad.data_ptr())
            return
        host = self._host.get(index)
        if host is None:
            host = self._host[index] = torch.empty(p.shape, dtype=p.dtype, device="cpu")
        result.copy_into_ptr(index, host.data_ptr())
        grad.copy_(host)


class TorchGrads:
    """The torch side of a wrapped model's gradients, for its
    ``gradsync._core.ModelSync``: records and held gradients come from the
    hooks (``_hooks.Hooks``), results are written by a :class:`GradWriter`,
    sparse gradients reduced by ``_sparse.SparseGrads``."""

    def __init__(self, params, hooks, writer, sparse):
        self._params = params
        self.hooks = hooks
        self._writer = writer
        self._sparse = sparse

    def new_record(self):
        return self.hooks.record()

    def hand_over_held(self, record):
        self.hooks.hand_over_held(record)

    def write_back(self, result, record):
        lent = self._writer.write_back(result, record.outputs(), set(result.report.unused_everywhere))
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
