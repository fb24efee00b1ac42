"""The sharded side-by-side cases under torch's own sharding: FSDP2
(``fully_shard`` on every child module with parameters, then the root, as
models are sharded per block) and DDP with ``ZeroRedundancyOptimizer``
(ZeRO-1), each case in processes of its own on 2 CPU ranks (gloo).

    python benches/torch/sharded_side_by_side.py [--json docs/data/sharded/peers.json] [--deadline 90]

The cases and the reference are the test suite's (``python/tests/sharded.py``:
AdamW, 4 steps, parameters compared with one process on every rank's batch).
A peer may be exact, wrong, raise, hang (its processes are killed after
``--deadline`` seconds; collectives time out after 20 s) or die; each is a
result. The docs' sharded table puts these next to gradsync's column, which
the tests write.
"""

import argparse
import datetime
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import spawn, write_json  # noqa: E402


def _rank(rank, world, port, impl, name, results):
    import torch.distributed as dist

    import sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        outcome = sharded.case(rank, world, impl, name)
    except Exception as e:  # the peer's failure is the result
        outcome = {"status": "error", "error": sharded.first_line(e)}
    results.put((rank, outcome))


def run(impl, name, world, deadline):
    """One case under ``impl`` in fresh processes: a hang if any rank's
    collective timed out (the others may have seen their peer leave
    first), else rank 0's outcome, or what happened to the processes."""
    got, dead = spawn(_rank, world, (impl, name), deadline)
    timed_out = [o for o in got.values() if o["status"] == "error" and "Timed out waiting" in o["error"]]
    if timed_out:
        return timed_out[0]
    if 0 in got:
        return got[0]
    if dead:
        r, code = dead[0]
        why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return {"status": "died", "detail": f"rank {r}'s process {why}"}
    return {"status": "blocked", "detail": f"hangs (killed after {deadline} s)"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the outcomes here (docs/data/sharded/peers.json)")
    parser.add_argument("--deadline", type=int, default=90)
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="only these cases (default: every case)")
    args = parser.parse_args()
    import sharded

    unknown = sorted(set(args.cases or ()) - set(sharded.CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; the cases: {list(sharded.CASES)}")
    rows = []
    for name in args.cases or sharded.CASES:
        row = {"case": sharded.label(name)}
        for impl in ("fsdp2", "zero1"):
            outcome = run(impl, name, 2, args.deadline)
            if outcome["status"] == "error" and "Timed out waiting" in outcome["error"]:
                # gloo's own words for a peer that never joined the collective.
                row[impl] = "hangs until the group's timeout (20 s here, 30 min by default), then raises"
            elif outcome["status"] in ("ok", "error"):
                row[impl] = sharded.describe(outcome)
            else:
                row[impl] = outcome["detail"]
            print(f"{name}, {impl}: {row[impl]}", flush=True)
        rows.append(row)
    if args.json:
        write_json(args.json, rows)

if __name__ == "__main__":
    main()
