"""What one of gradsync's gloo groups costs a member, by world size: the
connections (sockets) it holds and the time its group takes to be made,
beside a group made as torch makes it.

    python benches/torch/gloo_groups.py [--worlds 8 16 32 64 128] [--json docs/data/groups.json]

Each world is ``world`` lightweight members: processes forked from this one
(torch imported once, its pages shared), on one store over loopback. Each
member makes the group, then runs what gradsync runs on its groups: an
all-reduce of 1 KiB (the runtime's control words and buckets), a broadcast
(the state group's buffers) and an all-gather (a sharded model's
consolidation). Reported per member, the most over the members: sockets
the group holds after each, and the seconds until the group is made.

``torch``: ``ProcessGroupGloo(store, rank, world, timeout)``, which connects
every pair when it is made. ``gradsync``: ``gradsync.torch._comm.gloo_group``,
whose pairs connect on first use. A wrapper makes two such groups (the
runtime's and the state group), three under ``shard_parameters=True`` (the
gather lane): the sockets below count one group's.
"""

import argparse
import datetime
import multiprocessing
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import write_json  # noqa: E402

WAYS = ("torch", "gradsync")


def _sockets():
    """Sockets this process holds now."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # (the listing's own descriptor, closed since)
            pass
    return count


def _member(rank, world, port, way, out):
    """One member: make the group, run the three collectives, report."""
    import torch
    import torch.distributed as dist

    from gradsync.torch._comm import gloo_group

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    before = _sockets()
    start = time.monotonic()
    scoped = dist.PrefixStore(way, store)
    group = (dist.ProcessGroupGloo(scoped, rank, world, timeout) if way == "torch"
             else gloo_group(scoped, rank, world, timeout))
    made_s = time.monotonic() - start
    held = {"made": _sockets() - before}
    words = torch.ones(256)
    group.allreduce([words]).wait()
    assert words[0].item() == world, "an all-reduce of ones sums to the world"
    held["all_reduce"] = _sockets() - before
    group.broadcast(words, 0).wait()
    held["broadcast"] = _sockets() - before
    gathered = [torch.zeros(4) for _ in range(world)]
    group.allgather([gathered], [torch.full((4,), float(rank))]).wait()
    assert [g[0].item() for g in gathered] == list(range(world)), "an all-gather in rank order"
    held["all_gather"] = _sockets() - before
    out.send((made_s, held))
    # Every member measured before any leaves (a peer gone would close its sockets).
    store.add("measured", 1)
    while store.add("measured", 0) < world:
        time.sleep(0.01)
    out.close()
    os._exit(0)


def _store(port, world, deadline):
    """The world's store, in a process of its own (this one forks the
    members, and a fork must not copy a running server's threads)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", port, world, True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=deadline))
    while True:  # (until the members left: run_world ends it)
        time.sleep(1)


def run_world(world, way, deadline=300):
    """One world of forked members; the most any member held and waited."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    store = ctx.Process(target=_store, args=(port, world, deadline))
    store.start()
    pipes, procs = [], [store]
    for rank in range(world):
        mine, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_member, args=(rank, world, port, way, theirs))
        proc.start()
        theirs.close()
        pipes.append(mine)
        procs.append(proc)
    reports = []
    for rank, pipe in enumerate(pipes):
        if not pipe.poll(deadline):
            for proc in procs:  # (the store too)
                proc.kill()
            sys.exit(f"{way} at {world} members: member {rank} did not report within {deadline} s")
        reports.append(pipe.recv())
    for proc in procs[1:]:
        proc.join(timeout=30)
    store.kill()
    store.join()
    held = {k: max(h[k] for _, h in reports) for k in reports[0][1]}
    return {"world": world, "way": way, "made_s": max(m for m, _ in reports), **held}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--json", help="write the rows here (docs/data/groups.json)")
    args = parser.parse_args()
    import torch  # noqa: F401  (imported once, before the members are forked)

    rows = []
    for world in args.worlds:
        for way in WAYS:
            row = run_world(world, way)
            rows.append(row)
            print(f"{world:5d} members  {way:8s}  made in {row['made_s'] * 1e3:7.1f} ms  sockets held: "
                  f"made {row['made']:4d}, all-reduce {row['all_reduce']:4d}, broadcast {row['broadcast']:4d}, "
                  f"all-gather {row['all_gather']:4d}", flush=True)
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
