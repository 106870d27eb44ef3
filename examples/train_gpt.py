"""Pretrain a small GPT on the bytes of Python's own standard library (no download: every
machine with Python has the corpus), with fz: ZeRO stage 0-3, checkpoints, resume, eval.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
    ... examples/train_gpt.py --steps 400 --save-every 100          # checkpoints in checkpoints/train_gpt
    ... examples/train_gpt.py --steps 600 --resume --save-every 100 # continue exactly where it stopped
    ... examples/train_gpt.py --deepspeed examples/ds_config.json   # the spec from a DeepSpeed config
    ... examples/train_gpt.py --offload cpu                         # optimizer state in host memory (or nvme)
    .venv/bin/python examples/train_gpt.py --ci                     # one process, a short run

Tokens are bytes (vocab 256); the last 5% of the corpus is held out for the eval. The
data position is saved with the checkpoint (`loader.attach`), so a resumed run sees
exactly the samples the uninterrupted run would have. TensorBoard: runs/train_gpt/<run>.
"""
from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.data import Dataset

import fz


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.fc, self.out = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT. fz finds the blocks itself (the elements of `self.blocks`, a ModuleList)."""

    def __init__(self, seq: int, dim: int, heads: int, layers: int, vocab: int = 256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def default_model() -> GPT:
    """The example's model at its default sizes (`fz plan --model examples/train_gpt.py:default_model`)."""
    return GPT(seq=128, dim=128, heads=4, layers=4)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def stdlib_bytes(limit: int) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    buf = bytearray()
    for path in sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)):
        buf += path.read_bytes()
        if len(buf) >= limit:
            break
    return torch.frombuffer(buf[:limit], dtype=torch.uint8)


class Windows(Dataset):
    """Sample i: the seq + 1 bytes from i * seq on (inputs and next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq: int):
        self.data, self.seq = data, seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * self.seq:(i + 1) * self.seq + 1].long()


KEYWORDS = {"precision": "fp32", "micro_batch": 8, "grad_accum": 2, "lr": 3e-3}  # with --deepspeed: "auto" fillers


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3, help="ZeRO stage 0-3")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="default fp32")
    ap.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"],
                    help="where the optimizer state lives (and, at stage 3 with --offload-params, the params)")
    ap.add_argument("--offload-params", action="store_true", help="stage 3: parameter shards too")
    ap.add_argument("--nvme-path", default="nvme_offload", help="the disk tier's directory (--offload nvme)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro-batch", type=int, help="default 8")
    ap.add_argument("--grad-accum", type=int, help="default 2")
    ap.add_argument("--lr", type=float, help="default 3e-3")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--data-mb", type=float, default=16, help="corpus size (MB of stdlib sources)")
    ap.add_argument("--workers", type=int, default=0, help="data loader worker processes per rank")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--ckpt-dir", default="checkpoints/train_gpt")
    ap.add_argument("--resume", nargs="?", const="latest", default=None, help="from the latest step, or this one")
    ap.add_argument(
        "--deepspeed",
        metavar="JSON",
        help='the spec from a DeepSpeed config; --precision/--micro-batch/--grad-accum/--lr fill its "auto"',
    )
    ap.add_argument("--logdir", default="runs/train_gpt", help="TensorBoard root ('' for none)")
    ap.add_argument("--csv", default="", help="also write scalars.csv under this root")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ci", action="store_true", help="a short run: tiny model and corpus, 30 steps")
    args = ap.parse_args()
    args.given = {k: getattr(args, k) for k in KEYWORDS if getattr(args, k) is not None}  # said on the command line
    if args.ci:
        args.steps, args.seq, args.dim, args.layers, args.data_mb = min(args.steps, 30), 64, 64, 2, 0.5
        args.eval_every, args.eval_batches, args.micro_batch = 10, 2, args.micro_batch or 4
    for k, v in KEYWORDS.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    return args


def offload(args: argparse.Namespace):
    if args.offload == "cpu":
        return fz.offload.cpu(params=args.offload_params)
    if args.offload == "nvme":
        Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
        return fz.offload.nvme(args.nvme_path, params=args.offload_params)
    return None


def make_spec(args: argparse.Namespace) -> fz.Spec:
    if args.deepspeed:  # the JSON decides; flags given fill its "auto" values (and must agree with the rest)
        spec = fz.Spec.from_deepspeed(args.deepspeed, **args.given)
        return spec.replace(loss_fn=lm_loss, offload=offload(args) or spec.offload)
    return fz.Spec(stage=args.stage, optimizer=fz.optim.adamw(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01),
                   grad_accum=args.grad_accum, micro_batch=args.micro_batch, clip_grad_norm=1.0,
                   precision=args.precision, loss_fn=lm_loss, seed=0, offload=offload(args))


def evaluate(state: fz.State, heldout: Dataset, batches: int) -> float:
    """Mean held-out loss over the first `batches` steps of the held-out set (every rank calls it)."""
    spec = state.spec.replace(grad_accum=1)
    loader = fz.data.loader(heldout, spec, micro_batch=spec.micro_batch, shuffle=False, epochs=1)
    losses = [float(fz.eval_step(state, b)) for _, b in zip(range(batches), loader)]
    return sum(losses) / len(losses)


def main() -> None:
    args = parse()
    rank, world = fz.distributed.init()  # under torchrun: the job's group; alone: a group of one
    torch.set_num_threads(1)
    spec = make_spec(args)
    if rank == 0 and args.deepspeed:
        print(spec.explain())
    data = stdlib_bytes(int(args.data_mb * 2**20))
    cut = int(len(data) * 0.95)
    train, heldout = Windows(data[:cut], args.seq), Windows(data[cut:], args.seq)

    with torch.device("meta"):  # fz materialises only this rank's shard, module by module
        model = GPT(args.seq, args.dim, heads=4, layers=args.layers)
    state = fz.init(model, spec)
    if rank == 0:
        print(f"{len(train):,} training windows of {args.seq + 1} bytes; world {world}")
        print(fz.memory_report(state))

    ckpt = fz.Checkpointer(args.ckpt_dir, keep_last=2)
    if args.resume and ckpt.latest_step() is not None:
        state = ckpt.restore(state, step=None if args.resume == "latest" else int(args.resume))
    loader = fz.data.loader(train, state, num_workers=args.workers)  # resumes at state.data's position
    # a DeepSpeed config's tensorboard / csv_monitor decide where logs go; without one, the flags
    where = {} if args.deepspeed else {"log_dir": args.logdir or None, "csv_dir": args.csv or None}
    monitor = fz.Monitor.from_spec(spec, total_steps=args.steps, log_every=args.log_every, **where)
    losses, start, t0 = [], int(state.step), time.perf_counter()
    for batch in loader:
        if int(state.step) >= args.steps:
            break
        state, loss = fz.train_step(state, batch)
        monitor(state, loss, batch)
        losses.append(float(loss))
        step = int(state.step)
        if args.eval_every and step % args.eval_every == 0:
            monitor.log({"eval/loss": evaluate(state, heldout, args.eval_batches)}, step)
        if args.save_every and step % args.save_every == 0:
            ckpt.save(loader.attach(state))  # the data position goes into the checkpoint
    if args.save_every and ckpt.latest_step() != int(state.step):  # the last steps too
        ckpt.save(loader.attach(state))
    ckpt.close()
    monitor.close()
    if rank == 0 and losses:
        k = min(5, len(losses))
        print(f"loss {sum(losses[:k]) / k:.4f} -> {sum(losses[-k:]) / k:.4f} over steps {start + 1}-{int(state.step)} "
              f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
