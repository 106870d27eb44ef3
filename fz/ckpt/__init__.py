"""Checkpoints: sharded save/restore on DCP with an atomic commit, and safetensors export.

    ckpt = fz.Checkpointer("ckpt", keep_last=3, async_=True)
    ckpt.save(state)                                     # every rank; writes ckpt/step_<N>
    state = ckpt.restore(fz.init(model, spec))           # any world size, stage, precision
    fz.save(state, "ckpt"); fz.restore(template, "ckpt") # the same as functions, state first
    fz.load_weights(state, "model.safetensors")          # weights only, e.g. from consolidate
    $ fz consolidate ckpt model.safetensors --dtype bf16 # one file of the full weights
    $ fz inspect ckpt

Modules, by format: fz's own here: checkpointer (Checkpointer), functions (fz.save, fz.restore,
DeepSpeed's tag layout), arguments (the functions' argument order), saver, commit (putting a
checkpoint in place, replacing one safely), loader, layout (directories, durable renames), manifest
(checksums), signing (keyed manifests), tree (state <-> keys), group (checkpoint process groups,
agreement), reader, index and chunk (DCP files without torch.distributed or unpickling), writer,
space, finite (NaN/inf counted as weights load), regular (regular files only), export
(consolidate, inspect), results (what those return), progress. Hugging Face's safetensors and
folders in fz/ckpt/hf/, DeepSpeed's checkpoints in fz/ckpt/deepspeed/: each imports only fz/ckpt's
base (regular, signing, layout, finite, progress, results) and the formats below it (hf, then
deepspeed); the rest of fz/ckpt is above them (tests/unit/test_layering.py).
"""
from fz.ckpt.checkpointer import Checkpointer, wait_for_checkpoints
from fz.ckpt.export import consolidate, inspect
from fz.ckpt.functions import restore, save
from fz.ckpt.hf.safetensors_io import load_weights
from fz.ckpt.loader import PartialRestoreWarning
from fz.ckpt.results import CheckpointInfo, Consolidated

__all__ = ["CheckpointInfo", "Checkpointer", "Consolidated", "PartialRestoreWarning", "consolidate", "inspect",
           "load_weights", "restore", "save", "wait_for_checkpoints"]
