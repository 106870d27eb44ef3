"""A small GPT used by the tests, the example and the benchmarks.

Embedding, causal self-attention, MLP, LayerNorm and an LM head tied to the
embedding: the shapes of a real transformer at a size a CPU trains in seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0


class Embedding(nn.Embedding):
    """GPT-2's small-normal init: with a tied head, N(0, 1) would start at huge logits."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)  # a key bias gets only rounding noise as gradient
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """`forward(tokens)` returns logits; `loss(tokens)` the next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab, cfg.dim)
        self.wpe = Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied LM head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: the `loss_fn` the tests and examples use."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def synthetic_tokens(n: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Learnable synthetic data: each row counts up from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    return (start + step * torch.arange(seq + 1)) % vocab


def gpt_for_params(target: int, seq: int = 128, vocab: int = 4096) -> GPTConfig:
    """A config with about `target` parameters (for benchmarks)."""
    layers = 4
    dim = int(math.sqrt(max(target - vocab * 64, 1) / (12 * layers)))
    dim = max(64, dim // 64 * 64)
    return GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=max(1, dim // 64), layers=layers)
