"""What every framework wrapper offers the same way, over its runtime
session: ending, aborting, joining and resetting steps, the timeline.

A wrapper mixes :class:`StepControls` in before its framework's module class
and provides ``_session``, ``_open`` (the step being collected: ``number``,
``sync_pending``, ``arrivals``; ``gradsync.torch._steps``), ``_closed``, ``_apply_result(result)``
(write a finished step into the gradients, return its report) and
``_new_step()``, ``_params``, ``_names`` and ``_placement(param)`` (its
dtype and device, as the framework names them); ``_NAME`` names it in errors.
"""

from gradsync._errors import ClosedError, ConfigError


class StepControls:
    """Step controls shared by ``gradsync.torch`` and ``gradsync.paddle``."""

    _NAME = "wrapper"
    # Why later use is refused, once closed (a wrapper may say more).
    _closed_why = None

    def _refuse_if_closed(self):
        if self._closed:
            raise ClosedError(self._closed_why or f"this gradsync {self._NAME} was closed")

    def finish_step(self):
        """End the step now. Needed only where the wrapper cannot see the end
        of backward (``torch.autograd.grad``, ``paddle.grad``, a backward
        nested inside another one). Does nothing if no gradient arrived and no
        forward asked for a synchronized step since the last one ended.
        Returns the step's report, or ``None``."""
        self._refuse_if_closed()
        step = self._open
        if not (step.sync_pending or step.arrivals):
            return None
        return self._finish()

    def _finish(self):
        return self._apply_result(self._session.finish(self._open.number))

    def abort_step(self, reason="out_of_memory"):
        """This rank cannot finish the step (call it in the ``except`` that
        caught the out-of-memory error or the bad batch): every rank's step is
        skipped, or with ``abort_policy="partial"`` averaged over the ranks
        that finished. Nobody blocks. ``reason``: ``"out_of_memory"``,
        ``"bad_batch"``, ``"non_finite"`` or an integer code. Returns the
        step's report."""
        self._refuse_if_closed()
        return self._apply_result(self._session.abort(self._open.number, reason))

    def join_now(self):
        """This rank has run out of data: contribute zeros to the other ranks'
        steps until every rank has joined (each of those steps is averaged
        over the ranks that contributed). Returns ``{"first_step", "steps"}``."""
        self._refuse_if_closed()
        first, steps = self._session.join()
        self._new_step()
        return {"first_step": first, "steps": steps}

    def reset(self):
        """After a failed step (``gradsync.StepFailedError``), on every rank:
        agree on the step to continue at (on fresh communication groups) and
        clear the failed step's state. Returns that step."""
        self._refuse_if_closed()
        step = self._session.reset()
        self._new_step()
        return step

    def write_timeline(self, path):
        """Write every step's timeline as Chrome trace JSON (open it in
        https://ui.perfetto.dev); needs ``record_timeline=True``."""
        return self._session.write_timeline(path)

    def _apply(self, *args, **kwargs):
        """The framework's conversion of parameters and buffers (``.to()``,
        ``.double()``, ``.cpu()``, ...). gradsync registered every parameter's
        dtype and device when it wrapped the model, so a conversion that
        changes them is refused (its gradients would be read as the
        registered type); one that keeps them is fine."""
        params = self.__dict__.get("_params") or []
        before = [self._placement(p) for p in params]
        converted = super()._apply(*args, **kwargs)
        for name, p, was in zip(self._names, params, before):
            if self._placement(p) != was:
                raise ConfigError(
                    f"parameter {name!r} went from {was} to {self._placement(p)} after gradsync wrapped the "
                    f"model: convert the module first and wrap it then (as with DDP); close this {self._NAME}"
                )
        return converted

    @property
    def current_step(self):
        """The step gradients are being collected for."""
        return self._open.number

    @property
    def session(self):
        """The underlying :class:`gradsync.Session` (progress, memory figures)."""
        return self._session
