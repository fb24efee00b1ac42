"""How long a lost rank costs an elastic job, and what its liveness check costs a healthy step.

    python benches/torch/elastic_recovery.py [--worlds 2 4 8] [--parts ...] [--json PATH]

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
  process start (the supervisor starts it at once, forked from its warm
  interpreter: torch is imported already) to the first step it applied, and from its join request
  being answered (admission and state transfer) to that step;
* **healthy step**: the median step time before the kill, for scale.

Part ``loaded`` runs the same recovery with busy loops on every core (two
per core, started before the job): the kill is still found at once (the
process's death is seen by its supervisor and the sockets), and the
liveness check must not take a slow member for a lost one; the row counts
such false losses (membership changes naming anyone but the killed rank).

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


#: What this bench's runs share (the model as torch's DDP in the torchrun runs can train it, one bucket).
SAME_AS_TORCHRUN = ("--no-recompute", "--bucket-mb", "25")


def launch(nproc, args, rejoin=False, timeout=900, common=SAME_AS_TORCHRUN):
    """Run the elastic example with ``common`` and ``args`` (the benches of
    elastic jobs share it); returns the members' reports by member id and
    the kill record. A run that fails ends the bench, saying why."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "gradsync.launch", "--nproc", str(nproc), "--port", str(free_port()),
               *(["--rejoin"] if rejoin else []), str(EXAMPLE), "--report", str(report), "--log-every", "100000",
               *common, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            bench = Path(sys.argv[0]).stem
            sys.exit(f"{bench}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        reports = {}
        for f in Path(tmp).glob("out.*"):
            if f.suffix not in (".killed", ".tmp"):
                r = json.loads(f.read_text())
                reports[r["member"]] = r
        killed = report.with_name("out.killed")
        return reports, json.loads(killed.read_text()) if killed.exists() else None


def applied_times(report):
    return sorted((int(s), t) for s, t in report["applied_at"].items())


def busy_loops(per_core=2):
    """Processes spinning on every core (a loaded machine); kill them after."""
    spin = "while True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(per_core * (os.cpu_count() or 1))]


def recovery(world, kill_step, steps, policy="skip", loaded=False):
    loops = busy_loops() if loaded else []
    try:
        reports, killed = launch(world, ["--steps", str(steps), "--kill", f"1@{kill_step}:backward",
                                         "--abort-policy", policy], rejoin=policy == "skip")
    finally:
        for p in loops:
            p.kill()
    survivor = next(r for m, r in reports.items() if m < world and m != 1)
    times = applied_times(survivor)
    before = [b - a for (_, a), (_, b) in zip(times, times[1:]) if b < killed["time"]]
    losses = [e for e in survivor["events"] if e["kind"] == "lost"]
    (lost,) = [e for e in losses if e["lost"] == [1]]
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
        "false_losses": len(losses) - 1,
    }
    if loaded:
        row["loaded"] = f"{len(loops)} busy loops"
    joiners = [r for m, r in reports.items() if m >= world]
    if joiners:
        joiner = joiners[0]
        (joined,) = [e for e in joiner["events"] if e["kind"] == "joined"]
        first = min(t for _, t in applied_times(joiner))
        row["replacement_start_to_first_applied_s"] = first - joiner["started"]
        # The launcher's default since it has one: a fork of its warm interpreter (torch imported already).
        row["worker_start"] = "warm"
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


PARTS = ("recovery", "partial", "loaded", "torchrun", "liveness")


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
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="what to measure: recovery (skip policy), partial (abort_policy='partial'), loaded "
                        "(recovery with busy loops on every core), torchrun (its restart), liveness (the monitor's "
                        "cost on a healthy step); with --json, only these parts of the file are replaced")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()

    path = Path(args.json) if args.json else None
    run = json.loads(path.read_text()) if path and path.is_file() else {}
    run.update(cpus=os.cpu_count(), kill_step=args.kill_step)
    worlds = args.worlds
    for part, policy, loaded in (("recovery", "skip", False), ("partial", "partial", False),
                                 ("loaded", "skip", True)):
        if part in args.parts:
            run[part] = []
            for world in worlds:
                row = recovery(world, args.kill_step, args.rank_steps // world, policy, loaded)
                run[part].append(row)
                print(json.dumps({part: row}), flush=True)
    if "torchrun" in args.parts:
        run["torchrun"] = []
        for world in worlds:
            row = torchrun_recovery(world, args.kill_step, args.torchrun_steps)
            run["torchrun"].append(row)
            print(json.dumps({"torchrun": row}), flush=True)
    if "liveness" in args.parts:
        run.update(liveness=liveness_cost(args.liveness_steps, args.liveness_rounds),
                   liveness_steps=args.liveness_steps, liveness_rounds=args.liveness_rounds)
        print(json.dumps({"liveness": run["liveness"]}), flush=True)
    # Which command made each part (a part measured again replaces its line).
    commands = {k: v for k, v in run.get("commands", {}).items() if k not in args.parts}
    this = "python benches/torch/elastic_recovery.py " + " ".join(sys.argv[1:])
    run["commands"] = {**commands, **{part: this for part in args.parts}}
    run.pop("command", None)

    for part in ("recovery", "loaded"):
        for r in run.get(part, []) if part in args.parts else []:
            print(f"{part}, world {r['world']}: healthy step {r['healthy_step_s'] * 1e3:.1f} ms, kill -> new group "
                  f"{r['kill_to_new_group_s'] * 1e3:.0f} ms, kill -> next applied step "
                  f"{r['kill_to_next_applied_s'] * 1e3:.0f} ms, false losses {r['false_losses']}")
    for r in run.get("torchrun", []) if "torchrun" in args.parts else []:
        print(f"torchrun, world {r['world']}: healthy step {r['healthy_step_s'] * 1e3:.1f} ms, "
              f"kill -> next applied step {r['kill_to_next_applied_s']:.2f} s (restart + checkpoint load)")
    if path:
        path.write_text(json.dumps(run, indent=2) + "\n")


if __name__ == "__main__":
    main()
