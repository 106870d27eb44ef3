"""Hostile DeepSpeed checkpoints are refused by every reader, fast, in bounded memory (issue 40, 1-3).

Each case is a small DeepSpeed checkpoint (tests/support/ds_hostile.py) with one file crafted:
a BUILD that re-points a storage at a file outside the folder, a FIFO, shared lists that
expand to 2**30 elements, a partition_count of 1e9, a tensor whose stride repeats one element
2**31 times, a negative shape, 100k-deep nesting, a `latest` leading outside the save_dir,
another run's rank file. `DeepSpeedCheckpoint`, `fz.import_deepspeed`, `fz.restore` and the
`fz consolidate` command must each refuse it with a CheckpointError (the command: exit 2 and
the message) naming the file and the cause, within a bound set by the same reader's time on
an intact checkpoint, and without the memory a crafted size asks for.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import fz
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.cli import main
from fz.errors import CheckpointError

from support import ds_hostile as h
from support.helpers import make_model, spec

READERS = ("open", "import", "restore", "consolidate")


def _read(reader: str, state: fz.State, path: Path, out: Path) -> None:
    """`path` read by `reader` to the end; a refusal raises CheckpointError (the command's too)."""
    if reader == "open":
        ck = DeepSpeedCheckpoint(path)
        for name in [*ck.params, *ck.frozen]:
            list(ck.read(name))
    elif reader == "import":
        fz.import_deepspeed(state, path)
    elif reader == "restore":
        fz.restore(state, path)
    else:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["consolidate", str(path), str(out)])
        if rc:
            assert rc == 2 and err.getvalue().startswith("fz consolidate: error: "), (rc, err.getvalue())
            raise CheckpointError(err.getvalue())


def _seconds(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    with contextlib.suppress(CheckpointError):
        fn()
    return time.perf_counter() - t


@pytest.fixture(scope="module")
def state() -> fz.State:
    return fz.init(make_model(), spec(1, 1))


@pytest.fixture(scope="module")
def reference(state: fz.State, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """Seconds each reader takes on an intact checkpoint of the same size (import and restore
    end refusing it: the state is another model's), the slowest of two tries."""
    root = h.checkpoint(tmp_path_factory.mktemp("intact") / "ck")
    out = root.parent / "out.safetensors"
    return {r: max(_seconds(functools.partial(_read, r, state, root, out)) for _ in range(2)) for r in READERS}


def _refused(reader: str, state: fz.State, root: Path, reference: dict[str, float]) -> str:
    """The refusal's message, checked to come in bounded time and memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with h.within(120), pytest.raises(CheckpointError) as e:
        _read(reader, state, root, root.parent / "out.safetensors")
    took = time.perf_counter() - t
    assert took < 5 + 10 * reference[reader], (took, reference[reader])
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak  # KiB on Linux
    assert grew < 1 << 20, f"the peak memory grew {grew} KiB"
    assert not (root.parent / "out.safetensors").exists()
    return str(e.value)


def _module(raw: h.Raw) -> Callable[[str, int, dict], None]:
    """A patch adding `raw` to rank 0's module as a buffer (read whole when the checkpoint opens)."""
    def patch(kind: str, rank: int, obj: dict) -> None:
        if kind == "model" and rank == 0:
            obj["module"]["evil"] = raw
            obj["buffer_names"] = [*obj["buffer_names"], "evil"]
    return patch


def _client(value: object) -> Callable[[str, int, dict], None]:
    def patch(kind: str, rank: int, obj: dict) -> None:
        if kind == "model" and rank == 0:
            obj["evil"] = value
    return patch


def _partition_count(kind: str, rank: int, obj: dict) -> None:
    if kind == "optim" and rank == 0:
        obj["optimizer_state_dict"]["partition_count"] = 10**9


def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(h.SECRET)
    return secret


def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return fifo


# (case, what the crafted checkpoint's patch adds given tmp_path, the file refused, words of the cause)
PICKLES = {
    "build after the storage, to a file outside": (
        lambda p: _module(h.tensor((8,), (1,), after_storage=h.rebind(_outside(p)))), 0, "a BUILD of _Storage"),
    "build after the storage, to a FIFO": (
        lambda p: _module(h.tensor((8,), (1,), after_storage=h.rebind(_fifo(p)))), 0, "a BUILD of _Storage"),
    "build after the tensor": (
        lambda p: _module(h.tensor((8,), (1,), after=h.rebind(_outside(p)))), 0, "a BUILD of Lazy"),
    "billion laughs": (lambda p: _client(h.laughs(30)), 0, "stands for more than"),
    "partition_count 1e9": (lambda p: _partition_count, "optim",
                            "partition_count says the checkpoint was written by 1000000000 ranks"),
    "stride 0": (lambda p: _module(h.tensor((2**31,), (0,))), 0, "needs more than its storage's 8 elements"),
    "overlapping strides": (lambda p: _module(h.tensor((4, 4), (1, 1))), 0, "needs more than its storage's 8"),
    "negative shape": (lambda p: _module(h.tensor((-1, 4), (4, 1))), 0, "not up to 64 non-negative ints"),
    "overflowing shape": (lambda p: _module(h.tensor((2**62, 2**62), (2**62, 1))), 0, "needs more than its storage"),
    "offset past the storage": (lambda p: _module(h.tensor((4,), (1,), offset=6)), 0, "needs more than its storage"),
    "storage longer than its bytes": (lambda p: _module(h.tensor((8,), (1,), numel=2**40)), 0,
                                      "holds 32 bytes, not 1099511627776"),
    "100k-deep nesting": (lambda p: _client(h.nested(100_000)), 0, "nests deeper than 100 levels"),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", list(PICKLES))
def test_crafted_pickle_is_refused(case: str, reader: str, state: fz.State, reference: dict[str, float],
                                   tmp_path: Path) -> None:
    make, which, cause = PICKLES[case]
    root = h.checkpoint(tmp_path / "ck", patch=make(tmp_path))
    msg = _refused(reader, state, root, reference)
    file = h.optim_file(root) if which == "optim" else h.model_file(root)
    assert str(file) in msg and cause in msg, msg


def _swap_fifo(root: Path, tmp_path: Path) -> str:
    f = h.optim_file(root, 1)
    f.unlink()
    os.mkfifo(f)
    return f"{f} is not a regular file (a FIFO)"


def _swap_symlink(root: Path, tmp_path: Path) -> str:
    other = h.checkpoint(tmp_path / "other")
    f = h.optim_file(root, 1)
    f.unlink()
    f.symlink_to(h.optim_file(other, 1))
    return f"{f} leads to {h.optim_file(other, 1)}, outside the checkpoint folder"


def _another_run(**kw: object) -> Callable[[Path, Path], str]:
    """Rank 1's optimizer file replaced by rank 1's of a run written with `kw`."""
    def swap(root: Path, tmp_path: Path) -> str:
        other = h.checkpoint(tmp_path / "other", **kw)  # type: ignore[arg-type]
        shutil.copy(h.optim_file(other, 1), h.optim_file(root, 1))
        return f"{h.optim_file(root, 1)} is not of the run that wrote {h.optim_file(root).name}: its"
    return swap


def _version(kind: str, rank: int, obj: dict) -> None:
    obj["ds_version"] = "0.18.0"


def _another_model_file(root: Path, tmp_path: Path) -> str:
    other = h.checkpoint(tmp_path / "other", params=[("w", (6, 4)), ("b", (9,))])
    shutil.copy(h.model_file(other, 1), h.model_file(root, 1))
    return f"{h.model_file(root, 1)} is not of the run that wrote {h.model_file(root).name}: its param_shapes"


def _latest(to: Callable[[Path, Path], str]) -> Callable[[Path, Path], str]:
    """`latest` rewritten to name `to(root, other run's save_dir)`."""
    def swap(root: Path, tmp_path: Path) -> str:
        other = h.checkpoint(tmp_path / "other")
        (root / "latest").write_text(to(root, other))
        return f"{root / 'latest'} names"
    return swap


def _symlinked_tag(root: Path, other: Path) -> str:
    (root / "global_step9").symlink_to(other / h.TAG, target_is_directory=True)
    return "global_step9"


def _latest_linked_out(root: Path, tmp_path: Path) -> str:
    """`latest` a symlink to a one-line file outside (a token): its text must not become the tag."""
    secret = tmp_path / "token"
    secret.write_text("hf_SECRET0123")
    (root / "latest").unlink()
    (root / "latest").symlink_to(secret)
    return f"{root / 'latest'} leads to {secret}, outside"


FILES = {
    "rank file is a FIFO": _swap_fifo,
    "rank file is a symlink out of the folder": _swap_symlink,
    "another run's rank file: version": _another_run(patch=_version),
    "another run's rank file: shapes": _another_run(params=[("w", (6, 4)), ("b", (9,))]),
    "another run's rank file: step": _another_run(step=5),
    "another run's ZeRO-3 model states": _another_model_file,
    "latest names a sibling": _latest(lambda root, other: f"../{other.name}/{h.TAG}"),
    "latest names an absolute path": _latest(lambda root, other: str(other / h.TAG)),
    "latest names a symlink out": _latest(_symlinked_tag),
    "latest is a symlink out": _latest_linked_out,
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", list(FILES))
def test_crafted_folder_is_refused(case: str, reader: str, state: fz.State, reference: dict[str, float],
                                   tmp_path: Path) -> None:
    root = h.checkpoint(tmp_path / "ck")
    want = FILES[case](root, tmp_path)
    msg = _refused(reader, state, root, reference)
    assert want in msg and "SECRET" not in msg, msg


def test_what_differs_is_named(tmp_path: Path) -> None:
    for i, (kw, what) in enumerate([({"patch": _version}, "DeepSpeed version '0.18.0' differs from"),
                                    ({"params": [("w", (6, 4)), ("b", (9,))]}, "partition sizes [17] differs from"),
                                    ({"step": 5}, "Adam step 5.0 differs from")]):
        root = h.checkpoint(tmp_path / f"ck{i}")
        _another_run(**kw)(root, tmp_path / f"other{i}")
        with pytest.raises(CheckpointError) as e:
            DeepSpeedCheckpoint(root)
        assert f"its {what} zero_pp_rank_0_mp_rank_00_optim_states.pt's" in str(e.value), str(e.value)


def test_an_explicit_tag_may_lead_outside(tmp_path: Path) -> None:
    """Only `latest` is held to the save_dir: tag=... names a checkpoint on purpose, and loads it."""
    root, other = h.checkpoint(tmp_path / "ck"), h.checkpoint(tmp_path / "other", step=5)
    for tag in (f"../other/{h.TAG}", str(other / h.TAG)):
        ck = DeepSpeedCheckpoint(root, tag=tag)
        assert ck.global_steps == 5 and ck.optimizer_step == 5
    assert DeepSpeedCheckpoint(root).global_steps == 3
