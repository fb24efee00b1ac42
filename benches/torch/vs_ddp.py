"""gradsync against torch's DistributedDataParallel, measured in one run.

    .venv/bin/python benches/torch/vs_ddp.py [--world 2] [--tokens-per-rank 64] [--steps 30]
                                             [--model tied|gpt2-small|resnet18] [--reentrant]
                                             [--tiny-params N] [--separate ROUNDS] [--json]
                                             [--compile outer|inner] [--compile-backend inductor]
                                             [--keep-freed-memory]

Spawns ``--world`` processes on loopback (gloo, one thread per rank). Every
rank builds the same model once per policy and runs the policies interleaved,
step by step (the order rotates every step), so a noisy machine affects them
alike. With ``--separate ROUNDS`` each policy runs instead in processes of
its own, one policy after another, ``ROUNDS`` times (the order rotating):
every step then follows the policy's own previous step, as in training, and
no other replica's memory comes and goes in between (with GPT-2 that
changes what a step costs in page faults). Policies:

* ``gradsync``    gradsync.torch.DistributedDataParallel (overlapped, exact);
* ``ddp``         torch DDP, overlapped (with reentrant checkpointing it
                  raises on the tied embedding: reported as such);
* ``ddp_static``  torch DDP with ``static_graph=True`` (what DDP offers for
                  reentrant checkpointing: no overlap in the first step);
* ``no_sync``     backward without communication, then one fused all-reduce
                  (the usual workaround);
* ``local``       no communication at all (the bound overlap approaches);
* ``gradsync_bf16`` gradsync with bfloat16 buckets on the wire (opt-in).

A step is forward + backward + communication + SGD; its time is the slower
rank's, printed with the training thread's kernel time and page faults in
it. Models (``--model``):

* ``tied`` (default): a tied 2048x1024 embedding and head, 4 checkpointed
  Linear+Tanh blocks of 1024 (6.3 M parameters);
* ``gpt2-small``: HF ``transformers`` GPT-2 (124 M parameters, tied
  embedding and head), random init without dropout, one sequence of ``--tokens-per-rank``
  tokens per rank, HF gradient checkpointing on every block (reentrant with
  ``--reentrant``);
* ``resnet18``: torchvision's ResNet-18 (11.7 M parameters, BatchNorm
  buffers broadcast at each forward by every wrapper), random init,
  ``--images-per-rank`` images of 3x``--image-size``² and 1000 classes; no
  checkpointing (torchvision's model has none).

``--tiny-params N`` replaces the model with N parameters of 16 values, to
measure the per-parameter overhead (the models and batches: ``bench_models.py``;
what is made of the step times: ``step_stats.py``). A policy that raises (DDP under
reentrant checkpointing, for instance) is reported with its error and left
out of the rest of the run. ``--compile outer`` runs every policy as ``torch.compile(wrapped)``,
``--compile inner`` wraps ``torch.compile(model)`` (``local`` and ``no_sync``
compile the model); gradsync's exposed communication (the reduction time
left after backward ends, from its step report) shows whether the overlap
survives. The end checks that the synchronized policies' parameters agree
(with ``--separate``: their per-step losses), and times the Python hook call
into the runtime on its own.

``--keep-freed-memory`` starts every rank with glibc told to keep freed
memory instead of returning it to the OS (see ``KEEP_FREED_MEMORY``): the
page faults that otherwise come and go from one process to the next, under
any policy, leave the comparison.

With ``--json`` the last line of stdout is one JSON object:
``{"policies": {"gradsync": {"step_s_median": s, ...}, ...}, "agree": {...}, "hook_call_us_median": x, ...}``;
each policy's lists (``step_s``, ``after_own_step``, ...) hold its measured steps;
``kept_freed_memory`` says whether the ranks ran with ``KEEP_FREED_MEMORY``;
``paired`` (interleaved runs) compares gradsync with each other synchronized
policy round by round: ``{"ddp": {"median_s", "low_s", "high_s", "level",
"rounds", "verdict"}, ...}``, the median difference of their back-to-back
steps with a distribution-free confidence interval, and whether gradsync was
``"faster"``, ``"slower"`` or ``"within noise"`` (the interval holds 0).
A difference of medians can flip from one run to the next where the interval
says the policies are within noise of each other.
"""

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from bench_models import batch, loss_of, make_model
from step_stats import measured_window, paired_with_gradsync, split_by_predecessor

# glibc's malloc, by default, hands large freed blocks back to the OS (munmap,
# or trimming the heap once its free top passes a threshold that adapts as it
# goes) and every page of them faults in again, zeroed, the next time: on this
# machine 15-26 k faults a ResNet-18 step, or none, from one process to the
# next, under either policy. These keep freed memory in the process (both
# thresholds far above any tensor here), so a step pays for its arithmetic and
# communication only. Any PyTorch CPU training job can set them.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}

POLICIES = ["gradsync", "ddp", "ddp_static", "no_sync", "local", "gradsync_bf16"]

# What a rank records of each step of a policy: the step's time (the slower
# rank's), this rank's ``loss.backward()`` call, the training thread's kernel
# time and page faults (each the larger of the ranks'; zeroing fresh pages for
# large gradients is most of that kernel time), the CPU time of every thread
# of every rank (summed: on a machine with no spare core, what one policy
# burns beyond another's is taken from the step), whether the process ran this
# policy's step just before, gradsync's exposed communication, buckets reduced
# before backward ended and bucket memory (gradsync only), and the loss.
STEP_SERIES = ["step_s", "backward_s", "kernel_s", "page_faults", "cpu_s", "after_own_step", "exposed_comm_s",
               "buckets_overlapped", "bucket_memory_bytes", "losses"]


def first_line(error):
    """An exception as one short line (DDP's messages run for paragraphs)."""
    text = (str(error).strip().splitlines() or [""])[0]
    cut = text.find(". ", 20)
    return f"{type(error).__name__}: {text[: cut + 1] if cut > 0 else text}"


class FusedAllReduce:
    """The no_sync workaround: one all-reduce of every gradient after backward."""

    def __init__(self, model, group):
        self.params = list(model.parameters())
        self.group = group

    def sync(self):
        grads = [p.grad for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        for g, v in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(v)


def build(policy, args, group):
    """The policy's model, the callable that runs its forward (compiled
    under ``--compile``) and what synchronizes it after backward, if anything."""
    import gradsync.torch as gt

    model = make_model(args)
    plain = model
    if args.compile == "inner":
        model = torch.compile(model, backend=args.compile_backend)
    cap = args.bucket_mb
    fused = None
    if policy in ("gradsync", "gradsync_bf16"):
        wire = "bfloat16" if policy == "gradsync_bf16" else "float32"
        model = gt.DistributedDataParallel(model, bucket_cap_mb=cap, wire_dtype=wire)
    elif policy == "ddp":
        model = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap)
    elif policy == "ddp_static":
        model = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap, static_graph=True)
    elif policy == "no_sync":
        fused = FusedAllReduce(plain, group)
    run = torch.compile(model, backend=args.compile_backend) if args.compile == "outer" else model
    return model, run, fused


def hook_call_us(samples=20_000):
    """Median time of one Python call into the runtime's hook (16 float32
    values: the copy is negligible), over a 1-rank session."""
    import gradsync

    class Alone:  # a 1-rank communicator: nothing to sum
        def all_reduce(self, addr, numel, dtype, factor, timeout_s):
            pass

        def reset(self):
            pass

    n = 256
    session = gradsync.Session(Alone(), 0, 1, [f"p{i}" for i in range(n)], [16] * n, ["float32"] * n)
    t = torch.zeros(16)
    addr = t.data_ptr()
    times = []
    step = 0
    for _ in range(max(1, samples // n)):
        for i in range(n):
            t0 = time.perf_counter_ns()
            session.arrive_ptr(step, i, 0, addr)
            times.append(time.perf_counter_ns() - t0)
        session.finish(step).release()
        step += 1
    session.close()
    return statistics.median(times) / 1000


def rank_main(rank, args, port, out_q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=300))
    policies = list(args.policies)
    runners = {}
    for policy in policies:
        # A policy that fails mid-step may leave its group with a collective
        # unmatched: each has its own group, with a bounded wait.
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
        runners[policy] = build(policy, args, group)
    opts = {p: torch.optim.SGD(runners[p][0].parameters(), lr=args.lr) for p in policies}
    if args.compile != "none":
        # One compiled model per policy: more cache entries than dynamo's default allows.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(policies))
    # Per policy, one entry per step it ran (see ``STEP_SERIES``).
    series = {p: {k: [] for k in STEP_SERIES} for p in policies}
    previous = None
    failed = {}
    for step in range(args.steps):
        live = [p for p in policies if p not in failed]
        order = live[step % len(live):] + live[: step % len(live)]
        data = batch(args, step, rank)
        for policy in order:
            model, run, fused = runners[policy]
            dist.barrier()  # every rank starts the policy's step together
            usage0 = resource.getrusage(resource.RUSAGE_THREAD)
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            error = None
            try:
                opts[policy].zero_grad()
                loss = loss_of(args, run, data)
                t_backward = time.perf_counter()
                loss.backward()
                backward_s = time.perf_counter() - t_backward
                if fused is not None:
                    fused.sync()
                opts[policy].step()
            except Exception as e:  # a policy's failure is a result (DDP under reentrant checkpointing)
                error = first_line(e)
            took_s = time.perf_counter() - t0
            usage1 = resource.getrusage(resource.RUSAGE_THREAD)
            cpu = torch.tensor([time.process_time() - cpu0], dtype=torch.float64)
            follows_itself, previous = previous == policy, policy
            # The slower rank's time, its training thread's kernel time and page faults.
            took = torch.tensor([took_s, 1.0 if error else 0.0, usage1.ru_stime - usage0.ru_stime,
                                 usage1.ru_minflt - usage0.ru_minflt], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)
            if took[1].item():
                failed[policy] = {"step": step, "error": error or "raised on another rank"}
                continue
            report = getattr(model, "last_report", None)
            row = series[policy]
            row["step_s"].append(took[0].item())
            row["backward_s"].append(backward_s)
            row["kernel_s"].append(took[2].item())
            row["page_faults"].append(int(took[3].item()))
            row["cpu_s"].append(cpu.item())
            row["after_own_step"].append(follows_itself)
            row["exposed_comm_s"].append(report.exposed_comm_s if report is not None else None)
            if report is not None:
                row["buckets_overlapped"].append((report.buckets_done_before_finish, report.buckets_launched))
                row["bucket_memory_bytes"].append(model.memory_bytes)
            row["losses"].append(loss.item())
        if rank == 0 and args.progress and (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {step + 1}/{args.steps}", file=sys.stderr, flush=True)
    # The synchronized policies must have trained the same parameters.
    def flat(p):
        model = runners[p][0]
        module = model.module if hasattr(model, "module") else model
        return torch.cat([q.detach().flatten() for q in module.parameters()])

    base = flat("no_sync") if "no_sync" in policies and "no_sync" not in failed else None
    agree = {}
    if base is not None:
        for p in policies:
            if p not in ("local", "no_sync") and p not in failed:
                agree[p] = (flat(p) - base).abs().max().item()
    for p in policies:
        if p.startswith("gradsync"):
            runners[p][0].close()
    # Rank 0 answers with every policy's raw series; main() takes the medians.
    kept = all(os.environ.get(k) == v for k, v in KEEP_FREED_MEMORY.items())
    result = {"series": {p: series[p] for p in policies if p not in failed}, "failed": failed, "agree": agree,
              "kept_freed_memory": kept} if rank == 0 else None
    out_q.put(result)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description="gradsync vs torch DDP, interleaved in one run")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", choices=["tied", "gpt2-small", "resnet18"], default="tied")
    ap.add_argument("--tokens-per-rank", type=int, default=64)
    ap.add_argument("--images-per-rank", type=int, default=8, help="resnet18's batch per rank")
    ap.add_argument("--image-size", type=int, default=128, help="resnet18's image side")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--reentrant", action="store_true", help="reentrant checkpointing (DDP needs static_graph)")
    ap.add_argument("--tiny-params", type=int, default=0, help="N parameters of 16 values instead of the model")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="bucket cap of gradsync and DDP")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--compile", choices=["none", "outer", "inner"], default="none",
                    help="outer: torch.compile(wrapped); inner: the wrapper around torch.compile(model)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (inductor needs a C++ compiler)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--losses", action="store_true", help="keep every step's loss in the JSON")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-hook-timing", action="store_true")
    ap.add_argument("--hook-samples", type=int, default=20_000, help="Python hook calls timed (the median is printed)")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="tell glibc in every rank to keep freed memory (%s) instead of handing it back to the OS "
                         "and faulting it in again at the next step; the same for every policy"
                         % " ".join(f"{k}={v}" for k, v in KEEP_FREED_MEMORY.items()))
    ap.add_argument("--separate", type=int, default=0, metavar="ROUNDS",
                    help="run each policy in processes of its own, one policy after another, ROUNDS times "
                         "(the order rotating every round): every step follows the policy's own, as in training")
    args = ap.parse_args()
    if args.compile != "none" and (args.reentrant or args.tiny_params or args.model != "tied"):
        ap.error("--compile measures the default model with non-reentrant checkpointing")
    if args.tiny_params and args.model != "tied":
        ap.error("--tiny-params replaces the model: leave --model out")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {POLICIES}")
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} leaves nothing to measure after --warmup {args.warmup}")
    if args.separate < 0:
        ap.error("--separate takes a number of rounds, 1 or more")
    args.progress = sys.stderr.isatty()
    if args.keep_freed_memory:
        # glibc reads these when a process starts: the spawned ranks inherit them.
        os.environ.update(KEEP_FREED_MEMORY)
    if args.separate:
        result = run_separately(args)
    else:
        raw = run_ranks(args, args.policies)
        warm, end = measured_window(args.steps, args.warmup, len(args.policies) - len(raw["failed"]))
        result = {"warmup": warm, "measured_end": end, "rounds": None, "agree": raw["agree"], "agree_losses": None,
                  "kept_freed_memory": raw["kept_freed_memory"],
                  "policies": {p: summarize(args, v, v["step_s"][0], v["losses"], warm, end)
                               for p, v in raw["series"].items()}}
        for p, why in raw["failed"].items():
            result["policies"][p] = failure(why)
        result["paired"] = paired_with_gradsync(result["policies"])
    result.update({
        "world": args.world,
        "model": "tiny" if args.tiny_params else args.model,
        "tokens_per_rank": args.tokens_per_rank,
        "images_per_rank": args.images_per_rank if args.model == "resnet18" else None,
        "tiny_params": args.tiny_params,
        "reentrant": args.reentrant,
        "steps": args.steps,
        "bucket_mb": args.bucket_mb,
        "compile": args.compile,
    })
    if not args.no_hook_timing:
        result["hook_call_us_median"] = hook_call_us(args.hook_samples)
    print_table(args, result)
    if args.json:
        print(json.dumps(result))


def run_ranks(args, policies):
    """Run ``policies`` on ``--world`` fresh processes; rank 0's raw answer."""
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_args = argparse.Namespace(**{**vars(args), "policies": list(policies)})
    procs = [ctx.Process(target=rank_main, args=(r, run_args, port, out_q)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = [out_q.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return next(r for r in results if r is not None)


def run_separately(args):
    """``--separate ROUNDS``: each policy alone in its processes, policies one
    after another, the order rotating every round. Medians over steps
    ``--warmup``+1 to ``--steps`` of every round; the policies' agreement is
    that of their per-step losses (their parameters live in different
    processes), taken in the first round."""
    policies, merged, first, losses, failed = list(args.policies), {}, {}, {}, {}
    kept = []  # per run: whether its ranks ran with KEEP_FREED_MEMORY
    warm, end = measured_window(args.steps, args.warmup, 1)
    for r in range(args.separate):
        for policy in policies[r % len(policies):] + policies[: r % len(policies)]:
            if policy in failed:
                continue
            if args.progress:
                print(f"round {r + 1}/{args.separate}: {policy}", file=sys.stderr, flush=True)
            raw = run_ranks(args, [policy])
            kept.append(raw["kept_freed_memory"])
            if policy in raw["failed"]:
                failed[policy] = raw["failed"][policy]
                continue
            v = raw["series"][policy]
            first.setdefault(policy, v["step_s"][0])
            losses.setdefault(policy, v["losses"])
            into = merged.setdefault(policy, {k: [] for k in STEP_SERIES})
            for k in STEP_SERIES:
                into[k] += v[k][warm:end]
    result = {"warmup": warm, "measured_end": end, "rounds": args.separate,
              "agree": {}, "policies": {}, "kept_freed_memory": bool(kept) and all(kept),
              # Steps of different runs are not back to back: no round-by-round comparison.
              "paired": {}}
    for p in policies:
        if p in failed:
            result["policies"][p] = failure(failed[p])
        elif p in merged:
            result["policies"][p] = summarize(args, merged[p], first[p], losses[p], 0, None)
    ref = next((p for p in ("no_sync", "ddp") if p in losses), None)
    result["loss_reference"] = ref
    result["agree_losses"] = {
        p: max(abs(a - b) for a, b in zip(losses[p], losses[ref]))
        for p in losses if ref is not None and p not in (ref, "local")
    }
    return result


def summarize(args, v, step_s_first, losses, first, end):
    """A policy's figures over steps [first, end) of its series ``v`` (``end``
    None: to the last)."""
    part = {k: v[k][first:end] for k in STEP_SERIES}
    exposed = [x for x in part["exposed_comm_s"] if x is not None]
    return {
        "step_s_median": statistics.median(part["step_s"]),
        "step_s_first": step_s_first,
        "backward_s_median": statistics.median(part["backward_s"]),
        "kernel_s_median": statistics.median(part["kernel_s"]),
        "page_faults_median": statistics.median(part["page_faults"]),
        "cpu_s_median": statistics.median(part["cpu_s"]),
        "exposed_comm_s_median": statistics.median(exposed) if exposed else None,
        # Per measured step: buckets reduced before backward ended, of those launched.
        "buckets_overlapped": part["buckets_overlapped"] or None,
        "bucket_memory_bytes": part["bucket_memory_bytes"] or None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "losses": losses if args.losses else None,
        "step_s": part["step_s"],
        "after_own_step": part["after_own_step"],
    }


def failure(why):
    """What the table and the JSON say of a policy that raised."""
    return {"step_s_median": None, "note": f"raises at step {why['step']}: {why['error']}"}


def print_table(args, result):
    pol = result["policies"]
    ref = pol.get("no_sync", {}).get("step_s_median")
    if args.tiny_params:
        what = f"{args.tiny_params} tiny parameters"
    elif args.model == "resnet18":
        what = f"resnet18, {args.images_per_rank} images/rank of {args.image_size}x{args.image_size}"
    else:
        what = f"{args.model}, {args.tokens_per_rank} tokens/rank"
    compiled = "" if args.compile == "none" else f", torch.compile {args.compile} ({args.compile_backend})"
    if args.model == "resnet18" or args.tiny_params:
        checkpointing = "no checkpointing"
    else:
        checkpointing = f"{'reentrant' if args.reentrant else 'non-reentrant'} checkpointing"
    first, end = result["warmup"], result["measured_end"]
    if result["rounds"]:
        how = (f"each policy in its own processes, {result['rounds']} round(s) of {args.steps} steps "
               f"(medians of steps {first + 1}-{end} of every round)")
    else:
        left = f", the last {args.steps - end} left out to end on a whole rotation" if end < args.steps else ""
        how = f"interleaved, {args.steps} steps (medians of steps {first + 1}-{end}: without the first {first}{left})"
    kept = ", glibc keeping freed memory" if result["kept_freed_memory"] else ""
    print(f"world {args.world}, {what}, {checkpointing}{compiled}{kept}, {how}, slower rank:")
    for p, r in pol.items():
        s = r.get("step_s_median")
        if s is None:
            print(f"  {p:<14} {r.get('note', 'not run')}")
            continue
        ratio = f"{s / ref:5.2f}x no_sync" if ref else ""
        exposed = r.get("exposed_comm_s_median")
        exposed = f"  exposed comm {exposed * 1e3:5.1f} ms" if exposed is not None else ""
        if r.get("buckets_overlapped"):
            done = statistics.median(d for d, _ in r["buckets_overlapped"])
            launched = statistics.median(n for _, n in r["buckets_overlapped"])
            exposed += f", buckets done in backward {done:g}/{launched:g}"
            exposed += f", bucket memory {r['bucket_memory_bytes'][-1] / 2**20:.0f} MiB"
        mixed = split_by_predecessor(r["step_s"], r["after_own_step"])
        if mixed:
            exposed += f"\n  {'':<14} after its own step {mixed[0] * 1e3:.1f} ms, after another policy's {mixed[1] * 1e3:.1f}"
        print(f"  {p:<14} {s * 1e3:8.1f} ms  first step {r['step_s_first'] * 1e3:8.1f} ms  {ratio}  "
              f"backward {r['backward_s_median'] * 1e3:7.1f} ms  kernel {r['kernel_s_median'] * 1e3:6.1f} ms "
              f"({r['page_faults_median']:.0f} page faults)  cpu {r['cpu_s_median'] * 1e3:6.1f} ms  "
              f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}{exposed}")
    for p, d in result["paired"].items():
        if d is None:
            print(f"  gradsync - {p}, round by round: too few rounds for a confidence interval")
            continue
        print(f"  gradsync - {p}, round by round ({d['rounds']} rounds): median {d['median_s'] * 1e3:+.1f} ms, "
              f"{d['level']:.0%} CI {d['low_s'] * 1e3:+.1f} to {d['high_s'] * 1e3:+.1f} ms: "
              + (d["verdict"] if d["verdict"] == "within noise" else f"gradsync {d['verdict']}"))
    if result["agree"]:
        print("  parameters vs no_sync: " + ", ".join(f"{p} {d:.1e}" for p, d in result["agree"].items()))
    if result["agree_losses"]:
        print(f"  per-step losses, largest difference from {result['loss_reference']}'s: "
              + ", ".join(f"{p} {d:.1e}" for p, d in result["agree_losses"].items()))
    if "hook_call_us_median" in result:
        print(f"  Python hook call into the runtime: {result['hook_call_us_median']:.2f} µs median")


if __name__ == "__main__":
    main()
