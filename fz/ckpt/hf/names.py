"""Which tensors of a weights file fill which parameters of a state: names, tied aliases, and
transformers 5's load-time conversions.

A file's names are those its writer used. fz's own files and most Hugging Face checkpoints
use the model's state_dict names; a tied pair (`lm_head.weight` <- `model.embed_tokens.weight`
when `config.tie_word_embeddings`) is one tensor in fz, found under any of its names (HF
writes it once; a file with both loads too, the canonical name's tensor winning, as HF's
tie_weights keeps the embedding). transformers 5 also changes some models' layout at load
time (Mixtral's experts, one tensor per expert in the files, fused into one per layer in
memory): for a transformers model this module renames and converts exactly as
`from_pretrained` does, with transformers' own conversion mapping and rename rules
(`rename_source_key`), so a folder `save_pretrained` wrote loads into the same class under fz
(fz.hf.save_pretrained applies the reverse, `revert_weight_conversion`).

transformers is imported only here, only when the model is a transformers model.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from fz.ckpt.hf.weights import Entry
from fz.errors import CheckpointError


@dataclass
class Group:
    """Several file tensors that one transformers conversion turns into one or more targets."""

    first: str  # the converter's first target name (its key in transformers' loop)
    converter: Any  # a fresh WeightConverter prototype (deep-copied for each use)
    sources: list[tuple[str, str]] = field(default_factory=list)  # (file name, the converter's source pattern)
    outputs: dict[str, str] = field(default_factory=dict)  # converted name -> canonical name

    def realize(self, model: nn.Module | None, tensor: Callable[[str], Tensor]) -> dict[str, Tensor]:
        """{converted name: tensor}, the sources read by `tensor(file name)` when the conversion asks."""
        conv = copy.deepcopy(self.converter)
        for key, pattern in self.sources:
            conv.add_tensor(self.first, key, pattern, lambda key=key: tensor(key))
        out = conv.convert(self.first, model=model, config=getattr(model, "config", None))
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


@dataclass
class Match:
    """How the file fills the state: canonical name -> file name (read directly, by rows), the
    converted groups, and what does not match."""

    direct: dict[str, str]
    groups: list[Group]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]

    @property
    def problems(self) -> list[str]:
        return ([f"shape mismatch: {m}" for m in self.mismatched] + [f"missing: {n}" for n in self.missing]
                + [f"unexpected: {n}" for n in self.unexpected])  # the shapes first: they say why


def _hf_rules(model: nn.Module | None):
    """(renamings, converters, base_model_prefix) transformers applies when loading `model`; None
    for a model that is not a transformers one, or a transformers without load-time conversions."""
    if model is None or not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    mapping = get_model_conversion_mapping(model, add_legacy=True) or []  # type: ignore[arg-type]
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    return renamings, [m for m in mapping if isinstance(m, WeightConverter)], model.base_model_prefix


def _patterns(model: nn.Module | None, attr: str) -> list[str]:
    return list(getattr(model, attr, None) or []) if model is not None else []


def match(entries: dict[str, Entry], targets: dict[str, tuple[int, ...]], aliases: dict[str, str],
          model: nn.Module | None) -> Match:
    """Pair the file's tensors with the state's `targets` ({canonical name: shape}); `aliases` maps
    every name of the model (tied ones included) to its canonical name."""
    known = {n: c for n, c in aliases.items() if c in targets}
    known.update((c, c) for c in targets)
    rules = _hf_rules(model)
    keys = sorted(entries)
    if rules is not None:
        from transformers.core_model_loading import dot_natural_key, rename_source_key
        keys.sort(key=dot_natural_key)
        renamings, converters, prefix = rules
        by_pattern = {p: c for c in converters for p in c.source_patterns}
    direct: dict[str, list[tuple[str, str]]] = {}  # canonical -> [(renamed, file name)]
    groups: dict[str, Group] = {}
    unexpected: list[str] = []
    for key in keys:
        renamed, pattern = key, None
        if rules is not None:
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, known)
            if renamed not in known and key in known:  # as from_pretrained: the name was right as it was
                renamed, pattern = key, None
        if renamed not in known:
            unexpected.append(key)
        elif pattern is not None:
            g = groups.setdefault(renamed, Group(renamed, copy.deepcopy(by_pattern[pattern])))
            g.sources.append((key, pattern))
        else:
            direct.setdefault(known[renamed], []).append((renamed, key))
    chosen = {c: next((k for r, k in names if r == c), names[0][1]) for c, names in direct.items()}
    mismatched = [f"{k} is {entries[k].shape} in the file, {tuple(targets[c])} here"
                  for c, k in chosen.items() if tuple(entries[k].shape) != tuple(targets[c])]
    filled = set(chosen)
    for g in groups.values():
        try:
            meta = g.realize(model, lambda k: torch.empty(entries[k].shape, dtype=entries[k].dtype, device="meta"))
        except Exception as e:  # noqa: BLE001 - the conversion itself refuses these tensors: named
            raise CheckpointError(f"weights: transformers' conversion into {g.first!r} fails on the file's tensors "
                                  f"({', '.join(k for k, _ in g.sources[:3])}, ...): {type(e).__name__}: {e}") from e
        for name, t in meta.items():
            if name not in known:
                unexpected.append(f"{name} (converted from {g.sources[0][0]}, ...)")
                continue
            g.outputs[name] = c = known[name]
            filled.add(c)
            if tuple(t.shape) != tuple(targets[c]):
                mismatched.append(f"{name} is {tuple(t.shape)} converted from {g.sources[0][0]}, ..., "
                                  f"{tuple(targets[c])} here")
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    missing = [c for c in targets if c not in filled
               and not any(re.search(p, n) for p in ignore_missing for n, cc in known.items() if cc == c)]
    unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignore_unexpected)]
    return Match(chosen, [g for g in groups.values() if g.outputs], missing, unexpected, mismatched)
