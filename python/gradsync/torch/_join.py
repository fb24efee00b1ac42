"""torch's ``Join`` (uneven inputs) for gradsync's DDP.

``with model.join():`` (or ``Join([model])``) builds the model's join hook on
every rank when the context begins: from then on the runtime divides each
step's sum by the world size (DDP's default ``divide_by_initial_world_size=True``:
a joined rank's zeros count) or by the ranks that contributed. A rank whose
inputs run out enters ``Join.__exit__``, which calls the hook's
:meth:`ShadowStep.main_hook` once per step the other ranks still run: it
contributes zeros to that step through the runtime's ``shadow_step``. When
every rank has joined, :meth:`ShadowStep.post_hook` gives every rank the
last joiner's parameters and buffers. Buffers broadcast before a forward
come from the highest rank still training, the joined ranks taking part
from :meth:`ShadowStep.main_hook`. With sharded parameters the main hook
also serves the other ranks' parameter gathers of that step (a joined rank
asks for nothing), which is why every rank's first forward of a step tells
the joined ones, ``no_sync`` micro-batches included.
"""

from torch.distributed.algorithms.join import JoinHook


class ShadowStep(JoinHook):
    """What ``Join`` runs on a rank whose inputs ran out: each main hook
    contributes zeros to one step of the ranks still training."""

    def __init__(self, ddp):
        self.ddp = ddp

    def main_hook(self):
        # The buffer broadcast of the others' forward first (when DDP's rule
        # sends one), their parameter gathers (sharded parameters), then
        # their step's collectives.
        self.ddp._broadcast_buffers_now(joined=True)
        self.ddp._shadow_gathers()
        self.ddp._sync.shadow_step()

    def post_hook(self, is_last_joiner):
        # Ranks that joined early skipped optimizer steps: take the last
        # joiner's parameters and buffers, as DDP does. Sharded parameters
        # live in every rank's pieces, which each rank kept stepping (and a
        # released parameter holds nothing to send): not those.
        ddp = self.ddp
        pieces = {id(p) for p in ddp._params} if ddp.parameters_sharded else set()
        ddp._states.from_last_joiner([t for t in ddp._model_states() if id(t) not in pieces], is_last_joiner)
        ddp._sync.set_divisor("contributors")
