"""Data-parallel training of a small transformer language model with gradsync.

    torchrun --nproc-per-node 2 examples/torch/train_lm.py [--steps 80] [--impl gradsync|ddp]
        [--wire-dtype float32|bfloat16] [--trace timeline.json] [--metrics-addr 127.0.0.1:9464]

Every transformer block, the embedding and the tied output head run under
reentrant activation checkpointing (``use_reentrant=True``, PyTorch's default),
so the tied embedding's gradient hook fires twice per step, the first time
with a partial gradient: torch's DistributedDataParallel raises "Expected to
mark a variable ready only once" on it (see ``--impl ddp``). With gradsync the
run is exact: it prints the loss and what the runtime saw every few steps,
and ends with an equivalence check against the same model trained in one
process on the whole batch (exit status 1 if it fails). With ``--wire-dtype
bfloat16`` the buckets travel as bfloat16: the check then reports how far
the run drifted instead of failing. ``--trace`` writes rank 0's timeline
(Chrome trace JSON); ``--metrics-addr`` serves rank 0's Prometheus metrics.
"""

import argparse
import copy
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gradsync
from gradsync.torch import DistributedDataParallel as GradsyncDDP

# Data and update are identical in the replicas and the reference, but sums
# run in a different order (per-rank means, float32 all-reduce), so the
# parameters differ by rounding, amplified a little by training.
TOLERANCE = 1e-4
# SGD with momentum: learns the task in 80 steps (Adam's normalization would
# turn rounding-level differences of near-zero gradients into full steps).
LR = 0.5


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, ``blocks`` blocks, and an output head
    tied to the token embedding. ``recompute``: every segment (embedding,
    each block, head) under reentrant checkpointing."""

    def __init__(self, vocab, dim, heads, blocks, context, recompute=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.recompute = recompute
        nn.init.normal_(self.embed.weight, std=0.02)  # also the output head: keep the first logits small

    def _embed(self, tokens):
        return self.embed(tokens) + self.pos[: tokens.shape[1]]

    def _head(self, x):
        return F.linear(self.norm(x), self.embed.weight)  # tied to the embedding

    def _run(self, fn, *args):
        if self.recompute:
            return checkpoint(fn, *args, use_reentrant=True)
        return fn(*args)

    def forward(self, tokens):
        # Reentrant checkpointing needs an input that requires grad to build a graph.
        x = self._run(self._embed, tokens) if not self.recompute else checkpoint(
            lambda t, anchor: self._embed(t) + 0 * anchor, tokens, self.pos, use_reentrant=True
        )
        for block in self.blocks:
            x = self._run(block, x)
        return self._run(self._head, x)


def corpus(vocab, steps, global_batch, context, seed):
    """A deterministic Markov text (every token has 3 possible successors, so
    the best loss is ln 3 = 1.10): every rank generates the same, then takes
    its slice of each global batch."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 3), generator=g)
    tokens = torch.empty(steps, global_batch, context + 1, dtype=torch.long)
    tokens[:, :, 0] = torch.randint(0, vocab, (steps, global_batch), generator=g)
    choice = torch.randint(0, 3, tokens.shape, generator=g)
    for i in range(1, context + 1):
        tokens[:, :, i] = successors[tokens[:, :, i - 1], choice[:, :, i]]
    return tokens


def train(model, data, rank, world, steps, lr, log_every, report=None):
    """SGD with momentum on this rank's slices; returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    per_rank = data.shape[1] // world
    losses = []
    for step in range(steps):
        batch = data[step, rank * per_rank : (rank + 1) * per_rank]
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if report is not None and (step % log_every == 0 or step == steps - 1):
            report(step, loss.item(), time.perf_counter() - t0)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--impl", choices=["gradsync", "ddp"], default="gradsync",
                        help="ddp: torch's DistributedDataParallel, to see it fail on this model")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--wire-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="element type of the buckets on the wire (bfloat16 halves the bytes, loses precision)")
    parser.add_argument("--trace", metavar="FILE", help="write rank 0's timeline as Chrome trace JSON")
    parser.add_argument("--metrics-addr", metavar="HOST:PORT", help="serve rank 0's Prometheus metrics there")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    vocab, dim, heads, blocks, context = 64, 64, 4, 4, 32
    torch.manual_seed(args.seed)
    base = TinyLM(vocab, dim, heads, blocks, context)
    data = corpus(vocab, args.steps, args.batch * world, context, args.seed)
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        print(f"gradsync train_lm: {world} ranks, {args.impl}, {args.steps} steps, batch {world}x{args.batch}x{context}, "
              f"{params} parameters, {blocks} blocks, reentrant recompute, tied embedding", flush=True)

    if args.impl == "ddp":
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    else:
        if args.metrics_addr and rank == 0:
            gradsync.install_prometheus(args.metrics_addr)
        model = GradsyncDDP(copy.deepcopy(base), bucket_cap_mb=0.25, wire_dtype=args.wire_dtype,
                            record_timeline=bool(args.trace) and rank == 0)

    def report(step, loss, seconds):
        losses = torch.tensor([loss])
        dist.all_reduce(losses)
        if rank == 0:
            r = model.last_report
            print(f"step {step + 1:>4}/{args.steps}  loss {losses.item() / world:.4f}  step {seconds * 1e3:6.1f} ms  "
                  f"exposed comm {r.exposed_comm_s * 1e3:5.2f} ms  buckets overlapped {r.buckets_done_before_finish}/"
                  f"{r.buckets_launched}  late {r.late_arrivals}  corrected {len(r.corrected)}", flush=True)

    try:
        losses = train(model, data, rank, world, args.steps, lr=LR, log_every=args.log_every,
                       report=report if args.impl == "gradsync" else None)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        print(f"rank {rank}: {args.impl} failed: {first.split('. ')[0]}.", file=sys.stderr, flush=True)
        sys.exit(1)

    # Every replica must be identical, and equal to one process on the whole batch.
    trained = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    gathered = [torch.empty_like(trained) for _ in range(world)]
    dist.all_gather(gathered, trained)
    spread = max((g - gathered[0]).abs().max().item() for g in gathered)
    ok = True
    if rank == 0:
        reference = copy.deepcopy(base)
        reference.recompute = False
        ref_losses = train(reference, data, 0, 1, args.steps, lr=LR, log_every=args.log_every)
        diff = (torch.cat([p.detach().flatten() for p in reference.parameters()]) - trained).abs().max().item()
        exact_wire = args.wire_dtype == "float32"
        ok = spread == 0.0 and math.isfinite(losses[-1]) and (diff <= TOLERANCE or not exact_wire)
        print(f"replicas: max |param_r - param_0| = {spread:.1e}")
        print(f"reference (one process, whole batch, no recompute): loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}")
        logged = [s for s in range(args.steps) if s % args.log_every == 0 or s == args.steps - 1]
        print("reference loss at the logged steps: " + " ".join(f"{ref_losses[s]:.4f}" for s in logged))
        if exact_wire:
            verdict = "OK" if ok else "FAILED"
            print(f"equivalence: max |param - reference| = {diff:.2e} (tolerance {TOLERANCE:.0e}) {verdict}", flush=True)
        else:
            print(f"drift with a {args.wire_dtype} wire: max |param - reference| = {diff:.2e}", flush=True)
        if args.trace:
            model.write_timeline(args.trace)
            print(f"timeline: {args.trace} (open in https://ui.perfetto.dev)", flush=True)
    verdict = torch.tensor([0 if ok else 1])
    dist.broadcast(verdict, 0)
    if isinstance(model, GradsyncDDP):
        model.close()
    dist.destroy_process_group()
    sys.exit(int(verdict.item()))


if __name__ == "__main__":
    main()
