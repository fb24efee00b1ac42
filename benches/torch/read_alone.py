"""What a read of a ``shard_parameters=True`` model on one rank alone costs,
beside the collective way (``whole_parameters()`` on every rank).

    python benches/torch/read_alone.py [--worlds 2 4] [--layers 12] [--width 512] [--vocab 8192] [--repeat 3]
                                       [--json docs/data/sharded/reads.json]

The model is ``sharded_memory.py``'s GPT-2-shaped stack. Every rank trains
one AdamW step; then rank 0 alone reads the model between steps while the
other ranks wait in a barrier (their runtimes' piece servers answer):

* ``state_dict``: ``model.state_dict()``, the DDP tutorial's rank-0 save;
* ``norms``: a logging callback's ``[p.norm() for p in model.parameters()]``
  under ``torch.no_grad()``, each released parameter read with its bucket;
* ``deepcopy``: ``copy.deepcopy(model.module)``, an EMA's copy.

Then every rank runs ``model.state_dict()`` inside ``whole_parameters()``
(``whole``: a collective gather). Each is repeated and the fastest kept.
Each rank reports its peak resident memory (``ru_maxrss``) before and after
each read: the other ranks' growth shows whether they held the model whole.
Fresh CPU processes over gloo; the time is rank 0's.
"""

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import model_shape_arguments, peak_resident, spawn_every, write_json  # noqa: E402
from sharded_memory import sharded_stack  # noqa: E402

MIB = 1 << 20
TOKENS = 16
WAYS = ("state_dict", "norms", "deepcopy", "whole")


def _rank(rank, world, port, args, results):
    wrapped, opt, ids = sharded_stack(rank, world, port, args, TOKENS)
    logits = wrapped(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    opt.step()
    del logits

    def read(way):
        if way == "state_dict":
            return wrapped.state_dict()
        if way == "norms":
            with torch.no_grad():
                return [p.norm() for p in wrapped.module.parameters()]
        if way == "deepcopy":
            return copy.deepcopy(wrapped.module)
        with wrapped.whole_parameters():
            return wrapped.state_dict()

    out = {}
    for way in WAYS:
        before, best = peak_resident(), float("inf")
        for _ in range(args.repeat):
            dist.barrier()
            start = time.perf_counter()
            if way == "whole" or rank == 0:
                got = read(way)
                del got
            best = min(best, time.perf_counter() - start)
            dist.barrier()
        out[way] = {"seconds": best, "growth": peak_resident() - before}
    whole_bytes = sum(form.numel() * form.element_size() for form in wrapped.parameter_forms().values())
    results.put((rank, {"ways": out, "pieces": wrapped.parameter_bytes, "whole": whole_bytes}))
    wrapped.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    model_shape_arguments(parser, layers=12, width=512, vocab=8192)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/reads.json)")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        got = spawn_every(_rank, world, (args,), 900, f"read_alone: world {world}")
        for way in WAYS:
            others = [got[r]["ways"][way]["growth"] for r in range(1, world)]
            row = {"world": world, "way": way, "seconds": got[0]["ways"][way]["seconds"],
                   "reader_growth": got[0]["ways"][way]["growth"], "others_growth": max(others),
                   "whole": got[0]["whole"], "pieces": got[0]["pieces"]}
            rows.append(row)
            print(f"world {world}, {way}: {row['seconds'] * 1e3:.0f} ms on rank 0 "
                  f"({row['whole'] / row['seconds'] / 1e9:.2f} GB/s of the {row['whole'] / MIB:.0f} MiB model); "
                  f"peak resident memory grew {row['reader_growth'] / MIB:.0f} MiB on rank 0, at most "
                  f"{row['others_growth'] / MIB:.0f} MiB on the others", flush=True)
    if args.json:
        write_json(args.json, rows, layers=args.layers, width=args.width, vocab=args.vocab)


if __name__ == "__main__":
    main()
