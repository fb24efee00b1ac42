"""The models and batches ``vs_ddp.py`` measures: a tied embedding/head with
checkpointed blocks (the default), N tiny parameters, HF GPT-2 and
torchvision's ResNet-18, each built the same way for every policy (one seed),
with each rank's batch seeded by step and rank."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class TiedBlocks(nn.Module):
    """Tied embedding/head and ``blocks`` checkpointed Linear+Tanh blocks."""

    def __init__(self, vocab=2048, dim=1024, blocks=4, reentrant=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
        self.reentrant = reentrant

    def _block(self, i, x):
        return torch.tanh(self.blocks[i](x))

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.reentrant:
            x = x + 0 * self.embed.weight[:1]  # reentrant checkpoints need an input that requires grad
        for i in range(len(self.blocks)):
            x = checkpoint(self._block, i, x, use_reentrant=self.reentrant)
        return F.linear(x, self.embed.weight)


class TinyParams(nn.Module):
    """``n`` parameters of 16 values, each used once: overhead per parameter."""

    def __init__(self, n):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(16) * 0.1) for _ in range(n))

    def forward(self, x):
        return sum((x * p).sum() for p in self.ps)


def make_model(args):
    torch.manual_seed(1234)
    if args.tiny_params:
        return TinyParams(args.tiny_params)
    if args.model == "gpt2-small":
        from transformers import GPT2Config, GPT2LMHeadModel

        # 124 M parameters, random init; no dropout, so every policy computes the same thing.
        model = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": args.reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": args.reentrant})
        model.config.use_cache = False
        model.train()
        return model
    if args.model == "resnet18":
        import torchvision

        return torchvision.models.resnet18(weights=None)
    return TiedBlocks(reentrant=args.reentrant)


def batch(args, step, rank):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    if args.tiny_params:
        return torch.randn(16, generator=g), None
    if args.model == "gpt2-small":
        return torch.randint(0, 50257, (1, args.tokens_per_rank), generator=g), None
    if args.model == "resnet18":
        images = torch.randn(args.images_per_rank, 3, args.image_size, args.image_size, generator=g)
        return images, torch.randint(0, 1000, (args.images_per_rank,), generator=g)
    tokens = torch.randint(0, 2048, (args.tokens_per_rank,), generator=g)
    return tokens, torch.randint(0, 2048, (args.tokens_per_rank,), generator=g)


def loss_of(args, model, data):
    x, y = data
    if args.tiny_params:
        return model(x)
    if args.model == "gpt2-small":
        return model(input_ids=x, labels=x).loss
    return F.cross_entropy(model(x), y)
