"""`fz consolidate` of a DeepSpeed checkpoint: full weights to safetensors, one chunk at a time.

The names and values are those of DeepSpeed's zero_to_fp32 (`get_fp32_state_dict_from_zero_checkpoint`):
the state_dict buffers (floating ones as fp32), the frozen params, the trainable params' fp32
masters, then each tied alias as a copy of the tensor it shares. Where zero_to_fp32 leaves
names out (ZeRO 1's frozen params, ZeRO 3's tied aliases, which its files do not list) they
are written too, from the module states. Each parameter is streamed chunk by chunk (read with
pread, cast if asked, written at its offset), so memory stays near one chunk. A NaN or inf in
the weights, or a value the cast makes inf, is counted as it streams and refused as
fz.import_deepspeed refuses it (fz.NonFiniteError naming the tensors) before the last file is
finished: nothing is written.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.finite import Tally
from fz.ckpt.hf import folder as hf_folder
from fz.ckpt.hf.safetensors_io import StreamWriter
from fz.ckpt.layout import PathLike
from fz.ckpt.progress import Progress
from fz.ckpt.results import CheckpointInfo, Consolidated


def tensors(ck: DeepSpeedCheckpoint, cast: torch.dtype | None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, output dtype, shape) of everything consolidate writes, in zero_to_fp32's order."""
    def out(dtype: torch.dtype) -> torch.dtype:
        return (cast or torch.float32) if dtype.is_floating_point else dtype

    rows = [(n, out(t.dtype), tuple(t.shape)) for n, t in ck.buffers.items()]
    rows += [(n, out(torch.float32), s) for n, s in ck.frozen.items()]
    rows += [(n, out(torch.float32), s) for n, s in ck.params.items()]
    shapes = ck.params | ck.frozen
    rows += [(alias, out(torch.float32), shapes[real]) for alias, real in ck.shared.items() if real in shapes]
    return rows


def consolidate(path: PathLike, out: PathLike, *, cast: torch.dtype | None = None, tag: str | None = None,
                progress: bool | None = None, hf: bool = False, max_shard_size: int | str = "5GB") -> Consolidated:
    """DeepSpeed checkpoint `path` (a save_dir or a tag folder) to the safetensors file `out`,
    or with `hf=True` to a Hugging Face folder (shards of at most `max_shard_size`)."""
    with DeepSpeedCheckpoint(path, tag) as ck:
        rows = tensors(ck, cast)
        sizes = {n: math.prod(s) * d.itemsize for n, d, s in rows}
        total = sum(math.prod(s) * 4 for n, _, s in rows if n not in ck.buffers)
        header = {"format": "pt", "deepspeed_checkpoint": str(ck.path.resolve()), "deepspeed_tag": ck.tag,
                  "global_steps": str(ck.global_steps)}
        target = Path(out)
        limit = hf_folder.shard_size(max_shard_size) if hf else 0
        tmp = hf_folder.staging(target) if hf else None
        groups = hf_folder.shards([(n, sizes[n]) for n, _, _ in rows], limit) if hf else [[n for n, _, _ in rows]]
        paths = [tmp / f for f in hf_folder.filenames(len(groups))] if tmp is not None else [target]
        by_name = {r[0]: r for r in rows}
        bar = Progress(total, "consolidate", enabled=progress)
        # the weights' NaN or inf, as fz.import_deepspeed refuses them (buffers and tied copies left out), and
        # values the cast turns to inf
        chunks, found = 0, Tally("fz consolidate", f"DeepSpeed checkpoint {ck.path}", cast)
        try:
            with hf_folder.undo_on_error(Path(out), tmp):
                for i, (file, group) in enumerate(zip(paths, groups)):
                    last = found.check if i == len(paths) - 1 else None
                    chunks += _write(ck, file, [by_name[n] for n in group], header, bar, found, last)
                if tmp is not None:
                    weight_map = {n: p.name for p, group in zip(paths, groups) for n in group}
                    hf_folder.commit(tmp, target, weight_map, sum(sizes.values()), hf_folder.side_files(ck.path))
        finally:
            bar.close()
        return Consolidated(checkpoint=str(ck.path), out=str(out), tensors=len(rows), bytes=total, chunks=chunks)


def _write(ck: DeepSpeedCheckpoint, path: Path, rows: list[tuple[str, torch.dtype, tuple[int, ...]]],
           header: dict[str, str], bar: Progress, found: Tally, last: Callable[[], None] | None) -> int:
    """One safetensors file of `rows`; returns the chunks streamed. `last`, on the last file, is
    called before it is finished (an error there leaves no file)."""
    writer = StreamWriter(path, rows, header)
    chunks, shapes = 0, ck.params | ck.frozen
    try:
        for name, dtype, _ in rows:
            if name in ck.buffers:
                writer.write(name, ck.buffers[name].to(dtype))
                continue
            for at, chunk in ck.read(name):
                written = chunk.to(dtype)
                if name in shapes:
                    found.see(name, written, math.prod(shapes[name]), chunk)
                writer.write_flat(name, at, written)
                bar.update(chunk.numel() * 4)
                chunks += 1
        if last is not None:
            last()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return chunks


def inspect(path: Path, tag: str | None = None) -> CheckpointInfo:
    """What DeepSpeed checkpoint `path` (a save_dir or a tag folder) holds, read from its files as
    consolidate reads them (every rank's file parsed, no tensor read): its step, world, stage,
    precision and the model's tensors (counted as zero_to_fp32 writes them, in fp32). DeepSpeed
    writes no manifest: there is nothing to verify, and `verified` is None."""
    with DeepSpeedCheckpoint(path, tag) as ck:
        model = [(n, s) for n, s in (ck.params | ck.frozen).items()]
        rows = tensors(ck, None)
        return CheckpointInfo(path=str(ck.path), key=False, signed=False, meta_error=None, step=ck.global_steps,
                              train_step=ck.global_steps, world=ck.world, stage=ck.stage, precision=str(ck.precision),
                              master=True, fz_version=None, torch_version=None, tensors=len(rows),
                              bytes=sum(math.prod(s) * d.itemsize for _, d, s in rows), model_tensors=len(model),
                              model_bytes=sum(math.prod(s) * 4 for _, s in model), verified=None,
                              verify_error=None, format="deepspeed")
