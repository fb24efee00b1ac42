"""torch's ``Join`` (uneven inputs) for gradsync's DDP.

``with model.join():`` (or ``Join([model])``) runs each rank's loop; a rank
whose inputs run out enters ``Join.__exit__``, which calls the hook's
:meth:`ShadowStep.main_hook` once per step the other ranks still run: it
contributes zeros to that step through the runtime's ``shadow_step``. The
runtime averages such a step over the ranks that contributed; with DDP's
default ``divide_by_initial_world_size=True`` :func:`rescale_to_initial_world`
turns that into the sum over the initial world size, as DDP computes it.
When every rank has joined, :meth:`ShadowStep.post_hook` gives every rank
the last joiner's parameters and buffers.
"""

import torch
from torch.distributed.algorithms.join import JoinHook


class ShadowStep(JoinHook):
    """What ``Join`` runs on a rank whose inputs ran out: each main hook
    contributes zeros to one step of the ranks still training."""

    def __init__(self, ddp):
        self.ddp = ddp

    def main_hook(self):
        ddp = self.ddp
        ddp._raise_if_unfinished("join")
        ddp.last_report = ddp._session.shadow_step()
        ddp._new_step()

    def post_hook(self, is_last_joiner):
        # Ranks that joined early skipped optimizer steps: take the last
        # joiner's parameters and buffers, as DDP does.
        ddp = self.ddp
        ddp._states.from_last_joiner(ddp._model_states(), is_last_joiner)
        ddp._divide_by_initial_world = False


def rescale_to_initial_world(params, report, world):
    """A step some rank joined (shadowed) was averaged over the ranks that
    contributed; make each ``.grad`` the sum over ``world`` ranks instead
    (ranks that aborted under ``abort_policy="partial"`` stay out of the
    divisor, as their own setting says)."""
    counted = world - len(report.aborted)
    if report.contributors >= counted or report.contributors == 0:
        return
    scale = report.contributors / counted
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
