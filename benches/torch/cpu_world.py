"""CPU worlds for the torch benchmarks: ``world`` fresh processes on
loopback (gloo), each running ``target(rank, world, port, *args, results)``
and putting ``(rank, value)`` on ``results``."""

import json
import os
import platform
import queue
import socket
import sys
import time

import torch.multiprocessing as mp


def spawn(target, world, args, deadline):
    """Run ``target`` on ``world`` fresh processes. Returns ``(got, dead)``:
    the values by rank that came back within ``deadline`` seconds, and
    ``(rank, exit status)`` of processes that died; the others are killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    end = time.monotonic() + deadline
    while len(got) < world and time.monotonic() < end:
        try:
            rank, value = results.get(timeout=1)
            got[rank] = value
        except queue.Empty:
            # Every rank still to answer has exited (raised): nothing more will come.
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in got):
                break
    while len(got) < world:  # (what a rank put just before it exited)
        try:
            rank, value = results.get(timeout=0.5)
        except queue.Empty:
            break
        got[rank] = value
    for p in procs:
        p.join(timeout=5)
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None)]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return got, dead


def spawn_every(target, world, args, deadline, what):
    """:func:`spawn`, every rank's value by rank; exits naming the ranks
    that failed, ``what`` saying which run it was."""
    got, dead = spawn(target, world, args, deadline)
    if dead or len(got) < world:
        sys.exit(f"{what}: ranks {dead or sorted(set(range(world)) - set(got))} failed")
    return got


def model_shape_arguments(parser, layers, width, vocab):
    """The GPT-2-shaped model's ``--layers``, ``--width`` and ``--vocab``
    (``sharded_memory.Stack``), with these defaults, on ``parser``."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--vocab", type=int, default=vocab)


def peak_resident():
    """This process's peak resident memory so far (``ru_maxrss``), in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_json(path, rows, **meta):
    """The run's ``rows`` and what it ran on (the command, this machine,
    torch's version, and ``meta``) as JSON at ``path``, for docs/gen.py."""
    import torch

    meta = {
        "command": "python " + os.path.relpath(os.path.abspath(sys.argv[0])) + " " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU ranks over gloo (loopback)",
        "torch": torch.__version__,
        **meta,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
