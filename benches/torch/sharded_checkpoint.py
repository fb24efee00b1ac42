"""What a sharded checkpoint of a ``shard_parameters=True`` model costs a
rank in memory: saved on one world size, loaded on another, the model
built on the meta device both times (it need not fit one rank).

    python benches/torch/sharded_checkpoint.py [--save-world 2] [--load-world 3] [--layers 12] [--width 768]
                                               [--vocab 50257] [--ways pieces whole]
                                               [--json docs/data/sharded/checkpoint.json]

The model is ``sharded_memory.py``'s GPT-2-shaped stack (the defaults: GPT-2
small's shape, 124 M parameters). The saving job trains one step with
AdamW and saves with ``gradsync.torch.checkpoint.save``; a fresh job of
another size, built on the meta device again, loads it with
``checkpoint.load`` and trains one step. Each in fresh processes (CPU
ranks, gloo). Each rank reports its peak resident memory (``ru_maxrss``)
before and after the save or the load, and the bytes of pieces it keeps;
every number is the largest over the ranks.

Two ways are measured: ``pieces`` (what ``checkpoint.save`` and ``load`` do:
each rank writes and reads its pieces' blocks) and ``whole`` (the same
calls inside ``model.whole_parameters()``: the model gathered whole on every
rank first, as ``checkpoint.save`` did before): the growth of the peak is
what the checkpoint costs above what training did.
"""

import argparse
import os
import resource
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import model_shape_arguments, spawn_every, write_json  # noqa: E402
from sharded_memory import Stack  # noqa: E402

MIB = 1 << 20
TOKENS = 16


def _peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step(wrapped, opt, rank, args):
    ids = torch.randint(0, args.vocab, (1, TOKENS), generator=torch.Generator().manual_seed(rank))
    opt.zero_grad()
    logits = wrapped(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    opt.step()


def _rank(rank, world, port, path, loading, whole, args, results):
    import contextlib

    import gradsync.torch as gt
    from gradsync.torch import checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Stack(args.layers, args.width, vocab=args.vocab)
    wrapped = gt.DistributedDataParallel(model, shard_parameters=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    if not loading:
        _step(wrapped, opt, rank, args)
    else:
        wrapped.shard_optimizer(opt)
    before = _peak()
    held = wrapped.whole_parameters() if whole else contextlib.nullcontext()
    with held:
        (checkpoint.load if loading else checkpoint.save)(path, wrapped, opt)
    after = _peak()
    if loading:
        _step(wrapped, opt, rank, args)
    whole_bytes = sum(form.numel() * form.element_size() for form in wrapped.parameter_forms().values())
    results.put((rank, {"growth": after - before, "peak": after, "pieces": wrapped.parameter_bytes,
                        "whole": whole_bytes}))
    wrapped.close()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save-world", type=int, default=2)
    parser.add_argument("--load-world", type=int, default=3)
    model_shape_arguments(parser, layers=12, width=768, vocab=50257)
    parser.add_argument("--ways", nargs="+", choices=("pieces", "whole"), default=["pieces", "whole"])
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/checkpoint.json)")
    args = parser.parse_args()
    rows = []
    for way in args.ways:
        path = tempfile.mkdtemp(prefix="gradsync-checkpoint-bench-")
        try:
            for what, world in (("save", args.save_world), ("load", args.load_world)):
                got = spawn_every(_rank, world, (path, what == "load", way == "whole", args), 900,
                                  f"sharded_checkpoint: {way}, {what} on {world}")
                row = {"way": way, "what": what, "world": world,
                       **{k: max(r[k] for r in got.values()) for k in ("growth", "peak", "pieces", "whole")}}
                rows.append(row)
                print(f"{way}: {what} on {world} ranks: model {row['whole'] / MIB:.0f} MiB, pieces "
                      f"{row['pieces'] / MIB:.0f} MiB a rank, peak resident memory grew "
                      f"{row['growth'] / MIB:.0f} MiB in the {what} (to {row['peak'] / MIB:.0f} MiB)", flush=True)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    if args.json:
        write_json(args.json, rows, layers=args.layers, width=args.width, vocab=args.vocab,
                   save_world=args.save_world, load_world=args.load_world)


if __name__ == "__main__":
    main()
