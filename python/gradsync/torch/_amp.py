"""torch's ``GradScaler`` over a gradsync wrapper's optimizer.

``scaler.unscale_(optimizer)`` is where a mixed-precision loop first reads
the optimizer's gradients (nanoGPT: ``scaler.scale(loss).backward();
scaler.unscale_(optimizer); clip; scaler.step(optimizer)``), so gradsync
steps in there (torch's method is wrapped once, when the first wrapper is
built):

* an optimizer over a sharded wrapper's parameters is converted to its
  pieces first (``sharding.optimizer.sharded_optimizer_of``), so its gradients are
  found (unconverted, its parameters have no ``.grad`` and the scaler
  would find no gradient at all: "No inf checks were recorded");
* sharded, each rank sees only its partition, so whether a gradient is
  inf or nan is decided over every rank's (a collective): every rank then
  skips the step, or none does, as under DDP where every rank holds the
  same averages;
* after a step gradsync skipped (an abort on some rank: no gradient is
  left to unscale) the scaler records "no inf" for the optimizer instead
  of nothing, so ``scaler.step(optimizer)`` is the optimizer's (empty) step
  rather than torch's assertion, on the ranks that go on with the step.
"""

import torch

from gradsync.torch.sharding import clip as _clip
from gradsync.torch.sharding.norm import LOST
from gradsync.torch.sharding.optimizer import sharded_optimizer_of

# torch's GradScaler.unscale_, once wrapped.
_TORCH_UNSCALE = None
# Whether an optimizer steps parameters of a live gradsync wrapper (``ddp``'s).
_OURS = None


def install(ours):
    """Wrap ``torch.amp.GradScaler.unscale_`` (once; subclasses that do not
    override it, ``torch.cuda.amp.GradScaler`` among them, inherit it).
    ``ours(optimizer)``: whether it steps a live wrapper's parameters."""
    global _TORCH_UNSCALE, _OURS
    if _TORCH_UNSCALE is not None:
        return
    _TORCH_UNSCALE, _OURS = torch.amp.GradScaler.unscale_, ours
    torch.amp.GradScaler.unscale_ = _unscale_


def _unscale_(self, optimizer):
    """``GradScaler.unscale_`` (see the module docs)."""
    if not self._enabled:
        return _TORCH_UNSCALE(self, optimizer)
    sharded = sharded_optimizer_of(optimizer) if _clip.live() else None
    _TORCH_UNSCALE(self, optimizer)
    found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    part = sharded._partition if sharded is not None else None
    if part is not None and not part.sharded_step.quiet:
        local = max((float(v.item()) for v in found.values()), default=0.0)
        try:
            agreed = float(part.combine(torch.tensor(local, dtype=torch.float64), "max"))
        except LOST as error:
            if part.recover is None:
                raise
            part.recover(error)  # (the settlement stepped or dropped the step: nothing is left to step)
            agreed = 0.0
        for value in found.values():
            value.fill_(agreed)
        if not found:
            found[self._scale.device] = torch.full((), agreed, dtype=torch.float32, device=self._scale.device)
    if not found and (sharded is not None or _OURS(optimizer)):
        found[self._scale.device] = torch.zeros((), dtype=torch.float32, device=self._scale.device)
    return None
