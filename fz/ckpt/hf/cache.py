"""Where a Hugging Face weights folder's files may lie: in the folder, or, for a snapshot of the Hub's
cache (`<repo>/snapshots/<revision>/`, as `snapshot_download` and `from_pretrained` leave it, each
file a link to `<repo>/blobs/<hash>`), in that repo's `blobs`: nowhere else."""
from __future__ import annotations

import os
from pathlib import Path

from fz.ckpt.regular import inside


def in_folder(folder: Path, f: Path, what: str = "weights file") -> Path:
    """`f`, refused unless it lies in `folder` (links followed) or, in a Hugging Face cache snapshot
    (`<repo>/snapshots/<revision>`, as snapshot_download leaves it), in that repo's `blobs` (a folder
    there, not a link to one), where the snapshot's files link: nowhere else."""
    at = Path(os.path.abspath(folder))
    for snapshot in (at, *at.parents):  # the folder, or a subfolder of a snapshot (diffusers' unet/, subfolder=)
        blobs = snapshot.parent.parent / "blobs"
        # the repo's own blobs folder, not a link (a `blobs` linked to / made every file a blob)
        if snapshot.parent.name == "snapshots" and blobs.is_dir() and not blobs.is_symlink():
            try:
                if Path(f).resolve().is_relative_to(blobs.resolve()):
                    return f
            except (OSError, ValueError):
                pass  # inside() says why
            break
    return inside(folder, f, what, "the weights folder")
