"""How long a lost rank costs an elastic job, and what its liveness check costs a healthy step.

    python benches/torch/elastic_recovery.py [--worlds 2 4 8] [--json PATH]

Each recovery run launches ``python -m gradsync.launch --nproc W --rejoin``
over examples/torch/train_elastic.py on loopback; rank 1 SIGKILLs itself in
the middle of backward at step 20. From the members' reports (wall-clock
times the processes recorded):

* **kill -> survivors' next applied step**: from the kill to the first step
  the survivors applied without it (this includes the step in flight,
  skipped, and one full step at the smaller world);
* **kill -> new group**: from the kill to the survivors' agreement on the
  new membership (the event's time);
* **replacement start -> first applied step**: from the replacement's
  process start (the supervisor starts it at once; the figure includes
  importing torch) to the first step it applied, and from its join request
  being answered (admission and state transfer) to that step;
* **healthy step**: the median step time before the kill, for scale.

Side by side, the same model under torchrun's own recovery
(``torchrun_restart.py``: torch's DDP, a checkpoint after every step, rank
1 SIGKILLed at the same step; torchrun stops every worker and starts them
all again, and they load the checkpoint): kill -> next applied step.

The liveness cost: a healthy 4-rank run with the liveness monitor beating
every 0.1 s (the default) against one whose monitor beats every 1000 s (in
effect off), alternating, median step time of each. Every run trains the
same model, without activation checkpointing (torch's DDP in the torchrun
runs refuses its tied embedding under reentrant checkpointing), with DDP's
default bucket cap (25 MB: one bucket). Numbers are for this machine's loopback; the
column ``world`` is the number of processes on its cores.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torch" / "train_elastic.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, args, rejoin=False, timeout=900):
    """Run the elastic example; returns the members' reports and the kill record."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "gradsync.launch", "--nproc", str(nproc), "--port", str(free_port()),
               *(["--rejoin"] if rejoin else []), str(EXAMPLE), "--report", str(report), "--log-every", "100000",
               "--no-recompute", "--bucket-mb", "25", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"elastic_recovery: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        reports = {}
        for f in Path(tmp).glob("out.*"):
            if f.suffix != ".killed":
                r = json.loads(f.read_text())
                reports[r["member"]] = r
        killed = report.with_name("out.killed")
        return reports, json.loads(killed.read_text()) if killed.exists() else None


def applied_times(report):
    return sorted((int(s), t) for s, t in report["applied_at"].items())


def recovery(world, kill_step, steps, policy="skip"):
    reports, killed = launch(world, ["--steps", str(steps), "--kill", f"1@{kill_step}:backward",
                                     "--abort-policy", policy], rejoin=policy == "skip")
    survivor = next(r for m, r in reports.items() if m < world and m != 1)
    times = applied_times(survivor)
    before = [b - a for (_, a), (_, b) in zip(times, times[1:]) if b < killed["time"]]
    (lost,) = [e for e in survivor["events"] if e["kind"] == "lost"]
    # The first step applied at the smaller world (a survivor a step behind
    # the victim may still apply the step before, after the kill): under the
    # partial policy the lost step itself, averaged over the survivors.
    next_applied = min(t for s, t in times if s >= lost["step"] and t > killed["time"])
    row = {
        "world": world,
        "policy": policy,
        "lost_step_applied": any(s == lost["step"] for s, _ in times),
        "healthy_step_s": statistics.median(before),
        "kill_to_next_applied_s": next_applied - killed["time"],
        "kill_to_new_group_s": lost["time"] - killed["time"],
    }
    joiners = [r for m, r in reports.items() if m >= world]
    if joiners:
        joiner = joiners[0]
        (joined,) = [e for e in joiner["events"] if e["kind"] == "joined"]
        first = min(t for _, t in applied_times(joiner))
        row["replacement_start_to_first_applied_s"] = first - joiner["started"]
        row["admitted_to_first_applied_s"] = first - (joined["time"] - joined["seconds"])
    return row


def torchrun_recovery(world, kill_step, steps):
    """Kill -> next applied step when torchrun restarts the job from a checkpoint."""
    torchrun = Path(sys.executable).with_name("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(torchrun), "--nproc-per-node", str(world), "--max-restarts", "1", "--master-port",
               str(free_port()), str(ROOT / "benches" / "torch" / "torchrun_restart.py"), "--times", tmp,
               "--steps", str(steps), "--kill-step", str(kill_step)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            sys.exit(f"elastic_recovery: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        killed = float(Path(tmp, "killed").read_text())
        lines = [line.split() for line in Path(tmp, "rank0").read_text().splitlines()]
    first = [(int(a), int(s), float(t)) for a, s, t in lines]
    before = [t for a, _, t in first if a == 0]
    return {
        "world": world,
        "healthy_step_s": statistics.median(b - a for a, b in zip(before, before[1:])),
        "kill_to_next_applied_s": min(t for a, _, t in first if a == 1) - killed,
    }


def liveness_cost(steps, rounds):
    """Median step time with the monitor beating every 0.1 s and every 1000 s."""
    out = {"beat_0.1s": [], "beat_1000s": []}
    for _ in range(rounds):
        for name, beat in (("beat_0.1s", "0.1"), ("beat_1000s", "1000")):
            reports, _ = launch(4, ["--steps", str(steps), "--beat", beat])
            times = [t for _, t in applied_times(next(r for r in reports.values() if r["rank"] == 0))]
            out[name].append(statistics.median(b - a for a, b in zip(times[10:], times[11:])))
    return {**{k: statistics.median(v) for k, v in out.items()}, "rounds": out}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--rank-steps", type=int, default=2400,
                        help="steps x world of a recovery run: long enough for a replacement to start and join "
                        "(importing torch takes seconds)")
    parser.add_argument("--torchrun-steps", type=int, default=60)
    parser.add_argument("--liveness-steps", type=int, default=200)
    parser.add_argument("--liveness-rounds", type=int, default=8)
    parser.add_argument("--liveness-only", action="store_true",
                        help="measure only the liveness cost, replacing that part of --json's file")
    parser.add_argument("--partial-only", action="store_true",
                        help="only the recovery under abort_policy='partial', into the --json file's 'partial' part")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()

    if args.partial_only:
        if not args.json:
            parser.error("--partial-only needs --json (the file whose partial part it replaces)")
        run = json.loads(Path(args.json).read_text())
        run["partial"] = []
        for world in args.worlds:
            row = recovery(world, args.kill_step, args.rank_steps // world, "partial")
            run["partial"].append(row)
            print(json.dumps(row), flush=True)
        run["command"] += f" && python benches/torch/elastic_recovery.py {' '.join(sys.argv[1:])}"
        Path(args.json).write_text(json.dumps(run, indent=2) + "\n")
        return

    if args.liveness_only:
        if not args.json:
            parser.error("--liveness-only needs --json (the file whose liveness part it replaces)")
        run = json.loads(Path(args.json).read_text())
        run.update(liveness=liveness_cost(args.liveness_steps, args.liveness_rounds),
                   liveness_steps=args.liveness_steps, liveness_rounds=args.liveness_rounds)
        run["command"] += f" && python benches/torch/elastic_recovery.py {' '.join(sys.argv[1:])}"
        Path(args.json).write_text(json.dumps(run, indent=2) + "\n")
        print(json.dumps(run["liveness"]))
        return
    rows = []
    for world in args.worlds:
        row = recovery(world, args.kill_step, args.rank_steps // world)
        rows.append(row)
        print(json.dumps(row), flush=True)
    restarts = []
    for world in args.worlds:
        row = torchrun_recovery(world, args.kill_step, args.torchrun_steps)
        restarts.append(row)
        print(json.dumps({"torchrun": row}), flush=True)
    cost = liveness_cost(args.liveness_steps, args.liveness_rounds)
    print(json.dumps({"liveness": cost}), flush=True)

    print("\n| world | healthy step, ms | kill -> new group, ms | kill -> next applied step, ms | "
          "replacement start -> first applied step, s | admitted -> first applied step, ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['healthy_step_s'] * 1e3:.1f} | {r['kill_to_new_group_s'] * 1e3:.0f} | "
              f"{r['kill_to_next_applied_s'] * 1e3:.0f} | {r.get('replacement_start_to_first_applied_s', float('nan')):.2f} | "
              f"{r.get('admitted_to_first_applied_s', float('nan')) * 1e3:.0f} |")
    for r in restarts:
        print(f"torchrun, world {r['world']}: healthy step {r['healthy_step_s'] * 1e3:.1f} ms, "
              f"kill -> next applied step {r['kill_to_next_applied_s']:.2f} s (restart + checkpoint load)")
    print(f"\nhealthy 4-rank step: monitor every 0.1 s {cost['beat_0.1s'] * 1e3:.2f} ms, "
          f"every 1000 s {cost['beat_1000s'] * 1e3:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python benches/torch/elastic_recovery.py " + " ".join(sys.argv[1:]),
            "cpus": os.cpu_count(), "kill_step": args.kill_step, "recovery": rows, "torchrun": restarts,
            "liveness": cost,
            "liveness_steps": args.liveness_steps, "liveness_rounds": args.liveness_rounds,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
