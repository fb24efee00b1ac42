"""What a change of members moves per member in a sharded elastic job, at
1,000-10,000 members: the settlement's plan (``sharding.reshard``), as each
member computes it, for a world that loses one rank.

    python benches/torch/reshard_scale.py [--worlds 16 128 1024 10000] [--model-mib 1024] [--bucket-mib 25]
                                          [--stride 8] [--rows 3] [--json docs/data/sharded/reshard.json]

A model of ``--model-mib`` MiB of float32 values in buckets of
``--bucket-mib``, each rank keeping its partition and its buddy's
(``--stride`` ranks on: a host of 8 ranks), loses rank ``world // 2``.
Each member moves, per value, the parameter and ``--rows - 1`` optimizer
states (AdamW's two), as float64. Reported, for the members with the
most to move (the neighbours of the lost rank and of its buddy, and a
spread of others): the bytes a member receives and the peers it exchanges
with, the move's point-to-point plan (:func:`~gradsync.torch.sharding.reshard.transfers`)
beside the broadcast of every run to every member it replaced; and the
time a member takes to compute it: the sources' table by old rank, once
per change (:class:`~gradsync.torch.sharding.reshard.Sources`), then its
plan per bucket, beside the sweep of every member's holdings per bucket
it replaced (``sweep_s``). No processes: the plan is what each member
computes alone, and the messages are what it names.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import write_json  # noqa: E402

MIB = 1 << 20


def _members(world, lost, stride):
    return [{"holds": True, "rank": r, "world": world, "stride": stride} for r in range(world) if r not in lost]


def _row(world, args):
    from gradsync.torch.sharding.reshard import Sources, runs, transfers
    from gradsync.torch.sharding.standing import places_of

    lost = [world // 2]
    everyone = _members(world, lost, args.stride)
    new_world = len(everyone)
    stride = min(args.stride, new_world - 1)
    bucket = args.bucket_mib * MIB // 4
    buckets = [bucket] * (args.model_mib // args.bucket_mib)
    start = time.perf_counter()
    layouts = [runs(numel, everyone) for numel in buckets]
    sweep_s = (time.perf_counter() - start) / len(buckets)
    start = time.perf_counter()
    layout = Sources(places_of(everyone))
    sources_s = time.perf_counter() - start
    near = {r for l in lost for r in (l - stride - 1, l - stride, l - 1, l, l + 1) if 0 <= r < new_world}
    sample = sorted(near | set(range(0, new_world, max(1, new_world // 16))))
    received, peers, plan_s = 0, 0, 0.0
    for r in sample:
        start = time.perf_counter()
        plans = [transfers(numel, layout, r, new_world, stride) for numel in buckets]
        plan_s = max(plan_s, (time.perf_counter() - start) / len(buckets))
        got = sum(hi - lo for sends, receives in plans for m, spans in receives.items() if m != r for lo, hi in spans)
        received = max(received, got * args.rows * 8)
        peers = max(peers, max(len(set(sends) | set(receives) - {r}) for sends, receives in plans))
    # The broadcast of every run to every member: each receives every value it is not the source of.
    broadcast = sum(buckets) * args.rows * 8 - min(
        sum(hi - lo for layout in layouts for lo, hi, s in layout if s == r) * args.rows * 8 for r in sample)
    return {"world": world, "model": sum(buckets) * 4, "received": received, "peers": peers,
            "broadcast_received": broadcast, "broadcasts": max(len(layout) for layout in layouts) * len(buckets),
            "sources_s": sources_s, "plan_s": plan_s, "sweep_s": sweep_s, "buckets": len(buckets),
            "sampled": len(sample)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[16, 128, 1024, 10000])
    parser.add_argument("--model-mib", type=int, default=1024)
    parser.add_argument("--bucket-mib", type=int, default=25)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/reshard.json)")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        row = _row(world, args)
        rows.append(row)
        print(f"world {world} -> {world - 1}: a member receives at most {row['received'] / MIB:.2f} MiB from "
              f"{row['peers']} peers per bucket (the broadcasts: {row['broadcast_received'] / MIB:.0f} MiB in "
              f"{row['broadcasts']} broadcasts); the sources {row['sources_s'] * 1e3:.2f} ms once, its plan "
              f"{row['plan_s'] * 1e3:.3f} ms a bucket (the sweep it replaced: {row['sweep_s'] * 1e3:.2f} ms a "
              "bucket)", flush=True)
    if args.json:
        write_json(args.json, rows, model_mib=args.model_mib, bucket_mib=args.bucket_mib, stride=args.stride,
                   rows_per_value=args.rows)


if __name__ == "__main__":
    main()
