"""What a buddy copy costs an elastic sharded job, and what a lost rank costs it.

    python benches/torch/sharded_elastic.py [--worlds 3 4] [--width 256] [--json docs/data/sharded/elastic.json]

Each run launches ``python -m gradsync.launch`` over
examples/torch/train_elastic.py on loopback (CPU ranks, gloo), unsharded,
with ``--shard`` (gradients and optimizer state sharded: each rank keeps its
partition and its buddy's) and with ``--shard-params`` (the parameters
sharded too, their pieces kept by a buddy as well):

* **memory per rank** (a run without a kill at each world size): bytes of
  parameters kept between steps (whole, or the pieces), of averaged
  gradients the runtime holds (buckets unsharded, partitions sharded) and
  of optimizer state (SGD momentum), largest over the ranks;
* **a kill** (the last world size): rank 1 SIGKILLs itself before its
  optimizer step at step 4, and, sharded parameters, in its forward (the
  others' gathers fail); from the survivors' reports, the time from the
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


#: The runs, by what is sharded, and the example's arguments for each.
MODES = {"unsharded": [], "gradients": ["--shard"], "parameters": ["--shard-params"]}


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
        for mode in MODES:
            reports = list(launch(world, common + MODES[mode], timeout=600, common=())[0].values())
            row = {"world": world, "mode": mode,
                   "parameter_bytes": max(r["memory"]["parameters"] for r in reports),
                   "runtime_bytes": max(r["memory"]["runtime"] for r in reports),
                   "optimizer_bytes": max(r["memory"]["optimizer"] for r in reports)}
            rows.append(row)
            print(f"world {world}, {mode}: parameters {row['parameter_bytes'] / 1e6:.2f} MB, gradients "
                  f"{row['runtime_bytes'] / 1e6:.2f} MB, optimizer state {row['optimizer_bytes'] / 1e6:.2f} MB "
                  "per rank", flush=True)
    world = args.worlds[-1]
    kills = []
    for mode, phase in [(m, "optimizer") for m in MODES] + [("parameters", "forward")]:
        how = ["--kill", f"1@4:{phase}"] + MODES[mode]
        reports = list(launch(world, common + how, timeout=600, common=())[0].values())
        lost = [e for r in reports for e in r["events"] if e["kind"] == "lost"]
        first = next(r for r in reports if r["rank"] == 0)
        kill = {"world": world, "mode": mode, "phase": phase, "recovery_s": max(e["seconds"] for e in lost),
                "skipped": args.steps - len(first["history"])}
        kills.append(kill)
        print(f"kill in {phase} at world {world}, {mode}: new group after {kill['recovery_s'] * 1e3:.0f} ms, "
              f"{kill['skipped']} steps skipped", flush=True)
    if args.json:
        meta = {"command": "python benches/torch/sharded_elastic.py " + " ".join(sys.argv[1:]),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU ranks over gloo (loopback)",
                "width": args.width}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "memory": rows, "kills": kills}, f, indent=1)


if __name__ == "__main__":
    main()
