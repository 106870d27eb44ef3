"""A DeepSpeed checkpoint with a malicious pickle is refused unread: nothing it names runs.

Each file of real fixtures (model states, every rank's optimizer states, a universal
checkpoint's fp32.pt) is replaced in turn by a torch.save-style zip whose data.pkl, loaded by
`torch.load(weights_only=False)` (what zero_to_fp32 does) or `pickle.load`, would write a
marker file. Reading the checkpoint must raise CheckpointError naming the file and the
callable, and the marker must never appear.
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fz.ckpt.deepspeed import opcodes as ds_opcodes
from fz.ckpt.deepspeed import unpickle as ds_pickle
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.errors import CheckpointError

from support import ds_hostile as h

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
CASES = [("stage2_fp32", "ckpt", f) for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                             "zero_pp_rank_1_mp_rank_00_optim_states.pt")]
CASES += [("stage3_bf16", "ckpt", f"{'bf16_' if k == 'optim' else ''}zero_pp_rank_{r}_mp_rank_00_{k}_states.pt")
          for r in (0, 1) for k in ("model", "optim")]
CASES += [("stage0_bf16", "ckpt", "mp_rank_00_model_states.pt"),
          ("stage2_fp32", "universal", "zero/blocks.1.up.weight/fp32.pt"),
          ("stage2_fp32", "universal", "zero/embed.weight/exp_avg_sq.pt"),
          ("stage2_fp32", "universal", "mp_rank_00_model_states.pt")]


class _System:
    """Pickles as a call of os.system (posix.system): what an attacker's file would hold."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class _Eval:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def _payloads(marker: Path) -> dict[str, bytes]:
    """{the name the refusal must give: a pickle that writes `marker` when loaded}."""
    write = f"open({str(marker)!r}, 'w').write('pwned')"
    return {
        "posix.system": pickle.dumps({"module": {"w": _System(f"touch {marker}")}, "buffer_names": []}, protocol=2),
        "builtins.eval": pickle.dumps({"optimizer_state_dict": [1, 2, _Eval(write)]}, protocol=4),
    }


def _poison(path: Path, payload: bytes) -> None:
    """Replace the data.pkl of the torch.save zip `path`, keeping its other members."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, payload if name.endswith("/data.pkl") else data)


def _read_everything(path: Path) -> None:
    ck = DeepSpeedCheckpoint(path)
    for name in [*ck.params, *ck.frozen]:
        for kind in ("fp32", *(ck.moments if name in ck.params else ())):
            list(ck.read(name, kind))


def test_payloads_are_live(tmp_path: Path) -> None:
    """The payloads do run under a plain unpickler (in a child process): the refusal below matters."""
    for i, name in enumerate(_payloads(tmp_path / "m")):
        marker = tmp_path / f"live{i}"
        subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                       input=_payloads(marker)[name], timeout=60, check=False, capture_output=True)
        assert marker.exists()


@pytest.mark.parametrize(("fixture", "sub", "file"), CASES)
def test_malicious_file_is_refused(tmp_path: Path, fixture: str, sub: str, file: str) -> None:
    for callable_name, payload in _payloads(tmp_path / "marker").items():
        d = tmp_path / callable_name
        shutil.copytree(DATA / fixture / sub, d)
        _poison(d / "global_step3" / file, payload)
        with pytest.raises(CheckpointError) as e:
            _read_everything(d)
        msg = str(e.value)
        assert callable_name in msg and str(d / "global_step3" / file) in msg, msg
        assert "not read" in msg
        assert not (tmp_path / "marker").exists()


def test_other_refusals(tmp_path: Path) -> None:
    src = DATA / "stage1_fp32" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"
    f = tmp_path / "pid.pt"
    shutil.copy(src, f)

    class _Pid(pickle.Pickler):
        def persistent_id(self, obj):
            return ("module", "os") if obj == "x" else None

    import io
    buf = io.BytesIO()
    _Pid(buf, protocol=2).dump({"module": "x"})
    _poison(f, buf.getvalue())
    with pytest.raises(CheckpointError, match=r"pid.pt has a persistent id .* not a torch storage"):
        ds_pickle.load(f)
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="legacy.pt is not a torch.save zip file"):
        ds_pickle.load(legacy)
    compressed = tmp_path / "deflated.pt"
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as out:
        for i in z.infolist():
            out.writestr(i.filename, z.read(i))
    with pytest.raises(CheckpointError, match="deflated.pt: member .* is compressed"):
        ds_pickle.load(compressed)


@pytest.mark.parametrize("name", [b"torch\nfloat32\n", b"torch\nFloatStorage\n", b"torch._utils\n_rebuild_tensor_v2\n",
                                  b"deepspeed.runtime.fp16.loss_scaler\nLossScaler\n", b"torch\nTensor\n",
                                  b"collections\nOrderedDict\n"])
def test_allowed_names_cannot_be_altered(tmp_path: Path, name: bytes) -> None:
    """BUILD on one of the table's shared objects (state, or slot state set with setattr) is an
    error, so one file cannot change how the next is read."""
    f = tmp_path / "build.pt"
    shutil.copy(DATA / "stage1_fp32" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt", f)
    for state in (b"}X\x05\x00\x00\x00dtypeNs", b"N}X\x05\x00\x00\x00dtypeNs\x86"):
        _poison(f, b"\x80\x02c" + name + state + b"b.")
        with pytest.raises(CheckpointError, match="build.pt is damaged or not a checkpoint fz reads"):
            ds_pickle.load(f)
    assert ds_pickle._ALLOWED["torch.FloatStorage"].dtype is torch.float32


BIG = (1 << 64).to_bytes(9, "little")


@pytest.mark.parametrize(("ops", "cause"), [
    (b"]q\x00h\x00a", "a container that holds itself (a cycle)"),
    (b"h\x05", "memo entry 5 read before it is written"),
    (b"(i__builtin__\nobject\n", "opcode INST"),
    (b"\x82\x01", "opcode EXT1"),
    (b"\x8f", "opcode EMPTY_SET"),
    (b"}G?\xf0\x00\x00\x00\x00\x00\x00K\x01s", "a dict key of type float"),
    (b"}\x8a\x09" + BIG + b"K\x01s", "a dict key of type int"),
    (b"K\x01K\x02", "values left on the stack at STOP"),
    (b"]K\x01b", "a BUILD of list"),
    (b"K\x01K\x02a", "APPEND on a value of type int"),
    (b"K\x01)R", "a call of int, which is not a function fz allows"),
    (b"c__builtin__\nlist\n)R", "names __builtin__.list, which fz does not load"),
])
def test_opcodes_beyond_plain_data_are_refused(tmp_path: Path, ops: bytes, cause: str) -> None:
    """Each opcode is interpreted by fz (ds_opcodes), never by pickle: what a DeepSpeed file
    never holds is refused naming it, before anything is built from it."""
    f = tmp_path / "ops.pt"
    shutil.copy(DATA / "stage1_fp32" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt", f)
    _poison(f, b"\x80\x02" + ops + b".")
    with pytest.raises(CheckpointError) as e:
        ds_pickle.load(f)
    assert f"checkpoint file {f}" in str(e.value) and cause in str(e.value), str(e.value)


def test_the_opcodes_read_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pickle of more opcodes than MAX_OPS (each can make an object) is refused when it gets there."""
    f = tmp_path / "long.pt"
    shutil.copy(DATA / "stage1_fp32" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt", f)
    _poison(f, b"\x80\x02" + b"]" * 50 + b"a" * 49 + b".")  # 101 opcodes: PROTO, 50 lists, 49 APPENDs, STOP
    monkeypatch.setattr(ds_opcodes, "MAX_OPS", 100)
    with pytest.raises(CheckpointError, match=f"{f} is damaged .*a pickle of more than 100 opcodes"):
        ds_pickle.load(f)
    monkeypatch.setattr(ds_opcodes, "MAX_OPS", 101)
    want: list = []
    for _ in range(49):
        want = [want]
    assert ds_pickle.load(f) == want  # within the bound: read


def test_a_storage_resolves_only_inside_its_own_archive(tmp_path: Path) -> None:
    """Its member `data/<key>` of the archive data.pkl is in, no other; every member lies inside
    the file; one name twice, or two pickles, is not a torch.save file."""
    record = h.pickled(h.tensor((8,), (1,)))
    good = h.archive(tmp_path / "good.pt", [("a/data.pkl", record), ("a/data/0", h.SECRET)])
    assert ds_pickle.materialize(ds_pickle.load(good)).tolist() == [1.0] * 8
    cases = {
        "other.pt": ([("a/data.pkl", record), ("b/data/0", h.SECRET)], "storage data/0 is not in its archive"),
        "twice.pt": ([("a/data.pkl", record), ("a/data/0", h.SECRET), ("a/data/0", b"\0" * 32)],
                     "holds member a/data/0 twice"),
        "pickles.pt": ([("a/data.pkl", record), ("b/data.pkl", record), ("a/data/0", h.SECRET)],
                       "has 2 data.pkl records"),
    }
    for name, (members, cause) in cases.items():
        f = h.archive(tmp_path / name, members)
        with pytest.raises(CheckpointError, match=f"{f}.* {cause}"):
            ds_pickle.load(f)
    long = tmp_path / "long.pt"
    raw = bytearray(good.read_bytes())
    central = raw.rfind(b"PK\x01\x02")  # the last member's central entry: a/data/0
    raw[central + 20:central + 28] = (1 << 20).to_bytes(4, "little") * 2  # its sizes, past the file's end
    long.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{long}: member a/data/0 ends at byte .* past the file's"):
        ds_pickle.load(long)


def test_a_zip_directory_of_more_entries_than_storages_is_refused_before_it_is_parsed(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """2 million entries (138 MB) took 39 s and 770 MB in zipfile before a refusal: the entries are
    counted in the directory's bytes first (the bound lowered here to keep the file small)."""
    from fz.ckpt.deepspeed import archive as ds_archive
    record = h.pickled(h.tensor((8,), (1,)))
    members = [("a/data.pkl", record), ("a/data/0", h.SECRET)] + [(f"a/x{i}", b"") for i in range(6)]
    f = h.archive(tmp_path / "many.pt", members)
    monkeypatch.setattr(ds_archive, "MAX_MEMBERS", 7)
    monkeypatch.setattr(ds_archive.zipfile, "ZipFile", None)  # never reached
    with pytest.raises(CheckpointError, match=f"{f}: its zip directory holds 8 entries, more than 7"):
        ds_pickle.load(f)
    raw = bytearray(f.read_bytes())  # the end record's directory offset, which zipfile ignores, set to 0
    end = raw.rfind(b"PK\x05\x06")
    raw[end + 16:end + 20] = bytes(4)
    (tmp_path / "offset0.pt").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="its zip directory holds 8 entries, more than 7"):
        ds_pickle.load(tmp_path / "offset0.pt")
    monkeypatch.undo()
    assert ds_pickle.materialize(ds_pickle.load(f)).tolist() == [1.0] * 8
