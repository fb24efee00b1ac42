"""A wrapper's ranks as a group ``torch.distributed`` knows.

``torch.distributed.checkpoint`` (and ``ShardedTensor``) coordinate through
torch's registered groups: ``get_rank(group)`` and the object collectives
need the default group to exist, and without one DCP silently saves as if
the process were alone (every rank writing the same files). A wrapper's
ranks are:

* ``process_group=`` given (or torch's world): that group, as it is;
* an elastic job: no group of torch's holds exactly the members, and the
  members change. Here gradsync makes torch's default group itself, over the
  current membership epoch's store (``{prefix}/torch-world``), on first use
  in the epoch (every member calls what needs it at the same point: a
  collective), and takes it down at the next change of members (the old
  group is kept alive, ``_gloo.never_free``, as the wrapper's own: its
  destructor could wait on a lost peer). So ``torch.distributed.get_rank()``
  and ``get_world_size()`` then answer the member's place too. Its pairs
  connect on first use, as gradsync's own groups' do
  (``_comm.gloo_group``), unless ``TORCH_GLOO_LAZY_INIT`` says otherwise.

An elastic program that made a default group of its own is refused here:
its ranks are not the job's members after the first change.
"""

import contextlib
import datetime
import os

import torch.distributed as dist

from gradsync._errors import ConfigError
from gradsync._gloo import never_free
from gradsync.torch._states import meet

#: The epoch prefix whose members torch's default group holds, when gradsync
#: made that group (one per process: torch has one default group); ``None``
#: when gradsync made none (or took its last one down).
_MADE_FOR = None


def elastic_world(store, prefix, rank, world, timeout_s, abandon=None):
    """Torch's default group over the members of the epoch under ``prefix``
    of ``store`` (this process is ``rank`` of ``world``), made now if it is
    not yet (a collective of every member). ``abandon``: as the state
    group's (``_states.StateBroadcast``), ends the wait for members that
    died meanwhile."""
    global _MADE_FOR
    if dist.is_initialized():
        if _MADE_FOR == prefix:
            return dist.group.WORLD
        if _MADE_FOR is None:
            raise ConfigError(
                "this elastic job's process initialised torch.distributed's default group itself: its ranks are not "
                "the job's members once they change. Leave init_process_group out of an elastic job (gradsync makes "
                "the default group of each membership where torch.distributed.checkpoint needs it)"
            )
        retire()
    scoped = dist.PrefixStore(f"{prefix}/torch-world", store)
    if abandon is not None and world > 1:
        meet(scoped, rank, world, timeout_s, abandon)
    with _connected_on_first_use():
        dist.init_process_group("gloo", store=scoped, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _MADE_FOR = prefix
    return dist.group.WORLD


def retire():
    """Take down the default group gradsync made for an earlier membership
    (a change of members; nothing when it made none)."""
    global _MADE_FOR
    if _MADE_FOR is None or not dist.is_initialized():
        _MADE_FOR = None
        return
    never_free(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()
    _MADE_FOR = None


@contextlib.contextmanager
def _connected_on_first_use():
    """The gloo groups torch makes inside connect a pair on its first use
    (``init_process_group`` takes no gloo device; torch reads
    ``TORCH_GLOO_LAZY_INIT`` when it makes a group): not every pair when
    made, O(world) sockets a member. A value the program set is kept."""
    if "TORCH_GLOO_LAZY_INIT" in os.environ:
        yield
        return
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
