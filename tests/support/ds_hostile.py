"""Hostile DeepSpeed checkpoints for the reader's tests, made in the test (nothing stored).

`checkpoint(root)` writes a small ZeRO-3 save_dir in DeepSpeed's exact file format (ds_synth:
world 2, tag global_step3, two trainable params and a frozen one); its `patch` hook crafts
the object a file holds before it is saved. The crafted pieces are what a hostile file's
pickle would hold, as opcodes (`Raw`) where Python's pickler cannot write them:
`tensor(...)` a tensor record with any size, stride and offset, and opcodes of choice right
after its storage reference or after the tensor; `rebind(file)` the BUILD that re-pointed
the old reader's storage at another file; `nested(n)` lists n deep; `archive` a zip of any
members, for files whose zip itself is crafted. `Net` is the model the checkpoint is of
(`refusal` imports it on each rank). `laughs(n)` is plain
data: lists that each hold the one before twice, 2**n elements in a few hundred bytes.
`within(seconds)` turns a hang into a failure (SIGALRM) so a regression cannot stall CI.
"""
from __future__ import annotations

import contextlib
import pickle
import signal
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from support import ds_synth
from support.ds_synth import Raw

PARAMS = [("w", (6, 4)), ("b", (5,))]
FROZEN = [("f", (3, 3))]
TAG = "global_step3"
SECRET = b"\x00\x00\x80\x3f" * 8  # 8 float32 ones: bytes of a file outside the checkpoint


def checkpoint(root: Path, params: list[tuple[str, tuple[int, ...]]] = PARAMS, step: int = 3,
               patch: Callable[[str, int, dict], None] | None = None) -> Path:
    """A ZeRO-3 save_dir at `root` (`latest` naming global_step3), two ranks; returns `root`."""
    ds_synth.write(root / TAG, params, world=2, frozen=FROZEN, step=step, patch=patch)
    return root


def model_file(root: Path, rank: int = 0) -> Path:
    return root / TAG / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file(root: Path, rank: int = 0) -> Path:
    return root / TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _str(s: str) -> bytes:
    data = s.encode()
    return pickle.BINUNICODE + len(data).to_bytes(4, "little") + data


def _int(i: int) -> bytes:
    return pickle.dumps(i, protocol=2)[2:-1]  # ints are never memoized: no memo index to clash with


def _tuple(xs: tuple[int, ...]) -> bytes:
    return pickle.MARK + b"".join(_int(x) for x in xs) + pickle.TUPLE


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def tensor(size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0, key: str = "0", numel: int = 8,
           after_storage: bytes = b"", after: bytes = b"") -> Raw:
    """torch's record of a float32 tensor over storage `key` (of `numel` elements: ds_synth's
    model files hold the 8-element buffer `scale` as storage "0"), with `after_storage` opcodes
    right after the storage reference and `after` ones after the tensor."""
    pid = pickle.MARK + _str("storage") + _global("torch", "FloatStorage") + _str(key) + _str("cpu") + _int(numel)
    args = (pid + pickle.TUPLE + pickle.BINPERSID + after_storage + _int(offset) + _tuple(size) + _tuple(stride)
            + pickle.NEWFALSE + _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE)
    return Raw(_global("torch._utils", "_rebuild_tensor_v2") + pickle.MARK + args + pickle.TUPLE + pickle.REDUCE
               + after)


def rebind(file: Path, at: int = 0) -> bytes:
    """A BUILD that sets the object on the stack's `file` and `at`: where the old reader read bytes from."""
    return (pickle.EMPTY_DICT + pickle.MARK + _str("file") + _str(str(file)) + _str("at") + _int(at)
            + pickle.SETITEMS + pickle.BUILD)


def archive(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A torch.save-style zip (stored, not compressed) of `members` as given: names may repeat."""
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore")  # zipfile warns of a repeated name, which is the point
        for name, data in members:
            z.writestr(name, data)
    return path


def pickled(raw: Raw) -> bytes:
    """`raw` as a whole pickle (protocol 2)."""
    return pickle.PROTO + b"\x02" + raw.ops + pickle.STOP


def nested(n: int) -> Raw:
    """A list holding a list ... n deep (n EMPTY_LISTs, then n - 1 APPENDs)."""
    return Raw(pickle.EMPTY_LIST * n + pickle.APPEND * (n - 1))


def laughs(n: int) -> list[Any]:
    """n levels of lists that each hold the one before twice: pickled once each (memo), 2**n when walked."""
    x: list[Any] = []
    for _ in range(n):
        x = [x, x]
    return x


class Hung(BaseException):
    """What `within` raises: not an OSError (TimeoutError is one), so code under test that catches
    OSError or Exception cannot swallow it."""


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Raise Hung in the block after `seconds` (a hang becomes a failure, not a stalled run)."""
    def expire(*_: Any) -> None:
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Net(torch.nn.Module):
    """The model `checkpoint` is of (w, b trainable; f frozen): fz.import_deepspeed reads all of it into one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4))
        self.b = torch.nn.Parameter(torch.zeros(5))
        self.f = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w.T).sum() + self.b.sum() + self.f.sum()


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def state(**kw: Any) -> Any:
    """A ZeRO-3 AdamW fz state of `Net` (kw: more Spec fields)."""
    import fz
    return fz.init(Net(), fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=_loss, seed=0, **kw))


def refusal(rank: int, world: int, root: Path) -> str:
    """fz.import_deepspeed of `root` into `state()` on this rank: the error it raised, as 'Type: message'."""
    import fz
    try:
        fz.import_deepspeed(state(), root)
    except Exception as e:  # what each rank raised is the result
        return f"{type(e).__name__}: {e}"
    return "imported"
