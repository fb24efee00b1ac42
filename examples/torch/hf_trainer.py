"""HF Trainer with gradient checkpointing on 2 CPU ranks: torch's DDP refuses it, gradsync trains it.

Run it with torchrun (``scripts/hf-trainer`` does)::

    torchrun --nproc-per-node 2 examples/torch/hf_trainer.py              # gradsync
    torchrun --nproc-per-node 2 examples/torch/hf_trainer.py --impl ddp   # torch's DDP

``--device cuda`` runs the same on one GPU per rank (NCCL; gradsync's
buckets on the GPU).

A small GPT-2 (random init from a config: nothing is downloaded) trains with
``transformers.Trainer``, ``gradient_checkpointing=True`` (reentrant, so
checkpointed blocks are invisible to DDP's graph traversal) and
``ddp_find_unused_parameters=True``: the setting behind many public reports
of "Expected to mark a variable ready only once". The training script is the
one a Trainer user writes; the only gradsync line is
``gradsync.torch.replace_ddp()``, after which the ``DistributedDataParallel``
that Accelerate builds inside the Trainer is gradsync's (``--shard``:
``replace_ddp(shard_gradients=True)``, gradients and optimizer state sharded).

At the end, rank 0 replays the run in one process: the same model, every
rank's batch of every step (recorded by the data collator), the same
optimizer, gradient clipping and learning rate, and prints an equivalence line.
"""

import argparse
import contextlib
import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist

TOLERANCE = 1e-4


def parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["gradsync", "ddp"], default="gradsync")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (constant)")
    parser.add_argument("--checkpointing", choices=["reentrant", "non-reentrant", "none"], default="reentrant",
                        help="gradient checkpointing of the GPT-2 blocks (torch's DDP runs only 'none' here)")
    parser.add_argument("--adamw", action="store_true", help="AdamW (lr 1e-3) instead of SGD")
    parser.add_argument("--save", action="store_true",
                        help="save checkpoints half way and at the last step (rank 0 compares the last one's "
                        "optimizer state with the replay's)")
    parser.add_argument("--shard", action="store_true",
                        help="gradsync sharded (ZeRO-2): replace_ddp(shard_gradients=True); nothing else changes")
    parser.add_argument("--shard-parameters", action="store_true",
                        help="gradsync with the parameters sharded too (ZeRO-3): replace_ddp(shard_parameters=True); "
                        "the script reads the parameters after training inside model.whole_parameters()")
    parser.add_argument("--lean", action="store_true",
                        help="with --shard-parameters: paced for the least memory (buckets_in_flight=0, "
                             "prefetch_units=False)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank, NCCL (gradsync's buckets on the GPU)")
    return parser.parse_args()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=96, n_positions=64, n_embd=64, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # deterministic, so one process can replay it
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences with a learnable rule (each token is the previous plus one)."""

    def __init__(self, n, seq, vocab=96):
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (starts + torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder:
    """The data collator: stacks a batch and remembers it for the replay."""

    def __init__(self):
        self.batches = []

    def __call__(self, items):
        out = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        self.batches.append(out["input_ids"].clone().cpu())
        return out


def replay(model, batches_by_rank, args, lr, max_grad_norm, device, decay=()):
    """One process, every rank's batch of every step at once (``decay``:
    the names the Trainer puts in its first parameter group, so the
    optimizer state is numbered as the Trainer's is)."""
    reference = copy.deepcopy(model).to(device)
    reference.train()
    if args.adamw:
        named = list(reference.named_parameters())
        groups = [{"params": [p for n, p in named if n in decay]}, {"params": [p for n, p in named if n not in decay]}]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(reference.parameters(), lr=lr)
    losses = []
    for step in range(args.steps):
        ids = torch.cat([batches[step] for batches in batches_by_rank]).to(device)
        opt.zero_grad()
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return reference, losses, opt


def main():
    args = parse()
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.impl == "gradsync":
        import gradsync.torch

        # The one line: Accelerate's DDP becomes gradsync's (sharded: the Trainer's optimizer then steps this
        # rank's partition, converted at its first step, and its checkpoints hold the whole state).
        pacing = {"buckets_in_flight": 0, "prefetch_units": False} if args.lean else {}
        gradsync.torch.replace_ddp(shard_gradients=args.shard, shard_parameters=args.shard_parameters, **pacing)

    model = tiny_gpt2()
    initial = copy.deepcopy(model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Tokens(args.steps * args.batch * world, args.seq)
    recorder = Recorder()
    lr, max_grad_norm = (1e-3 if args.adamw else args.lr), 1.0
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            gradient_checkpointing=args.checkpointing != "none",
            gradient_checkpointing_kwargs={"use_reentrant": args.checkpointing == "reentrant"},
            ddp_find_unused_parameters=True,
            ddp_backend="gloo" if args.device == "cpu" else "nccl",
            use_cpu=args.device == "cpu",
            optim="adamw_torch" if args.adamw else "sgd",
            learning_rate=lr,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=max_grad_norm,
            logging_steps=args.log_every,
            save_strategy="steps" if args.save else "no",
            save_steps=max(args.steps // 2, 1),  # (a save mid-run, training on after it, and one at the end)
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data, data_collator=recorder)
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            result = trainer.train()
        except Exception as e:  # torch's DDP: the failure is the result
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"rank {rank}: {args.impl} failed: {type(e).__name__}: {first}", flush=True)
            sys.exit(1)
        saved = saved_model = None
        if args.save and rank == 0:
            last = os.path.join(out, f"checkpoint-{args.steps}")
            saved = torch.load(os.path.join(last, "optimizer.pt"), weights_only=False)
            from safetensors.torch import load_file

            saved_model = load_file(os.path.join(last, "model.safetensors"))
    wrapped = trainer.model_wrapped
    kind = f"{type(wrapped).__module__}.{type(wrapped).__name__}"
    if rank == 0:
        print(f"{args.impl}: Trainer wrapped the model in {kind}", flush=True)
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']:4d}  loss {entry['loss']:.4f}", flush=True)
        print(f"trained {result.global_step} steps, final train loss {result.training_loss:.4f}", flush=True)
    # The trained parameters: with sharded parameters every rank gathers them whole to read them (a collective).
    with getattr(wrapped, "whole_parameters", contextlib.nullcontext)():
        finals = [p.detach().clone() for p in model.parameters()]
        named = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Every rank holds the same parameters.
    flat = torch.cat([p.reshape(-1) for p in finals])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    batches = [None] * world
    dist.all_gather_object(batches, recorder.batches[: args.steps])
    if rank == 0:
        spread = max((g - gathered[0]).abs().max().item() for g in gathered)
        print(f"replicas: max |param_r - param_0| = {spread:.1e}", flush=True)
        decay = set(trainer.get_decay_parameter_names(model))
        reference, losses, reference_opt = replay(initial, batches, args, lr, max_grad_norm, flat.device, decay)
        diff = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), finals))
        print(f"reference (one process, every rank's batches): loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        print("reference losses:", " ".join(f"{x:.4f}" for x in losses), flush=True)
        state_ok = True
        if saved is not None:
            # The checkpoint's optimizer state, whole (torch's format), against the replay's.
            want = reference_opt.state_dict()["state"]
            off = max(((saved["state"][n][k] - v).abs().max().item() for n in want for k, v in want[n].items()
                       if torch.is_tensor(v) and v.dim() > 0), default=0.0)
            state_ok = sorted(saved["state"]) == sorted(want) and off <= TOLERANCE
            print(f"checkpointed optimizer state: {len(saved['state'])} parameters, max |state - reference| = "
                  f"{off:.2e}", flush=True)
        if saved_model is not None:
            # The checkpoint's weights are the trained parameters, whole (tied ones saved once).
            off = max((saved_model[n] - named[n]).abs().max().item() for n in saved_model)
            state_ok = state_ok and sorted(saved_model) == sorted(n for n in named if n in saved_model) and off == 0.0
            print(f"checkpointed model: {len(saved_model)} tensors, max |saved - param| = {off:.1e}", flush=True)
        verdict = "OK" if diff <= TOLERANCE and spread == 0.0 and state_ok else "MISMATCH"
        print(f"equivalence: max |param - reference| = {diff:.2e} (tolerance {TOLERANCE:.0e}) {verdict}", flush=True)
        if verdict != "OK":
            sys.exit(2)


if __name__ == "__main__":
    main()
