"""Checkpoints: sharded save/restore on DCP with an atomic commit, and safetensors export.

    fz.save(state, "ckpt", keep_last=3)                  # every rank; writes ckpt/step_<N>
    state = fz.restore("ckpt", fz.init(model, spec))     # any world size, stage, precision
    fz.load_weights(state, "model.safetensors")          # weights only, e.g. from consolidate
    $ fz consolidate ckpt model.safetensors --dtype bf16 # one file of the full weights
    $ fz inspect ckpt

Modules: layout (directories, durable renames), manifest (checksums), tree (state <-> keys),
group (checkpoint process group, agreement), saver, loader, reader (DCP files without
torch.distributed), safetensors_io, export (consolidate, inspect), progress.
"""
from fz.ckpt.export import consolidate, inspect
from fz.ckpt.loader import PartialRestoreWarning, restore
from fz.ckpt.safetensors_io import load_weights
from fz.ckpt.saver import save, wait_for_checkpoints

__all__ = ["PartialRestoreWarning", "consolidate", "inspect", "load_weights", "restore", "save",
           "wait_for_checkpoints"]
