"""The wrappers alive in this process, and the optimizer hooks they share.

torch's optimizer hooks are global: one pair, installed with the first
wrapper, serves every wrapper of the process::

    optimizer.step() ─▶ pre hook: each live wrapper's step is finished and
                        averaged (else an error naming what is missing); an
                        optimizer over sharded parameters is taken over
                     ─▶ the optimizer's own step
                     ─▶ post hook: a sharded optimizer gathers the parameters

``torch.amp.GradScaler`` asks (``_amp``) whether an optimizer steps a
wrapper's parameters before it unscales them.
"""

import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gradsync.torch import _amp
from gradsync.torch.sharding.optimizer import sharded_optimizer_of

#: Wrappers alive and not closed in this process: for the optimizer check,
#: and to find the wrapper a new one takes a module over from.
LIVE = weakref.WeakSet()
#: torch's handles of the two optimizer hooks, once installed.
_HOOKS = None


def enlist(wrapper):
    """``wrapper`` is alive: the optimizer hooks see it (installed now if
    it is the process's first)."""
    global _HOOKS
    LIVE.add(wrapper)
    if _HOOKS is None:
        _HOOKS = (register_optimizer_step_pre_hook(_check_before_optimizer_step),
                  register_optimizer_step_post_hook(_after_optimizer_step))
        _amp.install(_steps_a_wrapper)


def _check_before_optimizer_step(optimizer, args, kwargs):
    """An optimizer step must not apply gradients a wrapper never averaged;
    an optimizer over a sharded wrapper's parameters steps sharded (it is
    taken over at its first step, ``sharding.optimizer.sharded_optimizer_of``)."""
    if getattr(optimizer, "_gradsync_facade", False):
        return  # (its inner optimizer's step comes through here)
    for wrapper in list(LIVE):
        wrapper._sync.raise_if_unfinished("optimizer.step()")
        wrapper._raise_if_unaveraged(optimizer)
    sharded = sharded_optimizer_of(optimizer)
    if sharded is not None:
        return sharded.before_step(args, kwargs)  # (the step's arguments, a closure wrapped, or None)
    return None


def _steps_a_wrapper(optimizer):
    """Whether ``optimizer`` steps parameters of a live wrapper."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return any(w._holds_any(params) for w in list(LIVE))


def _after_optimizer_step(optimizer, args, kwargs):
    """A sharded optimizer's step ends with the parameters' gather."""
    sharded = getattr(optimizer, "_gradsync_sharded", None)
    if sharded is not None:
        sharded.after_step()
