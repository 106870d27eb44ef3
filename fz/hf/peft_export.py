"""A PEFT model's State as PEFT writes it: the adapter (`adapter_config.json`,
`adapter_model.safetensors`), or, on request, the base model with the adapter merged.

`PeftModel.save_pretrained` writes only what trains: the adapters' weights under PEFT's names
and their config. fz gathers the State's trainable parameters (their fp32 masters, one bucket at
a time, every rank taking part) and hands them to PEFT's own writer on the writing rank, as
`state_dict=`, so the folder is PEFT's byte for byte and `PeftModel.from_pretrained(base, out)`
loads it. `merged=True` writes what `model.merge_and_unload().save_pretrained(out)` writes: the
writing rank holds the whole model once, in a copy of the PeftModel with the State's weights,
which PEFT merges (any adapter type PEFT merges); the user's model is left as it was.
Written into a hidden folder and moved into place whole.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fz.ckpt.group import GroupCache, exchange, state_ranks
from fz.ckpt.regular import parse_json, read_small
from fz.distributed.arrival import arrive
from fz.errors import ConfigError
from fz.observe.full_params import gathered
from fz.state import State
from fz.storage.fresh import fresh_dir, remove_entry

_MAX_CONFIG = 16 << 20  # bytes: a transformers config.json is a few KiB

_GROUPS = GroupCache()
_TMP = ".fz-peft-"


def is_peft_model(model: Any) -> bool:
    """A peft.PeftModel (by what it has, so that peft need not be installed to ask)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model") and hasattr(model, "active_adapter")


def save_peft(state: State, out: str | os.PathLike[str], model: Any, *, merged: bool = False,
              processing_class: Any = None, dtype: torch.dtype | None = None) -> tuple[list[str], int, int, str]:
    """Write the PEFT `model`'s State to `out` (module docstring); every rank calls it. The adapters
    in `dtype` (None: the precision the run computes in, as DeepSpeed's bf16 module writes them);
    merged, fp32. Returns the files written, the tensors and bytes gathered for them, and the dtype."""
    plan = state.plan
    what = f"fz.hf.save_pretrained of a PEFT model to {out}"
    if len(plan.ranks) > 1:
        arrive("fz.hf.save_pretrained", plan.ranks, plan.rank)
    cast = torch.float32 if merged else dtype or state.spec.compute_dtype
    written = {n for n, p in model.named_parameters() if p.requires_grad} | _adapters_parameters(model)
    embeddings = {} if merged else _embeddings_peft_saves(model)
    writer = plan.rank == plan.ranks[0]
    group = _GROUPS.get(state_ranks(state), state.spec.timeout_s) if len(plan.ranks) > 1 else None
    keep: dict[str, Tensor] = {}
    for name, t in gathered(state, False, "fz.hf.save_pretrained", copy=True):
        if writer and (merged or name in written or name in embeddings.values()):
            keep[name] = t.detach().to("cpu", cast)
    err, files = None, []
    counted = (len(keep), sum(t.numel() * t.element_size() for t in keep.values()), str(cast).removeprefix("torch."))
    if writer:  # what state_dict() has besides: PEFT picks from it (VeRA's projections, buffers), or drops it
        listed = set(model.state_dict(keep_vars=True))  # names only: persistent buffers, every name of a tensor
        keep.update((n, b.detach().to("cpu")) for n, b in state.buffers.items() if n in listed and n not in keep)
        # every name of a kept tensor: a tied output embedding, VBLoRA's vector bank, VeRA's projections
        for alias, name in _aliases(model).items():  # (PEFT reads the model's own names of them)
            if name in keep and alias in listed:
                keep.setdefault(alias, keep[name])
    if writer:
        try:
            files = _write(Path(out), model, keep, merged, processing_class)
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
            err = e
    if group is not None:
        exchange(group, None, err, what)
    elif err is not None:
        raise err
    return files, *counted


def _adapters_parameters(model: Any) -> set[str]:
    """The parameters of the model's adapters, trained or not (PEFT writes every adapter's, each in
    its own folder, an untrained reference adapter too): those PEFT's layers keep in a ModuleDict or
    ParameterDict under an adapter's name (`lora_A["ref"]`, `lora_embedding_A["ref"]`)."""
    adapters = set(getattr(model, "peft_config", {}))
    out: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
            for key in adapters & set(module.keys()):
                out |= {f"{prefix}.{key}.{n}" if n else f"{prefix}.{key}"
                        for n, _ in (module[key].named_parameters() if isinstance(module[key], torch.nn.Module)
                                     else [("", None)])}
    return out


def _aliases(model: Any) -> dict[str, str]:
    """{a parameter's or buffer's other name: the first, under which fz holds it}."""
    first: dict[int, str] = {}
    out = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if first.setdefault(id(t), name) != name:
            out[name] = first[id(t)]
    return out


def _embeddings_peft_saves(model: Any) -> dict[str, str]:
    """{name (tied aliases too): the name fz holds it under} of the input and output embeddings,
    where PEFT's save_pretrained (save_embedding_layers="auto") writes them beside the adapter:
    an embedding the adapter targets, or a vocabulary resized from the base model's (its
    config.json, local; a base on the Hub is given them, and PEFT checks there)."""
    layers = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            layers.append(getattr(model, get)())
        except (AttributeError, NotImplementedError):
            continue
    layers = [m for m in layers if m is not None]
    targeted = any(hasattr(m, "base_layer") for m in layers)
    base = next(iter(getattr(model, "peft_config", {}).values()), None)
    model_id = str(getattr(base, "base_model_name_or_path", None) or "")
    config = Path(model_id) / "config.json" if model_id else None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    resized = False
    if config is not None and config.is_file():
        try:  # a base named by a (downloaded) adapter's config: bounded in size and depth, a regular file
            base_config = parse_json(read_small(config, _MAX_CONFIG, "the base model's config"), str(config))
            resized = base_config.get("vocab_size") not in (None, vocab)
        except (OSError, ValueError, AttributeError):  # a CheckpointError is a ValueError: unreadable, unknown
            resized = False
    elif model_id:
        resized = True
    if not (targeted or resized):
        return {}
    ids = {id(p) for m in layers for p in m.parameters()}
    aliases = _aliases(model)
    return {name: aliases.get(name, name) for name, p in model.named_parameters(remove_duplicate=False)
            if id(p) in ids}


@contextlib.contextmanager
def _prompt_encoder_of(model: Any, tensors: dict[str, Tensor]) -> Iterator[None]:
    """Prompt learning (prompt, prefix, p-tuning): PEFT saves the embeddings its prompt encoder computes,
    running the model's (empty at ZeRO-3 while training), not `state_dict=`: meanwhile the model holds a
    copy of its encoder with the State's weights."""
    encoder = getattr(model, "prompt_encoder", None)
    if not isinstance(encoder, torch.nn.Module) or not any(
            getattr(c, "is_prompt_learning", False) for c in getattr(model, "peft_config", {}).values()):
        yield
        return
    own = {k.removeprefix("prompt_encoder."): t for k, t in tensors.items() if k.startswith("prompt_encoder.")}
    filled = copy.deepcopy(encoder)
    with torch.no_grad():
        filled.load_state_dict(own, strict=False, assign=True)
    model.prompt_encoder = filled
    try:
        yield
    finally:
        model.prompt_encoder = encoder


def _write(out: Path, model: Any, tensors: dict[str, Tensor], merged: bool, processing_class: Any) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{_TMP}*"):
        remove_entry(stale)  # a planted link too, unfollowed
    tmp = fresh_dir(out / f"{_TMP}{os.getpid()}")
    try:
        if merged:
            copy_ = copy.deepcopy(model)
            missing = {n for n, _ in copy_.named_parameters()} - set(tensors)
            if missing:
                raise ConfigError(f"fz.hf.save_pretrained(merged=True): the state holds no {sorted(missing)[0]!r}: "
                                  "pass the PEFT model the state was made from")
            with torch.no_grad():
                copy_.load_state_dict(tensors, strict=False, assign=True)
            copy_.merge_and_unload().save_pretrained(tmp, safe_serialization=True)
        else:
            with _prompt_encoder_of(model, tensors):
                model.save_pretrained(tmp, state_dict=tensors, safe_serialization=True)
        if processing_class is not None:
            processing_class.save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            dst = out / name
            if dst.is_dir():
                shutil.rmtree(dst)
            os.replace(tmp / name, dst)
        return files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
