"""A DeepSpeed engine script (the loop of DeepSpeed's Getting Started) on fz: its only change is
the import line.

    fz run --num_gpus 2 examples/deepspeed_engine.py --deepspeed --deepspeed_config examples/ds_config.json \
        --save_dir out/ds_engine --steps 40 --save_interval 20
    fz run --num_gpus 2 examples/deepspeed_engine.py --deepspeed --deepspeed_config examples/ds_config.json \
        --load_dir out/ds_engine --steps 60        # resumes at the saved step, on the same batches

A small GPT-style model learns to continue byte sequences of the Python standard library's
sources (every machine has them). `load_checkpoint` also reads a checkpoint DeepSpeed wrote
(`global_stepN/`), so a run started under DeepSpeed continues here.
"""
from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
from torch import nn

import fz.deepspeed as deepspeed  # was: import deepspeed

SEQ = 64


class Bytes(torch.utils.data.Dataset):
    """Windows of SEQ + 1 bytes of the standard library's sources."""

    def __init__(self, limit: int = 1 << 20):
        src = Path(sysconfig.get_paths()["stdlib"])
        data = b"".join(p.read_bytes() for p in sorted(src.glob("*.py"))[:200])[:limit]
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * SEQ:i * SEQ + SEQ + 1]


class TinyLM(nn.Module):
    """engine(batch) returns the loss, as the Getting Started loop expects."""

    def __init__(self, dim: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(dim, 256)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        h = self.embed(x) + self.pos
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def dataloader_to_step(loader, step: int):
    it = iter(loader)
    for _ in range(step):
        next(it)
    return it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train to")
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--save_interval", type=int, default=20)
    parser.add_argument("--load_dir", default=None)
    parser.add_argument("--ckpt_id", default=None)
    args = deepspeed.add_config_arguments(parser).parse_args()

    model = TinyLM()
    model_engine, optimizer, data_loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=Bytes())
    accum = model_engine.gradient_accumulation_steps()
    step = 0
    if args.load_dir:
        _, client_sd = model_engine.load_checkpoint(args.load_dir, args.ckpt_id)
        step = client_sd["step"]
    it = dataloader_to_step(data_loader, step * accum)
    client_sd = {}
    while model_engine.global_steps < args.steps:
        batch = next(it)
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()
        step = model_engine.global_steps  # the engine logs every steps_per_print updates, as DeepSpeed's does
        if model_engine.micro_steps % accum == 0 and args.save_dir and step % args.save_interval == 0:
            client_sd["step"] = step
            model_engine.save_checkpoint(args.save_dir, args.ckpt_id, client_sd=client_sd)


if __name__ == "__main__":
    main()
