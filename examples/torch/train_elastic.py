"""An elastic data-parallel training loop: ranks die, the others go on, replacements join.

    python -m gradsync.launch --nproc 4 --rejoin examples/torch/train_elastic.py \\
        [--steps 40] [--kill RANK@STEP[:PHASE] ...] [--fixed-global-batch]

(``scripts/train --kill-rank R --kill-step S [--rejoin]`` runs it.) The model
is train_lm.py's small transformer, every block under reentrant
checkpointing. ``--kill 1@10:backward`` makes the process holding rank 1 at
step 10 kill itself with SIGKILL in the middle of backward (phases:
``forward``, ``backward``, ``collective`` (a few milliseconds into the end
of backward, while the runtime waits in its collectives), ``optimizer``
(before the optimizer step), ``between`` (after it: between two steps),
``boundary``; ``gather`` (``--shard``: inside the optimizer step, after
this rank stepped its partition and before the parameters' all-gather);
``raise``: an exception in forward (a bug on one rank: the process
prints its traceback and exits, its heartbeat beating until it is gone);
``freeze`` stops it with SIGSTOP instead: a host gone silent,
its sockets open, found by the liveness monitor; ``stall`` the same after its
optimizer step, so the others wait for it at the next boundary); the
survivors skip that step (``--abort-policy partial``: average it over
themselves), go on at a smaller world, and
with ``--rejoin`` a replacement joins and receives the model, the optimizer
state and the step from a live member. The run ends with the survivors'
parameters compared bit for bit, and rank 0 replaying the same history
(which steps were applied, at which world size) in one process: the
equivalence line is the check (exit status 1 if it fails), and each step's
gradient norm is compared with the replay's (a step summed from batches of
two different steps, or divided by the wrong count, shows there at once).
``--kill-after-join RANK:PHASE``: the process holding RANK dies in PHASE of
the first step after a replacement joined (a loss racing the admission).
``--shard``: sharded gradients and optimizer state (``shard_gradients=True``;
the optimizer, built as usual, steps this rank's partitions once the job
tracks it): each rank also keeps its buddy's partition, and a lost rank's
moves to the survivors. ``--shard-params``: the parameters sharded too
(``shard_parameters=True``, ZeRO-3: each block gathered for its forward
and backward; ``--shard-params whole``: the whole model gathered once per
step), their pieces kept by a buddy as well. ``--adamw``,
``--clip MAX_NORM``: AdamW, and clipping by the global norm (the replay
does the same). ``--read-alone`` (with ``--shard-params``): after each
optimizer step rank 0 alone logs the parameters' norms, as a logging
callback does (each released parameter read from every member's piece
server; after a kill in ``between`` or ``stall``, once the killed rank is
gone, its pieces from its buddy copy), and at the end reads
``model.module.state_dict()`` and evaluates a batch through the wrapper
alone (nanoGPT's ``estimate_loss()``): each is checked against the
parameters every member gathers. ``--ema`` (with ``--shard-params``): an
exponential moving average of the parameters kept sharded
(``ShardedAveragedModel``: each member averages its pieces and its buddy's,
so a lost member's averages live on), updated after every optimizer step;
at the end rank 0 reads it alone and compares it with torch's
``AveragedModel`` over the replay.
"""

import argparse
import copy
import dataclasses
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
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_lm import TOLERANCE, TinyLM, corpus  # noqa: E402

import gradsync  # noqa: E402
import gradsync.torch as gt  # noqa: E402
from gradsync.torch import checkpoint  # noqa: E402
from gradsync.torch.elastic import exit_status  # noqa: E402

# A gentler rate than train_lm.py's: over hundreds of steps, momentum at 0.5
# amplifies the rounding differences between the all-reduce's sum order and
# the replay's past the tolerance (a 3-rank run with no failure drifts too).
LR = 0.05
PHASES = ("forward", "backward", "collective", "optimizer", "gather", "between", "boundary", "freeze", "stall",
          "raise")
# Each applied step's gradient norm may differ from the replay's by rounding only.
NORM_RTOL = 1e-4
STARTED = time.time()  # before importing gradsync (a replacement's start, for the benchmark)


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


def die(report=None, freeze=False):
    """SIGKILL this process (as a crash or an OOM-killer would), or stop it
    (``freeze``: a host gone silent); ``report`` gets the time first."""
    if report:
        tmp = f"{report}.killed.{os.getpid()}.tmp"  # (two ranks may die at once)
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "time": time.time()}, f)
        os.replace(tmp, f"{report}.killed")
    os.kill(os.getpid(), signal.SIGSTOP if freeze else signal.SIGKILL)


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


def grad_norm(model):
    """The total gradient norm (what ``clip_grad_norm_`` would clip)."""
    return torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])).item()


def optimizer_of(args, params):
    """The run's optimizer over ``params``: SGD with momentum, or AdamW with ``--adamw``."""
    if args.adamw:
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


#: ``--ema``: the decay of the moving average.
EMA_DECAY = 0.9


def replay(args, base, data, history, batch, first_world, fixed):
    """One process, the same history: each applied step's gradient is the sum
    of the per-rank mean gradients of the ranks in its sum (their shards, in
    rank order, as the all-reduce adds them) divided by how many they are
    (fixed: by the first world size). Returns the model, each step's
    gradient norm, the parameters' squared norm after each step (``-1``:
    before the first) and (``--ema``) torch's ``AveragedModel`` of it
    updated after every step of the loop, applied or not (else ``None``)."""
    model = copy.deepcopy(base)
    model.recompute = False
    opt = optimizer_of(args, model.parameters())
    norms = {}
    weights = {-1: squared_norm(model.parameters())}
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY)) if args.ema else None
    applied = {step for step, *_ in history}
    if averaged is not None:  # (the loop's steps before the first applied one average the model as built)
        for _ in range(min(applied, default=args.steps)):
            averaged.update_parameters(model)
    for step, _world, _contributors, ranks in history:
        opt.zero_grad()
        for rank in ranks:
            loss_of(model, shard(data, step, rank, batch)).backward()
        divisor = first_world if fixed else len(ranks)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(divisor)
        norms[step] = grad_norm(model)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        weights[step] = squared_norm(model.parameters())
        if averaged is not None:  # (after this step, and after each skipped one up to the next applied)
            later = [s for s in applied if s > step]
            for _ in range((min(later) if later else args.steps) - step):
                averaged.update_parameters(model)
    return model, norms, weights, averaged


@torch.no_grad()
def squared_norm(params):
    """The sum of the parameters' squared norms, as a logging callback adds them."""
    return sum(p.norm().item() ** 2 for p in params)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--kill", type=kill_spec, action="append", default=[], metavar="RANK@STEP[:PHASE]",
                        help="the process holding RANK at STEP kills itself in PHASE (repeatable)")
    parser.add_argument("--kill-after-join", type=lambda t: kill_spec(t.replace(":", "@0:", 1)), metavar="RANK:PHASE",
                        help="the process holding RANK kills itself in PHASE of the first step after a join")
    parser.add_argument("--fixed-global-batch", action="store_true",
                        help="divide by the first world size, not by the ranks present")
    parser.add_argument("--abort-policy", choices=["skip", "partial"], default="skip")
    parser.add_argument("--liveness", type=float, default=1.0, help="seconds of silence before a rank is lost")
    parser.add_argument("--beat", type=float, default=0.1, help="seconds between the liveness monitor's beats")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--width", type=int, default=32, help="model width (a joiner with another is refused)")
    parser.add_argument("--bucket-mb", type=float, default=0.05,
                        help="bucket cap (the default splits this small model into a few buckets, for overlap)")
    parser.add_argument("--no-recompute", action="store_true",
                        help="no activation checkpointing (as torch's DDP needs; the benchmark's side-by-side)")
    parser.add_argument("--buffer", action="store_true",
                        help="give the model a buffer (tokens seen), which DDP's broadcast_buffers sends from rank 0")
    parser.add_argument("--no-broadcast-buffers", action="store_true",
                        help="DDP's broadcast_buffers=False: each rank keeps its own buffers")
    parser.add_argument("--adamw", action="store_true", help="AdamW instead of SGD with momentum")
    parser.add_argument("--clip", type=float, default=0.0, metavar="MAX_NORM",
                        help="clip the gradients by their global norm (model.clip_grad_norm_)")
    parser.add_argument("--shard", action="store_true",
                        help="shard gradients and optimizer state (each partition also kept by a buddy rank)")
    parser.add_argument("--shard-params", nargs="?", const="blocks", choices=["blocks", "whole"],
                        help="shard the parameters too (ZeRO-3; implies --shard): each block gathered when it runs, "
                             "or (whole) the whole model gathered once per step")
    parser.add_argument("--read-alone", action="store_true",
                        help="(with --shard-params) rank 0 alone logs the parameters' norms after each step and "
                             "reads the state dict at the end")
    parser.add_argument("--ema", action="store_true",
                        help="keep a sharded moving average of the parameters (with --shard-params)")
    parser.add_argument("--report", metavar="FILE", help="write this member's outcome to FILE.<member> (JSON)")
    parser.add_argument("--break-at-start", action="store_true",
                        help="membership epoch 0 breaks before the optimizer is tracked (what a member that seems "
                        "silent at start-up on a loaded machine does): the job recovers at its first boundary")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds a collective may wait for its peers (DistributedDataParallel's timeout)")
    parser.add_argument("--start-timeout", type=float, default=300.0, metavar="S",
                        help="seconds the first members wait for one another before going on without those missing")
    parser.add_argument("--pace-ms", type=float, default=0.0, metavar="MS",
                        help="sleep MS after each step: a run that waits for a replacement to start leaves the cores "
                        "to it and covers the wait in fewer steps")
    parser.add_argument("--save-at", type=int, metavar="STEP",
                        help="after STEP's optimizer step, save a sharded checkpoint to --checkpoint (with --shard)")
    parser.add_argument("--checkpoint", metavar="DIR", help="where --save-at saves")
    parser.add_argument("--resume", metavar="DIR",
                        help="load the sharded checkpoint DIR before training and go on from where it was saved")
    parser.add_argument("--data-world", type=int, metavar="N",
                        help="draw each step's batches for N ranks (default: the first world), as the job being "
                             "resumed did")
    args = parser.parse_args()
    args.shard = args.shard or args.shard_params is not None
    if (args.save_at is not None or args.resume) and not args.shard:
        parser.error("--save-at and --resume use gradsync.torch.checkpoint, which saves sharded models: add --shard")
    if args.read_alone and (args.shard_params is None or not args.report):
        parser.error("--read-alone reads released parameters: add --shard-params (and --report, whose kill marks it "
                     "waits for)")
    if args.ema and args.shard_params is None:
        parser.error("--ema keeps a ShardedAveragedModel, which averages sharded parameters: add --shard-params")
    if args.save_at is not None and not args.checkpoint:
        parser.error("--save-at needs --checkpoint DIR")
    try:
        elastic, base, data, model, opt, averaged = build(args)
        loss, applied_at, norms, logged = train(args, elastic, model, opt, averaged, data)
    except gradsync.MembershipError as e:
        # The job went on without this process (or cannot go on at all).
        print(f"member {os.environ.get('GRADSYNC_MEMBER')}: left the job ({e.kind}): {e}", file=sys.stderr, flush=True)
        sys.exit(exit_status(e))
    if not elastic.is_member:
        print(f"member {elastic.member}: the job ended before it was admitted", flush=True)
        return
    sys.exit(0 if check(args, elastic, model, opt, averaged, base, data, loss, applied_at, norms, logged) else 1)


def build(args):
    """This process's membership, the model (and its replay's start), the
    data, the optimizer and (``--ema``) the sharded average."""
    torch.set_num_threads(1)
    elastic = gt.Elastic(liveness_s=args.liveness, fixed_global_batch=args.fixed_global_batch, beat_s=args.beat,
                         start_timeout_s=args.start_timeout)
    vocab, dim, heads, blocks, context = 32, args.width, 2, 2, 16
    torch.manual_seed(args.seed)
    base = TinyLM(vocab, dim, heads, blocks, context, recompute=not args.no_recompute)
    if args.buffer:
        base.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))
        base.register_forward_pre_hook(lambda m, inputs: m.tokens_seen.add_(inputs[0].numel()) and None)
    data = corpus(vocab, args.steps, args.batch * (args.data_world or elastic.first_world), context, args.seed)
    model = gt.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb, elastic=elastic,
                                       abort_policy=args.abort_policy,
                                       broadcast_buffers=not args.no_broadcast_buffers, shard_gradients=args.shard,
                                       shard_parameters={None: False, "blocks": True, "whole": []}[args.shard_params],
                                       timeout=args.timeout)
    # (Sharded, the same optimizer steps this rank's partitions once the job tracks it.)
    opt = optimizer_of(args, model.parameters())
    if args.break_at_start and not elastic.joining:
        if elastic.rank == 0:
            # What a monitor that accused a peer writes (the runtime's record of a broken epoch).
            elastic.store.add(f"{elastic.job}/membership/broken/{elastic.epoch}", 1)
        while elastic.membership.broken is None or elastic.membership.broken < elastic.epoch:
            time.sleep(0.01)
    elastic.track(model=model, optimizer=opt)
    averaged = gt.ShardedAveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY)) if args.ema else None
    if args.resume:
        checkpoint.load(args.resume, model, opt)
        print(f"member {elastic.member}: resumed from {args.resume} at step {elastic.step}", flush=True)
    if elastic.rank == 0 and not elastic.joining:
        print(f"gradsync train_elastic: {elastic.world} ranks, {args.steps} steps, batch {args.batch} per rank, "
              f"kills {[f'{r}@{s}:{p}' for r, s, p in args.kill] or 'none'}", flush=True)
    return elastic, base, data, model, opt, averaged


def train(args, elastic, model, opt, averaged, data):
    """The loop, with the kills asked for; returns the last loss, when
    each step this process saw applied was applied (wall clock), each
    applied step's gradient norm and (``--read-alone``) the parameters'
    norms rank 0 logged alone after each step."""
    kills = {(rank, step): phase for rank, step, phase in args.kill}
    after_join = {"step": None}

    def at(phase, step):
        if args.kill_after_join and step == after_join["step"]:
            rank, _, when = args.kill_after_join
            return elastic.rank == rank and when == phase
        return kills.get((elastic.rank, step)) == phase

    # Mid-backward: a gradient hook of the first block (backward reaches it late).
    killing = {"backward": False, "gather": False}
    model.module.blocks[0].mlp[0].weight.register_hook(lambda g: die(args.report) if killing["backward"] else g)
    if args.shard:  # after this rank stepped its partition, before the parameters' all-gather
        opt.register_step_post_hook(lambda *_: die(args.report) if killing["gather"] else None)
    began = time.perf_counter()
    applied_at = {}
    norms = {}
    logged = {}  # --read-alone: step -> the norms rank 0 logged alone
    loss = None
    for step in elastic.steps(args.steps):
        for event in elastic.changes():
            print(f"member {elastic.member}: step {event.step}: {event.kind} {event.lost or event.joined}; "
                  f"now rank {event.rank} of {event.world} ({event.seconds * 1e3:.0f} ms)", flush=True)
            if event.kind == "joined" and after_join["step"] is None and not elastic.joining:
                after_join["step"] = step
        if at("boundary", step) or at("freeze", step):
            die(args.report, freeze=at("freeze", step))
        batch = shard(data, step, elastic.rank, args.batch)
        if at("forward", step):
            die(args.report)
        if at("raise", step):
            raise RuntimeError(f"member {elastic.member}: a bug in this rank's forward at step {step}")
        loss = loss_of(model, batch)
        killing["backward"] = at("backward", step)
        if at("collective", step):
            threading.Timer(0.005, die, (args.report,)).start()
        loss.backward()
        if elastic.history and elastic.history[-1][0] == step:
            applied_at[step] = time.time()
            # Sharded: the global norm is a collective (a loss during it may drop the step).
            if args.clip:
                norm = model.clip_grad_norm_(args.clip).item()
            else:
                norm = model.clip_grad_norm_(math.inf).item() if args.shard else grad_norm(model)
            if elastic.history and elastic.history[-1][0] == step:
                norms[step] = norm
            else:
                del applied_at[step]
        if at("optimizer", step):
            die(args.report)
        killing["gather"] = at("gather", step)
        opt.step()
        opt.zero_grad()
        if averaged is not None:
            averaged.update_parameters(model)
        if step == args.save_at:
            checkpoint.save(args.checkpoint, model, opt)
        if args.pace_ms:
            time.sleep(args.pace_ms / 1000)
        if at("stall", step):  # silent after its step: the others wait for it at the next boundary
            die(args.report, freeze=True)
        if at("between", step):
            die(args.report)
        if args.read_alone and elastic.rank == 0:
            killed = [r for r, s, p in args.kill if s == step and p in ("between", "stall")]
            if killed:  # (read once it is gone or silent: its pieces come from its buddy copy)
                while not os.path.exists(f"{args.report}.killed"):
                    time.sleep(0.01)
                time.sleep(0.1)
            logged[step] = squared_norm(model.parameters())  # a logging callback's, on this rank alone
        if elastic.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step + 1:>4}/{args.steps}  loss {loss.item():.4f}  world {elastic.world}  "
                  f"{model.last_report.outcome if model.last_report else '-'}  "
                  f"{(time.perf_counter() - began) * 1e3:7.0f} ms", flush=True)
    return loss, applied_at, norms, logged


def memory(model, opt):
    """Bytes this rank holds of averaged gradients (the runtime's buckets or
    partitions), of optimizer state (sharded: its partitions and its
    buddy's) and of parameters between steps (``--shard-params``: its
    pieces and its buddy's)."""
    state = sum(v.numel() * v.element_size() for entry in opt.state.values() for v in entry.values()
                if torch.is_tensor(v))
    return {"runtime": model.memory_bytes, "optimizer": state, "parameters": model.parameter_bytes}


def check(args, elastic, model, opt, averaged, base, data, loss, applied_at, norms, logged):
    """Every member puts its digest into the store; rank 0 compares them and
    replays the history. Returns whether the run is exact."""
    alone, held_out = None, shard(data, 0, 0, args.batch)
    if args.read_alone and elastic.rank == 0:  # (the others wait for it in whole_parameters())
        names = [n for n, _ in model.module.named_parameters()]
        state = model.module.state_dict()
        alone = torch.cat([state[n].flatten() for n in names])
        with torch.no_grad():  # nanoGPT's estimate_loss() on the master process: through the wrapper, alone
            evaluated_alone = loss_of(model, held_out).item()
    ema = None
    if averaged is not None:
        with averaged.applied():  # (every member enters; rank 0 reads the average alone)
            if elastic.rank == 0:
                state = model.module.state_dict()
                ema = torch.cat([state[n].flatten() for n, _ in model.module.named_parameters()])
    with model.whole_parameters():  # (sharded parameters: gathered on every member; else nothing to do)
        mine = digest(model.module)
        trained = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        norm_now = squared_norm(model.module.parameters())
        with torch.no_grad():
            evaluated = loss_of(model.module, held_out).item()
    elastic.store.set(f"{elastic.job}/final/{elastic.epoch}/{elastic.rank}", mine)
    outcome = {"member": elastic.member, "rank": elastic.rank, "world": elastic.world, "epoch": elastic.epoch,
               "applied": elastic.applied, "history": elastic.history, "digest": mine, "started": STARTED,
               "applied_at": applied_at, "events": [dataclasses.asdict(e) for e in elastic.events],
               "memory": memory(model, opt)}
    ok = True
    if elastic.rank == 0:
        keys = [f"{elastic.job}/final/{elastic.epoch}/{r}" for r in range(elastic.world)]
        elastic.store.wait(keys)
        digests = [elastic.store.get(k).decode() for k in keys]
        identical = len(set(digests)) == 1
        reference, replayed, weights, ref_average = replay(args, base, data, elastic.history, args.batch,
                                                           elastic.first_world, args.fixed_global_batch)
        diff = (torch.cat([p.detach().flatten() for p in reference.parameters()]) - trained).abs().max().item()
        worlds = [len(ranks) for *_, ranks in elastic.history]
        changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
        # Steps this process applied and the replay has: their gradient norms must agree.
        compared = sorted(set(norms) & set(replayed))
        off = [s for s in compared if abs(norms[s] - replayed[s]) > NORM_RTOL * max(replayed[s], 1e-12)]
        unknown = sorted(set(norms) - set(replayed))  # applied here, yet not in the history: never
        ok = (identical and loss is not None and math.isfinite(loss.item()) and diff <= TOLERANCE
              and not off and not unknown)
        print(f"replicas: {elastic.world} members, parameters {'bitwise identical' if identical else 'DIFFER'} "
              f"(sha256 {digests[0][:16]})")
        print(f"history: {len(worlds)} steps applied, {args.steps - len(worlds)} skipped; world "
              + " -> ".join(map(str, changes)))
        print(f"gradient norms: {len(compared)} steps compared with the replay, "
              + (f"steps {off[:5]} differ (rtol {NORM_RTOL:.0e})" if off else "all agree")
              + (f"; steps {unknown[:5]} applied here are not in the history" if unknown else ""))
        print(f"equivalence: max |param - replay| = {diff:.2e} (tolerance {TOLERANCE:.0e}) "
              f"{'OK' if ok else 'FAILED'}", flush=True)
        outcome.update(identical=identical, diff=diff, ok=ok, norms_off=off, norms_compared=len(compared))
        if ema is not None:
            want = torch.cat([p.detach().flatten() for p in ref_average.module.parameters()])
            ema_diff = (ema - want).abs().max().item()
            counted = int(averaged.n_averaged) == int(ref_average.n_averaged)
            ok = outcome["ok"] = ok and ema_diff <= TOLERANCE and counted
            outcome.update(ema_diff=ema_diff, ema_counted=counted)
            print(f"moving average: max |average - AveragedModel over the replay| = {ema_diff:.2e} after "
                  f"{int(averaged.n_averaged)} updates ({'the same count' if counted else 'ANOTHER count'})",
                  flush=True)
        if alone is not None:
            # Each step's log against the replay after the last step applied by then (a skipped one changes nothing).
            applied = sorted(weights)
            want = {s: weights[max(a for a in applied if a <= s)] for s in logged}
            apart = max((abs(logged[s] - want[s]) / want[s] for s in logged), default=0.0)
            last = logged[max(logged)] if logged else None
            outcome.update(read_alone_diff=(alone - trained).abs().max().item(), logged_steps=len(logged),
                           logged_apart=apart, logged_last=last, norm_now=norm_now,
                           evaluated_alone=evaluated_alone, evaluated=evaluated)
            print(f"read alone: state dict {outcome['read_alone_diff']:.1e} from the gathered parameters; norms "
                  f"logged at {len(logged)} steps, {apart:.1e} from the replay's (relative), the last "
                  f"{'equal to' if last == norm_now else 'DIFFERENT from'} the gathered parameters'; an "
                  f"evaluation alone {evaluated_alone:.6f} (gathered: {evaluated:.6f})", flush=True)
    if args.report:  # written whole, then renamed: a reader never sees half of it
        with open(f"{args.report}.{elastic.member}.tmp", "w") as f:
            json.dump(outcome, f)
        os.replace(f"{args.report}.{elastic.member}.tmp", f"{args.report}.{elastic.member}")
    elastic.close()
    return ok


if __name__ == "__main__":
    main()
