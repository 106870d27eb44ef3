"""Models as people write them, for tests/*/test_real_models*.py: parents that read, iterate and
unpack their blocks, checkpoints inside blocks, BatchNorm and dropout, and tiny Hugging Face
models from configs (never downloaded weights), one of 3.4B parameters on the meta device for
plans. Plus the single-process reference loop."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIM = 16


class Block(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.layer_idx, self.is_sliding = i, i % 2 == 1  # what HF parents read (ModernBERT's attention_type)
        self.attn = nn.Linear(DIM, DIM)
        self.ff = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.ff(torch.relu(self.attn(x))))


class Readers(nn.Module):
    """Its forward reads attributes of its blocks, iterates, unpacks and indexes block containers."""

    def __init__(self, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList(Block(i) for i in range(depth))
        self.pairs = nn.ModuleList(nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)]) for _ in range(depth))
        self.dicts = nn.ModuleList(
            nn.ModuleDict({"attn": nn.Linear(DIM, DIM), "ff": nn.Linear(DIM, DIM)}) for _ in range(depth)
        )
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.inp(x)
        assert len(self.blocks) == 2 and len(self.pairs[0]) == 2
        for block in self.blocks[: len(self.blocks)]:
            scale = 0.5 if block.is_sliding else 1.0
            h = block(h) * scale + 0.01 * block.layer_idx
        for attn, ff in self.pairs:
            h = h + torch.tanh(ff(attn(h)))
        for layer in self.dicts:
            assert "attn" in layer
            h = h + torch.tanh(layer["ff"](layer["attn"](h)))
        return self.out(h).squeeze(-1)


class ReadsWeight(Readers):
    def forward(self, x):
        return self.blocks[0].attn.weight.sum() + super().forward(x).mean()


class Inner(nn.Module):
    """A block that checkpoints its own parts (torch.utils.checkpoint, as HF layers do)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def part(self, x):
        return torch.tanh(self.b(torch.relu(self.a(x))))

    def forward(self, x):
        return x + checkpoint(self.part, x, use_reentrant=self.reentrant)


class CheckpointsInside(nn.Module):
    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList(Inner(reentrant) for _ in range(2))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=False) if i == 1 else block(h)  # around a block, too
        return self.out(h).squeeze(-1)


class MoE(nn.Module):
    """Experts chosen by the batch (`route`): an expert no row picks gets no gradient."""

    def __init__(self, experts: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(experts))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x, route):
        h = self.inp(x)
        for e in sorted(set(route.tolist())):
            h = h + torch.tanh(self.experts[e](h)) * (route == e).float()[:, None]
        return self.out(h).squeeze(-1)


def moe_loss(model, batch):
    return F.mse_loss(model(batch["x"], batch["route"]), batch["y"])


def routed(step: int, rows: int, experts=(0,)) -> dict:
    """points() with a route: the rows split evenly among `experts` (in order, so ranks' chunks differ)."""
    out = points(step, rows)
    out["route"] = torch.tensor(experts).repeat_interleave(rows // len(experts))
    return out


class BasicBlock(nn.Module):
    """torchvision's resnet BasicBlock, small."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, c: int = 4, classes: int = 3, p: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(self.drop(h.mean((2, 3))))


def mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def xent(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def points(step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 8, generator=g)
    return {"x": x, "y": torch.sin(x.sum(1))}


def images(step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    return {"x": torch.randn(rows, 3, 6, 6, generator=g), "y": torch.randint(0, 3, (rows,), generator=g)}


def tokens(step: int, rows: int, name: str) -> dict:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(3, 64, (rows, 8), generator=g)
    return {"input_ids": ids, "labels": ids.roll(1, 1) if name == "t5" else ids}


def hf_model(name: str, seed: int = 0) -> nn.Module:
    """GPT-2, Llama (untied, or tied: "llama_tied"), Mixtral, BERT, T5, ModernBERT from 2-layer configs with hidden
    size 32, no dropout (so that a reference with another generator takes the same path)."""
    import transformers as tr
    torch.manual_seed(seed)
    ids = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    if name == "gpt2":
        m = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    elif name in ("llama", "llama_tied"):
        m = tr.LlamaForCausalLM(tr.LlamaConfig(num_key_value_heads=1, max_position_embeddings=16,
                                               tie_word_embeddings=name == "llama_tied", **small, **ids))
    elif name == "mixtral":  # router logits in the loss (the load-balancing term): transformers records them by hooks
        moe = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
        m = tr.MixtralForCausalLM(tr.MixtralConfig(num_key_value_heads=1, max_position_embeddings=16, **moe, **small,
                                                   **ids))
    elif name == "bert":
        m = tr.BertForMaskedLM(tr.BertConfig(max_position_embeddings=16, pad_token_id=0, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0, **small))
    elif name == "t5":
        m = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                                      num_heads=2, decoder_start_token_id=0, dropout_rate=0.0, **ids))
    elif name == "modernbert":
        m = tr.ModernBertForMaskedLM(tr.ModernBertConfig(max_position_embeddings=16, global_attn_every_n_layers=2,
                                                         local_attention=8, cls_token_id=2, sep_token_id=1,
                                                         **small, **ids))
    else:
        raise ValueError(name)
    return m


def llama_3b() -> nn.Module:
    """OpenLLaMA-3B's shape (3,426.5M parameters) on the meta device, for plans of a GPU job
    (`fz plan --model tests/support/real_nets.py:llama_3b`); nothing is allocated or downloaded."""
    import transformers as tr
    with torch.device("meta"):
        return tr.LlamaForCausalLM(tr.LlamaConfig(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26,
                                                  num_attention_heads=32, vocab_size=32000))


def llama_7b() -> nn.Module:
    """Llama-2-7B's shape (6,738.4M parameters; its 131.1M-parameter embedding is DeepSpeed's largest
    layer) on the meta device: the 8-GPU case docs/planning.md sets beside DeepSpeed's estimator."""
    import transformers as tr
    with torch.device("meta"):
        return tr.LlamaForCausalLM(tr.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                  num_attention_heads=32, vocab_size=32000))


def t0_3b() -> nn.Module:
    """bigscience/T0_3B's shape (T5 v1.1 XL: 2,849.8M parameters, a 65.8M-parameter embedding shared
    by encoder and decoder, an untied head) on the meta device: DeepSpeed's own estimator example."""
    import transformers as tr
    cfg = tr.T5Config(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32,
                      feed_forward_proj="gated-gelu")
    with torch.device("meta"):
        t0 = tr.T5ForConditionalGeneration(cfg)
        t0.lm_head.weight = nn.Parameter(torch.empty(32128, 2048))  # transformers 5 ties T5's head; T0_3B's is not
    return t0


def hf_loss(model, batch):
    return model(**batch).loss


def reference(make: Callable[[], nn.Module], loss_fn, batches: list[dict], world: int, lr: float = 1e-2,
              train: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch, one process: each step's loss is the mean over the ranks' chunks, each chunk run
    on its own (as fz's ranks do: BatchNorm sees one rank's rows), and the buffers the chunks change
    are averaged (fz's default buffer_sync). Returns (losses, state_dict)."""
    model = make()
    model.train(train)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for batch in batches:
        chunks = [{k: v.chunk(world)[r] for k, v in batch.items()} for r in range(world)]
        start = {n: b.clone() for n, b in model.named_buffers()}
        after, total = [], 0.0
        opt.zero_grad()
        for c in chunks:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(start[n])
            loss = loss_fn(model, c) / world
            loss.backward()
            total += loss.item()
            after.append({n: b.clone() for n, b in model.named_buffers()})
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(after[0][n] if not b.is_floating_point() else sum(a[n] for a in after) / world)
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
