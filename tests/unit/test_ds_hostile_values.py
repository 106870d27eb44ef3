"""Values a DeepSpeed checkpoint parses to but cannot hold are refused at import, naming file and field.

Each case is ds_hostile's small ZeRO-3 checkpoint with one value crafted: Adam state that is
finite but impossible (a negative exp_avg_sq, a negative or fractional step), a loss scale of
0, -4 or NaN, counts and shapes that are inf, 2**70, negative, strings or floats, and NaN
fp32 masters. Taken, they end as NaN weights a step later, a ZeroDivisionError, every step
skipped, a raw OverflowError, or a wrong number (the shape "64" read as (6, 4)); each must be
a CheckpointError (NaN masters: fz.NonFiniteError) naming the file, the field and the value,
and `fz consolidate` must exit 2 with its error line, writing nothing.
"""
from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fz
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.export import consolidate
from fz.cli import main
from fz.errors import CheckpointError

from support import ds_hostile as h


def _adam(nu: float | None = None, step: float | None = None) -> Callable[[str, int, dict], None]:
    """Every rank's Adam state of sub-group 0 given exp_avg_sq `nu` and `step` (None: as written)."""
    def patch(kind: str, rank: int, obj: dict) -> None:
        if kind == "optim":
            st = obj["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
            if nu is not None:
                st["exp_avg_sq"].fill_(nu)
            if step is not None:
                st["step"] = torch.tensor(step)
    return patch


def test_synthetic_adam_state_imports_and_trains(tmp_path: Path) -> None:
    """The control: ds_synth's own moments are possible ones (exp_avg_sq >= 0); a step keeps the weights finite."""
    state, _ = fz.import_deepspeed(h.state(), h.checkpoint(tmp_path / "ck"))
    state, _ = fz.train_step(state, torch.ones(2, 4))
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in state.params.values()]
    assert all(bool(torch.isfinite(p).all()) for p in full)


@pytest.mark.parametrize("nu, step, words", [
    (-1.0, None, "negative values in Adam's exp_avg_sq (a mean of squares: never < 0) of 2 tensors: 'b' exp_avg_sq 5 "
                 "of 5, 'w' exp_avg_sq 24 of 24"),
    (None, -7.0, "zero_pp_rank_0_mp_rank_00_optim_states.pt: its Adam step is -7.0, not an integer from 0"),
    (None, 0.5, "zero_pp_rank_0_mp_rank_00_optim_states.pt: its Adam step is 0.5, not an integer from 0"),
    (None, float("inf"), "its Adam step is inf, not an integer"),
    (None, 2.0**63, "its Adam step is 9.223372036854776e+18, not an integer from 0 to 281474976710656"),  # wraps at +1
])
def test_impossible_adam_state_is_refused(nu: float | None, step: float | None, words: str, tmp_path: Path) -> None:
    """Finite but impossible: Adam's next step would take sqrt(nu < 0) or divide by 1 - beta**step: NaN weights."""
    root = h.checkpoint(tmp_path / "ck", patch=_adam(nu, step))
    with pytest.raises(CheckpointError) as e:
        fz.import_deepspeed(h.state(), root, allow_nonfinite=True)  # not a NaN: allow_nonfinite does not let it by
    assert words in str(e.value) and str(root / h.TAG) in str(e.value), str(e.value)


def _scale(value: object) -> Callable[[str, int, dict], None]:
    """An fp16 run whose loss scaler's cur_scale is `value`."""
    def patch(kind: str, rank: int, obj: dict) -> None:
        if kind == "model":
            obj["ds_config"] = {**obj["ds_config"], "fp16": {"enabled": True}}
        else:
            obj["optimizer_state_dict"]["loss_scaler"].state["cur_scale"] = value
    return patch


@pytest.mark.parametrize("value", [-4.0, 0.0, float("nan"), float("inf"), 1e39, "abc", True, None])
def test_impossible_loss_scale_is_refused(value: object, tmp_path: Path) -> None:
    """0 divides by zero in the step, NaN or a negative scale skips every step: refused at open, naming the field."""
    root = h.checkpoint(tmp_path / "ck", patch=_scale(value))
    with pytest.raises(CheckpointError) as e:
        DeepSpeedCheckpoint(root)
    assert f"{h.optim_file(root)}: its loss_scaler cur_scale is {value!r}, not a finite number > 0" \
        in str(e.value), str(e.value)


def test_a_good_loss_scale_imports(tmp_path: Path) -> None:
    """DeepSpeed's int scale (2**16) is a scale: the fp16 state gets it."""
    root = h.checkpoint(tmp_path / "ck", patch=_scale(2**16))
    state, _ = fz.import_deepspeed(h.state(precision="fp16"), root)
    assert float(state.scaler["scale"]) == 65536.0


def _set(kind: str, keys: tuple[str, ...], value: object) -> Callable[[str, int, dict], None]:
    """Rank 0's `kind` file's obj[keys[0]][keys[1]]... set to `value` (on every rank for the model's own fields)."""
    def patch(k: str, rank: int, obj: dict) -> None:
        if k == kind and (rank == 0 or kind == "model"):
            for key in keys[:-1]:
                obj = obj[key]
            obj[keys[-1]] = value
    return patch


_OSD = ("optimizer_state_dict",)
INF = float("inf")
# (patch, the file named, the field named, the value shown)
FIELDS = {
    "global_steps inf": (_set("model", ("global_steps",), INF), "model", "global_steps", "inf"),
    "global_steps 2**70": (_set("model", ("global_steps",), 2**70), "model", "global_steps", str(2**70)),
    "global_steps -5": (_set("model", ("global_steps",), -5), "model", "global_steps", "-5"),
    "global_steps a string": (_set("model", ("global_steps",), "12"), "model", "global_steps", "'12'"),
    "global_steps a bool": (_set("model", ("global_steps",), True), "model", "global_steps", "True"),
    "skipped_steps 2**70": (_set("model", ("skipped_steps",), 2**70), "model", "skipped_steps", str(2**70)),
    "dp_world_size inf": (_set("model", ("dp_world_size",), INF), "model", "dp_world_size", "inf"),
    "mp_world_size inf": (_set("model", ("mp_world_size",), INF), "model", "mp_world_size", "inf"),
    "stage inf": (_set("model", ("ds_config", "zero_optimization", "stage"), INF), "model",
                  "ds_config zero_optimization stage", "inf"),
    "lr_scheduler a list": (_set("model", ("lr_scheduler",), [1, 2]), "model", "lr_scheduler", "[1, 2]"),
    "last_batch_iteration inf": (_set("model", ("lr_scheduler", "last_batch_iteration"), INF), "model",
                                 "lr_scheduler last_batch_iteration", "inf"),
    "last_batch_iteration 'abc'": (_set("model", ("lr_scheduler", "last_batch_iteration"), "abc"), "model",
                                   "lr_scheduler last_batch_iteration", "'abc'"),
    "last_batch_iteration 2**70": (_set("model", ("lr_scheduler", "last_batch_iteration"), 2**70), "model",
                                   "lr_scheduler last_batch_iteration", str(2**70)),
    "last_batch_iteration -1e6": (_set("model", ("lr_scheduler", "last_batch_iteration"), -10**6), "model",
                                  "lr_scheduler last_batch_iteration", "-1000000"),
    "param_shapes a string": (_set("model", ("param_shapes",), [{"w": "64", "b": (5,)}]), "model",
                              "param_shapes['w']", "'64'"),
    "param_shapes floats": (_set("model", ("param_shapes",), [{"w": (6.7, 4.2), "b": (5,)}]), "model",
                            "param_shapes['w'][0]", "6.7"),
    "param_shapes inf": (_set("model", ("param_shapes",), [{"w": (INF, 4), "b": (5,)}]), "model",
                         "param_shapes['w'][0]", "inf"),
    "partition_count inf": (_set("optim", (*_OSD, "partition_count"), INF), "optim", "partition_count", "inf"),
    "partition_count a string": (_set("optim", (*_OSD, "partition_count"), "2"), "optim", "partition_count", "'2'"),
    "partition_count 0": (_set("optim", (*_OSD, "partition_count"), 0), "optim", "partition_count", "0"),
    "Adam step inf": (_adam(step=INF), "optim", "Adam step", "inf"),
    "shared_params a list": (_set("model", ("shared_params",), [1, 2]), "model", "shared_params", "[1, 2]"),
    "shared_params a dict value": (_set("model", ("shared_params",), {"b": {"x": 1}}), "model", "shared_params['b']",
                                   "{'x': 1}"),
}


def _cli(*argv: str) -> tuple[int, str]:
    """`fz ARGV`'s exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    return rc, err.getvalue()


@pytest.mark.parametrize("reader", ["open", "import", "consolidate"])
@pytest.mark.parametrize("case", list(FIELDS))
def test_impossible_field_is_refused(case: str, reader: str, tmp_path: Path) -> None:
    """Each is a CheckpointError (the command: exit 2 and its error line) naming the file, the field and the
    value; not a raw OverflowError, nor a wrong number taken (a string shape "64" as (6, 4), 6.7 as 6)."""
    patch, which, field, shown = FIELDS[case]
    root, out = h.checkpoint(tmp_path / "ck", patch=patch), tmp_path / "out.safetensors"
    if reader == "consolidate":
        rc, msg = _cli("consolidate", str(root), str(out))
        assert rc == 2 and msg.startswith("fz consolidate: error: ") and not out.exists(), (rc, msg)
    else:
        with pytest.raises(CheckpointError) as e:
            DeepSpeedCheckpoint(root) if reader == "open" else fz.import_deepspeed(h.state(), root)
        msg = str(e.value)
    file = h.optim_file(root) if which == "optim" else h.model_file(root)
    assert f"{file}: its {field} is {shown}," in msg, msg


def _nan_master(kind: str, rank: int, obj: dict) -> None:
    if kind == "optim" and rank == 0:
        obj["optimizer_state_dict"]["fp32_flat_groups"][0][2] = float("nan")  # rank 0 holds w's first 12


@pytest.mark.parametrize("hf", [False, True])
def test_consolidate_refuses_nan_masters(hf: bool, tmp_path: Path) -> None:
    """A NaN master would be carried into every model loaded from the file: refused as fz.import_deepspeed
    refuses it (fz.NonFiniteError naming the tensor; the command: exit 2, its error line), and nothing is written."""
    root, out = h.checkpoint(tmp_path / "ck", patch=_nan_master), tmp_path / ("out" if hf else "out.safetensors")
    with pytest.raises(fz.NonFiniteError, match=r"fz consolidate: DeepSpeed checkpoint .* holds NaN or inf in 1 "
                                                r"tensors \(1 values\): 'w' 1 of 24\. .*nothing was written"):
        consolidate(root, out, hf=hf)
    rc, err = _cli("consolidate", str(root), str(out), *(["--hf"] if hf else []))
    assert rc == 2 and err.startswith("fz consolidate: error: fz consolidate: DeepSpeed checkpoint"), (rc, err)
    assert "'w' 1 of 24" in err, err
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["ck", "out"] if hf else ["ck"]) and not (hf and any(out.iterdir())), left  # --hf: an empty folder


@pytest.mark.parametrize("patch", ["nan_master", "negative_nu"])
def test_a_refused_import_leaves_no_usable_template(patch: str, tmp_path: Path) -> None:
    """The import fills its template in place, so a refused value is already in it: the template is given
    up (as fz.restore's is), and a step on it is an error naming the import, never a step on NaN weights."""
    root = h.checkpoint(tmp_path / "ck", patch=_nan_master if patch == "nan_master" else _adam(nu=-1.0))
    template = h.state()
    with pytest.raises((fz.NonFiniteError, CheckpointError)):
        fz.import_deepspeed(template, root)
    with pytest.raises(fz.ConfigError, match=r"fz.train_step: this state was donated to fz.import_deepspeed; use the "
                                             r"state it returned \(where it raised, there is none: make a new state"):
        fz.train_step(template, torch.ones(2, 4))
    assert repr(template) == "State(donated to fz.import_deepspeed)"
    state, _ = fz.import_deepspeed(h.state(), h.checkpoint(tmp_path / "good"))  # a fresh template imports
    assert int(state.step) > 0


@pytest.mark.parametrize("value, words", [
    (INF, "its group_paddings is inf, not a list of 2 counts"),
    ([0], "its group_paddings is [0], not a list of 2 counts"),
    ([0, INF], "its group_paddings[1] is inf, not an integer"),
    ([0, -3], "its group_paddings[1] is -3, not an integer"),
])
def test_impossible_group_paddings_are_refused(value: object, words: str) -> None:
    """ZeRO 1/2's per-group padding sizes each rank's partition: a count per group, each an int >= 0
    (stage 1/2 files read it through fields.paddings; ds_hostile writes stage 3, which has none)."""
    from fz.ckpt.deepspeed import fields
    assert fields.paddings(None, 2, "f") == fields.paddings([], 2, "f") == [0, 0]
    assert fields.paddings([0, 6], 2, "f") == [0, 6]
    with pytest.raises(CheckpointError, match=re.escape("DeepSpeed checkpoint file f: " + words)):
        fields.paddings(value, 2, "f")


def _huge_master(kind: str, rank: int, obj: dict) -> None:
    if kind == "optim" and rank == 0:
        obj["optimizer_state_dict"]["fp32_flat_groups"][0][2] = 1e6  # finite in fp32, beyond fp16's 65504


def test_consolidate_refuses_what_its_cast_makes_inf(tmp_path: Path) -> None:
    """--dtype fp16 turns a weight of 1e6 into inf: refused as a NaN is (naming the cast), nothing written;
    bf16, whose range is fp32's, writes it."""
    root = h.checkpoint(tmp_path / "ck", patch=_huge_master)
    rc, err = _cli("consolidate", str(root), str(tmp_path / "o16.safetensors"), "--dtype", "fp16")
    assert rc == 2 and "cast to float16 holds NaN or inf in 1 tensors (1 values): 'w' 1 of 24" in err, (rc, err)
    assert "cast to bfloat16, whose range is float32's" in err and not (tmp_path / "o16.safetensors").exists()
    consolidate(root, tmp_path / "o.safetensors", dtype="bf16")
    assert load_file(str(tmp_path / "o.safetensors"))["w"].flatten()[2] == torch.tensor(1e6, dtype=torch.bfloat16)


def test_zero_to_fp32_refuses_what_its_cast_makes_inf(tmp_path: Path) -> None:
    """DeepSpeed's zero_to_fp32 API as fz gives it, to fp16: the 1e6 was written as inf; now refused as
    consolidate refuses it, nothing written."""
    from fz.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
    root = h.checkpoint(tmp_path / "ck", patch=_huge_master)
    with pytest.raises(fz.NonFiniteError, match=r"cast to float16 holds NaN or inf in 1 tensors \(1 values\): 'w' 1 "
                                                "of 24.* nothing was written"):
        convert_zero_checkpoint_to_state_dict(root, tmp_path / "out", dtype="float16", safe_serialization=True)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    convert_zero_checkpoint_to_state_dict(root, tmp_path / "out", dtype="bfloat16", safe_serialization=True)
    assert torch.isfinite(load_file(str(tmp_path / "out" / "model.safetensors"))["w"]).all()
    # a mask buffer's -inf is no cast's: written, as consolidate and import_deepspeed take it
    masked = h.checkpoint(tmp_path / "masked", patch=_buffers(float("-inf"), torch.tensor(3)))
    convert_zero_checkpoint_to_state_dict(masked, tmp_path / "m", dtype="float16", safe_serialization=True)
    assert torch.isneginf(load_file(str(tmp_path / "m" / "model.safetensors"))["scale"]).all()


def test_a_nan_read_is_not_blamed_on_the_cast(tmp_path: Path) -> None:
    """A NaN already in the checkpoint, consolidated to fp16: the error names the checkpoint, not the cast."""
    root = h.checkpoint(tmp_path / "ck", patch=_nan_master)
    rc, err = _cli("consolidate", str(root), str(tmp_path / "o16.safetensors"), "--dtype", "fp16")
    assert rc == 2 and "holds NaN or inf in 1 tensors" in err and "cast to" not in err, (rc, err)


def test_an_engine_whose_load_was_refused_says_to_make_it_again(tmp_path: Path) -> None:
    """load_checkpoint filled the engine's state in place before refusing a NaN master: the error says
    the engine must be made again (deepspeed.initialize), not fz.init, which an engine script never calls."""
    import fz.deepspeed as deepspeed
    root = h.checkpoint(tmp_path / "ck", patch=_nan_master)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=h.Net(), config=config)
    with pytest.raises(fz.NonFiniteError, match="make the engine again with deepspeed.initialize"):
        engine.load_checkpoint(root, tag=h.TAG)


def test_a_tensor_named_many_times_in_the_client_state_is_read_once(tmp_path: Path) -> None:
    """One 4 MiB tensor referenced 1000 times (2 bytes of pickle each) and 50 views of it: read once,
    every reference a view of that one storage, as torch.load makes them (a copy per reference made
    a 4 MB file cost 1 GB at 200 references)."""
    big = torch.arange(1 << 20, dtype=torch.float32)

    def patch(kind: str, rank: int, obj: dict) -> None:
        if kind == "model":
            obj["many"], obj["views"] = [big] * 1000, [big[i:i + 1000] for i in range(50)]
    client = DeepSpeedCheckpoint(h.checkpoint(tmp_path / "ck", patch=patch)).client_state
    every = [*client["many"], *client["views"]]
    assert len({t.untyped_storage().data_ptr() for t in every}) == 1
    assert torch.equal(client["many"][999], big) and torch.equal(client["views"][49], big[49:1049])


@pytest.mark.parametrize("counters", [{"global_samples": -7.9}, {"global_samples": "abc"},
                                      {"global_samples": float("inf")}, [1, 2, 3], {"global_samples": True},
                                      {"global_samples": 2**200}])
def test_engine_counters_that_are_not_counts_are_refused(counters: object, tmp_path: Path) -> None:
    """engine.load_checkpoint read global_samples with int(): a string, inf or a list was a raw
    ValueError / OverflowError / TypeError, -7.9 became -7. Now a CheckpointError naming the folder."""
    import json

    import fz.deepspeed as deepspeed
    from fz.ckpt import manifest
    from fz.deepspeed.checkpoints import ENGINE_KEY
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=h.Net(), config=config)
    engine.save_checkpoint(str(tmp_path), tag="t1")
    step = tmp_path / "t1"
    doc = json.loads((step / "data_0.json").read_text())
    doc["client"][ENGINE_KEY] = counters
    (step / "data_0.json").write_text(json.dumps(doc))
    files = manifest.read(step)
    files.update(manifest.describe(step, ["data_0.json"]))
    manifest.write(step, files)
    with pytest.raises(CheckpointError, match=r"counters .*not \{'global_samples': an integer from 0 to 2\*\*62"):
        engine.load_checkpoint(str(tmp_path), tag="t1")


@pytest.mark.parametrize("tag", [b"global_step3\x00", b"a" * 300])
def test_a_latest_that_names_no_file_is_a_checkpoint_error(tag: bytes, tmp_path: Path) -> None:
    """A NUL byte or a name over 255 bytes in `latest` was a raw ValueError("embedded null byte") or
    OSError(ENAMETOOLONG) from every reader; each is now a CheckpointError naming `latest`."""
    import fz.deepspeed as deepspeed
    ds = h.checkpoint(tmp_path / "ds")
    (ds / "latest").write_bytes(tag)
    own = tmp_path / "fz"
    fz.save(h.state(), own)
    (own / "latest").write_bytes(tag.replace(b"global_step3", b"step_0"))
    engine, *_ = deepspeed.initialize(model=h.Net(), config={"train_micro_batch_size_per_gpu": 2, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-3}}})
    for read in (lambda: fz.import_deepspeed(h.state(), ds), lambda: fz.restore(h.state(), ds),
                 lambda: engine.load_checkpoint(str(ds)), lambda: fz.restore(h.state(), own)):
        with pytest.raises(CheckpointError, match=r"latest (holds|is corrupted)"):
            read()


class _Buffered(h.Net):
    """ds_hostile's Net with the buffer ds_synth saves (`scale`) and an integer one, as BatchNorm's count."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("count", torch.tensor(0))


def _buffers(scale: float, count: object) -> Callable[[str, int, dict], None]:
    def patch(kind: str, rank: int, obj: dict) -> None:
        if kind == "model":
            obj["module"]["scale"] = torch.full((8,), scale)
            obj["module"]["count"] = count
            obj["buffer_names"] = [*obj["buffer_names"], "count"]
    return patch


@pytest.mark.parametrize("scale, count, error, words", [
    (float("nan"), torch.tensor(3), fz.NonFiniteError,
     r"holds NaN or inf in 1 tensors \(8 values\): buffer 'scale' 8 of 8"),
    (float("inf"), torch.tensor(3), fz.NonFiniteError, "buffer 'scale' 8 of 8"),
    (1.0, torch.tensor(float("nan")), CheckpointError, "buffer count is torch.float32 in the checkpoint, torch.int64 "
                                                       "here"),
])
def test_a_buffer_no_run_holds_is_refused(scale: float, count: object, error: type, words: str, tmp_path: Path) -> None:
    """A NaN running statistic was copied in unchecked (weights' NaN were refused), and a float NaN for an
    integer buffer landed as -2**63; a -inf (a mask's) still imports."""
    state = fz.init(_Buffered(), fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=h._loss, seed=0))
    with pytest.raises(error, match=words):
        fz.import_deepspeed(state, h.checkpoint(tmp_path / "ck", patch=_buffers(scale, count)))
    state = fz.init(_Buffered(), fz.Spec(stage=3, optimizer=fz.optim.adamw(lr=1e-3), loss_fn=h._loss, seed=0))
    new, _ = fz.import_deepspeed(state, h.checkpoint(tmp_path / "ok", patch=_buffers(float("-inf"), torch.tensor(3))))
    assert new.buffers["count"].item() == 3 and bool(torch.isneginf(new.buffers["scale"]).all())
