"""gradsync for Paddle: :class:`DataParallel` in place of ``paddle.DataParallel``,
exact with ``recompute`` (where Paddle's leaves recomputed layers' gradients
unaveraged), on the same Rust runtime as :mod:`gradsync.torch`::

    import gradsync.paddle
    model = gradsync.paddle.DataParallel(model)

Importing it needs Paddle, not torch.
"""

from gradsync.paddle.data_parallel import DataParallel

__all__ = ["DataParallel"]
