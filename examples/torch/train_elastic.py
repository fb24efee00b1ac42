"""An elastic data-parallel training loop: ranks die, the others go on, replacements join.

    python -m gradsync.launch --nproc 4 --rejoin examples/torch/train_elastic.py \\
        [--steps 40] [--kill RANK@STEP[:PHASE] ...] [--fixed-global-batch]

(``scripts/train --kill-rank R --kill-step S [--rejoin]`` runs it.) The model
is train_lm.py's small transformer, every block under reentrant
checkpointing. ``--kill 1@10:backward`` makes the process holding rank 1 at
step 10 kill itself with SIGKILL in the middle of backward (phases:
``forward``, ``backward``, ``collective`` (a few milliseconds into the end
of backward, while the runtime waits in its collectives), ``optimizer``,
``boundary``); the survivors skip that step, go on at a smaller world, and
with ``--rejoin`` a replacement joins and receives the model, the optimizer
state and the step from a live member. The run ends with the survivors'
parameters compared bit for bit, and rank 0 replaying the same history
(which steps were applied, at which world size) in one process: the
equivalence line is the check (exit status 1 if it fails).
"""

import argparse
import copy
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import TOLERANCE, TinyLM, corpus  # noqa: E402

import gradsync.torch as gt  # noqa: E402

# A gentler rate than train_lm.py's: over hundreds of steps, momentum at 0.5
# amplifies the rounding differences between the all-reduce's sum order and
# the replay's past the tolerance (a 3-rank run with no failure drifts too).
LR = 0.05
PHASES = ("forward", "backward", "collective", "optimizer", "boundary")


def kill_spec(text):
    """``RANK@STEP[:PHASE]`` -> ``(rank, step, phase)``."""
    try:
        where, _, phase = text.partition(":")
        rank, step = (int(x) for x in where.split("@"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use RANK@STEP or RANK@STEP:PHASE") from None
    phase = phase or "backward"
    if phase not in PHASES:
        raise argparse.ArgumentTypeError(f"phase {phase!r}: one of {', '.join(PHASES)}")
    return rank, step, phase


def die():
    """SIGKILL this process (as a crash or an OOM-killer would)."""
    os.kill(os.getpid(), signal.SIGKILL)


def digest(model):
    """SHA-256 of every parameter's bytes (equal digests: bitwise equal replicas)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard(data, step, rank, batch):
    return data[step, rank * batch : (rank + 1) * batch]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def replay(base, data, history, batch, first_world, fixed):
    """One process, the same history: each applied step's gradient is the sum
    of the per-rank mean gradients of the ranks present (their shards, in
    rank order, as the all-reduce adds them) divided by the ranks present
    (fixed: by the first world size)."""
    model = copy.deepcopy(base)
    model.recompute = False
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step, world, _contributors in history:
        opt.zero_grad()
        for rank in range(world):
            loss_of(model, shard(data, step, rank, batch)).backward()
        divisor = first_world if fixed else world
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
        opt.step()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--kill", type=kill_spec, action="append", default=[], metavar="RANK@STEP[:PHASE]",
                        help="the process holding RANK at STEP kills itself in PHASE (repeatable)")
    parser.add_argument("--fixed-global-batch", action="store_true",
                        help="divide by the first world size, not by the ranks present")
    parser.add_argument("--abort-policy", choices=["skip", "partial"], default="skip")
    parser.add_argument("--liveness", type=float, default=1.0, help="seconds of silence before a rank is lost")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--report", metavar="FILE", help="write this member's outcome as JSON (tests read it)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    elastic = gt.Elastic(liveness_s=args.liveness, fixed_global_batch=args.fixed_global_batch)
    vocab, dim, heads, blocks, context = 32, 32, 2, 2, 16
    torch.manual_seed(args.seed)
    base = TinyLM(vocab, dim, heads, blocks, context)
    data = corpus(vocab, args.steps, args.batch * elastic.first_world, context, args.seed)
    model = gt.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.05, elastic=elastic,
                                       abort_policy=args.abort_policy)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    elastic.track(model=model, optimizer=opt)
    kills = {(rank, step): phase for rank, step, phase in args.kill}
    if elastic.rank == 0 and not elastic.joining:
        print(f"gradsync train_elastic: {elastic.world} ranks, {args.steps} steps, batch {args.batch} per rank, "
              f"kills {sorted(kills.items()) or 'none'}", flush=True)

    def at(phase, step):
        return kills.get((elastic.rank, step)) == phase

    # Mid-backward: a gradient hook of the first block (backward reaches it late).
    victim = model.module.blocks[0].mlp[0].weight
    killing = {"backward": False}
    victim.register_hook(lambda g: die() if killing["backward"] else g)
    began = time.perf_counter()
    for step in elastic.steps(args.steps):
        for event in elastic.changes():
            print(f"member {elastic.member}: step {event.step}: {event.kind} {event.lost or event.joined}; "
                  f"now rank {event.rank} of {event.world} ({event.seconds * 1e3:.0f} ms)", flush=True)
        if at("boundary", step):
            die()
        batch = shard(data, step, elastic.rank, args.batch)
        if at("forward", step):
            die()
        loss = loss_of(model, batch)
        killing["backward"] = at("backward", step)
        if at("collective", step):
            threading.Timer(0.005, die).start()
        loss.backward()
        if at("optimizer", step):
            die()
        opt.step()
        opt.zero_grad()
        if elastic.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            r = model.last_report
            print(f"step {step + 1:>4}/{args.steps}  loss {loss.item():.4f}  world {elastic.world}  "
                  f"{r.outcome if r else '-'}  {(time.perf_counter() - began) * 1e3:7.0f} ms", flush=True)

    if not elastic.is_member:
        print(f"member {elastic.member}: the job ended before it was admitted", flush=True)
        return
    # Every member: its digest into the store; rank 0 compares and replays.
    mine = digest(model.module)
    elastic.store.set(f"{elastic.job}/final/{elastic.epoch}/{elastic.rank}", mine)
    outcome = {"member": elastic.member, "rank": elastic.rank, "world": elastic.world, "epoch": elastic.epoch,
               "applied": elastic.applied, "history": elastic.history, "digest": mine,
               "events": [e.__dict__ for e in elastic.events]}
    ok = True
    if elastic.rank == 0:
        keys = [f"{elastic.job}/final/{elastic.epoch}/{r}" for r in range(elastic.world)]
        elastic.store.wait(keys)
        digests = [elastic.store.get(k).decode() for k in keys]
        identical = len(set(digests)) == 1
        reference = replay(base, data, elastic.history, args.batch, elastic.first_world, args.fixed_global_batch)
        trained = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        diff = (torch.cat([p.detach().flatten() for p in reference.parameters()]) - trained).abs().max().item()
        applied = len(elastic.history)
        worlds = [w for _, w, _ in elastic.history]
        changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
        ok = identical and math.isfinite(loss.item()) and diff <= TOLERANCE
        print(f"replicas: {elastic.world} members, parameters {'bitwise identical' if identical else 'DIFFER'} "
              f"(sha256 {digests[0][:16]})")
        print(f"history: {applied} steps applied, {args.steps - applied} skipped; world "
              + " -> ".join(map(str, changes)))
        print(f"equivalence: max |param - replay| = {diff:.2e} (tolerance {TOLERANCE:.0e}) "
              f"{'OK' if ok else 'FAILED'}", flush=True)
        outcome.update(identical=identical, diff=diff, ok=ok)
    if args.report:
        with open(f"{args.report}.{elastic.member}", "w") as f:
            json.dump(outcome, f)
    elastic.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
