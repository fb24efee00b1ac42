"""What a buddy copy costs an elastic sharded job, and what a lost rank costs it.

    python benches/torch/sharded_elastic.py [--worlds 3 4] [--width 256] [--json docs/data/sharded/elastic.json]

Each run launches ``python -m gradsync.launch`` over
examples/torch/train_elastic.py on loopback (CPU ranks, gloo), unsharded and
with ``--shard`` (each rank keeps its partition and its buddy's):

* **memory per rank** (a run without a kill at each world size): bytes of
  averaged gradients the runtime holds (buckets unsharded, partitions
  sharded) and of optimizer state (SGD momentum), largest over the ranks;
* **a kill** (the last world size): rank 1 SIGKILLs itself before its
  optimizer step at step 4; from the survivors' reports, the time from the
  failure to the new group's first agreement (sharded: with the state moved
  to the new layout) and the steps the survivors skipped.

Every run ends with the survivors' check against a one-process replay (a run
that fails it stops the bench).
"""

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_recovery import launch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--width", type=int, default=256, help="the example's model width")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/elastic.json)")
    args = parser.parse_args()
    common = ["--width", str(args.width), "--bucket-mb", "1", "--steps", str(args.steps)]
    rows = []
    for world in args.worlds:
        for shard in (False, True):
            reports = list(launch(world, common + (["--shard"] if shard else []), timeout=600, common=())[0].values())
            row = {"world": world, "sharded": shard,
                   "runtime_bytes": max(r["memory"]["runtime"] for r in reports),
                   "optimizer_bytes": max(r["memory"]["optimizer"] for r in reports)}
            rows.append(row)
            print(f"world {world}, {'sharded' if shard else 'unsharded'}: gradients {row['runtime_bytes'] / 1e6:.2f} "
                  f"MB, optimizer state {row['optimizer_bytes'] / 1e6:.2f} MB per rank", flush=True)
    world = args.worlds[-1]
    kills = []
    for shard in (False, True):
        how = ["--kill", "1@4:optimizer"] + (["--shard"] if shard else [])
        reports = list(launch(world, common + how, timeout=600, common=())[0].values())
        lost = [e for r in reports for e in r["events"] if e["kind"] == "lost"]
        first = next(r for r in reports if r["rank"] == 0)
        kill = {"world": world, "sharded": shard, "recovery_s": max(e["seconds"] for e in lost),
                "skipped": args.steps - len(first["history"])}
        kills.append(kill)
        print(f"kill at world {world}, {'sharded' if shard else 'unsharded'}: new group after "
              f"{kill['recovery_s'] * 1e3:.0f} ms, {kill['skipped']} steps skipped", flush=True)
    if args.json:
        meta = {"command": "python benches/torch/sharded_elastic.py " + " ".join(sys.argv[1:]),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU ranks over gloo (loopback)",
                "width": args.width}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "memory": rows, "kills": kills}, f, indent=1)


if __name__ == "__main__":
    main()
