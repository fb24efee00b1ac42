"""Workers forked from a warm interpreter (``python -m gradsync.launch``'s default).

Importing torch costs a process seconds of CPU (about 4 s on a small
machine, 2 more for ``torch._dynamo``, which building any torch optimizer
imports), and a supervisor on a machine with few cores that starts N
workers pays it N times at once; a replacement for a lost worker pays it
before it can even ask to join. So the supervisor forks, once, before it
hosts the store (no thread, no socket yet), a *warm interpreter* that
imports what every worker imports; each worker is then a fork of it that
runs the training script as ``python -u script.py args`` would run it:

* ``sys.argv`` is the script and its arguments, ``sys.path[0]`` the
  script's directory, the script runs as ``__main__``;
* the environment is the worker's own (``os.environ`` and the C environment);
* standard output and error are unbuffered and are the supervisor's;
* it ends as an interpreter ends: ``sys.exit``'s status, an uncaught
  exception's traceback and status 1, ``atexit`` handlers and finalisation;
  a signal's death is reported as such.

The warm interpreter never touches a GPU (a process cannot use CUDA in a
fork of one that initialised it): importing the modules above asks torch
for no device (checked on torch 2.15: ``torch._C._cuda_getDeviceCount`` is
not called), and each worker initialises CUDA itself, as a new process does.

The data flow: the supervisor sends ``(argv, env)`` over a pipe; the warm
interpreter forks, answers the child's pid, and reports each child's exit
status when it reaps it. The supervisor keeps a :class:`Worker` handle per
worker (``poll``, ``terminate``, ``pid``: what it used of ``subprocess.Popen``).

What differs from a fresh interpreter: modules the warm interpreter imported
are imported already, so a setting read at import time (``TORCH_LOGS``, a
``torch._dynamo`` config variable) comes from the supervisor's environment,
not from ``os.environ`` changes the script makes before its imports.
``--fresh-interpreters`` starts each worker as a new ``python -u`` process.
"""

import io
import multiprocessing
import os
import runpy
import signal
import sys

#: What every worker of a gradsync job imports: the warm interpreter imports it once.
PRELOAD = ("torch", "torch._dynamo", "gradsync.torch")


class Worker:
    """A worker forked from the warm interpreter: the part of
    ``subprocess.Popen`` the supervisor uses."""

    def __init__(self, pid, warm):
        self.pid = pid
        self._warm = warm
        #: The exit status once the warm interpreter reported it (negative: killed by that signal).
        self.returncode = None

    def poll(self):
        """The exit status, or ``None`` while the worker runs."""
        if self.returncode is None:
            self._warm.collect()
        return self.returncode

    def terminate(self):
        """Send SIGTERM (as ``Popen.terminate``)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


class WarmInterpreter:
    """The supervisor's end of the warm interpreter (see the module docs).
    Create it before anything starts a thread or opens a socket."""

    def __init__(self, preload=PRELOAD):
        parent, child = multiprocessing.Pipe()
        pid = os.fork()
        if pid == 0:
            parent.close()
            argv, env = _serve(child, preload)
            _run_worker(argv, env)  # only a worker gets here; it ends the process
        child.close()
        self.pid = pid
        self._conn = parent
        # pid -> Worker, until its exit status came (the warm interpreter
        # answers "started" before it can reap that pid, so a status always
        # finds its Worker here).
        self._workers = {}

    def start(self, argv, env):
        """Fork a worker that runs ``argv`` (the script and its arguments)
        with environment ``env``; its :class:`Worker`. Raises ``OSError``
        when the warm interpreter is gone."""
        try:
            self._conn.send((list(argv), dict(env)))
            while True:
                message = self._conn.recv()
                if message[0] == "started":
                    worker = Worker(message[1], self)
                    self._workers[worker.pid] = worker
                    return worker
                self._record(message)
        except (EOFError, BrokenPipeError, ConnectionResetError) as e:
            raise OSError(f"the warm interpreter (pid {self.pid}) is gone") from e

    def collect(self):
        """Take in the exit statuses the warm interpreter reported."""
        try:
            while self._conn.poll():
                self._record(self._conn.recv())
        except (EOFError, OSError):
            # The warm interpreter died (killed with the job?): no status will
            # come; a worker that is gone ended with an unknown status (1).
            for pid, worker in list(self._workers.items()):
                if not _alive(pid):
                    worker.returncode = 1
                    del self._workers[pid]

    def _record(self, message):
        _, pid, code = message
        self._workers.pop(pid).returncode = code


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _serve(conn, preload):
    """The warm interpreter's loop: import ``preload``, then fork a worker
    per request and report exit statuses. Returns ``(argv, env)`` in a
    forked worker; the warm interpreter itself ends with the supervisor."""
    # Ctrl-C reaches the whole process group: the supervisor handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:
        try:
            __import__(name)
        except Exception:  # a worker that needs it reports the error itself
            pass
    while True:
        try:
            if conn.poll(0.005):
                argv, env = conn.recv()
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    return argv, env
                conn.send(("started", pid))
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn.send(("ended", pid, os.waitstatus_to_exitcode(status)))
        except (EOFError, OSError):
            # The supervisor is gone: so is the job's store; end without
            # running the supervisor's exit handlers.
            os._exit(0)


def _run_worker(argv, env):
    """Run the script in this (forked) process as ``python -u`` would, and end the process."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    # -u: unbuffered standard streams (as the interpreter makes them).
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                  errors=sys.stdout.errors, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                  errors="backslashreplace", write_through=True)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        sys.exit(1)
    sys.exit(0)
