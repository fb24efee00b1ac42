"""Memory per rank and step time of sharded training (ZeRO-2), gradsync
against torch's DDP, DDP with torch's ZeroRedundancyOptimizer (ZeRO-1) and
FSDP2 (``fully_shard`` per block), on CPU ranks (gloo, loopback); parameter
sharding and FSDP2 also in mixed precision (``-bf16``: bfloat16 compute,
float32 pieces and reduction: ``param_dtype`` and ``MixedPrecisionPolicy``),
and parameter sharding paced for memory as it ships on CPU
(``buckets_in_flight=0``: no bucket still reducing when a block's backward
begins) and otherwise (``-1``: ``buckets_in_flight=1``, the default on a
CUDA device; ``-unpaced``: ``buckets_in_flight=None``, no limit;
``-lean``: ``buckets_in_flight=0`` and ``prefetch_units=False``, no block
gathered ahead).

    python benches/torch/sharded_memory.py [--worlds 2 4 8] [--layers 8] [--width 256] [--steps 4]
                                           [--json docs/data/sharded/memory.json]

Each configuration runs in its own processes. A GPT-2-shaped stack
(``--layers`` blocks of attention-sized and MLP-sized linear layers of
``--width``, tied embedding and head) trains with AdamW; after the last step
every rank counts, in bytes:

* ``params``: the parameters it holds (FSDP2: its shards),
* ``grads``: gradient memory: ``.grad`` tensors (FSDP2: its shards, plus
  a block's unsharded gradients and the reduce-scatter inputs it holds until
  a later block's reduce-scatter; DDP's are views of its buckets) plus
  gradsync's runtime buckets and partitions (``Session.memory_bytes``),
* ``optimizer``: the optimizer state it holds;

``params`` counts what holds parameter values: the parameters (released
ones hold nothing), gradsync's pieces where they own their values
(``shard_parameters=True``) and the runtime's parameter-gather buffers
while they are held (``shard_gradients=True`` keeps them between steps).
``peak`` is the largest sum of the three seen at the start of each block's
forward and backward, at the end of the model's forward, after a backward, after an optimizer step,
as each gradient is computed (counting it), in FSDP2's reduce-scatter once its input is filled (counting
it and the unsharded gradients it was filled from) and,
under ``shard_parameters=True``, after every gather of a unit (FSDP2: its
unsharded parameters counted while allocated, and the flat output of an
all-gather until its parameters are copied out), in the steps after the
first (which runs with the model as built); and the median step time (forward,
backward, optimizer step) over the steps after the first. The goal line is ``(grads + optimizer) / world + one
bucket`` of the whole model's float32 bytes; the peak's (parameter
sharding's) ``(params + grads + optimizer) / world + two blocks + one bucket``. Every number is the largest
over the ranks. Storages are counted once (a view and its base are one).
"""

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_world import spawn, write_json  # noqa: E402
IMPLS = ("gradsync-sharded", "gradsync-params", "gradsync-params-1", "gradsync-params-unpaced", "gradsync-params-lean",
         "gradsync-params-bf16", "gradsync", "ddp", "zero1", "fsdp2", "fsdp2-bf16")
CAP_MB = 4


class Block(nn.Module):
    """A transformer block's parameters (attention projections, MLP), as linear layers."""

    def __init__(self, width):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        x = x + self.proj(attn)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Stack(nn.Module):
    """A GPT-2-shaped model: tied embedding and head, ``layers`` blocks."""

    def __init__(self, layers, width, vocab=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln = nn.LayerNorm(width)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.t()


def sharded_stack(rank, world, port, args, tokens=16):
    """This process as ``rank`` of ``world`` (gloo on ``port``, one thread)
    holding the :class:`Stack` of ``args`` (``--layers``, ``--width``,
    ``--vocab``) wrapped with ``shard_parameters=True``, its AdamW and this
    rank's ``tokens`` token ids: ``(wrapper, optimizer, ids)``."""
    import gradsync.torch as gt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    wrapped = gt.DistributedDataParallel(Stack(args.layers, args.width, vocab=args.vocab), shard_parameters=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, tokens), generator=torch.Generator().manual_seed(rank))
    return wrapped, opt, ids


def _bytes(tensors):
    """Bytes of the distinct storages behind ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _state_tensors(optimizer):
    inner = getattr(optimizer, "optim", None) or getattr(optimizer, "inner", None) or optimizer
    return [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


def build(impl, model, world):
    """``model`` under ``impl`` (one of :data:`IMPLS`) and its optimizer."""
    from gradsync.torch import DistributedDataParallel as GradsyncDDP

    if impl.startswith(("gradsync-sharded", "gradsync-params")):
        setting = {"shard_gradients": True} if impl == "gradsync-sharded" else {"shard_parameters": True}
        if impl.endswith("-bf16"):
            setting["param_dtype"] = torch.bfloat16
        if impl.endswith("-lean"):
            setting["buckets_in_flight"] = 0
        if impl.endswith("-1"):
            setting["buckets_in_flight"] = 1
        if impl.endswith("-unpaced"):
            setting["buckets_in_flight"] = None
        if impl.endswith("-lean"):
            setting["prefetch_units"] = False
        wrapped = GradsyncDDP(model, bucket_cap_mb=CAP_MB, **setting)
        return wrapped, wrapped.shard_optimizer(torch.optim.AdamW, lr=1e-4)
    if impl == "gradsync":
        wrapped = GradsyncDDP(model, bucket_cap_mb=CAP_MB)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    if impl == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=True)
        return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    if impl == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, gradient_as_bucket_view=True)
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    if impl in ("fsdp2", "fsdp2-bf16"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        # (-bf16: the same mixed precision as gradsync's param_dtype: bfloat16 compute, float32 reduce.)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if impl.endswith("-bf16") else None,
                                      reduce_dtype=torch.float32 if impl.endswith("-bf16") else None)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    raise ValueError(impl)


def _parameter_memory(model, wrapped):
    """What holds parameter values now: the parameters, gradsync's pieces
    and parameter-gather buffers, FSDP2's unsharded parameters."""
    tensors = list(model.parameters())
    partition = getattr(wrapped, "_partition", None)
    if partition is not None:
        tensors += [piece.tensor for piece in partition.every_held_piece()]
        held = partition.gathering._held if partition.gathering is not None else None
        if held is not None:
            tensors += list(held[2])
        # A prefetch's buffers, in flight on the lane while a block computes.
        prefetching = getattr(partition.residence, "_prefetching", None)
        if prefetching is not None and prefetching[2].buffers is not None:
            tensors += list(prefetching[2].buffers)
    return tensors + _fsdp_parameter_buffers(model)


def _fsdp_states(model):
    """FSDP2's state of every module that has one and its parameter groups
    (torch 2.15 keeps a list of groups per module; earlier releases one)."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        state = state() if state is not None else None
        if state is not None:
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            yield state, [g for g in groups if g is not None]


def _fsdp_unsharded(model):
    """Each FSDP2 parameter's unsharded ``Parameter`` (its storage is empty
    while resharded)."""
    for _, groups in _fsdp_states(model):
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    yield fsdp_param, unsharded


def _fsdp_parameter_buffers(model):
    """FSDP2's parameter memory besides its shards: unsharded parameters
    while allocated and the flat outputs of all-gathers, held until their
    parameters are copied out."""
    tensors = [u for _, u in _fsdp_unsharded(model) if u.untyped_storage().nbytes()]
    for state, groups in _fsdp_states(model):
        tensors += [g._all_gather_result.all_gather_output for g in groups
                    if getattr(g, "_all_gather_result", None) is not None]
        held = getattr(getattr(state, "_comm_ctx", None), "all_gather_state", None)
        if held is not None:
            tensors.append(held.all_gather_result.all_gather_output)
    return tensors


def _fsdp_gradient_buffers(model):
    """FSDP2's gradient memory besides its sharded ``.grad``: the unsharded
    gradients of a block in its backward and the reduce-scatter inputs it
    holds until a later block's reduce-scatter (or the end of backward)."""
    tensors = []
    for fsdp_param, unsharded in _fsdp_unsharded(model):
        tensors += [unsharded.grad, getattr(fsdp_param, "_unsharded_accumulated_grad", None)]
    for state, _ in _fsdp_states(model):
        ctx = getattr(state, "_comm_ctx", None)
        tensors += [held.reduce_scatter_input for held in getattr(ctx, "reduce_scatter_states", ())]
    return tensors


def _gradient_tensors(model, wrapped):
    """Gradient tensors now: ``.grad`` tensors (not views of gradsync's
    buckets, which ``Session.memory_bytes`` counts) and FSDP2's buffers."""
    grads = [p.grad for p in model.parameters()
             if p.grad is not None and getattr(p.grad._base, "_gradsync_step", None) is None]
    partition = getattr(wrapped, "_partition", None)
    if partition is not None:
        grads += [piece.tensor.grad for piece in partition.every_held_piece() if piece.tensor.grad is not None
                  and getattr(piece.tensor.grad._base, "_gradsync_step", None) is None]
    return grads + _fsdp_gradient_buffers(model)


def _runtime_bytes(impl, wrapped):
    """gradsync's runtime buckets and partitions (``Session.memory_bytes``); 0 for the others."""
    return wrapped.memory_bytes if impl.startswith("gradsync") else 0


def _gradient_memory(impl, model, wrapped):
    """Gradient memory now: :func:`_gradient_tensors` and the runtime's buckets and partitions."""
    return _bytes(_gradient_tensors(model, wrapped)) + _runtime_bytes(impl, wrapped)


def _sample_inside_backward(model, sample):
    """Samples where each implementation's gradients take the most memory,
    between the block hooks: as each gradient is computed (the new gradient
    counted; gradsync's buckets filling and in flight are in its runtime's
    bytes), and in FSDP2's reduce-scatter once its input is filled, while
    the block's unsharded gradients are still held."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    leaves = list(model.parameters()) + [u for _, u in _fsdp_unsharded(model)]
    for leaf in leaves:
        if leaf.requires_grad:
            leaf.register_hook(lambda grad: sample(extra=[grad]))
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in
    if getattr(copy_in, "_sampled", False):
        return

    def sampled_copy_in(unsharded_grads, reduce_scatter_input, world_size):
        copy_in(unsharded_grads, reduce_scatter_input, world_size)
        sample(extra=[*unsharded_grads, reduce_scatter_input])

    sampled_copy_in._sampled = True
    _fsdp_collectives.foreach_reduce_scatter_copy_in = sampled_copy_in


def _rank(rank, world, port, impl, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = Stack(args.layers, args.width)
    whole = sum(p.numel() for p in model.parameters()) * 4
    block_bytes = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
    wrapped, optimizer = build(impl, model, world)
    peak = [0]

    def sample(*_, extra=()):
        held = _bytes(_parameter_memory(model, wrapped) + _gradient_tensors(model, wrapped)
                      + _state_tensors(optimizer) + list(extra))
        held += _runtime_bytes(impl, wrapped)
        peak[0] = max(peak[0], held)

    model.register_forward_hook(sample)
    for block in model.blocks:
        # (Registered after wrapping: FSDP2's and gradsync's release hooks ran before these.)
        block.register_forward_pre_hook(sample)
        block.register_full_backward_pre_hook(sample)
    residence = getattr(getattr(wrapped, "_partition", None), "residence", None)
    if hasattr(residence, "after_round"):
        residence.after_round = sample
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps):
        if step == 1:
            # The peak of a step after the first: the first runs with the model as built
            # (whole, under shard_parameters=True too) and builds the optimizer state
            # (and FSDP2's unsharded parameters).
            peak[0] = 0
            _sample_inside_backward(model, sample)
        ids = torch.randint(0, 1024, (args.batch, args.tokens), generator=g)
        began = time.perf_counter()
        optimizer.zero_grad()
        logits = wrapped(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)).backward()
        times.append(time.perf_counter() - began)
        sample()
        began = time.perf_counter()
        optimizer.step()
        times[-1] += time.perf_counter() - began
        sample()
    out = {
        "params": _bytes(_parameter_memory(model, wrapped)),
        "grads": _gradient_memory(impl, model, wrapped),
        "optimizer": _bytes(_state_tensors(optimizer)),
        "peak": peak[0],
        "step_s": statistics.median(times[1:]),
        "whole": whole,
        "block": block_bytes,
    }
    if hasattr(wrapped, "close"):
        wrapped.close()
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run(impl, world, args):
    """One configuration in its own processes; the largest of each number over the ranks."""
    got, dead = spawn(_rank, world, (impl, args), deadline=900)
    if len(got) < world:
        raise RuntimeError(f"ranks {sorted(set(range(world)) - set(got))} did not finish (died: {dead})")
    per_rank = [got[r] for r in range(world)]
    return {k: max(o[k] for o in per_rank) for k in per_rank[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--json", help="write the numbers here (docs/data/sharded/memory.json)")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        for impl in args.impls:
            print(f"world {world}, {impl} ...", flush=True)
            try:
                r = run(impl, world, args)
            except Exception as e:  # a peer that cannot run here is a result, not a crash
                print(f"  failed: {e}", flush=True)
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                rows.append({"world": world, "impl": impl, "error": why})
                continue
            goal = (r["whole"] + 2 * r["whole"]) / world + CAP_MB * (1 << 20)
            # Parameter sharding's: everything / world, two blocks whole, one bucket.
            peak_goal = 4 * r["whole"] / world + 2 * r["block"] + CAP_MB * (1 << 20)
            row = {"world": world, "impl": impl, **r, "goal": goal, "peak_goal": peak_goal}
            rows.append(row)
            mb = 1 << 20
            print(f"  params {r['params'] / mb:.1f} MB, grads {r['grads'] / mb:.1f} MB, optimizer "
                  f"{r['optimizer'] / mb:.1f} MB, grads + optimizer {(r['grads'] + r['optimizer']) / mb:.1f} MB "
                  f"(goal {goal / mb:.1f}), peak in a step {r['peak'] / mb:.1f} MB (ZeRO-3 goal {peak_goal / mb:.1f}), "
                  f"step {r['step_s'] * 1e3:.0f} ms",
                  flush=True)
    if args.json:
        write_json(args.json, rows,
                   model=f"{args.layers} blocks of width {args.width}, tied embedding (vocab 1024); "
                         f"{args.batch} x {args.tokens} tokens per rank, AdamW, bucket cap {CAP_MB} MB")

if __name__ == "__main__":
    main()
