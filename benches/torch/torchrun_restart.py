"""The same model under torchrun's own recovery, for elastic_recovery.py's comparison.

    torchrun --nproc-per-node W --max-restarts 1 benches/torch/torchrun_restart.py --times DIR [--steps N]

train_elastic.py's transformer under torch's DDP (no recompute: DDP refuses
the tied embedding under reentrant checkpointing), with what a torchrun job
needs to survive a failure: rank 0 checkpoints the model and the optimizer
after every step (the most favourable case: no step is lost) and every rank
loads the checkpoint when it starts. In the first attempt rank 1 SIGKILLs
itself mid-backward at ``--kill-step``; torchrun's agent then stops every
worker and starts them all again. Each rank appends ``attempt step time``
lines to ``DIR/rank<r>`` when a step is applied, and the killed rank writes
``DIR/killed`` first.
"""

import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "torch"))
from train_elastic import LR, loss_of, shard  # noqa: E402
from train_lm import TinyLM, corpus  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--times", required=True, help="directory for the step times")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's store keeps the first attempt's gloo addresses under the
    # same keys: without a prefix per attempt the restarted workers connect
    # to the dead ones' ports (torch 2.15, static and c10d rendezvous alike).
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", agent_store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(7)
    model = TinyLM(32, 32, 2, 2, 16, recompute=False)
    data = corpus(32, args.steps, args.batch * world, 16, 7)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    checkpoint = os.path.join(args.times, "checkpoint.pt")
    start = 0
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, weights_only=True)
        ddp.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    killing = attempt == 0 and rank == 1
    model.blocks[0].mlp[0].weight.register_hook(
        lambda g: (open(os.path.join(args.times, "killed"), "w").write(str(time.time())),
                   os.kill(os.getpid(), signal.SIGKILL)) if killing and step == args.kill_step else g)
    with open(os.path.join(args.times, f"rank{rank}"), "a") as log:
        for step in range(start, args.steps):
            loss_of(ddp, shard(data, step, rank, args.batch)).backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                tmp = checkpoint + ".tmp"
                torch.save({"model": ddp.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp)
                os.replace(tmp, checkpoint)
            log.write(f"{attempt} {step} {time.time()}\n")
            log.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
