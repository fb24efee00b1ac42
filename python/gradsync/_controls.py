"""What every framework wrapper offers its users the same way: ending,
aborting, joining and resetting steps, accumulation, reports, the timeline.

A wrapper mixes :class:`StepControls` in before its framework's module class
and keeps its :class:`gradsync._core.ModelSync` in ``_sync``; every control
here is the core's. ``_NAME`` names the wrapper in messages, and
``_placement(param)`` says a parameter's dtype and device as the framework
names them (a conversion after wrapping is refused).
"""

from gradsync._errors import ConfigError


class StepControls:
    """Step controls shared by ``gradsync.torch`` and ``gradsync.paddle``."""

    _NAME = "wrapper"

    def finish_step(self):
        """End the step now. Under torch the end of backward is always seen
        (the wrapped model inside nested checkpoints included); under Paddle
        it is needed after ``paddle.grad``. Does nothing if no gradient
        arrived and no forward asked for a synchronized step since the last
        one ended. Returns the step's report, or ``None``."""
        return self._sync.finish_step()

    def abort_step(self, reason="out_of_memory"):
        """This rank cannot finish the step (call it in the ``except`` that
        caught the out-of-memory error or the bad batch): every rank's step is
        skipped, or with ``abort_policy="partial"`` averaged over the ranks
        that finished. Nobody blocks. ``reason``: ``"out_of_memory"``,
        ``"bad_batch"``, ``"non_finite"`` or an integer code of your own
        (another name is a :class:`gradsync.ConfigError`). Returns the step's
        report."""
        return self._sync.abort(reason)

    def join_now(self):
        """This rank has run out of data: contribute zeros to the other ranks'
        steps until every rank has joined (each of those steps is averaged
        over the ranks that contributed). Returns ``{"first_step", "steps"}``."""
        return self._sync.join()

    def reset(self):
        """After a failed step (``gradsync.StepFailedError``), on every rank:
        agree on the step to continue at (on fresh communication groups) and
        clear the failed step's state. Returns that step."""
        return self._sync.reset()

    def no_sync(self):
        """Accumulate gradients over several backward passes (micro-batches):
        as under DDP, each rank's gradients sum up locally in place (and may
        be read or changed there); the first backward outside the context
        ends the step and averages the sum, overlapped with that backward."""
        return self._sync.no_sync()

    def write_timeline(self, path):
        """Write every step's timeline as Chrome trace JSON (open it in
        https://ui.perfetto.dev); needs ``record_timeline=True``."""
        return self._sync.session.write_timeline(path)

    def _refuse_if_closed(self):
        self._sync.refuse_if_closed()

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
    def last_report(self):
        """The :class:`gradsync.StepReport` of the last step that ended (``None`` before)."""
        return self._sync.last_report

    @property
    def current_step(self):
        """The step gradients are being collected for (the runtime's count)."""
        return self._sync.current_step

    @property
    def memory_bytes(self):
        """Bytes of gradient memory gradsync's runtime holds for this model
        now: its bucket buffers (a set the steps pack into, and one more
        while a finished step's averages are still referenced), or, with
        ``shard_gradients=True``, this rank's partitions and the one whole
        bucket kept for the next step; plus per-parameter metadata. The
        Prometheus gauge ``gradsync_bucket_memory_bytes`` carries the buffers'
        part at each step's end."""
        return self._sync.session.memory_bytes

    @property
    def session(self):
        """The underlying :class:`gradsync.Session` (progress, memory figures)."""
        return self._sync.session

    @property
    def path(self):
        """The :class:`gradsync.DataPath` this wrapper's gradients take:
        native or Python hooks and collectives, and why."""
        return self._sync.path
