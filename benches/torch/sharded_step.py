"""Step time of sharded training, interleaved: gradsync with sharded
gradients (ZeRO-2) and sharded parameters (ZeRO-3, also with
``param_dtype=torch.bfloat16``, one bucket in flight: ``-1``,
``buckets_in_flight=1`` (the default on a CUDA device; on CPU it is 0),
unpaced: ``-unpaced``, ``buckets_in_flight=None``, and paced for the least
memory: ``-lean``, ``buckets_in_flight=0, prefetch_units=False``),
unsharded gradsync, torch DDP and FSDP2
(also in mixed precision) take turns in the same processes, so each step
of one is timed under the same load as its neighbours' steps.

    python benches/torch/sharded_step.py [--worlds 2 4] [--steps 30] [--warmup 3]
                                         [--json docs/data/sharded/steps.json]

Each world runs in its own CPU processes (gloo, loopback). Every process
builds the same GPT-2-shaped stack once per implementation (``--layers``
blocks of ``--width``, tied embedding and head, AdamW); then, round after
round, each implementation runs one step (zero_grad, forward, backward,
optimizer step), in an order that rotates every round. Reported per
implementation: the median step time over the rounds after the warm-up
(the largest median over the ranks). gradsync sharded runs twice: as it
ships (each bucket's gather started as soon as it is packed, unpacked while
the later ones are in flight) and with one gather of every bucket
(``gradsync-sharded-at-once``, the gather before it was pipelined). For
both, and for sharded parameters, also the parameter gathers' share (the
time inside ``Partition.gather``: packing this rank's chunk, the runtime's
all-gather, writing the parameters; with sharded parameters the time
inside the lane's rounds: the needs summed, the gathers started, waited
for and read back) and the optimizer's own step over this rank's partition.
"""

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import spawn, write_json  # noqa: E402
from sharded_memory import CAP_MB, Stack, build  # noqa: E402

IMPLS = ("gradsync-sharded", "gradsync-sharded-at-once", "gradsync-params", "gradsync-params-1",
         "gradsync-params-unpaced", "gradsync-params-lean", "gradsync-params-bf16", "gradsync", "ddp", "fsdp2",
         "fsdp2-bf16")


def _build(impl, model, world):
    """``model`` under ``impl`` (``sharded_memory.build``'s, and the
    sharded wrapper with one gather of every bucket) and its optimizer."""
    wrapped, optimizer = build(impl.removesuffix("-at-once"), model, world)
    if impl.startswith("gradsync-sharded"):
        wrapped._partition.pipelined = not impl.endswith("-at-once")
    return wrapped, optimizer


class Timed:
    """Seconds spent inside the methods ``names`` of ``owner`` (none calling
    another), summed until read."""

    def __init__(self, owner, *names):
        self.spent = 0.0
        for name in names:
            self._time(owner, name)

    def _time(self, owner, name):
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - began

        setattr(owner, name, timed)

    def take(self):
        spent, self.spent = self.spent, 0.0
        return spent


def _rank(rank, world, port, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    runs = {}
    for impl in args.impls:
        torch.manual_seed(0)
        wrapped, optimizer = _build(impl, Stack(args.layers, args.width), world)
        probes = {}
        if impl.startswith("gradsync-sharded"):
            probes["gather"] = Timed(wrapped._partition, "gather")
            probes["optimizer"] = Timed(optimizer.inner, "step")
        elif impl.startswith("gradsync-params"):
            lane = getattr(wrapped._partition.residence, "lane", None)  # (one block: one gather per step)
            probes["gather"] = (Timed(lane, "needs", "start", "finish") if lane is not None
                                else Timed(wrapped._partition, "gather"))
            probes["optimizer"] = Timed(optimizer.inner, "step")
        runs[impl] = (wrapped, optimizer, probes, {"step": []} | {k: [] for k in probes})
    g = torch.Generator().manual_seed(rank)
    for round_ in range(args.warmup + args.steps):
        ids = torch.randint(0, 1024, (args.batch, args.tokens), generator=g)
        order = args.impls[round_ % len(args.impls):] + args.impls[: round_ % len(args.impls)]
        for impl in order:
            wrapped, optimizer, probes, times = runs[impl]
            for probe in probes.values():
                probe.take()
            began = time.perf_counter()
            optimizer.zero_grad()
            logits = wrapped(ids)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)).backward()
            optimizer.step()
            spent = time.perf_counter() - began
            if round_ >= args.warmup:
                times["step"].append(spent)
                for name, probe in probes.items():
                    times[name].append(probe.take())
        if rank == 0 and (round_ + 1) % 10 == 0:
            print(f"  world {world}: round {round_ + 1} of {args.warmup + args.steps}", flush=True)
    out = {impl: {name: statistics.median(values) for name, values in times.items()}
           for impl, (_, _, _, times) in runs.items()}
    for wrapped, _, _, _ in runs.values():
        if hasattr(wrapped, "close"):
            wrapped.close()
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run(world, args):
    """One world in its own processes: per implementation, each median the largest over the ranks."""
    got, dead = spawn(_rank, world, (args,), deadline=1800)
    if len(got) < world:
        raise RuntimeError(f"ranks {sorted(set(range(world)) - set(got))} did not finish (died: {dead})")
    return {impl: {name: max(got[r][impl][name] for r in range(world)) for name in got[0][impl]}
            for impl in got[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds not timed")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/steps.json)")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        print(f"world {world}: {', '.join(args.impls)} interleaved, {args.steps} rounds ...", flush=True)
        medians = run(world, args)
        ddp = medians.get("ddp", {}).get("step")
        for impl, m in medians.items():
            row = {"world": world, "impl": impl, **{f"{k}_s": v for k, v in m.items()}}
            rows.append(row)
            extra = "".join(f", {k} {v * 1e3:.1f} ms" for k, v in m.items() if k != "step")
            ratio = f" ({m['step'] / ddp:.2f}x DDP)" if ddp else ""
            print(f"  {impl}: step {m['step'] * 1e3:.1f} ms{ratio}{extra}", flush=True)
    if args.json:
        write_json(args.json, rows, steps=args.steps,
                   model=f"{args.layers} blocks of width {args.width}, tied embedding (vocab 1024); "
                         f"{args.batch} x {args.tokens} tokens per rank, AdamW, bucket cap {CAP_MB} MB")

if __name__ == "__main__":
    main()
