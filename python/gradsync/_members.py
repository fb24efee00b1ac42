"""Many lightweight members of an elastic job: real
:class:`gradsync._native.Membership` objects, as :class:`gradsync.torch.Elastic`
builds them (each with its two store clients, its probe listener and its
liveness monitor), many per process and no model. The membership scale test
(``python/tests/test_membership_scale.py``) and bench
(``benches/torch/membership_scale.py``) run them against one store to
measure what the protocol costs at a job's size, which no machine here can
run as training processes.

    python -m gradsync._members --store HOST:PORT --job J --first 512 --procs 8

One interpreter imports torch once and forks ``--procs`` children before it
opens any socket or thread; ``--victim M`` puts member ``M`` alone in the
first child, so that killing that process is a lost member. Each child
prints one JSON line per event to standard output::

    {"event": "started", "member": 3, "epoch": 0, "pid": 812, "t": ...}
    {"event": "broke", "member": 3, "epoch": 0, "t": ...}      (it saw its epoch broken)
    {"event": "roster", "member": 3, "epoch": 1, "world": 511, "lost": [300], "digest": ..., "t": ...}
    {"event": "error", "member": 3, "kind": "left_out", "message": ..., "t": ...}

and takes commands from the store: the test sets ``{job}/test/cmd/{n}``
(``silence M``: member ``M``'s monitor and probe listener stop, as for a
host whose link is cut; ``quit``) and counts them at ``{job}/test/cmds``.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback

#: How often a child looks at its members' flags (local reads) and at the store's commands.
LOOK_S, COMMANDS_S = 0.005, 0.05


def _emit(event, **fields):
    """One JSON line, written whole (lines of children sharing a pipe never interleave)."""
    os.write(1, (json.dumps({"event": event, "t": time.time(), **fields}) + "\n").encode())


def _store(address, timeout_s):
    """A client of the job's store: ``(c10d store or None, client the runtime takes)``,
    its calls bounded by ``timeout_s`` (connecting may take longer: see
    ``gradsync.torch._job.connect``)."""
    from gradsync._native import EtcdClient

    if address.startswith("etcd://"):
        return None, EtcdClient(address[len("etcd://"):], "", timeout_s=timeout_s)
    from gradsync.torch import _shim
    from gradsync.torch._job import tcp_store

    shim, why = _shim.load("collectives")
    if shim is None:
        raise SystemExit(f"gradsync members: {why}")

    host, _, port = address.rpartition(":")
    store = tcp_store(host, int(port), timeout_s)
    return store, shim.StoreClient(store)


def _child(args, ids):
    """Run members ``ids`` until told to quit."""
    from concurrent.futures import ThreadPoolExecutor

    from gradsync._errors import MembershipError
    from gradsync._native import Membership
    from gradsync.torch import _shim

    # Dozens of members share this interpreter, each returning from the runtime
    # into Python at once after a change: hand the interpreter over every
    # 0.5 ms, not every 5 ms, so that their timestamps are the protocol's, not
    # a queue for the interpreter (a job's process holds one member).
    sys.setswitchinterval(0.0005)
    shim, _ = _shim.load("collectives")
    prefix = f"{args.job}/membership"
    control_store, control = _store(args.store, 60.0)
    control = control_store or control  # torch's store, or the etcd client: both add and get
    members, keep = {}, []
    for m in ids:
        store, client = _store(args.store, 60.0)
        beat_store, beat_client = _store(args.store, max(2.0, 2 * args.liveness))
        cancel = shim.Cancel()
        keep += [store, beat_store, cancel]
        members[m] = Membership(shim.table(), client, beat_client, cancel, prefix, m, liveness_s=args.liveness,
                                beat_s=args.beat, node=m // args.per_node,
                                probe_host="127.0.0.1")
    first = list(range(args.first))
    nodes = [m // args.per_node for m in first]
    epochs = {}

    def start(m):
        epochs[m] = members[m].start(first, nodes)["epoch"]
        _emit("started", member=m, epoch=epochs[m], pid=os.getpid())

    def recover(m):
        try:
            roster = members[m].recover([])
        except MembershipError as e:
            _emit("error", member=m, kind=getattr(e, "kind", None), message=str(e))
            return None
        epochs[m] = roster["epoch"]
        _emit("roster", member=m, epoch=roster["epoch"], world=len(roster["members"]), lost=roster["lost"],
              digest=hash(tuple(roster["members"])))
        return m

    pool = ThreadPoolExecutor(max_workers=max(1, len(ids)))
    list(pool.map(start, ids))
    live, recovering, seen_cmds, last_look = set(ids), {}, 0, 0.0
    while True:
        now = time.monotonic()
        if now - last_look >= COMMANDS_S:
            last_look = now
            count = control.add(f"{args.job}/test/cmds", 0)
            while seen_cmds < count:
                text = control.get(f"{args.job}/test/cmd/{seen_cmds + 1}")
                if text is None:  # counted, not written yet (etcd's get does not wait)
                    break
                seen_cmds += 1
                command = text.decode().split()
                if command[0] == "quit":
                    for m in live:
                        members[m].close()
                    os._exit(0)
                if command[0] == "silence" and int(command[1]) in live:
                    gone = int(command[1])
                    members[gone].close()  # its heartbeat stops, nothing answers for it; it never checks in
                    live.discard(gone)
        for m in list(live):
            if m in recovering:
                if recovering[m].done() and recovering.pop(m).result() is None:
                    live.discard(m)
                continue
            broken = members[m].broken
            if broken is not None and broken >= epochs[m]:
                _emit("broke", member=m, epoch=epochs[m])
                recovering[m] = pool.submit(recover, m)
        time.sleep(LOOK_S)


def main(argv=None):
    """The command line (see the module docs)."""
    parser = argparse.ArgumentParser(prog="python -m gradsync._members", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="HOST:PORT of a TCPStore, or etcd://HOST:PORT")
    parser.add_argument("--job", required=True)
    parser.add_argument("--first", type=int, required=True, help="the job's first members (ids 0..N-1)")
    parser.add_argument("--procs", type=int, default=8, help="processes they run in")
    parser.add_argument("--victim", type=int, help="a member alone in the first process (kill it to lose it)")
    parser.add_argument("--per-node", type=int, default=8, help="members per node (their node is id // this)")
    parser.add_argument("--liveness", type=float, default=1.0)
    parser.add_argument("--beat", type=float, default=0.1)
    args = parser.parse_args(argv)
    import torch  # noqa: F401  (imported once, before the fork)

    import gradsync.torch  # noqa: F401

    others = [m for m in range(args.first) if m != args.victim]
    groups = [[args.victim]] if args.victim is not None else []
    rest = max(1, args.procs - len(groups))
    groups += [others[k::rest] for k in range(rest)]
    children = []
    for ids in groups:
        pid = os.fork()
        if pid == 0:
            try:
                _child(args, ids)
            except BaseException:  # noqa: BLE001  (a forked child reports whatever ended it, then exits)
                traceback.print_exc()
            finally:
                os._exit(1)
        children.append(pid)
    signal.signal(signal.SIGTERM, lambda *_: [os.kill(c, signal.SIGKILL) for c in children] and sys.exit(1))
    status = 0
    for pid in children:
        _, code = os.waitpid(pid, 0)
        status = status or (os.waitstatus_to_exitcode(code) not in (0, -signal.SIGKILL))
    return int(status)


if __name__ == "__main__":
    threading.current_thread().name = "gradsync-members"
    sys.exit(main())
