"""What wrapping a model with ``shard_parameters=True`` costs a rank in
memory: built on the CPU as usual, or on the meta device (materialized a
unit at a time, each unit initialized and sent from rank 0).

    python benches/torch/meta_init.py [--worlds 2 4] [--layers 12] [--width 768] [--vocab 50257]
                                      [--json docs/data/sharded/meta.json]

The model is ``sharded_memory.py``'s GPT-2-shaped stack (the defaults: GPT-2
small's shape, 124 M parameters with its tied 50257-word embedding). Each
configuration runs in fresh processes (CPU ranks, gloo); each rank reports
its peak resident memory (``ru_maxrss``) before building the model and after
wrapping it, and the bytes of pieces it keeps; every number is the largest
over the ranks. The growth is what building and wrapping cost at their
peak: on the CPU at least the whole model; on the meta device the pieces
plus the largest unit (the root, which holds the embedding, here). torch's
one-time cost of loading its meta kernels is paid before the measurement in
both modes.
"""

import argparse
import os
import resource
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import model_shape_arguments, spawn_every, write_json  # noqa: E402
from sharded_memory import Stack  # noqa: E402

MIB = 1 << 20


def _rank(rank, world, port, meta, args, results):
    import gradsync.torch as gt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # torch loads its meta kernels at the first module built on the meta device (a fixed cost, about
    # 150 MiB here, whatever the model): paid before the measurement in both modes.
    with torch.device("meta"):
        Stack(1, 8, vocab=8)
    torch.manual_seed(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta" if meta else "cpu"):
        model = Stack(args.layers, args.width, vocab=args.vocab)
    wrapped = gt.DistributedDataParallel(model, shard_parameters=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    whole = sum(form.numel() * form.element_size() for form in wrapped.parameter_forms().values())
    largest = max(sum(p.numel() for p in block.parameters()) for block in model.blocks) * 4
    results.put((rank, {"growth": after - before, "pieces": wrapped.parameter_bytes, "whole": whole,
                        "block": largest}))
    wrapped.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    model_shape_arguments(parser, layers=12, width=768, vocab=50257)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/meta.json)")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        for meta in (False, True):
            got = spawn_every(_rank, world, (meta, args), 600, f"meta_init: world {world}, "
                              f"{'meta' if meta else 'cpu'}")
            row = {"world": world, "built_on": "meta" if meta else "cpu",
                   **{k: max(r[k] for r in got.values()) for k in ("growth", "pieces", "whole", "block")}}
            rows.append(row)
            print(f"world {world}, built on {row['built_on']}: model {row['whole'] / MIB:.0f} MiB, peak resident "
                  f"memory grew {row['growth'] / MIB:.0f} MiB while building and wrapping, pieces kept "
                  f"{row['pieces'] / MIB:.0f} MiB", flush=True)
    if args.json:
        write_json(args.json, rows, layers=args.layers, width=args.width, vocab=args.vocab)


if __name__ == "__main__":
    main()
