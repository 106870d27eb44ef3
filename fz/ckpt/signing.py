"""Keyed checkpoints: an HMAC-SHA256 over the manifest's file table proves who wrote a checkpoint.

The manifest's crc32s catch damage, not tampering: anyone can change a file and recompute
them. With a key (`key=` on fz.save / fz.restore / fz.Checkpointer / consolidate / inspect,
else the environment variable FZ_CKPT_KEY, which the `fz` command reads too), each file's
checksum is its sha256 and the manifest carries `hmac`, HMAC-SHA256(key, the file table):
changing any byte of any file, or the table, needs the key. Restoring with a key refuses a
checkpoint that is unsigned, signed with another key, or modified. The key is never written
anywhere; ranks that save compare only a fingerprint of it (`key_id`).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

from fz.errors import CheckpointError, ConfigError

ENV = "FZ_CKPT_KEY"
ALGORITHM = "sha256"  # each file's checksum in a signed manifest
Key = str | bytes | None


def resolve(key: Key) -> bytes | None:
    """The key as bytes: `key`, else FZ_CKPT_KEY from the environment, else None (unsigned)."""
    if key is None:
        key = os.environ.get(ENV) or None
        where = f"the environment variable {ENV}"
    else:
        where = "key="
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes):
        raise ConfigError(f"{where} must be str or bytes, got {type(key).__name__}")
    if len(key) < 16:
        raise ConfigError(f"{where} is {len(key)} bytes: a checkpoint key needs at least 16 (e.g. "
                          "python -c 'import secrets; print(secrets.token_hex(32))')")
    return key


def key_id(key: bytes | None) -> str | None:
    """A fingerprint that tells keys apart without revealing them (None: no key)."""
    return None if key is None else hmac.new(key, b"fz checkpoint key id", hashlib.sha256).hexdigest()[:16]


def sign(key: bytes, files: dict[str, dict]) -> str:
    return hmac.new(key, json.dumps(files, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def check(path: str, body: dict, files: dict[str, dict], key: bytes) -> None:
    """The manifest `body` (at `path`) is signed with `key`; every file's checksum is a sha256."""
    tag = body.get("hmac")
    if not isinstance(tag, str):
        raise CheckpointError(f"{path} is not signed: the checkpoint was saved without a key, so nothing proves who "
                          f"wrote it. Restore it without key= (and without {ENV}) only if you trust its source")
    if not hmac.compare_digest(tag, sign(key, files)):
        raise CheckpointError(f"{path} does not carry this key's signature: the checkpoint was saved with another "
                          "key, or modified since it was saved")
    weak = sorted(n for n, v in files.items() if v.get("algorithm") != ALGORITHM)
    if weak:
        raise CheckpointError(f"{path} is signed but lists non-{ALGORITHM} checksums ({', '.join(weak[:3])}): refused")
