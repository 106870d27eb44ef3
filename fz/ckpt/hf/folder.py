"""The layout of a Hugging Face model folder, for `fz consolidate --hf`: weights in safetensors
shards of at most `max_shard_size` with `model.safetensors.index.json` (or one
`model.safetensors`), beside the config and tokenizer files a Trainer checkpoint keeps.

The folder is written under a temporary name inside `out` and its files moved into place,
the weights' entry point (the index, or `model.safetensors`) last: a failure leaves no
folder that `from_pretrained` would load half of.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from fz.ckpt.regular import inside, stat_regular
from fz.errors import CheckpointError, ConfigError
from fz.storage.fresh import fresh_dir, remove_entry

T = TypeVar("T")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# Files a Trainer's checkpoint-N folder (or a from_pretrained folder) keeps beside the weights
_SIDE = re.compile(r"^(config|generation_config|tokenizer(_config)?|special_tokens_map|added_tokens|"
                   r"preprocessor_config|processor_config|chat_template)\.(json|jinja)$|^(vocab|merges)\.\w+$|"
                   r"^(tokenizer|spiece|spm|sentencepiece(\.bpe)?)\.model$")  # sentencepiece's names


def shard_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" / "500MB" / "2GiB" (transformers' units:
    GB = 10**9, GiB = 2**30, and "5Gb" in bits, as `convert_file_size_to_int` reads them)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if m is None:
            raise ConfigError(f"max_shard_size={size!r}: give bytes as an int or a string such as '5GB' or '500MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
        if re.search(r"[KMGT]b\s*$", str(size)):  # a lower-case b after a decimal unit: bits
            n //= 8
    if n <= 0:
        raise ConfigError(f"max_shard_size={size!r}: must be a positive number of bytes")
    return n


def shards(sizes: Sequence[tuple[T, int]], limit: int) -> list[list[T]]:
    """Items (names, entries) in order, cut into files of at most `limit` bytes (a larger tensor
    gets a file of its own), as huggingface_hub's split_torch_state_dict_into_shards does."""
    out: list[list[T]] = [[]]
    used = 0
    for name, n in sizes:
        if out[-1] and used + n > limit:
            out.append([])
            used = 0
        out[-1].append(name)
        used += n
    return out


def filenames(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


SIDE_MAX = 256 << 20  # bytes of one config or tokenizer file copied beside the weights


def side_files(step_dir: Path) -> list[Path]:
    """Config and tokenizer files beside the checkpoint: in its root (fz's root, DeepSpeed's save_dir:
    a transformers + DeepSpeed checkpoint-N/), else in the folder holding the root where that is a
    Trainer's checkpoint-N/ (it holds trainer_state.json: fz.hf's keeps them next to `fz/`); never
    another folder above the checkpoint, whose files are not its. Each is a regular file inside
    that folder (a link out of it, to another file or /proc, is refused: it would be copied into
    a folder users publish) of at most SIDE_MAX bytes."""
    root = step_dir.parent
    trainers = [root.parent] if (root.parent / "trainer_state.json").is_file() else []
    for where in (root, *trainers):
        found = sorted(p for p in where.iterdir() if _SIDE.search(p.name) and (p.is_file() or p.is_symlink()))
        if any(p.name == "config.json" for p in found):
            for p in found:
                inside(where, p, "a config or tokenizer file", str(where))
                if stat_regular(p, "a config or tokenizer file").st_size > SIDE_MAX:
                    raise CheckpointError(f"{p} is over {SIDE_MAX >> 20} MiB: not a config or tokenizer file fz "
                                          "copies beside the weights")
            return found
    return []


def staging(out: Path) -> Path:
    """An empty temporary folder inside `out` (made if missing; earlier leftovers removed)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"fz consolidate --hf: {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(".fz-consolidate-*"):
        remove_entry(old)  # a planted link too, unfollowed
    return fresh_dir(out / f".fz-consolidate-{os.getpid()}")


def commit(tmp: Path, out: Path, weight_map: dict[str, str], total: int, extra: list[Path]) -> list[str]:
    """Move the shards and side files into `out`, then write the index (or move the single
    file) last; stale weight files of an earlier export go. Returns the weights' file names."""
    files = sorted(set(weight_map.values()))
    for old in [*out.glob("model-*-of-*.safetensors"), out / WEIGHTS, out / INDEX]:
        if old.exists():
            old.unlink()
    for src in extra:  # copied into the staging folder, then renamed: a planted link in `out` is replaced, not followed
        shutil.copy2(src, tmp / src.name)
        os.replace(tmp / src.name, out / src.name)
    for name in files:
        if name != WEIGHTS:
            os.replace(tmp / name, out / name)
    if files == [WEIGHTS]:
        os.replace(tmp / WEIGHTS, out / WEIGHTS)
    else:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp / INDEX, out / INDEX)
    shutil.rmtree(tmp, ignore_errors=True)
    return [*files, *([] if files == [WEIGHTS] else [INDEX])]


@contextmanager
def undo_on_error(out: Path, tmp: Path | None) -> Iterator[None]:
    """An export's failure: the staging folder `tmp` goes, and a full disk is named as such."""
    from fz.ckpt.layout import disk_full

    try:
        yield
    except BaseException as e:
        full = None if isinstance(e, (ConfigError, KeyboardInterrupt, SystemExit)) else disk_full(out, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise
