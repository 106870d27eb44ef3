"""The model, batches and DeepSpeed configs both fz and real DeepSpeed train in the DeepSpeed-checkpoint tests.

Small enough that a checkpoint of it is a few kB, yet it has what a checkpoint reader must
handle: a tied embedding / LM head (DeepSpeed's `shared_params`), a frozen Linear
(`frozen_param_shapes`), a persistent buffer, and parameters whose sizes do not divide by the
world size (ZeRO-3's per-parameter padding). Imports only torch, so DeepSpeed's venv can use it.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB, DIM, SEQ, MICRO = 37, 12, 8, 2
WORLD = 2
LR, WEIGHT_DECAY, WARMUP = 1e-2, 0.1, 4


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim - 1)  # 35 rows: odd sizes, so ZeRO pads
        self.down = nn.Linear(3 * dim - 1, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding tied to the LM head, two blocks, a frozen projection and a persistent buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(DIM), Block(DIM)])
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        x = x + self.frozen(x) * self.scale.to(x.dtype)
        return self.head(x)


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token cross entropy, in fp32."""
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step: int, rank: int, micro: int = MICRO) -> Tensor:
    """Rank `rank`'s tokens for step `step` (0-based): the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (micro, SEQ), generator=g)


def ds_config(stage: int, precision: str, world: int = WORLD) -> dict:
    """DeepSpeed's config for one fixture: AdamW with weight decay, WarmupLR, `stage`, fp32 or bf16."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO * world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                     "warmup_num_steps": WARMUP, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0})
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


FIXTURES = {f"stage{s}_{p}": (s, p) for s in (1, 2, 3) for p in ("fp32", "bf16")} | {"stage0_fp32": (0, "fp32"),
                                                                                      "stage0_bf16": (0, "bf16")}
# trained with two parameter groups, as Hugging Face's Trainer gives DeepSpeed (`param_groups`)
GROUPED = {"stage0_fp32_groups": (0, "fp32"), "stage1_fp32_groups": (1, "fp32"), "stage2_bf16_groups": (2, "bf16"),
           "stage3_bf16_groups": (3, "bf16")}
NO_DECAY = ("bias", "norm.weight")  # the names Hugging Face's Trainer leaves out of weight decay (biases, norms)


def param_groups(model: nn.Module, grouped: bool) -> list:
    """`model_parameters` for deepspeed.initialize: the trainable parameters, or (grouped) the
    weight-decay group and the no-decay group (biases and norms, weight_decay 0), decay first."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not grouped:
        return [p for _, p in trainable]
    return [{"params": [p for n, p in trainable if not n.endswith(NO_DECAY)], "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in trainable if n.endswith(NO_DECAY)], "weight_decay": 0.0}]
