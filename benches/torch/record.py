"""Record the benchmark runs the docs draw their numbers and chart from.

    .venv/bin/python benches/torch/record.py            # every run below
    .venv/bin/python benches/torch/record.py tiny       # the runs whose name starts so
    .venv/bin/python benches/torch/record.py --smoke --out DIR   # each run for 3 steps, into DIR (the tests)

Each run is ``vs_ddp.py --json``; its JSON (with the command that produced
it added as ``command``) goes to ``docs/data/bench/NAME.json``. Then
``.venv/bin/python docs/gen.py --write`` redraws the README's cost table and
chart, and the docs build renders the rest. Nothing in the docs is typed in
by hand: to change a number, run the benchmark again.
"""

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "data" / "bench"
BENCH = "benches/torch/vs_ddp.py"
# name -> arguments. The first two are the per-parameter and the per-step
# cost on the small tied LM; both run every policy, interleaved.
RUNS = {
    "1-tiny-params": "--tiny-params 1000 --steps 30 --policies gradsync,ddp,no_sync,local --no-hook-timing",
    "2-tied-64": "--tokens-per-rank 64 --steps 30 --policies gradsync,ddp,no_sync,local --no-hook-timing",
    "3-tied-256": "--tokens-per-rank 256 --steps 30 --policies gradsync,ddp,no_sync,local --no-hook-timing",
}


#: What ``--smoke`` adds to each run: a step of warm-up and two measured.
SMOKE = "--steps 3 --warmup 1"


def record(name: str, args: str, out: Path = OUT, python: str = ".venv/bin/python") -> None:
    """Run one benchmark and write its JSON into ``out``."""
    command = f"{python} {BENCH} {args} --json"
    print(f"== {name}: {command}", file=sys.stderr, flush=True)
    proc = subprocess.run(shlex.split(command), cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)
    lines = proc.stdout.strip().splitlines()
    sys.stdout.write("\n".join(lines[:-1]) + "\n")
    result = json.loads(lines[-1])
    result["command"] = command
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


def main() -> None:
    """Record the runs named on the command line by prefix (all without)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefixes", nargs="*", help="runs whose name (after its number) starts so; all without")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON goes (default: the docs' data)")
    parser.add_argument("--smoke", action="store_true", help=f"each run with {SMOKE} (checks that they run)")
    args = parser.parse_args()
    chosen = {n: a for n, a in RUNS.items()
              if not args.prefixes or any(n.split("-", 1)[1].startswith(p) for p in args.prefixes)}
    if not chosen:
        sys.exit(f"no run matches {args.prefixes}; runs: {list(RUNS)}")
    if args.smoke and args.out == OUT:
        sys.exit("--smoke runs are not the docs' numbers: give --out DIR")
    for name, run_args in chosen.items():
        if args.smoke:
            record(name, f"{run_args} {SMOKE}", args.out, sys.executable)
        else:
            record(name, run_args)


if __name__ == "__main__":
    main()
