"""Offline tools on a checkpoint directory, one process and no torch.distributed:
`consolidate` (full weights to one safetensors file, or a Hugging Face folder) and `inspect`
(what is in it).

consolidate streams each stored chunk (cast if asked) into its place in the output and
drops it: peak host memory stays near the largest chunk (plus its cast copy), not the model.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fz.ckpt import manifest, signing
from fz.ckpt.deepspeed import export as ds_export
from fz.ckpt.deepspeed import files as ds_files
from fz.ckpt.finite import Tally
from fz.ckpt.hf import folder as hf_folder
from fz.ckpt.hf.safetensors_io import StreamWriter
from fz.ckpt.layout import META, PathLike, read_json, resolve
from fz.ckpt.progress import Progress
from fz.ckpt.reader import CheckpointReader
from fz.ckpt.results import CheckpointInfo, Consolidated
from fz.errors import CheckpointError, ConfigError
from fz.spec import PRECISIONS

_PREFIX, _BUFFERS = "model/", "buffers/"
# CheckpointInfo's fields read from fz.json, and their types there
_META_FIELDS: dict[str, type] = {
    **dict.fromkeys(("step", "train_step", "world", "stage", "tensors", "bytes", "model_tensors", "model_bytes"), int),
    **dict.fromkeys(("precision", "fz_version", "torch_version"), str), "master": bool}


def _fits(value: object, kind: type) -> bool:
    """A field of fz.json as fz writes it: of its type; a string short and printable (a terminal
    escape in `fz inspect`'s output could fake a verified checkpoint or hide lines)."""
    if type(value) is not kind:
        return False
    return not isinstance(value, str) or (len(value) <= 64 and value.isprintable())


def _name(key: str) -> str:
    """A checkpoint key's name in the exported file (the model's state_dict name)."""
    return key.split("/", 1)[1]


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in PRECISIONS:
        raise ConfigError(f"--dtype {name!r}: must be one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def _verify(d: Path, progress: bool | None, key: bytes | None) -> None:
    files = manifest.read(d, key)
    manifest.check_sizes(d, files)
    bar = Progress(sum(f["size"] for f in files.values()), "verify     ", enabled=progress)
    manifest.check_sums(d, files, sorted(files), bar.update)
    bar.close()


def _meta(d: Path) -> dict[str, Any]:
    """fz.json: a JSON object whose state_dict_buffers, if any, are names (a list or a number there
    was an AttributeError or TypeError traceback from fz inspect and consolidate)."""
    path = d / META
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path} is damaged: it is a JSON {type(meta).__name__}, not an object")
    buffers = meta.get("state_dict_buffers", [])
    if not isinstance(buffers, list) or not all(isinstance(n, str) for n in buffers):
        raise CheckpointError(f"checkpoint file {path} is damaged: its state_dict_buffers is {buffers!r:.60}, not a "
                              "list of buffer names")
    return meta


def _check_target(out: Path, hf: bool) -> None:
    """Where consolidate writes, checked before anything is read: a file's name (not a folder), in
    a folder that exists (for --hf, the nearest one there is) and that this process may write."""
    if not hf and out.is_dir():
        raise CheckpointError(f"{out} is a folder: give a file name (OUT.safetensors), or --hf "
                              "(hf=True) to write a Hugging Face folder there")
    where = out if hf else out.parent
    if not hf and not where.is_dir():
        raise CheckpointError(f"cannot write {out}: the folder {where} does not exist")
    while hf and not where.exists() and where != where.parent:
        where = where.parent
    if where.is_dir() and not os.access(where, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {out}: {where} is not writable (permissions, or a "
                              "read-only filesystem)")


def consolidate(ckpt: PathLike, out: PathLike, *, dtype: str | None = None, step: int | None = None,
                verify: bool = True, progress: bool | None = None, key: signing.Key = None, hf: bool = False,
                max_shard_size: int | str = "5GB") -> Consolidated:
    """Write the full parameters of checkpoint `ckpt` to the safetensors file `out`, or with
    `hf=True` to the folder `out` as Hugging Face lays one out (shards of at most
    `max_shard_size` and their index, or one `model.safetensors`; the config and tokenizer
    files found beside the checkpoint, as a Trainer's checkpoint-N/ keeps them), which
    `from_pretrained` loads.

    Names are the canonical parameter names, then the buffers of the model's state_dict (its
    persistent ones: BatchNorm's statistics). A tied pair is written once, under its canonical
    name (safetensors refuses shared storage): load the file with
    `safetensors.torch.load_model(model, out, strict=True)`, which fills the tied names
    (`from_pretrained` ties them itself); `dtype` ("bf16", "fp16", "fp32") casts the floating
    tensors, None keeps the stored dtype (fp32 master weights when the run had them). With a
    `key` (or FZ_CKPT_KEY) the checkpoint must be signed with it, and is verified even with
    verify=False. A NaN or inf in the weights, or a value the cast makes inf, is fz.NonFiniteError
    naming the tensors, and nothing is written. Returns what it wrote (a Consolidated).
    A DeepSpeed checkpoint (a save_dir with `latest`, or a tag folder; `step` N reads tag
    global_stepN) is consolidated as DeepSpeed's zero_to_fp32 does it (fz/ckpt/deepspeed/export.py).
    (From a live state, a Hugging Face model folder: fz.hf.save_pretrained.)
    """
    _check_target(Path(out), hf)
    if ds_files.is_deepspeed(Path(ckpt)):  # a DeepSpeed save_dir or tag folder: fz/ckpt/deepspeed/export.py
        tag = ds_files.unsigned_tag(Path(ckpt), step, key)
        return ds_export.consolidate(ckpt, out, cast=_dtype(dtype), progress=progress, hf=hf,
                                     max_shard_size=max_shard_size, tag=tag)
    d = resolve(ckpt, step)
    key = signing.resolve(key)
    limit = hf_folder.shard_size(max_shard_size) if hf else 0
    if verify or key is not None:
        _verify(d, progress, key)
    meta = _meta(d)
    reader = CheckpointReader(d)
    cast = _dtype(dtype)
    names = [k for k in reader.keys() if k.startswith(_PREFIX)]
    if not names:
        raise CheckpointError(f"checkpoint {d} holds no model weights")
    if hf and any(k[len(_PREFIX):].startswith("base_model.model.") for k in names):
        raise CheckpointError(f"checkpoint {d} is a PEFT model's (its names are PEFT's, base_model.model....): a "
                              "--hf folder of them would load as an untrained model. Write the adapter with "
                              "trainer.save_model() or fz.hf.save_pretrained(state, out, model=peft_model) "
                              "(merged=True: the merged model); a Trainer's checkpoint-N folder holds the adapter")
    names += [f"{_BUFFERS}{n}" for n in meta.get("state_dict_buffers", []) if f"{_BUFFERS}{n}" in reader.meta]

    def out_dtype(k: str) -> torch.dtype:
        stored = reader.meta[k].properties.dtype
        return cast if cast is not None and stored.is_floating_point else stored

    sizes = {k: reader.meta[k].size.numel() * out_dtype(k).itemsize for k in names}
    total = sum(reader.meta[k].size.numel() * reader.meta[k].properties.dtype.itemsize for k in names)
    header = {"format": "pt", "fz_step": str(meta.get("step")), "fz_checkpoint": str(d.resolve())}
    target = Path(out)
    tmp = hf_folder.staging(target) if hf else None
    groups = hf_folder.shards([(k, sizes[k]) for k in names], limit) if hf else [names]
    paths = [tmp / f for f in hf_folder.filenames(len(groups))] if tmp is not None else [target]
    bar = Progress(total, "consolidate", enabled=progress)
    found = Tally("fz consolidate", f"checkpoint {d}", cast)  # as fz.restore refuses them, and what the cast makes inf
    try:
        with hf_folder.undo_on_error(Path(out), tmp):
            for i, (path, group) in enumerate(zip(paths, groups)):
                last = found.check if i == len(paths) - 1 else None  # refused before the last file is finished
                _write(reader, path, group, out_dtype, cast, header, bar, found, last)
            if tmp is not None:
                weight_map = {_name(k): p.name for p, group in zip(paths, groups) for k in group}
                hf_folder.commit(tmp, target, weight_map, sum(sizes.values()), hf_folder.side_files(d))
    finally:
        bar.close()
    return Consolidated(checkpoint=str(d), out=str(out), tensors=len(names), bytes=total, chunks=reader.chunks)


def _write(reader: CheckpointReader, path: Path, keys: list[str], out_dtype: Callable[[str], torch.dtype],
           cast: torch.dtype | None, header: dict[str, str], bar: Progress, found: Tally,
           last: Callable[[], None] | None) -> None:
    """One safetensors file of `keys`, each stored chunk streamed (cast if asked) into its place, the
    weights' non-finite values counted; `last`, on the last file, is called before it is finished."""
    writer = StreamWriter(path, [(_name(k), out_dtype(k), tuple(reader.meta[k].size)) for k in keys], header)

    def put(k: str, offsets, chunk: torch.Tensor) -> None:
        nbytes, read = chunk.numel() * chunk.element_size(), chunk
        if cast is not None and chunk.dtype != cast and chunk.is_floating_point():
            chunk = chunk.to(cast)
        if not k.startswith(_BUFFERS):  # a buffer may hold -inf on purpose (a mask)
            found.see(_name(k), chunk, reader.meta[k].size.numel(), read)
        writer.write_chunk(_name(k), offsets, chunk)
        bar.update(nbytes)

    try:
        for k in keys:
            reader.stream(k, lambda offsets, chunk, k=k: put(k, offsets, chunk))  # type: ignore[misc]  # noqa: B008 - binds this k
        if last is not None:
            last()
        writer.close()
    except BaseException:
        writer.abort()
        raise


def inspect(ckpt: PathLike, *, step: int | None = None, verify: bool = True,
            progress: bool | None = None, key: signing.Key = None) -> CheckpointInfo:
    """What a checkpoint holds (from fz.json), whether its manifest is signed, and whether it
    verifies (with a `key`, or FZ_CKPT_KEY: its signature too). Damage is reported in the
    CheckpointInfo (`meta_error`, `verify_error`), not raised, so every readable fact is shown."""
    if ds_files.is_deepspeed(Path(ckpt)):  # DeepSpeed's own save_dir or tag folder: what its files say
        tag = None if step is None or Path(ckpt).name == f"global_step{step}" else f"global_step{step}"
        return ds_export.inspect(Path(ckpt), tag)
    d = resolve(ckpt, step)
    key = signing.resolve(key)
    try:
        signed = manifest.is_signed(d)
    except ConfigError:
        signed = None
    meta_error = None
    try:
        meta = _meta(d)
        wrong = [k for k, t in _META_FIELDS.items() if meta.get(k) is not None and not _fits(meta[k], t)]
        if wrong:  # shown as unknown, the rest as read (escaped: a terminal's control codes are not printed)
            meta_error = (f"checkpoint file {d / META} is damaged: " + ", ".join(
                f"{k} is {meta.pop(k)!r:.40}, not {_META_FIELDS[k].__name__}"
                + (" of up to 64 printable characters" if _META_FIELDS[k] is str else "") for k in wrong))
    except ConfigError as e:
        meta, meta_error = {}, str(e)
    verified = verify_error = None
    if verify:
        try:
            _verify(d, progress, key)
            verified = True
        except ConfigError as e:
            verified, verify_error = False, str(e)
    read: dict[str, Any] = {k: meta.get(k) for k in _META_FIELDS}
    return CheckpointInfo(path=str(d), key=key is not None, signed=signed, meta_error=meta_error, **read,
                          verified=verified, verify_error=verify_error)
