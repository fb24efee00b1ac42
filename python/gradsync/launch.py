"""gradsync's supervisor for elastic jobs: ``python -m gradsync.launch``.

    python -m gradsync.launch --nproc 4 [--rejoin] train.py [args ...]

It hosts the job's store (torch's ``TCPStore``: the job's membership lives
there, so it outlives every training process, rank 0 included), starts the
workers with the variables :class:`gradsync.torch.Elastic` reads, and
watches them. When a worker dies it records the death in the store (the
survivors then need not wait for its heartbeat to stop) and, with
``--rejoin``, starts a replacement that joins the running job; the
survivors are never touched. When no member of the job is left (every
process of its newest membership is dead), it says so, tells the
replacements still waiting to join that there is nothing to join (they end
with ``MembershipError(kind="no_members")``), and exits with 1.

Several machines: host the store on one (``--store-only``, or a supervisor
with workers), and on each machine run a supervisor with ``--store
HOST:PORT --node-rank K --nnodes M``: every supervisor starts ``--nproc``
workers of the first ``M * nproc`` and replaces its own. A machine lost with
its supervisor is survived: the others go on (the store decides; see
:mod:`gradsync.torch.elastic`), and a sharded job keeps each partition's
buddy copy on another machine. A replacement machine joins the running job
with ``--join`` (its workers ask to be admitted, as replacements do; give it
a ``--node-rank`` no live machine has). A supervisor exits
with 0 when its workers finished the job, with 3 when every one of them left
a job that went on without them (``EXIT_LEFT``) or was refused as a joiner
(``EXIT_REFUSED``), else 1: the job did not finish. (torchrun's agent
cannot do this: on any failure it stops every worker of the job and starts
them all again, and its c10d rendezvous store lives in one agent.)

Workers are forked from a warm interpreter that imported torch once
(:mod:`gradsync._warm_start`: each runs its script as ``python -u`` would,
in milliseconds instead of the seconds importing torch takes);
``--fresh-interpreters`` starts each as a new process instead.

etcd: ``--store etcd://HOST:PORT[,HOST:PORT...]`` keeps the job's
membership in an etcd cluster instead (see :mod:`gradsync.torch.etcd`; each
epoch's rank 0 hosts that epoch's group rendezvous at its machine's
``--host``); no supervisor then holds anything the others need, and
``--store-only`` is not needed.
"""

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time

from gradsync.torch.elastic import (
    ENV_FIRST, ENV_HOST, ENV_JOB, ENV_JOIN, ENV_MEMBER, ENV_NODE, ENV_NODES, ENV_STORE, EXIT_LEFT, EXIT_REFUSED,
)


def _describe(code):
    """A worker's exit status in words."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Supervisor:
    """Starts this machine's workers, records deaths, starts replacements."""

    def __init__(self, args, store, address, warm=None):
        import torch.distributed as dist  # noqa: F401  (the store is torch's)

        from gradsync._native import Membership
        from gradsync.torch import _shim
        from gradsync.torch.etcd import EtcdStore

        shim, why = _shim.load("collectives")
        if shim is None:
            sys.exit(f"gradsync launch: {why}")
        self._membership = Membership
        self._table = shim.table()
        self._client = store.client if isinstance(store, EtcdStore) else shim.StoreClient(store)
        self.args = args
        self.store = store
        self.address = address
        #: How many members the job started with (a replacement machine reads it from the store).
        self.first = self._first_world()
        self.workers = {}  # member id -> Popen
        self.finished = {}  # member id -> exit status, for workers that ended
        self.rejoins = 0
        self.first_success = None  # when the first worker finished the job
        self.failed_after_success = False
        self.gave_up = None  # why the job was given up (no member left)
        self.prefix = f"{args.job}/membership"
        #: Where workers are forked from (``None``: each worker is a new ``python -u`` process).
        self.warm = warm

    def _log(self, message):
        print(f"gradsync launch: {message}", file=sys.stderr, flush=True)

    def _start(self, member, join):
        env = dict(os.environ)
        env.update({ENV_STORE: self.address, ENV_JOB: self.args.job, ENV_MEMBER: str(member),
                    ENV_FIRST: str(self.first), ENV_JOIN: "1" if join else "0", ENV_HOST: self.args.host,
                    ENV_NODE: str(self.args.node_rank), ENV_NODES: str(self.args.nnodes)})
        env.setdefault("OMP_NUM_THREADS", "1")
        self.workers[member] = self._fork(env) or subprocess.Popen(
            [sys.executable, "-u", self.args.script, *self.args.script_args], env=env)
        if join:
            self._log(f"started member {member} (pid {self.workers[member].pid}) to join the job")

    def _fork(self, env):
        """A worker forked from the warm interpreter; ``None`` without one
        (or once it is gone: then every worker starts as a new process)."""
        if self.warm is None:
            return None
        try:
            return self.warm.start([self.args.script, *self.args.script_args], env)
        except OSError as e:
            self._log(f"{e}: workers start as new processes from now on")
            self.warm = None
            return None

    def run(self):
        """Start the workers and watch them until every one has ended;
        returns the exit status of the job."""
        base = self.args.node_rank * self.args.nproc
        for i in range(self.args.nproc):
            if self.args.join:
                self._start(self._replacement_id(), join=True)
            else:
                self._start(base + i, join=False)
        try:
            while self.workers:
                for member, proc in list(self.workers.items()):
                    code = proc.poll()
                    if code is not None:
                        self._ended(member, proc, code)
                time.sleep(0.005)
        except KeyboardInterrupt:
            for proc in self.workers.values():
                proc.terminate()
            return 130
        # The job succeeded when workers finished it and none failed after
        # the first did (members lost or left out during training do not count).
        if self.first_success is not None:
            if self.failed_after_success:
                self._log("the job finished, but a worker failed after the first one finished: exit status 1")
                return 1
            return 0
        if self.gave_up is not None:
            self._log(f"the job did not finish: {self.gave_up}")
            return 1
        # Every worker of this supervisor left a job that went on elsewhere (several machines).
        if self.finished and all(code in (EXIT_LEFT, EXIT_REFUSED) for code in self.finished.values()):
            return EXIT_LEFT
        self._log("the job did not finish: no worker of this machine finished it (see their messages above)")
        return 1

    def _ended(self, member, proc, code):
        del self.workers[member]
        self.finished[member] = code
        if code == 0:
            self.first_success = self.first_success or time.time()
            return
        # Whatever ended it, this process is no member any more: record it,
        # so nobody waits for it and the store knows who is left.
        try:
            self._membership.obituary(self._table, self._client, self.prefix, member)
        except Exception as e:  # the store is ours: only a dying supervisor gets here
            self._log(f"could not record that member {member} ended: {e}")
        if code == EXIT_LEFT:
            self._log(f"member {member} (pid {proc.pid}) left the job: the others had gone on without it")
            return
        if code == EXIT_REFUSED:
            self._log(f"member {member} (pid {proc.pid}) was refused by the job's members (its message says why)")
            return
        self.failed_after_success |= self.first_success is not None
        if self.gave_up is not None:
            self._log(f"member {member} (pid {proc.pid}) {_describe(code)} (the job had no member left)")
            return
        left = self._members_left()
        if left is not None and not left and self.first_success is None:
            self._give_up(f"member {member} (pid {proc.pid}) {_describe(code)}, and no member of the job is left")
            return
        self._log(f"member {member} (pid {proc.pid}) {_describe(code)}; the others go on without it")
        if self.args.rejoin and self.first_success is None and self.rejoins < self.args.max_rejoins and left:
            self.rejoins += 1
            self._start(self._replacement_id(), join=True)

    def _first_world(self):
        """The job's first world size: ``--nnodes`` times ``--nproc``,
        recorded in the store by the first supervisors; a replacement
        machine (``--join``) reads it there, so its workers' ids follow
        every id the job gave out, whatever its own options say."""
        key = f"{self.args.job}/first_world"
        if not self.args.join:
            first = self.args.nnodes * self.args.nproc
            self.store.set(key, str(first))
            return first
        try:
            return int(self.store.get(key))  # (waits for the job's first supervisors, up to the store's timeout)
        except Exception as e:  # the store's timeout: no job of that name
            sys.exit(f"gradsync launch: --join found no job named {self.args.job!r} in the store ({e}); "
                     "start its first machines first, or check --job and --store")

    def _replacement_id(self):
        """A member id no process of the job had (the store counts them)."""
        return self.first + self.store.add(f"{self.args.job}/replacements", 1) - 1

    def _members_left(self):
        """The members of the job's newest membership not known dead
        (``None`` when the store cannot tell)."""
        try:
            return self._membership.members_left(self._table, self._client, self.prefix)
        except Exception as e:  # the store is ours: only a dying supervisor gets here
            self._log(f"could not read the job's members: {e}")
            return None

    def _give_up(self, why):
        """No member is left: the job is over; replacements waiting to join are told so."""
        self.gave_up = why
        waiting = sorted(self.workers)
        self._log(f"{why}: the job cannot go on"
                  + (f"; the replacements waiting to join ({', '.join(map(str, waiting))}) give up" if waiting else ""))
        try:
            self._membership.give_up(self._table, self._client, self.prefix, why)
        except Exception as e:  # the store is ours: only a dying supervisor gets here
            self._log(f"could not tell the waiting replacements: {e}; stopping them")
            for proc in self.workers.values():
                proc.terminate()


def _port(text):
    """A TCP port number (argparse type)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
    return port


def main(argv=None):
    """The supervisor's command line (``argv``: the arguments, default
    ``sys.argv[1:]``); returns the job's exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.launch", description=__doc__.split("\n\n")[0],
        epilog="Workers read GRADSYNC_STORE, GRADSYNC_JOB, GRADSYNC_MEMBER, GRADSYNC_FIRST and GRADSYNC_JOIN "
        "(gradsync.torch.Elastic does).",
    )
    parser.add_argument("--nproc", type=int, default=1, help="workers on this machine")
    parser.add_argument("--rejoin", action="store_true", help="start a replacement for a worker that dies")
    parser.add_argument("--max-rejoins", type=int, default=100, help="replacements at most (default 100)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="this machine's address: the store is hosted there, and (etcd) the rendezvous of an "
                        "epoch whose first member runs here (default loopback)")
    parser.add_argument("--port", type=_port, default=29510, help="port of the hosted store (default 29510)")
    parser.add_argument("--store", metavar="HOST:PORT",
                        help="use the store another supervisor hosts, or etcd://HOST:PORT[,HOST:PORT...] (an etcd cluster)")
    parser.add_argument("--store-only", action="store_true", help="only host the store (several machines)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index (several machines)")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the job's first membership")
    parser.add_argument("--job", default="gradsync-elastic", help="the job's name in the store")
    parser.add_argument("--join", action="store_true",
                        help="a replacement machine: its workers join the running job (with --store; give a "
                        "--node-rank no live machine has)")
    parser.add_argument("--fresh-interpreters", action="store_true",
                        help="start each worker as a new `python -u` process instead of forking it from a warm "
                        "interpreter that imported torch once (see gradsync._warm_start)")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.nnodes < 1 or args.node_rank < 0 or not (args.join or args.node_rank < args.nnodes):
        parser.error("--nproc and --nnodes must be positive, and --node-rank below --nnodes (any, with --join)")
    if args.join and not args.store:
        parser.error("--join joins a running job: name its store with --store HOST:PORT")
    if not args.store_only and not args.script:
        parser.error("name the training script (or pass --store-only)")

    import torch.distributed as dist

    from gradsync.torch.etcd import EtcdStore, is_etcd

    warm = None
    if not args.store_only and not args.fresh_interpreters:
        # Before the store: the warm interpreter must be forked while this
        # process has no thread and no socket.
        from gradsync._warm_start import WarmInterpreter

        warm = WarmInterpreter()
    if args.store and is_etcd(args.store):
        if args.store_only:
            parser.error("--store-only hosts a TCPStore; an etcd cluster needs no host from gradsync")
        try:
            store = EtcdStore(args.store, timeout=60)
        except Exception as e:  # MembershipError: etcd unreachable
            sys.exit(f"gradsync launch: {e}")
        address = args.store
        print(f"gradsync launch: the job's store is etcd at {args.store[len('etcd://'):]}", file=sys.stderr, flush=True)
    elif args.store:
        host, _, port = args.store.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
        address = args.store
    else:
        store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        address = f"{args.host}:{store.port}"
        print(f"gradsync launch: the job's store is at {address}", file=sys.stderr, flush=True)
    if args.store_only:
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    return Supervisor(args, store, address, warm).run()


if __name__ == "__main__":
    sys.exit(main())
