"""Data-parallel training of a small transformer language model with gradsync, in Paddle.

    .venv-paddle/bin/python examples/paddle/train_lm.py [--steps 30] [--impl gradsync|paddle] [--ranks 2]
    .venv-paddle/bin/python -m paddle.distributed.launch --nproc_per_node 2 examples/paddle/train_lm.py

Two CPU ranks (gloo), started by ``paddle.distributed.spawn``, or by
``paddle.distributed.launch`` when the script runs under it. Every
transformer block runs under ``paddle.distributed.fleet.utils.recompute``
(Paddle's default, ``use_reentrant=True``), and the output head is the
embedding matrix itself (tied). With ``--impl paddle`` (``paddle.DataParallel``)
the first backward raises "parameter ... has been ready before" (Paddle
3.3.1); the example prints it and exits. With gradsync (default) the run
is exact.
It prints the loss every few steps and ends with a replica check and an
equivalence check against one process trained on every rank's batch (exit
status 1 if either fails).
"""

import argparse
import os
import sys

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute

VOCAB, DIM, HEADS, BLOCKS, SEQ, ROWS = 96, 64, 4, 3, 16, 4
LR = 0.1
# Same data and update as one process, sums in another order: rounding only.
TOLERANCE = 1e-4


class Block(nn.Layer):
    """Pre-norm self-attention and MLP, with residuals."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiHeadAttention(DIM, HEADS)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Layer):
    """A causal LM whose head is its embedding (tied), every block recomputed."""

    def __init__(self):
        super().__init__()
        paddle.seed(1234)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = self.create_parameter([SEQ, DIM], default_initializer=nn.initializer.Normal(std=0.02))
        self.blocks = nn.LayerList([Block() for _ in range(BLOCKS)])
        self.ln = nn.LayerNorm(DIM)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos
        mask = paddle.tril(paddle.ones([SEQ, SEQ], dtype="bool"))
        for block in self.blocks:
            x = recompute(block, x, mask)
        return paddle.matmul(self.ln(x), self.embed.weight, transpose_y=True)


def batch(step, rank):
    """Sequences that count up modulo VOCAB from a random start: learnable."""
    starts = np.random.RandomState(10_000 * step + rank).randint(0, VOCAB, size=(ROWS, 1))
    seq = (starts + np.arange(SEQ + 1)) % VOCAB
    return paddle.to_tensor(seq[:, :-1].astype("int64")), paddle.to_tensor(seq[:, 1:].astype("int64"))


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).reshape([-1, VOCAB]), targets.reshape([-1]))


def flat(model):
    return np.concatenate([p.numpy().ravel() for p in model.parameters()])


def rank_main(args):
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    net = TinyLM()
    if args.impl == "gradsync":
        import gradsync.paddle

        model = gradsync.paddle.DataParallel(net)
    else:
        model = paddle.DataParallel(net)
    opt = paddle.optimizer.SGD(learning_rate=LR, parameters=net.parameters())
    for step in range(args.steps):
        tokens, targets = batch(step, rank)
        loss = loss_of(model, tokens, targets)
        try:
            loss.backward()
        except Exception as e:
            # Paddle's DataParallel here; its group is left mid-collective,
            # so leave at once instead of waiting on it.
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            said = next((ln for ln in lines if "ready before" in ln or ln.startswith(("RuntimeError", "ValueError"))),
                        lines[0] if lines else type(e).__name__)
            print(f"rank {rank}, step {step}: {said[:240]}", flush=True)
            os._exit(1)
        opt.step()
        opt.clear_grad()
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1:4d}  loss {float(loss):.4f}", flush=True)
    mine = paddle.to_tensor(flat(net))
    gathered = []
    dist.all_gather(gathered, mine)
    spread = max(float(paddle.abs(g - gathered[0]).max()) for g in gathered)
    ok = True
    if rank == 0:
        print(f"replicas: max |param_r - param_0| = {spread:.1e}")
        ok &= spread <= TOLERANCE
        # The reference: one process, every rank's batch each step, mean of the ranks' losses.
        ref = TinyLM()
        ref_opt = paddle.optimizer.SGD(learning_rate=LR, parameters=ref.parameters())
        for step in range(args.steps):
            total = sum(loss_of(ref, *batch(step, r)) for r in range(world)) / world
            total.backward()
            ref_opt.step()
            ref_opt.clear_grad()
        diff = float(np.abs(flat(ref) - flat(net)).max())
        verdict = "OK" if diff <= TOLERANCE else "FAILED"
        ok &= diff <= TOLERANCE
        print(f"equivalence: max |param - reference| = {diff:.2e} (tolerance {TOLERANCE:g}) {verdict}", flush=True)
    if args.impl == "gradsync":
        model.close()
    if not ok:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--impl", choices=["gradsync", "paddle"], default="gradsync")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    if "PADDLE_TRAINER_ID" in os.environ:
        # Started by paddle.distributed.launch: this process is one rank.
        rank_main(args)
    else:
        dist.spawn(rank_main, args=(args,), nprocs=args.ranks, backend="gloo")


if __name__ == "__main__":
    main()
