"""What the PyTorch and Paddle wrappers share for gradient accumulation."""

import contextlib


@contextlib.contextmanager
def no_sync(wrapper):
    """Backward passes inside the block accumulate without ending a step
    (``wrapper._require_sync`` is read by the wrapper's forward)."""
    previous = wrapper._require_sync
    wrapper._require_sync = False
    try:
        yield
    finally:
        wrapper._require_sync = previous
