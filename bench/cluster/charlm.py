"""The ``charlm`` workload's model: a small decoder-only transformer over characters.

GPT-2's layout at toy size: token and learned position embeddings, ``layers`` pre-norm blocks
(causal multi-head self-attention, then a 4x GELU MLP, each with a residual), a final LayerNorm
and an untied output head. Untied so that every parameter belongs to exactly one module, which
the streaming DiLoCo fragments need (a tied weight would sit in two fragments). The default
(width 128, 6 layers, 4 heads, context 64, vocabulary 128) has 1,230,976 parameters.

Also here: the training batches (random windows of the training text, one stream per rank) and
the validation loss (mean next-character cross-entropy, nats, over fixed windows).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width must be a multiple of heads, got {width} and {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Decoder-only transformer: tokens (batch, time) int64 -> logits (batch, time, vocab)."""

    def __init__(self, vocab: int = 128, width: int = 128, layers: int = 6, heads: int = 4,
                 context: int = 64):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the context {self.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def lm_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``windows`` (batch, context + 1) int64, in nats."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def sample_windows(tokens: np.ndarray, context: int, count: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Start offsets (count,) of random windows of ``context + 1`` tokens."""
    high = len(tokens) - context - 1
    if high < 1:
        raise ValueError(f"text of {len(tokens)} tokens is too short for context {context}")
    return torch.randint(0, high, (count,), generator=generator)


def gather_windows(tokens: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    """(len(starts), context + 1) int64 windows of ``tokens`` at ``starts``."""
    offsets = torch.arange(context + 1)
    return tokens[starts[:, None] + offsets].long()


def validation_windows(val: np.ndarray, context: int, count: int) -> torch.Tensor:
    """``count`` fixed windows spread evenly over the validation text (the same every run)."""
    high = len(val) - context - 1
    if high < 1:
        raise ValueError(f"validation text of {len(val)} tokens is too short for context "
                         f"{context}")
    starts = torch.linspace(0, high, count).long()
    return gather_windows(torch.from_numpy(val), starts, context)


@torch.no_grad()
def validation_loss(model: nn.Module, windows: torch.Tensor, batch: int = 64) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over ``windows``."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        total += float(lm_loss(model, w)) * w.shape[0]
        n += w.shape[0]
    model.train(was_training)
    return total / n


if __name__ == "__main__":  # a library: say so rather than exit silently
    print(
        "bench/cluster/charlm.py is a library of the cluster benchmark (the charlm workload's "
        "model, batches and validation loss), imported by workloads.py; it runs nothing. See "
        "bench/cluster/README.md."
    )
