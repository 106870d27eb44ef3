"""What the offline tools return: `Consolidated` (fz.ckpt.consolidate) and `CheckpointInfo`
(fz.ckpt.inspect), frozen dataclasses with typed, documented fields in place of fz 0.1's dicts.

The fields keep the dicts' keys, and reading one by key (`info["step"]`, `.get`, `in`, `keys()`,
so `dict(info)` too) still works as before, with a DeprecationWarning naming the attribute: code
written against the dicts keeps running and is told what to change. `dataclasses.asdict` gives a
dict (every field; the dicts left some keys out).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, ClassVar


class _ReadByKey:
    """fz 0.1's dict reads on a result dataclass, each warning once per call site."""

    _made_by: ClassVar[str] = ""
    # a key the dict left out while a field was None: key -> that field
    _absent_when_none: ClassVar[dict[str, str]] = {}

    def _keys(self) -> list[str]:
        absent = self._absent_when_none
        return [f.name for f in fields(self)  # type: ignore[arg-type]
                if f.name not in absent or getattr(self, absent[f.name]) is not None]

    def _warn(self, how: str, instead: str) -> None:
        warnings.warn(f"{how} on the result of {self._made_by} is deprecated: it returns a "
                      f"{type(self).__name__} dataclass now; {instead}", DeprecationWarning, stacklevel=3)

    def __getitem__(self, key: str) -> Any:
        self._warn(f"[{key!r}]", f"read .{key}")
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        self._warn(f".get({key!r})", f"read .{key}")
        return getattr(self, key) if key in self._keys() else default

    def __contains__(self, key: object) -> bool:
        self._warn(f"{key!r} in", "read the field (None when not known)")
        return key in self._keys()

    def keys(self) -> list[str]:
        self._warn(".keys()", "use dataclasses.fields() or dataclasses.asdict()")
        return self._keys()


@dataclass(frozen=True)
class Consolidated(_ReadByKey):
    """What `fz.ckpt.consolidate` wrote."""

    _made_by: ClassVar[str] = "fz.ckpt.consolidate"

    checkpoint: str  # the step directory read (`<root>/step_<N>`)
    out: str  # the safetensors file written
    tensors: int  # parameters and state_dict buffers written
    bytes: int  # bytes read from the checkpoint, as stored (before any dtype cast)
    chunks: int  # stored chunks streamed (a tensor saved by several ranks has several)


@dataclass(frozen=True)
class CheckpointInfo(_ReadByKey):
    """What `fz.ckpt.inspect` found in a checkpoint. The fields from its fz.json are None when
    that file is unreadable (`meta_error` says why) or, in an older checkpoint, lacks them."""

    _made_by: ClassVar[str] = "fz.ckpt.inspect"
    _absent_when_none: ClassVar[dict[str, str]] = {"meta_error": "meta_error", "verified": "verified",
                                                    "verify_error": "verified"}

    path: str  # the step directory (`<root>/step_<N>`)
    key: bool  # a key was given (the argument or FZ_CKPT_KEY): verifying checks the signature too
    signed: bool | None  # the manifest carries an HMAC; None when the manifest is unreadable
    meta_error: str | None  # why fz.json could not be read; None when it was
    step: int | None  # the checkpoint's step (its directory's N)
    train_step: int | None  # the state's step count when saved
    world: int | None  # ranks that saved it
    stage: int | None  # ZeRO stage
    precision: str | None  # "fp32", "bf16" or "fp16"
    master: bool | None  # holds fp32 master weights
    fz_version: str | None
    torch_version: str | None
    tensors: int | None  # every stored tensor (parameters, optimizer state, buffers, RNG, ...)
    bytes: int | None  # their bytes as stored
    model_tensors: int | None  # the parameters alone (fp32 master weights when the run kept them)
    model_bytes: int | None
    verified: bool | None  # the sizes and checksums (and signature, with a key) match; None: not checked
    verify_error: str | None  # why verification failed; None when it passed or did not run
    format: str = "fz"  # "fz", or "deepspeed": DeepSpeed's own files, read (no manifest to verify, no fz.json)
