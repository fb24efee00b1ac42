"""Multi-process worlds for the tests: N processes on loopback, each with a
gloo default process group, running test functions on every rank.

A :class:`World` starts its processes once (importing torch costs seconds)
and runs any number of cases: ``world.run(fn, *args)`` calls
``fn(rank, world_size, *args)`` on every rank and returns the results by
rank, or raises with the failing rank's traceback. Every run has a deadline;
a world whose run timed out (or whose process died) is torn down.
"""

import datetime
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

# Ranks are forked from a server that imported torch once for the session
# (each spawned rank paid ~6 s of CPU importing it; the server has no
# thread, no CUDA and no process group, so a fork of it is a clean start).
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "gradsync.torch"])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world, port, pg_timeout_s, tasks, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(rank, world, *args, **kwargs)))
        except BaseException:  # report everything, the test decides
            results.put((rank, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankFailed(AssertionError):
    """A case raised on some rank; the message holds every failing rank's traceback."""


class World:
    """``size`` ranks in their own processes (see the module docs)."""

    def __init__(self, size, pg_timeout_s=60):
        self.size = size
        self._tasks = [_CONTEXT.Queue() for _ in range(size)]
        self._results = _CONTEXT.Queue()
        port = free_port()
        self._procs = [
            _CONTEXT.Process(target=_serve, args=(r, size, port, pg_timeout_s, self._tasks[r], self._results), daemon=True)
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout=120, allow_dead=(), **kwargs):
        """``fn(rank, size, *args, **kwargs)`` on every rank; results by rank.
        Ranks in ``allow_dead`` may exit without answering (their result is None)."""
        if self.broken:
            raise RuntimeError("this world was torn down after an earlier failure")
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out and r not in errors]
                unexpected = [r for r in dead if r not in allow_dead]
                for r in dead:
                    if r in allow_dead:
                        out[r] = None
                if unexpected:
                    self.close()
                    raise RankFailed(f"rank(s) {unexpected} died during {fn.__name__}")
                if time.monotonic() > deadline:
                    self.close()
                    missing = [r for r in range(self.size) if r not in out and r not in errors]
                    raise TimeoutError(f"{fn.__name__}: ranks {missing} did not answer within {timeout} s")
                continue
            (out if ok else errors)[rank] = value
        if errors:
            raise RankFailed("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.size)]

    def close(self):
        if not self.broken:
            self.broken = True
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
