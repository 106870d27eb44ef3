"""`deepspeed.utils.zero_to_fp32` on fz: a checkpoint's full fp32 weights as a state_dict, or
written to a folder, as DeepSpeed's functions give them.

Both read a DeepSpeed checkpoint (as `fz consolidate` does: its pickles interpreted, never run,
chunk by chunk) and the checkpoints `fz.deepspeed`'s `save_checkpoint` writes (fz's own, in
DeepSpeed's `save_dir/<tag>/` layout), which DeepSpeed's cannot read. The names are DeepSpeed's
(the model's, no `module.`): buffers, frozen parameters (in the dtype stored, as DeepSpeed's),
the trainable ones' fp32 masters, and each tied alias (the engine's save_checkpoint keeps its
aliases and frozen names beside its counters). ZeRO 1's frozen parameters, which DeepSpeed's
leaves out, are there too.
`lazy_mode=True` gives the tensors themselves (their `.contiguous()` is what DeepSpeed's lazy
ones give), held in memory: a warning says so.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fz.ckpt import consolidate
from fz.ckpt.deepspeed import files as ds_files
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.finite import nonfinite, report
from fz.errors import ConfigError
from fz.storage.fresh import replacing

log = logging.getLogger(__name__)
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _frozen_and_aliases(path: Path) -> tuple[dict[str, torch.dtype | None], dict[str, str]]:
    """The checkpoint's frozen parameters, each with the dtype DeepSpeed's zero_to_fp32 gives it (a
    DeepSpeed bf16 run's in bf16: stored so), or None (an fz.deepspeed checkpoint's: as read); and
    the tied aliases consolidate leaves out (alias -> name: an fz.deepspeed checkpoint's)."""
    if not ds_files.is_deepspeed(path):
        fields = _engine_fields(path)
        return dict.fromkeys(fields.get("frozen", [])), fields.get("shared_params", {})
    with DeepSpeedCheckpoint(path, None) as ck:  # stored as the module was: in the run's precision
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(ck.precision), torch.float32)
        return dict.fromkeys(ck.frozen, dtype), {}


def _engine_fields(path: Path) -> dict[str, Any]:
    """What fz.deepspeed's save_checkpoint keeps beside its counters (rank 0's data file): the tied
    aliases (`shared_params`: alias -> name) and the frozen parameters' names; empty where absent
    (an fz checkpoint of fz.save, or an older one)."""
    from fz.ckpt.layout import read_json, resolve
    from fz.deepspeed.checkpoints import ENGINE_KEY
    data = read_json(resolve(path) / "data_0.json")
    client = data.get("client") if isinstance(data, dict) else None
    fields = client.get(ENGINE_KEY) if isinstance(client, dict) else None
    if not isinstance(fields, dict):
        return {}
    shared, frozen = fields.get("shared_params", {}), fields.get("frozen", [])
    if not (isinstance(shared, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items())
            and isinstance(frozen, list) and all(isinstance(n, str) for n in frozen)):
        raise ConfigError(f"zero_to_fp32: {path}'s engine fields are not a dict of names and a list of names: "
                          "damaged or altered")
    return {"shared_params": shared, "frozen": frozen}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """{name: fp32 tensor} of the checkpoint in `checkpoint_dir` (its `latest` tag, or `tag`)."""
    if lazy_mode:
        log.warning("zero_to_fp32: lazy_mode=True gives the tensors themselves, in memory (fz reads the "
                    "checkpoint chunk by chunk, but returns whole tensors)")
    root = Path(checkpoint_dir)
    path = root / tag if tag is not None else root
    if not path.is_dir():
        raise ConfigError(f"zero_to_fp32: {path} is not a checkpoint folder")
    with tempfile.TemporaryDirectory(prefix="fz-zero-to-fp32-") as tmp:
        out = Path(tmp) / "weights.safetensors"
        consolidate(path, out, dtype="fp32", progress=False)
        weights = load_file(out)
    frozen, aliases = _frozen_and_aliases(path)
    for name, dtype in frozen.items():
        if name in weights:
            if dtype is not None:
                weights[name] = weights[name].to(dtype)  # widened by consolidate, exactly: narrowed back
            if exclude_frozen_parameters:
                del weights[name]
    for alias, name in aliases.items():  # each tied alias of what is left, as DeepSpeed's (the same tensor)
        if name in weights and alias not in weights:
            weights[alias] = weights[name]
    return weights


def _max_bytes(size: int | str | None) -> int | None:
    if size is None or isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * _UNITS[unit])
    raise ConfigError(f"zero_to_fp32: max_shard_size={size!r}; use bytes or a size like '5GB'")


OUTPUT_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
                      "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _output_dtype(dtype: str | torch.dtype) -> torch.dtype:
    found = OUTPUT_DTYPE_NAMES.get(dtype.lower().removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if found not in set(OUTPUT_DTYPE_NAMES.values()):
        raise ValueError(f"Unsupported output dtype {dtype!r}. Choose one of: {', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
    return found


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: int | str | None
                                               = "5GB", safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """convert_zero_checkpoint_to_state_dict in fp32 (DeepSpeed's older name)."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                          safe_serialization, tag, exclude_frozen_parameters)


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                                          dtype: str | torch.dtype = torch.float32,
                                          max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> None:
    """The state_dict written to `output_dir` as DeepSpeed writes it: its floating tensors in
    `dtype` (float32, float16 or bfloat16; others as stored), as `model.safetensors`
    (`safe_serialization=True`) or `pytorch_model.bin`, cut into numbered shards of at most
    `max_shard_size` with their `*.index.json` when it is larger."""
    to = _output_dtype(dtype)
    weights = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    # what the cast makes NaN or inf (a 1e5 master in fp16) is refused before any file is written; what the
    # checkpoint holds was read by consolidate (which refuses a parameter's, and keeps a mask buffer's -inf)
    made, cast = {}, {}
    for k, t in weights.items():
        if t.is_floating_point():
            if id(t) not in cast:  # a tied alias: the same tensor, cast and counted once
                cast[id(t)] = t.to(to)
                if n := nonfinite(cast[id(t)]) - nonfinite(t):
                    made[repr(k)] = (n, t.numel())
            weights[k] = cast[id(t)]
    dtype = str(to).removeprefix("torch.")
    report(made, False, "zero_to_fp32", f"DeepSpeed checkpoint {checkpoint_dir} cast to {dtype}",
           remedy="nothing was written (cast to bfloat16, whose range is float32's, the values may fit)")
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    limit = _max_bytes(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in weights.items():  # in order, a new shard when the next tensor would overflow this one
        nbytes = t.numel() * t.element_size()
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    stem, ext = name.rsplit(".", 1)
    files = [name] if len(shards) == 1 else \
        [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for file, keys in zip(files, shards):
        part = {k: weights[k].contiguous() for k in keys}
        if safe_serialization:  # a tied alias as a copy of its own (safetensors refuses shared tensors)
            seen: set[int] = set()
            for k, t in part.items():
                if t.untyped_storage().data_ptr() in seen:
                    part[k] = t.clone()
                seen.add(part[k].untyped_storage().data_ptr())
        with replacing(out / file) as tmp:  # a planted link in out_dir is replaced, never written through
            if safe_serialization:
                save_file(part, tmp, metadata={"format": "pt"})
            else:
                torch.save(part, tmp)
    if len(files) > 1:
        total = sum(math.prod(t.shape) * t.element_size() for t in weights.values())
        index: dict[str, Any] = {"metadata": {"total_size": total},
                                 "weight_map": {k: f for f, keys in zip(files, shards) for k in keys}}
        with replacing(out / f"{name}.index.json") as tmp:
            tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None, with_dtype: bool = False) -> None:
    """DeepSpeed's `zero_to_fp32.py` command line (`with_dtype`: its `zero_to_torch.py`, --dtype
    required): `python zero_to_fp32.py checkpoint_dir output_dir [--safe_serialization] ...`."""
    import argparse

    parser = argparse.ArgumentParser(description="The full weights of a ZeRO checkpoint (DeepSpeed's or "
                                                 "fz.deepspeed's) as a PyTorch state_dict, by fz")
    parser.add_argument("checkpoint_dir", help="the folder holding the tag folders, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the folder for the state_dict files")
    if with_dtype:
        parser.add_argument("--dtype", choices=sorted(OUTPUT_DTYPE_NAMES), required=True, help="output tensor dtype")
    parser.add_argument("--max_shard_size", default="5GB", help="the largest shard, like 5GB or 500MB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors, not a pickle")
    parser.add_argument("-t", "--tag", default=None, help="the tag folder, e.g. global_step1 (default: latest's)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="log more")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO)
    convert_zero_checkpoint_to_state_dict(args.checkpoint_dir, args.output_dir, getattr(args, "dtype", "float32"),
                                          args.max_shard_size, args.safe_serialization, args.tag,
                                          args.exclude_frozen_parameters)


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict_from_zero_checkpoint", "main"]

if __name__ == "__main__":
    main()
