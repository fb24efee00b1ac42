"""What an EMA of a ``shard_parameters=True`` model costs each rank:
``ShardedAveragedModel`` (each rank averages its pieces) beside
``torch.optim.swa_utils.AveragedModel`` of the same sharded model (a whole
copy on every rank).

    python benches/torch/averaged.py [--worlds 2 4] [--layers 12] [--width 512] [--vocab 8192] [--steps 5]
                                     [--json docs/data/sharded/averaged.json]

The model is ``sharded_memory.py``'s GPT-2-shaped stack, trained with
AdamW; after each step both averages are updated (EMA, decay 0.999,
``get_ema_multi_avg_fn``). Reported per rank, the largest over the ranks:
the bytes each average holds, the peak resident memory (``ru_maxrss``)
each one's construction added, and the median time of an update; and on
rank 0, how long an evaluation forward of the average takes on every
rank (inside ``applied()``; ``AveragedModel``'s copy is whole). Fresh CPU
processes over gloo.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import model_shape_arguments, peak_resident, spawn_every, write_json  # noqa: E402
from sharded_memory import sharded_stack  # noqa: E402

MIB = 1 << 20
TOKENS = 16
KINDS = ("sharded", "whole")


def _rank(rank, world, port, args, results):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    import gradsync.torch as gt

    wrapped, opt, ids = sharded_stack(rank, world, port, args, TOKENS)

    def step():
        opt.zero_grad()
        logits = wrapped(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()

    step()  # (the parameters are released from the first step's end)
    fn = get_ema_multi_avg_fn(0.999)
    out = {}
    before = peak_resident()
    sharded = gt.ShardedAveragedModel(wrapped, multi_avg_fn=fn)
    out["sharded"] = {"growth": peak_resident() - before, "bytes": sharded.held_bytes}
    before = peak_resident()
    whole = AveragedModel(wrapped.module, multi_avg_fn=fn)  # (reads every parameter alone: served)
    out["whole"] = {"growth": peak_resident() - before, "bytes": sum(p.numel() * p.element_size() for p in whole.parameters())}
    updates = {kind: [] for kind in KINDS}
    for _ in range(args.steps):
        step()
        for kind, average, model in (("sharded", sharded, wrapped), ("whole", whole, wrapped.module)):
            start = time.perf_counter()
            average.update_parameters(model)
            updates[kind].append(time.perf_counter() - start)
    for kind in KINDS:
        out[kind]["update_s"] = statistics.median(updates[kind])
    wrapped.eval()
    whole.eval()
    with torch.no_grad():
        dist.barrier()
        start = time.perf_counter()
        with sharded.applied():
            wrapped(ids)
        out["sharded"]["evaluate_s"] = time.perf_counter() - start
        dist.barrier()
        start = time.perf_counter()
        whole(ids)
        out["whole"]["evaluate_s"] = time.perf_counter() - start
    model_bytes = sum(form.numel() * form.element_size() for form in wrapped.parameter_forms().values())
    results.put((rank, {"kinds": out, "model": model_bytes}))
    dist.barrier()
    wrapped.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    model_shape_arguments(parser, layers=12, width=512, vocab=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/averaged.json)")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        got = spawn_every(_rank, world, (args,), 900, f"averaged: world {world}")
        for kind in KINDS:
            per_rank = [got[r]["kinds"][kind] for r in range(world)]
            row = {"world": world, "kind": kind, "model": got[0]["model"],
                   "bytes": max(k["bytes"] for k in per_rank), "growth": max(k["growth"] for k in per_rank),
                   "update_s": max(k["update_s"] for k in per_rank), "evaluate_s": per_rank[0]["evaluate_s"]}
            rows.append(row)
            print(f"world {world}, {kind}: the average holds {row['bytes'] / MIB:.1f} MiB per rank "
                  f"(the model {row['model'] / MIB:.0f} MiB), its construction grew peak memory "
                  f"{row['growth'] / MIB:.0f} MiB; an update {row['update_s'] * 1e3:.1f} ms, an evaluation "
                  f"{row['evaluate_s'] * 1e3:.0f} ms", flush=True)
    if args.json:
        write_json(args.json, rows, layers=args.layers, width=args.width, vocab=args.vocab, steps=args.steps)


if __name__ == "__main__":
    main()
