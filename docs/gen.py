"""Everything in the docs that carries a number is drawn here from output.

Sources, never edited by hand:

* ``target/pytest/*.md``: the side-by-side tables the pytest suites write
  (``scripts/test`` runs them), and the lost-host timings
  (``python/tests/test_lost_host.py``);
* ``docs/data/bench/*.json``: ``benches/torch/vs_ddp.py --json`` runs, written
  by ``benches/torch/record.py`` (which also records the command);
* ``docs/data/sim.json``: ``gradsync-bench sim --json``;
* ``docs/data/elastic.json``: ``benches/torch/elastic_recovery.py --json``;
* ``docs/data/membership/*.json``: ``gradsync-bench membership --json`` and
  ``benches/torch/membership_scale.py --json``, and ``docs/data/groups.json``:
  ``benches/torch/gloo_groups.py --json`` (see ``gen_membership.py``);
* ``docs/data/sharded/*.json``: ``benches/torch/sharded_memory.py``,
  ``sharded_side_by_side.py``, ``sharded_elastic.py``, ``meta_init.py``, ``sharded_checkpoint.py``,
  ``read_alone.py``, ``averaged.py`` and ``reshard_scale.py --json``;
* ``docs/data/host/*.json``: ``benches/torch/host_profile.py --json`` runs
  (host time per step and per gradient, world 1);
* ``docs/gpu/``: what ``scripts/gpu/run`` wrote on a lent GPU (the device,
  the GPU suite's and gpu-check's output, ``gpu_overhead.py --json`` per
  model, the suite's memory comparison).

The mkdocs hook (``docs/hooks.py``) calls :func:`expand` on every page, so a
page says ``<!-- gen: NAME -->`` where a generated block goes. The README
carries generated blocks between ``<!-- gen:NAME -->`` and
``<!-- /gen:NAME -->`` markers: ``cost`` (the CPU cost table and its chart,
``docs/img/cost.svg``), ``gpu-cost`` (the GPU overhead table) and
``elastic-cost`` (what a lost rank costs).
``.venv/bin/python docs/gen.py --write`` rewrites them from the JSON, and the
docs build (strict, in CI) fails when the README's copy is stale.
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

from gen_membership import gloo_groups, membership_bench, membership_extrapolation, membership_stores
from gen_sources import PYTEST, ROOT, Missing

BENCH = ROOT / "docs" / "data" / "bench"
SIM = ROOT / "docs" / "data" / "sim.json"
ELASTIC = ROOT / "docs" / "data" / "elastic.json"
HOST = ROOT / "docs" / "data" / "host"
SHARDED_MEMORY = ROOT / "docs" / "data" / "sharded" / "memory.json"
SHARDED_STEPS = ROOT / "docs" / "data" / "sharded" / "steps.json"
SHARDED_PEERS = ROOT / "docs" / "data" / "sharded" / "peers.json"
SHARDED_ELASTIC = ROOT / "docs" / "data" / "sharded" / "elastic.json"
SHARDED_META = ROOT / "docs" / "data" / "sharded" / "meta.json"
SHARDED_CHECKPOINT = ROOT / "docs" / "data" / "sharded" / "checkpoint.json"
SHARDED_READS = ROOT / "docs" / "data" / "sharded" / "reads.json"
SHARDED_AVERAGED = ROOT / "docs" / "data" / "sharded" / "averaged.json"
SHARDED_RESHARD = ROOT / "docs" / "data" / "sharded" / "reshard.json"
README = ROOT / "README.md"
COST_SVG = ROOT / "docs" / "img" / "cost.svg"
MARKER = re.compile(r"<!-- gen: ([a-z0-9-]+) -->")
EXCERPT = re.compile(r"<!-- excerpt: ([a-z0-9-]+) -->\n(.*?)<!-- /excerpt -->", re.S)
GPU = ROOT / "docs" / "gpu"
POLICY_LABELS = {
    "gradsync": "gradsync",
    "ddp": "torch DDP",
    "no_sync": "no_sync + one all-reduce",
    "local": "no communication",
}


def bench_runs() -> list[dict]:
    """The recorded benchmark runs, in the order their files sort."""
    if not BENCH.is_dir():
        raise Missing(f"{BENCH} is missing: run benches/torch/record.py")
    runs = []
    for path in sorted(BENCH.glob("*.json")):
        run = json.loads(path.read_text())
        run["_file"] = path.name
        runs.append(run)
    if not runs:
        raise Missing(f"no runs in {BENCH}: run benches/torch/record.py")
    return runs


def _ms(seconds) -> str:
    return "raises" if seconds is None else f"{seconds * 1e3:.1f}"


def _what(run: dict) -> str:
    if run["model"] == "tiny":
        return f"{run['tiny_params']} tiny parameters"
    if run["model"] == "tied":
        return f"tied LM, {run['tokens_per_rank']} tokens/rank"
    return run["model"]


def _paired(run: dict, other: str) -> str:
    p = run.get("paired", {}).get(other)
    if not p:
        return ""
    cell = f"{p['median_s'] * 1e3:+.1f} ({p['low_s'] * 1e3:+.1f}, {p['high_s'] * 1e3:+.1f})"
    return f"**{cell}**" if p["verdict"] != "within noise" else cell


def cost_table() -> str:
    """Median step per policy, and gradsync - DDP round by round, per recorded run."""
    runs = bench_runs()
    head = "| model (world 2, CPU, gloo) | " + " | ".join(POLICY_LABELS.values()) + " | gradsync − DDP (95% interval) |"
    lines = [head, "|---" * (len(POLICY_LABELS) + 2) + "|"]
    for run in runs:
        cells = [_ms(run["policies"].get(p, {}).get("step_s_median")) for p in POLICY_LABELS]
        lines.append(f"| {_what(run)} | " + " | ".join(cells) + f" | {_paired(run, 'ddp')} |")
    return "\n".join(lines)


def bench_details() -> str:
    """Every recorded run: its command, and each policy's line."""
    out = []
    for run in bench_runs():
        out.append(f"### {_what(run)}\n\n```sh\n{run['command']}\n```\n")
        out.append("| policy | median step ms | first step ms | backward ms | CPU ms (both ranks) |")
        out.append("|---|---|---|---|---|")
        for name, p in run["policies"].items():
            if p.get("step_s_median") is None:
                out.append(f"| {name} | {p.get('note', 'raises')} | | | |")
                continue
            cpu = p.get("cpu_s_median")
            out.append(
                f"| {name} | {_ms(p['step_s_median'])} | {_ms(p.get('step_s_first'))} | "
                f"{_ms(p.get('backward_s_median'))} | {_ms(cpu) if cpu is not None else ''} |"
            )
        rows = [(o, _paired(run, o)) for o in run.get("paired", {})]
        if rows:
            out.append("\nRound by round, gradsync minus each policy, ms: median (95% interval); **bold** where "
                       "the interval leaves out 0: " + "; ".join(f"{o} {c}" for o, c in rows) + ".\n")
        out.append("")
    return "\n".join(out)


def cost_svg() -> str:
    """A grouped bar chart: by how much each synchronized policy's median
    step exceeds the step without communication (the bound), per recorded
    run, as SVG text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "gradsync"
    runs = bench_runs()
    fig, ax = plt.subplots(figsize=(8.0, 2.8))
    width = 0.8 / (len(POLICY_LABELS) - 1)
    for i, (policy, label) in enumerate(list(POLICY_LABELS.items())[:-1]):
        xs, ys = [], []
        for j, run in enumerate(runs):
            s = run["policies"].get(policy, {}).get("step_s_median")
            bound = run["policies"]["local"]["step_s_median"]
            if s is not None:
                xs.append(j + (i - (len(POLICY_LABELS) - 2) / 2) * width)
                ys.append((s / bound - 1) * 100)
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(runs)), [_what(r) for r in runs])
    ax.set_ylabel("step time over no\ncommunication, %")
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def readme_cost_block() -> str:
    """The README's generated block: the cost table and the chart."""
    return cost_table() + "\n\n![step time over no communication, per policy](docs/img/cost.svg)\n\n"


def _gpu_json(name: str) -> dict:
    path = GPU / name
    if not path.is_file():
        raise Missing(f"{path} is missing: scripts/gpu/run writes it on a GPU machine (docs/gpu.md)")
    return json.loads(path.read_text())


def gpu_device() -> str:
    """The device and software the GPU outputs come from."""
    return " · ".join(line.strip() for line in (GPU / "device.txt").read_text().splitlines() if line.strip())


GPU_POLICIES = {
    "ddp": "torch DDP",
    "ddp_view": "DDP, gradient_as_bucket_view",
    "gradsync": "gradsync",
    "gradsync_host": "gradsync, buckets='host'",
}


def gpu_cost_table() -> str:
    """Each wrapper's overhead over no wrapper on one GPU, per model
    (``gpu_overhead.py --json``: median of the per-round differences)."""
    head = "| model (world 1, " + _gpu_json("overhead-gpt2-small.json")["device"] + ") | no wrapper, ms | "
    lines = [head + " | ".join(f"{v}, +ms" for v in GPU_POLICIES.values()) + " |", "|---" * (len(GPU_POLICIES) + 2) + "|"]
    for path in sorted(GPU.glob("overhead-*.json")):
        run = json.loads(path.read_text())
        pol = run["policies"]
        cells = [f"{pol[p]['overhead_s_median'] * 1e3:+.2f}" if p in pol else "" for p in GPU_POLICIES]
        lines.append(f"| {run['model']} ({run['params'] / 1e6:.0f} M parameters) | "
                     f"{pol['local']['step_s_median'] * 1e3:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_bench_details() -> str:
    """Every GPU benchmark run: its command, and each policy's line."""
    out = []
    for path in sorted(GPU.glob("overhead-*.json")):
        run = json.loads(path.read_text())
        out.append(f"### {run['model']}\n\n{run['device']}, torch {run['torch']}, NCCL {run['nccl']}, "
                   f"{run['steps']} measured steps, buckets of {run['bucket_mb']:g} MB.\n\n```sh\n{run['command']}\n```\n")
        out.append("| policy | median step ms | overhead ms | peak in a step, MiB | parameters vs no wrapper |")
        out.append("|---|---|---|---|---|")
        for name, p in run["policies"].items():
            over = p.get("overhead_s_median")
            diff = p.get("max_param_diff_vs_local")
            out.append(f"| {name} | {p['step_s_median'] * 1e3:.2f} | {'' if over is None else f'{over * 1e3:+.2f}'} | "
                       f"{p['peak_bytes_median'] / 2**20:.0f} | {'' if diff is None else f'{diff:.1e}'} |")
        out.append("")
    return "\n".join(out)


def gpu_memory_table() -> str:
    """Device memory above what the process held before the model, from the GPU suite."""
    mem = _gpu_json("gpu-memory.json")
    labels = {"local": "no wrapper", "ddp": "torch DDP", "ddp_bucket_view": "DDP, gradient_as_bucket_view",
              "gradsync": "gradsync"}
    params = mem["local"]["param_bytes"] / 2**20
    lines = [f"4 × Linear(4096, 4096), {params:.0f} MiB of float32 parameters, 3 SGD steps, {mem['device']}:", "",
             "| policy | peak MiB | held after the step, MiB |", "|---|---|---|"]
    for key, label in labels.items():
        lines.append(f"| {label} | {mem[key]['peak'] / 2**20:.0f} | {mem[key]['held'] / 2**20:.0f} |")
    return "\n".join(lines)


def gpu_outputs() -> str:
    """The GPU suite's and gpu-check's output, as they printed it."""
    out = []
    for name, what in (("suite.txt", "GPU suite (python/tests/test_gpu.py)"), ("gpu-check.txt", "scripts/gpu-check.sh run")):
        path = GPU / name
        if not path.is_file():
            raise Missing(f"{path} is missing: scripts/gpu/run writes it on a GPU machine")
        out.append(f"{what}:\n\n```text\n{path.read_text().strip()}\n```\n")
    return "\n".join(out)


# The README's generated blocks: each text ends with a line break, before its end marker.
README_BLOCKS = {
    "cost": lambda: readme_cost_block(),
    "gpu-cost": lambda: gpu_cost_table() + "\n",
    "elastic-cost": lambda: elastic_cost() + "\n",
}


def side_by_side(name: str) -> str:
    """A table the pytest suites wrote (``target/pytest/NAME.md``)."""
    path = PYTEST / f"{name}.md"
    if not path.is_file():
        raise Missing(f"{path} is missing: the tests write it (scripts/test)")
    return path.read_text().strip()


def lost_host() -> str:
    """What a lost host costs, as ``python/tests/test_lost_host.py`` measured
    it (``target/pytest/lost-host.md``; those tests need root for network
    namespaces, so without them the page says where the numbers come from)."""
    path = PYTEST / "lost-host.md"
    if not path.is_file():
        return ("*(Not measured in this build: `python/tests/test_lost_host.py` writes this table, and needs root "
                "for its network namespaces.)*")
    return path.read_text().strip()


def sim_table() -> str:
    """Scaling efficiency per rank count, from ``gradsync-bench sim --json``."""
    if not SIM.is_file():
        raise Missing(f"{SIM} is missing: see docs/benchmarks.md for the command that writes it")
    data = json.loads(SIM.read_text())
    names = ["gradsync", "no_sync", "ddp_static", "ideal"]
    by_ranks = {}
    for name in names:
        for point in data["policies"][name]:
            by_ranks.setdefault(point["ranks"], {})[name] = point["efficiency"]
    lines = [
        f"SIMULATED: {data['model']} on the {data['preset']} preset, recompute {'on' if data['recompute'] else 'off'}, "
        f"backward {data['compute_s'] * 1e3:.1f} ms.",
        "",
        "| ranks | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for ranks, eff in sorted(by_ranks.items()):
        lines.append(f"| {ranks} | " + " | ".join(f"{eff[n]:.3f}" for n in names) + " |")
    sweep = data["bucket_sweep"]
    compute = data["compute_s"]
    points = ", ".join(f"{p['bucket_mb']} MB {compute / p['step_s']:.3f}" for p in sweep["points"])
    lines += ["", f"Bucket size against efficiency at {sweep['ranks']} ranks (gradsync): {points}."]
    return "\n".join(lines)


def host_time() -> str:
    """Host time per step and per gradient at world 1, no wrapper against
    DDP (bucket view) and gradsync, one table per ``host_profile.py --json``
    run: the mean of each policy's two runs' medians."""
    runs = sorted(HOST.glob("*.json")) if HOST.is_dir() else []
    if not runs:
        raise Missing(f"no {HOST.relative_to(ROOT)}/*.json: run benches/torch/host_profile.py --json")
    out = []
    for path in runs:
        run = json.loads(path.read_text())
        by = {}
        for row in run["runs"]:
            by.setdefault(row["policy"], []).append(row)
        mean = {p: {k: sum(r[k] for r in rows) / len(rows) for k in ("forward_s", "backward_s")}
                for p, rows in by.items()}
        grads = run["runs"][0]["gradients"]
        what = f"{run['tiny_params']} parameters of 16 values" if run["model"] == "tiny" else (
            f"{run['model']}, {run['tokens']} tokens")
        base = mean["none"]["forward_s"] + mean["none"]["backward_s"]
        out.append(f"**{what}** ({grads} gradients), {run['device']}, torch {run['torch']}, {run['steps']} steps "
                   f"per run (medians), two runs per policy: `{run['command']}`\n")
        out.append("| wrapper | forward, ms | backward, ms | over no wrapper, ms per step | over no wrapper, µs per gradient |")
        out.append("|---|---|---|---|---|")
        names = {"none": "no wrapper", "ddp_view": "torch DDP, `gradient_as_bucket_view=True`", "gradsync": "gradsync"}
        for policy in ("none", "ddp_view", "gradsync"):
            m = mean[policy]
            extra = m["forward_s"] + m["backward_s"] - base
            over = "" if policy == "none" else f"{extra * 1e3:+.2f}"
            per = "" if policy == "none" else f"{extra / grads * 1e6:+.2f}"
            out.append(f"| {names[policy]} | {m['forward_s'] * 1e3:.2f} | {m['backward_s'] * 1e3:.2f} | {over} | {per} |")
        out.append("")
    return "\n".join(out)


def sharded_side_by_side() -> str:
    """gradsync's sharded column (the tests write it) next to FSDP2's and
    ZeRO-1's (``benches/torch/sharded_side_by_side.py --json``), per case."""
    ours = PYTEST / "sharded-side-by-side.json"
    if not ours.is_file():
        raise Missing(f"{ours} is missing: the tests write it (scripts/test)")
    rows = json.loads(ours.read_text())
    peers = {}
    if SHARDED_PEERS.is_file():
        peers = {r["case"]: r for r in json.loads(SHARDED_PEERS.read_text())["rows"]}
    out = ["| case (2 ranks) | torch FSDP2 | torch DDP + ZeroRedundancyOptimizer | gradsync, "
           "`shard_gradients=True` | gradsync, `shard_parameters=True` (max abs parameter diff from one process) |",
           "|---|---|---|---|---|"]
    for row in rows:
        peer = peers.get(row["case"], {})
        out.append(f"| {row['case']} | {peer.get('fsdp2', '—')} | {peer.get('zero1', '—')} | "
                   f"{row['gradsync']} | {row.get('params', '—')} |")
    if SHARDED_PEERS.is_file():
        meta = json.loads(SHARDED_PEERS.read_text())["meta"]
        out.append(f"\nThe peers' columns: {meta['machine']}, torch {meta['torch']}, `{meta['command']}`.")
    return "\n".join(out)


def _bench_run(path: Path, bench: str) -> dict:
    """The JSON a bench wrote at ``path``, or :class:`Missing` naming the
    command that writes it (``benches/torch/<bench> --json <path>``)."""
    if not path.is_file():
        rel = path.relative_to(ROOT)
        raise Missing(f"{rel} is missing: run benches/torch/{bench} --json {rel}")
    return json.loads(path.read_text())


def _table(columns, rows) -> list:
    """A markdown table's lines: ``columns`` (names) and ``rows`` (each a
    sequence of cells, already formatted)."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + \
        ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def sharded_elastic() -> str:
    """A buddy copy's memory and a lost rank's cost, sharded against
    unsharded elastic jobs (``benches/torch/sharded_elastic.py --json``)."""
    run = _bench_run(SHARDED_ELASTIC, "sharded_elastic.py")
    what = {"unsharded": "unsharded", "gradients": "`shard_gradients=True`, with a buddy copy",
            "parameters": "`shard_parameters=True`, with a buddy copy"}
    out = _table(["world", "sharded", "parameters per rank between steps, MB", "averaged gradients per rank, MB",
                  "optimizer state per rank, MB"],
                 [(r["world"], what[r["mode"]], f"{r['parameter_bytes'] / 1e6:.2f}", f"{r['runtime_bytes'] / 1e6:.2f}",
                   f"{r['optimizer_bytes'] / 1e6:.2f}") for r in run["memory"]])
    out += ["", "| a rank killed | sharded | failure → new group, ms | steps skipped |", "|---|---|---|---|"]
    for k in run["kills"]:
        when = "before its optimizer step" if k["phase"] == "optimizer" else f"in its {k['phase']}"
        out.append(f"| {when}, world {k['world']} → {k['world'] - 1} | {what[k['mode']]} | "
                   f"{k['recovery_s'] * 1e3:.0f} | {k['skipped']} |")
    meta = run["meta"]
    out.append(f"\n{meta['machine']}; the elastic example's model at width {meta['width']} (SGD with momentum); "
               f"`{meta['command']}`.")
    return "\n".join(out)


def sharded_meta() -> str:
    """What building and wrapping a model with ``shard_parameters=True``
    costs a rank, built on the CPU or on the meta device
    (``benches/torch/meta_init.py --json``)."""
    run = _bench_run(SHARDED_META, "meta_init.py")
    mib = 1 << 20
    out = ["| world | built on | peak resident memory growth while building and wrapping, MiB | "
           "pieces kept, MiB | the model, MiB |", "|---|---|---|---|---|"]
    for r in run["rows"]:
        where = "the meta device" if r["built_on"] == "meta" else "the CPU"
        out.append(f"| {r['world']} | {where} | {r['growth'] / mib:.0f} | {r['pieces'] / mib:.0f} | "
                   f"{r['whole'] / mib:.0f} |")
    meta = run["meta"]
    out.append(f"\n{meta['machine']}, torch {meta['torch']}; a GPT-2-shaped model of {meta['layers']} blocks of "
               f"width {meta['width']}, a tied {meta['vocab']}-word embedding; `{meta['command']}`.")
    return "\n".join(out)


def sharded_checkpoint() -> str:
    """What a sharded checkpoint of a model built on the meta device costs a
    rank, each rank writing and reading its pieces against the model
    gathered whole first (``benches/torch/sharded_checkpoint.py --json``)."""
    run = _bench_run(SHARDED_CHECKPOINT, "sharded_checkpoint.py")
    mib = 1 << 20
    way = {"pieces": "`checkpoint.save` / `load`: each rank its pieces",
           "whole": "the same inside `whole_parameters()`: the model gathered first"}
    out = _table(["how", "what", "ranks", "peak resident memory growth in it, MiB", "peak, MiB", "pieces kept, MiB",
                  "the model, MiB"],
                 [(way[r["way"]], r["what"], r["world"], *(f"{r[k] / mib:.0f}" for k in ("growth", "peak", "pieces", "whole")))
                  for r in run["rows"]])
    meta = run["meta"]
    out.append(f"\n{meta['machine']}, torch {meta['torch']}; a GPT-2-shaped model of {meta['layers']} blocks of "
               f"width {meta['width']}, a tied {meta['vocab']}-word embedding, built on the meta device, one AdamW "
               f"step before the save; `{meta['command']}`.")
    return "\n".join(out)


def sharded_reads() -> str:
    """What a read of the whole model between steps costs, on rank 0 alone
    against every rank inside ``whole_parameters()``
    (``benches/torch/read_alone.py --json``)."""
    run = _bench_run(SHARDED_READS, "read_alone.py")
    mib = 1 << 20
    what = {"state_dict": "`model.state_dict()` on rank 0 alone",
            "norms": "a norm log over `model.parameters()` on rank 0 alone (`torch.no_grad()`)",
            "deepcopy": "`copy.deepcopy(model.module)` on rank 0 alone",
            "whole": "`model.state_dict()` inside `whole_parameters()` on every rank"}
    out = _table(["ranks", "read", "time on rank 0, ms", "GB/s of the model",
                  "peak resident memory growth on the other ranks, MiB"],
                 [(r["world"], what[r["way"]], f"{r['seconds'] * 1e3:.0f}", f"{r['whole'] / r['seconds'] / 1e9:.2f}",
                   f"{r['others_growth'] / mib:.0f}") for r in run["rows"]])
    meta, whole = run["meta"], run["rows"][0]["whole"]
    out.append(f"\n{meta['machine']}, torch {meta['torch']}; a GPT-2-shaped model of {meta['layers']} blocks of "
               f"width {meta['width']}, a tied {meta['vocab']}-word embedding ({whole / mib:.0f} MiB), after one "
               f"AdamW step; the fastest of the repeats; `{meta['command']}`.")
    return "\n".join(out)


def sharded_averaged() -> str:
    """What an EMA of a parameter-sharded model costs each rank, kept as
    its pieces against ``AveragedModel``'s whole copy
    (``benches/torch/averaged.py --json``)."""
    run = _bench_run(SHARDED_AVERAGED, "averaged.py")
    mib = 1 << 20
    what = {"sharded": "`ShardedAveragedModel(model, ...)`", "whole": "`AveragedModel(model.module, ...)`"}
    out = _table(["ranks", "average", "held per rank, MiB", "peak resident memory its construction added, MiB",
                  "an update, ms", "an evaluation forward of it, ms"],
                 [(r["world"], what[r["kind"]], f"{r['bytes'] / mib:.1f}", f"{r['growth'] / mib:.0f}",
                   f"{r['update_s'] * 1e3:.1f}", f"{r['evaluate_s'] * 1e3:.0f}") for r in run["rows"]])
    meta, model = run["meta"], run["rows"][0]["model"]
    out.append(f"\n{meta['machine']}, torch {meta['torch']}; a GPT-2-shaped model of {meta['layers']} blocks of "
               f"width {meta['width']}, a tied {meta['vocab']}-word embedding ({model / mib:.0f} MiB), AdamW, an "
               f"EMA (decay 0.999) updated after each of {meta['steps']} steps; the largest over the ranks (the "
               f"evaluation: rank 0's); `{meta['command']}`.")
    return "\n".join(out)


def sharded_reshard() -> str:
    """What a change of members moves per member of a sharded elastic job,
    point to point beside the broadcasts it replaced
    (``benches/torch/reshard_scale.py --json``)."""
    run = _bench_run(SHARDED_RESHARD, "reshard_scale.py")
    mib = 1 << 20
    out = _table(["members", "received per member, MiB", "peers per bucket", "broadcast to every member, MiB",
                  "broadcasts per member", "the sources, once, ms", "a member's plan per bucket, ms",
                  "a member's planning per change, ms", "the sweeps it replaced, per change, ms"],
                 [(f"{r['world']} → {r['world'] - 1}", f"{r['received'] / mib:.1f}", r["peers"],
                   f"{r['broadcast_received'] / mib:.0f}", r["broadcasts"], f"{r['sources_s'] * 1e3:.2f}",
                   f"{r['plan_s'] * 1e3:.3f}", f"{(r['sources_s'] + r['plan_s'] * r['buckets']) * 1e3:.1f}",
                   f"{r['sweep_s'] * r['buckets'] * 1e3:.0f}") for r in run["rows"]])
    meta = run["meta"]
    out.append(f"\nA {meta['model_mib']} MiB float32 model in {meta['bucket_mib']} MiB buckets, buddies "
               f"{meta['stride']} ranks on, one rank lost; per value its parameter and "
               f"{meta['rows_per_value'] - 1} optimizer states moved as float64; the largest over the members "
               f"sampled (the lost rank's and its buddy's neighbours among them), each member's plan computed as it "
               f"computes it (no processes), on {meta['machine'].split(', CPU')[0]}; `{meta['command']}`.")
    return "\n".join(out)


#: The sharded benchmarks' configurations, as the tables name them.
SHARDED_NAMES = {
    "gradsync-sharded": "gradsync, `shard_gradients=True`",
    "gradsync-sharded-at-once": "the same, one gather of every bucket (not pipelined)",
    "gradsync-params": "gradsync, `shard_parameters=True` (on CPU `buckets_in_flight=0`)",
    "gradsync-params-1": "the same, `buckets_in_flight=1` (the default on a CUDA device)",
    "gradsync-params-unpaced": "the same, `buckets_in_flight=None`",
    "gradsync-params-lean": "the same, `buckets_in_flight=0, prefetch_units=False`",
    "gradsync-params-bf16": "the same, `param_dtype=torch.bfloat16`",
    "gradsync": "gradsync",
    "ddp": "torch DDP (`gradient_as_bucket_view`)",
    "zero1": "torch DDP + `ZeroRedundancyOptimizer`",
    "fsdp2": "torch FSDP2 (`fully_shard` per block)",
    "fsdp2-bf16": "the same, `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`",
}


def sharded_memory() -> str:
    """Memory per rank and step time, sharded against its peers, from
    ``benches/torch/sharded_memory.py --json``."""
    run = _bench_run(SHARDED_MEMORY, "sharded_memory.py")
    meta = run["meta"]
    names = SHARDED_NAMES
    mb = 1 << 20
    out = [f"{meta['model']}; {meta['machine']}, torch {meta['torch']}: `{meta['command']}`. Largest over the "
           "ranks, MB, after a step; the goal is (gradients + optimizer state of the whole model) / world + one "
           "bucket. Peak: the most the three held together in a step after the first, sampled at the start of "
           "each block's forward and backward, at the end of the forward, after every gather of "
           "`shard_parameters=True`, as each gradient is computed (that gradient counted too), in FSDP2's "
           "reduce-scatter once its input is filled (with the block's unsharded gradients it was filled from), "
           "after the backward and after the optimizer step. FSDP2's count includes what its state holds at "
           "those points: unsharded parameters and gradients, all-gather outputs not yet copied out, "
           "reduce-scatter inputs kept until a later block's reduce-scatter. The peak's goal for "
           "`shard_parameters=True` is (parameters + gradients + optimizer state) / world + two blocks + one "
           "bucket.\n",
           "| world | wrapper | parameters | gradients | optimizer state | gradients + optimizer (goal) | "
           "peak in a step | step, ms |",
           "|---|---|---|---|---|---|---|---|"]
    for row in run["rows"]:
        name = names.get(row["impl"], row["impl"])
        if "error" in row:
            out.append(f"| {row['world']} | {name} | | | | raises `{row['error']}` | | |")
            continue
        both = (row["grads"] + row["optimizer"]) / mb
        peak = f"{row['peak'] / mb:.1f}" if "peak" in row else "—"
        if row["impl"].startswith("gradsync-params") and "peak_goal" in row:
            peak += f" ({row['peak_goal'] / mb:.1f})"
        out.append(f"| {row['world']} | {name} | {row['params'] / mb:.1f} | {row['grads'] / mb:.1f} | "
                   f"{row['optimizer'] / mb:.1f} | {both:.1f} ({row['goal'] / mb:.1f}) | {peak} | "
                   f"{row['step_s'] * 1e3:.0f} |")
    return "\n".join(out)


def sharded_steps() -> str:
    """Step time of the sharded wrapper against gradsync, DDP and FSDP2,
    interleaved in the same processes, with the gather's and the
    optimizer's share (``benches/torch/sharded_step.py --json``)."""
    run = _bench_run(SHARDED_STEPS, "sharded_step.py")
    meta = run["meta"]
    names = SHARDED_NAMES
    out = [f"{meta['model']}; {meta['machine']}, torch {meta['torch']}: `{meta['command']}`. Median over "
           f"{meta['steps']} rounds, the largest over the ranks, ms.\n",
           "| world | wrapper | step | against DDP | of it: the parameter gather | of it: the optimizer step |",
           "|---|---|---|---|---|---|"]
    ddp = {row["world"]: row["step_s"] for row in run["rows"] if row["impl"] == "ddp"}
    for row in run["rows"]:
        ratio = f"{row['step_s'] / ddp[row['world']]:.2f}x" if row["world"] in ddp else ""
        parts = [f"{row[k] * 1e3:.0f}" if k in row else "" for k in ("gather_s", "optimizer_s")]
        out.append(f"| {row['world']} | {names.get(row['impl'], row['impl'])} | {row['step_s'] * 1e3:.0f} | "
                   f"{ratio} | {parts[0]} | {parts[1]} |")
    return "\n".join(out)


def _elastic() -> dict:
    return _bench_run(ELASTIC, "elastic_recovery.py")


def elastic_cost() -> str:
    """What a lost rank costs, per world size, and the liveness check's cost
    on a healthy step (``elastic_recovery.py --json``)."""
    run = _elastic()
    lines = [
        f"| world ({run['cpus']} cores, loopback) | healthy step, ms | kill → survivors in a new group, ms | "
        "kill → survivors' next applied step, ms | replacement's process start → its first applied step, s | "
        "admitted → its first applied step, ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in run["recovery"]:
        start = r.get("replacement_start_to_first_applied_s")
        admitted = r.get("admitted_to_first_applied_s")
        lines.append(
            f"| {r['world']} | {r['healthy_step_s'] * 1e3:.1f} | {r['kill_to_new_group_s'] * 1e3:.0f} | "
            f"{r['kill_to_next_applied_s'] * 1e3:.0f} | {'' if start is None else f'{start:.1f}'} | "
            f"{'' if admitted is None else f'{admitted * 1e3:.0f}'} |"
        )
    for r in run.get("partial", []):
        lost = "the lost step, averaged over the survivors" if r["lost_step_applied"] else "(lost step skipped)"
        # (Its "new group" event is logged after the redo: left blank.)
        lines.append(f"| {r['world']}, `abort_policy=\"partial\"`: {lost} | {r['healthy_step_s'] * 1e3:.1f} | | "
                     f"{r['kill_to_next_applied_s'] * 1e3:.0f} | | |")
    for r in run.get("loaded", []):
        false = {0: "no member taken for lost", 1: "1 member taken for lost"}.get(
            r["false_losses"], f"{r['false_losses']} members taken for lost")
        start = r.get("replacement_start_to_first_applied_s")
        admitted = r.get("admitted_to_first_applied_s")
        lines.append(f"| {r['world']}, {r['loaded']} on the cores ({false}) | {r['healthy_step_s'] * 1e3:.1f} | "
                     f"{r['kill_to_new_group_s'] * 1e3:.0f} | {r['kill_to_next_applied_s'] * 1e3:.0f} | "
                     f"{'' if start is None else f'{start:.1f}'} | "
                     f"{'' if admitted is None else f'{admitted * 1e3:.0f}'} |")
    for r in run.get("torchrun", []):
        lines.append(f"| {r['world']}, torchrun restart + checkpoint | {r['healthy_step_s'] * 1e3:.1f} | | "
                     f"{r['kill_to_next_applied_s'] * 1e3:.0f} | | |")
    cost = run["liveness"]
    lines.append("")
    on, off = cost["rounds"]["beat_0.1s"], cost["rounds"]["beat_1000s"]
    lines.append(
        f"A healthy 4-rank step with the liveness monitor beating every 0.1 s: {cost['beat_0.1s'] * 1e3:.2f} ms "
        f"(runs {min(on) * 1e3:.1f} to {max(on) * 1e3:.1f}); with it beating every 1000 s (in effect off): "
        f"{cost['beat_1000s'] * 1e3:.2f} ms ({min(off) * 1e3:.1f} to {max(off) * 1e3:.1f}); medians of "
        f"{run['liveness_rounds']} alternating runs of {run['liveness_steps']} steps each."
    )
    return "\n".join(lines)


def elastic_details() -> str:
    """The command and what the columns measure."""
    run = _elastic()
    commands = "\n".join(sorted(set(run["commands"].values())))
    return (f"```sh\n{commands}\n```\n\nRank 1 SIGKILLs itself mid-backward at step {run['kill_step']}; "
            "the times are wall clock, recorded by the processes themselves. " + _replacement_start(run))


def _replacement_start(run: dict) -> str:
    """How the recorded replacements started (rows without ``worker_start``
    were recorded before the launcher forked its workers from a warm interpreter)."""
    warm = any(r.get("worker_start") == "warm" for r in run.get("recovery", []))
    if warm:
        return ("A replacement is a fork of the launcher's warm interpreter (torch imported already); its start "
                "is that fork, on a machine whose cores the other workers keep busy.")
    return ("These runs started each replacement as a new interpreter (`--fresh-interpreters` now): its start "
            "includes starting Python and importing torch on a machine whose cores the other workers keep busy; "
            "the launcher's default, a fork of its warm interpreter, skips the import.")


GENERATORS = {
    "cost-table": cost_table,
    "bench-details": bench_details,
    "sim-table": sim_table,
    "ddp-side-by-side": lambda: side_by_side("ddp-side-by-side"),
    "paddle-side-by-side": lambda: side_by_side("paddle-side-by-side"),
    "paddle-faults": lambda: side_by_side("paddle-faults"),
    "sharded-side-by-side": sharded_side_by_side,
    "gpu-device": gpu_device,
    "gpu-cost": gpu_cost_table,
    "gpu-bench-details": gpu_bench_details,
    "gpu-memory": gpu_memory_table,
    "gpu-outputs": gpu_outputs,
    "elastic-recovery": lambda: elastic_cost() + "\n\n" + elastic_details(),
    "elastic-cost": elastic_cost,
    "lost-host": lambda: lost_host(),
    "membership-bench": membership_bench,
    "membership-stores": membership_stores,
    "membership-extrapolation": membership_extrapolation,
    "host-time": host_time,
    "sharded-memory": sharded_memory,
    "sharded-steps": sharded_steps,
    "sharded-elastic": sharded_elastic,
    "sharded-meta": sharded_meta,
    "sharded-checkpoint": sharded_checkpoint,
    "sharded-reads": sharded_reads,
    "sharded-averaged": sharded_averaged,
    "sharded-reshard": sharded_reshard,
    "gloo-groups": gloo_groups,
}


def expand(markdown: str) -> str:
    """Replace every ``<!-- gen: NAME -->`` marker with its block."""

    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise Missing(f"unknown generated block {name!r}; known: {sorted(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(block, markdown)


#: A distance a side-by-side cell reports (``ok, 7.4e-09 (one-process replay)``).
DISTANCE = re.compile(r"\b\d\.\de[+-]\d\d\b")


def _distances_masked(row: str) -> str:
    """``row`` with each distance it reports masked: a float32 run's
    distance from its replay moves in the last bits from run to run (the
    HF Trainer row has read 7.4e-09 and 1.1e-08 on the same code), so an
    excerpt's rows are compared by what they say, each distance as one."""
    return DISTANCE.sub("<distance>", row)


def readme_is_current() -> str | None:
    """``None`` if the README's generated parts are current, else what is
    stale: the cost block and chart must match the JSON, and every row of a
    side-by-side excerpt must be in the table the tests wrote, its
    distances aside (checked when the tests have run: ``target/pytest``)."""
    text = README.read_text()
    for m in EXCERPT.finditer(text):
        path = PYTEST / f"{m.group(1)}.md"
        if not path.is_file():
            continue
        table = {_distances_masked(row) for row in path.read_text().splitlines()}
        for row in m.group(2).splitlines()[2:]:
            if _distances_masked(row) not in table:
                return (f"README.md's excerpt row {row[:60]!r}... is not in {path.relative_to(ROOT)}: copy the "
                        "excerpt's rows from that table (written by scripts/test)")
    redraw = "is stale: run `.venv/bin/python docs/gen.py --write`"
    for name, make in README_BLOCKS.items():
        m = _readme_block(name).search(text)
        if m is None:
            return f"README.md has no <!-- gen:{name} --> ... <!-- /gen:{name} --> block"
        if m.group(2) != make():
            return f"README.md's {name} block {redraw}"
    if not COST_SVG.is_file() or COST_SVG.read_text() != cost_svg():
        return f"{COST_SVG.relative_to(ROOT)} {redraw}"
    return None


def _readme_block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- gen:{name} -->\n)(.*?)(<!-- /gen:{name} -->)", re.S)


def write_readme() -> None:
    """Rewrite the README's generated blocks and the chart from the JSON."""
    text = README.read_text()
    for name, make in README_BLOCKS.items():
        block = _readme_block(name)
        if block.search(text) is None:
            raise Missing(f"README.md has no <!-- gen:{name} --> ... <!-- /gen:{name} --> block")
        text = block.sub(lambda m, make=make: m.group(1) + make() + m.group(3), text)
    README.write_text(text)
    COST_SVG.parent.mkdir(parents=True, exist_ok=True)
    COST_SVG.write_text(cost_svg())


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_readme()
        print(f"wrote README.md's cost block and {COST_SVG.relative_to(ROOT)}")
    elif sys.argv[1:] == ["--check"]:
        stale = readme_is_current()
        print("README cost block current" if stale is None else f"stale: {stale}")
        sys.exit(stale is not None)
    else:
        sys.exit("usage: docs/gen.py --write | --check")
