"""Which files of a DeepSpeed checkpoint to read: the tag folder, its model-states and optimizer files.

DeepSpeed's `save_checkpoint(save_dir)` writes `save_dir/latest` (the tag) and
`save_dir/<tag>/` holding `mp_rank_00_model_states.pt` (ZeRO 0-2) or one
`zero_pp_rank_R_mp_rank_00_model_states.pt` per rank (ZeRO 3), and one
`[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per data-parallel rank. Model-parallel
(`mp_rank_01`...) and pipeline (`layer_NN-model_states.pt`) checkpoints are refused: their
tensors are slices of a model fz would have to merge, which it does not.

A downloaded checkpoint is not trusted: `latest` must name a tag folder inside the save_dir
(DeepSpeed follows it anywhere, an absolute path or `../other_run`; an explicit `tag=` still
may point elsewhere), every file read must lie inside the tag folder (a symlink out of it is
refused) and be a regular file (a FIFO would hang the read, a device never ends), and the
rank count a file states is checked against the files that exist before any list of names
is made from it.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from fz.ckpt import signing
from fz.ckpt.regular import NAME_MAX, inside, open_regular_file
from fz.errors import CheckpointError

MODEL = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MAX_LATEST = 4096  # a tag name; a longer `latest` is not DeepSpeed's


def _latest(path: Path, name: str = "latest") -> str:
    """The tag `path/<name>` names (`latest`, or ds_to_universal's `latest_universal`; its text,
    stripped: at most _MAX_LATEST bytes), read only if it lies inside `path`: a symlink out of it
    would put another file's text into the tag, and into the errors that name it."""
    inside(path, path / name, f"DeepSpeed's `{name}` file", "the save_dir")
    with open_regular_file(path / name, f"DeepSpeed's `{name}` file") as fh:
        raw = fh.read(_MAX_LATEST + 1)
    if len(raw) > _MAX_LATEST:
        raise CheckpointError(f"{path / name} is over {_MAX_LATEST} bytes: not a tag name (pass tag=...)")
    tag = raw.decode("utf-8", "replace").strip()
    if len(tag.encode()) > NAME_MAX or any(c < " " or c == "\x7f" for c in tag):
        raise CheckpointError(f"{path / name} holds {tag[:60]!r}, not a tag folder's name (control characters, or "
                              f"over {NAME_MAX} bytes): damaged or altered (pass tag=...)")
    return tag


def is_deepspeed(path: Path) -> bool:
    """A DeepSpeed save_dir (with `latest` naming a tag folder of model states) or a tag folder."""
    if (path / "latest").is_file() and not (path / "fz.json").exists():
        try:
            tag = _latest(path)
        except CheckpointError:
            return False
        return bool(tag) and _is_tag(path / tag)
    return _is_tag(path)


def unsigned_tag(path: Path, step: int | None, key: signing.Key) -> str | None:
    """The tag `step` names (global_step<N>; None: `latest`) of DeepSpeed checkpoint `path`. DeepSpeed
    never signs one, so a `key` (or FZ_CKPT_KEY), which asks for a signed checkpoint, is refused."""
    if signing.resolve(key) is not None:
        raise CheckpointError(f"{path} is a DeepSpeed checkpoint, which is never signed: a key (or "
                              "FZ_CKPT_KEY) asks for a signed one")
    return None if step is None else f"global_step{step}"


def _is_tag(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*model_states.pt"))


def resolve(path: Path, tag: str | None) -> tuple[Path, str]:
    """(tag folder, tag) of a save_dir (its `latest`, or `tag`) or of a tag folder itself."""
    if not path.exists():
        raise CheckpointError(f"DeepSpeed checkpoint {path} does not exist")
    if tag is None and _is_tag(path):
        return path, path.name
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise CheckpointError(f"{path} is not a DeepSpeed checkpoint: no `latest` file and no "
                                  "*_model_states.pt (pass the tag folder, or tag=...)")
        tag = latest_tag(path)
    folder = path / tag
    if not _is_tag(folder):
        tags = sorted(p.name for p in path.iterdir() if _is_tag(p)) if path.is_dir() else []
        raise CheckpointError(f"DeepSpeed checkpoint {path}: tag {tag!r} not found (no {folder} with model "
                              f"states; tags there: {', '.join(tags) or 'none'})")
    return folder, tag


def latest_tag(path: Path, name: str = "latest") -> str:
    """The tag `path/<name>` names, which must be a folder of the save_dir `path` itself
    (symlinks followed): DeepSpeed would load one anywhere."""
    tag = _latest(path, name)
    folder = path / tag
    if tag in ("", ".", "..") or Path(tag).name != tag or folder.resolve().parent != path.resolve():
        where = folder.resolve() if tag else path
        raise CheckpointError(f"{path / name} names {tag!r}, which is not a tag folder inside {path} (it leads "
                              f"to {where}): not loaded, as a downloaded checkpoint could point anywhere; pass tag=... "
                              "to load a checkpoint outside the save_dir on purpose")
    return tag


def refuse_parallel(folder: Path) -> None:
    """Model-parallel and pipeline checkpoints are not read: say so."""
    layers = sorted(folder.glob("layer_*model_states.pt"))
    if layers:
        raise CheckpointError(f"DeepSpeed checkpoint {folder} is a pipeline-parallel checkpoint ({layers[0].name}, "
                              "...): not supported; convert it with DeepSpeed's ds_to_universal first")
    others = sorted(p.name for p in folder.glob("*mp_rank_*") if not re.search(r"mp_rank_0+_", p.name))
    if others:
        raise CheckpointError(f"DeepSpeed checkpoint {folder} is a model-parallel (tensor-parallel) checkpoint "
                              f"({others[0]}): not supported; convert it with DeepSpeed's ds_to_universal first")


def optim_files(folder: Path) -> tuple[str, dict[int, Path]]:
    """(file prefix: '', 'bf16_' or 'fp16_'; {rank: optimizer-states file})."""
    found: dict[str, dict[int, Path]] = {}
    for p in folder.iterdir():
        m = _OPTIM.match(p.name)
        if m:
            found.setdefault(m.group(1) or "", {})[int(m.group(2))] = p
    if len(found) > 1:
        raise CheckpointError(f"DeepSpeed checkpoint {folder} mixes optimizer files of several kinds "
                              f"({', '.join(repr(k) for k in sorted(found))} prefixes): two runs saved to one tag?")
    if not found:
        return "", {}
    prefix, files = next(iter(found.items()))
    return prefix, files


def optim_name(prefix: str, rank: int) -> str:
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def zero3_model_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def zero3_model_files(folder: Path) -> dict[int, Path]:
    """{rank: ZeRO-3 model-states file} of the folder."""
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _ZERO3_MODEL.match(p.name))}


def model_file(folder: Path) -> Path:
    """The model-states file every layout has: mp_rank_00 (ZeRO 0-2), else rank 0's (ZeRO 3)."""
    for name in (MODEL, zero3_model_name(0)):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"DeepSpeed checkpoint {folder} has neither {MODEL} nor {zero3_model_name(0)}")


def ranks(folder: Path, found: dict[int, Path], world: int, name: Callable[[int], str], what: str) -> list[Path]:
    """The files of ranks 0..world-1, `found` being those in the folder ({rank: file}): a missing
    rank (the first named, the rest counted: `world` comes from a file and may be huge) or a
    rank beyond `world` is an error saying `what` stated the count."""
    if world < 1:
        raise CheckpointError(f"DeepSpeed checkpoint {folder}: {what} a world of {world} ranks: damaged")
    present = sum(1 for r in found if r < world)
    if present < world:
        first = next(r for r in range(len(found) + 1) if r not in found)
        more = world - present - 1
        raise CheckpointError(f"DeepSpeed checkpoint {folder} is missing {name(first)}"
                              f"{f' and {more} more' if more else ''} ({what} the checkpoint was written by {world} "
                              "ranks): a rank's save did not finish, or the files were not all copied")
    if len(found) > world:
        extra = min(r for r in found if r >= world)
        raise CheckpointError(f"DeepSpeed checkpoint {folder} has {len(found)} rank files ({found[extra].name}, ...) "
                              f"but {what} {world} ranks: files of another run in the same tag?")
    return [found[r] for r in range(world)]


def need(folder: Path, names: list[str], what: str) -> list[Path]:
    """The files `names` of the folder, each required: a missing one is an error naming it."""
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise CheckpointError(f"DeepSpeed checkpoint {folder} is missing {missing[0]}"
                              f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} ({what}): a rank's "
                              "save did not finish, or the files were not all copied")
    return [folder / n for n in names]
