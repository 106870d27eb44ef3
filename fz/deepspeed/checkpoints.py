"""DeepSpeed's checkpoint calls on fz checkpoints, in DeepSpeed's layout: `save_dir/<tag>/` and a
`latest` file holding the tag.

`save_checkpoint(save_dir, tag, client_state)` writes an fz checkpoint (atomic, checksummed,
pickle-free) as the folder `save_dir/<tag>/` itself, then `save_dir/latest` (rank 0, atomically,
once the folder is committed; fz/ckpt/functions.py: `save_tag`). A tag saved again is replaced,
as DeepSpeed overwrites it, with the old copy readable until the new one is committed.
`load_checkpoint(load_dir, tag=None)` restores the tag `latest` names, or `tag`: a folder fz
wrote (this layout, or the older `<tag>/step_<N>/`), or one DeepSpeed wrote
(`global_stepN/*_model_states.pt`: fz.import_deepspeed), so a run moves from DeepSpeed to fz
mid-way. The engine's own counters ride in the client state under one key, taken out on load.
Beside the client's keys, load returns the metadata DeepSpeed's own file would hold (`ds_fields`), as
DeepSpeed returns every key of the file it did not load itself.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

import fz
from fz.ckpt.deepspeed import files as ds_files
from fz.ckpt.functions import save_tag
from fz.ckpt.layout import OLD
from fz.errors import CheckpointError
from fz.log import logger
from fz.storage.fresh import replacing

ENGINE_KEY = "fz.deepspeed"  # the engine's counters in the client state
LATEST = "latest"


def save(state: fz.State, save_dir: Path, tag: str, client_state: dict[str, Any], counters: dict[str, Any],
         save_latest: bool) -> None:
    """Every rank; each sees `latest` once it returns (the commit ends in an agreement)."""
    if ENGINE_KEY in client_state:
        raise CheckpointError(f"save_checkpoint: client_state key {ENGINE_KEY!r} is the engine's own; rename it")
    # DeepSpeed's own fields, as a script saves back the client state it loaded: load computes them afresh
    client_state = {k: v for k, v in client_state.items() if k not in FIELDS}
    save_tag(state, save_dir, tag, client_state={**client_state, ENGINE_KEY: counters}, client_state_per_rank=True,
             latest=save_latest)
    if state.plan.rank == 0 and (state.spec.stage > 0 or state.spec.precision == "bf16"):  # as DeepSpeed copies its own
        for script in RECOVERY_SCRIPTS:
            with replacing(save_dir / f"{script}.py") as tmp:
                tmp.write_text(RECOVERY.format(script=script))
                tmp.chmod(0o755)


RECOVERY_SCRIPTS = ("zero_to_fp32", "zero_to_torch")
RECOVERY = '''#!/usr/bin/env python
"""Written by fz.deepspeed's save_checkpoint beside its checkpoints, as DeepSpeed writes its own:
    python {script}.py <this folder> <output folder> [--safe_serialization] [-t TAG] ...
gives their full weights as a PyTorch state_dict (fz/deepspeed/utils/{script}.py)."""
from fz.deepspeed.utils.{script} import main

if __name__ == "__main__":
    main()
'''


def load(state: fz.State, load_dir: Path, tag: str | None, universal: bool = False,
         strict: bool = True) -> tuple[fz.State, Path, dict[str, Any], dict] | None:
    """(state, path, client_state, engine counters), or None (warned) when no `latest` names a tag;
    `universal` (the config's checkpoint.load_universal): the tag `latest_universal` names, as
    DeepSpeed reads it, its absence an error as in DeepSpeed; `strict=False` (load_module_strict):
    the tensors both hold, the rest warned (fz.restore's)."""
    if tag is None:
        latest = "latest_universal" if universal else LATEST
        if not (load_dir / latest).is_file():
            if universal:
                raise CheckpointError(f"load_checkpoint: {load_dir / latest} does not exist (the config's "
                                      "checkpoint.load_universal is true; DeepSpeed raises too): pass tag=...")
            _nothing_loaded(load_dir)
            return None
        tag = ds_files.latest_tag(load_dir, latest)  # a tag folder of load_dir: DeepSpeed's would follow it anywhere
    path, aside = load_dir / tag, load_dir / (tag + OLD)
    if not path.exists() and not aside.is_dir():
        raise CheckpointError(f"load_checkpoint: {path} does not exist (tag {tag!r} in {load_dir})")
    read = path if path.exists() else aside  # a save of this tag is replacing it, or was cut off doing so
    state, client = fz.restore(state, read, with_client_state=True, strict=strict)  # type: ignore[misc]
    client = dict(client)
    counters = client.pop(ENGINE_KEY, None) or {}
    if not counters and "global_samples" in client:  # DeepSpeed's file: its own count
        counters = {"global_samples": client["global_samples"]}
    samples = counters.get("global_samples", 0) if isinstance(counters, dict) else None
    if type(samples) is not int or not 0 <= samples <= 2**62:
        raise CheckpointError(f"load_checkpoint: {read} holds engine counters {str(counters)[:80]!r}, not "
                              "{'global_samples': an integer from 0 to 2**62}: damaged or altered")
    return state, path, client, dict(counters)


FIELDS = ("buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
          "global_samples", "checkpoint_parallel_dimensions", "ds_config", "ds_version")  # DeepSpeed's, load computes


def _modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(prefix, module) as DeepSpeed's engine walks them (named_children, recursively): a submodule
    reached through two parents comes twice, under each path."""
    yield prefix, module
    for name, child in module.named_children():
        if child is not None:
            yield from _modules(child, f"{prefix}{name}.")


def ds_fields(model: nn.Module, config: Any, stage: int, global_samples: int, version: str,
              groups: tuple[tuple[str, ...], ...] = ()) -> dict[str, Any]:
    """The keys DeepSpeed's load_checkpoint returns beside the client's own (its `_common_checkpoint_state`
    less what it loads), for this model: the config as given, the version, the buffer names, the shapes
    (per parameter group: `groups`' names, or one group of all). Its `frozen_param_fragments`, a copy of the
    frozen weights (which the state holds), is None."""
    named: OrderedDict[nn.Parameter, str] = OrderedDict()  # a parameter -> its first name (a later one: tied)
    shared: dict[str, str] = {}
    buffers: list[str] = []
    for prefix, module in _modules(model):
        for name, p in module.named_parameters(recurse=False):
            if p is None:
                continue
            if p in named:
                shared[prefix + name] = named[p]
            else:
                named[p] = prefix + name
        buffers += [prefix + name for name, b in module.named_buffers(recurse=False)
                    if b is not None and name not in module._non_persistent_buffers_set]

    def optimized(p: nn.Parameter) -> bool:  # DeepSpeed's is_optimized_parameter: trainable and not empty
        return p.requires_grad and p.numel() > 0
    by_name = {k: p for p, k in named.items()}
    order = groups or (tuple(by_name),)
    return {"buffer_names": buffers,
            "param_shapes": [OrderedDict((k, by_name[k].shape) for k in g if k in by_name and optimized(by_name[k]))
                             for g in order] if stage else None,
            "frozen_param_shapes": OrderedDict((k, p.shape) for p, k in named.items() if not optimized(p))
            if stage >= 2 else None,
            "shared_params": shared if stage else None, "frozen_param_fragments": None,
            "global_samples": global_samples, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": config, "ds_version": version}


def _nothing_loaded(load_dir: Path) -> None:
    """DeepSpeed's (None, None) with a warning a script cannot miss: what is there, what to pass."""
    if not load_dir.exists():
        what = "does not exist"
    else:
        tags = sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.endswith((".tmp", OLD, ".del")))
        what = (f"has no '{LATEST}' file (its folders: {', '.join(tags[:5])}{', ...' if len(tags) > 5 else ''}; "
                "pass tag=... to load one)" if tags else f"has no '{LATEST}' file and no checkpoint")
    logger("deepspeed").warning(
        f"fz.deepspeed: load_checkpoint({str(load_dir)!r}): nothing loaded: {load_dir} {what}. The engine keeps its "
        "initial state, and load_checkpoint returns (None, None), as DeepSpeed's does: check `if load_path is None` "
        "before reading the client state")
