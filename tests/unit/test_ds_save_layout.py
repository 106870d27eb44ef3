"""fz.deepspeed's checkpoints at world 1: DeepSpeed's layout (`dir/<tag>/`, `latest` holding the tag),
a tag saved again replaced as DeepSpeed overwrites it (a copy readable at every moment of the
replacement), the older `dir/<tag>/step_<N>/` layout still loading, and a load with nothing to
load saying so."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch import nn

import fz
import fz.deepspeed as deepspeed
from fz.deepspeed.checkpoints import ENGINE_KEY

# what DeepSpeed 0.19.8's load_checkpoint returns beside the client's keys (its file's fields it does not load)
DS_FIELDS = {"buffer_names", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
             "global_samples", "checkpoint_parallel_dimensions", "ds_config", "ds_version"}


def _client(got: dict) -> dict:
    """The client's own keys of a load_checkpoint's client state, once its DeepSpeed fields are all there."""
    assert DS_FIELDS <= set(got), sorted(DS_FIELDS - set(got))
    return {k: v for k, v in got.items() if k not in DS_FIELDS}

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.lin(x), y)


def _engine(updates: int = 0):
    engine, *_ = deepspeed.initialize(model=Net(), config=CONFIG)
    g = torch.Generator().manual_seed(3)
    for _ in range(updates):
        engine.backward(engine(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)))
        engine.step()
    return engine


def _weights(engine) -> dict[str, torch.Tensor]:
    return fz.full_params(engine.state)


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_save_checkpoint_writes_deepspeeds_layout_and_a_rerun_replaces_the_tag(tmp_path):
    first, second = _engine(2), _engine(3)
    first.save_checkpoint(tmp_path, tag="run", client_state={"epoch": 1})
    assert sorted(os.listdir(tmp_path)) == ["latest", "run"] and (tmp_path / "latest").read_text() == "run"
    assert (tmp_path / "run" / "manifest.json").is_file() and not list((tmp_path / "run").glob("step_*"))
    second.save_checkpoint(tmp_path, tag="run", client_state={"epoch": 2})  # the script run again: DeepSpeed overwrites
    assert sorted(os.listdir(tmp_path)) == ["latest", "run"]
    engine = _engine()
    path, client = engine.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "run") and _client(client) == {"epoch": 2} and engine.global_steps == 3
    assert _same(_weights(engine), _weights(second))
    state, client = fz.restore(fz.init(Net(), fz.Spec()), tmp_path, with_client_state=True)  # the save_dir, as fz's
    assert client["epoch"] == 2 and int(state.step) == 3
    with pytest.raises(fz.ConfigError, match=r"tag='a/b': a tag is one folder name"):
        second.save_checkpoint(tmp_path, tag="a/b")


def test_a_replacing_save_cut_off_at_any_point_leaves_a_copy_load_checkpoint_finds(tmp_path):
    """The moments of a replacement (fz/ckpt/commit.py), made by hand: the old copy set aside, then
    the new one in place beside it. Each loads a complete copy; the next save settles it."""
    old, new = _engine(2), _engine(3)
    old.save_checkpoint(tmp_path / "new", tag="t")
    new.save_checkpoint(tmp_path / "new", tag="t2")  # the new copy, to move in by hand
    old.save_checkpoint(tmp_path, tag="t")
    os.replace(tmp_path / "t", tmp_path / "t.old")  # 1: set aside, nothing at t
    engine = _engine()
    assert engine.load_checkpoint(tmp_path)[0] == str(tmp_path / "t") and engine.global_steps == 2
    assert int(fz.restore(fz.init(Net(), fz.Spec()), tmp_path / "t").step) == 2
    shutil.copytree(tmp_path / "new" / "t2", tmp_path / "t")  # 2: the new copy in place, the old not yet dropped
    engine = _engine()
    engine.load_checkpoint(tmp_path)
    assert engine.global_steps == 3 and _same(_weights(engine), _weights(new))
    old.save_checkpoint(tmp_path, tag="other")  # the next save settles the cut-off one
    assert sorted(os.listdir(tmp_path)) == ["latest", "new", "other", "t"]
    os.replace(tmp_path / "t", tmp_path / "t.old")
    old.save_checkpoint(tmp_path, tag="t")  # saving the tag itself settles it first, then replaces it
    assert sorted(os.listdir(tmp_path)) == ["latest", "new", "other", "t"]


def test_the_older_tag_step_layout_still_loads_and_is_replaced(tmp_path):
    """An older fz wrote `dir/<tag>/step_<N>/` (fz.save into the tag folder)."""
    engine = _engine(2)
    counters = {"global_samples": 8, "micro_steps": 2}
    fz.save(engine.state, tmp_path / "global_step2", client_state={"epoch": 1, ENGINE_KEY: counters},
            client_state_per_rank=True)
    (tmp_path / "latest").write_text("global_step2")
    loaded = _engine()
    path, client = loaded.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2") and _client(client) == {"epoch": 1} and loaded.global_steps == 2
    assert loaded.global_samples == 8 and _same(_weights(loaded), _weights(engine))
    engine.save_checkpoint(tmp_path)  # the same tag again: now in DeepSpeed's layout
    assert (tmp_path / "global_step2" / "manifest.json").is_file() and sorted(os.listdir(tmp_path)) == [
        "global_step2", "latest"]


def test_load_checkpoint_with_nothing_to_load_returns_none_and_warns(tmp_path, caplog):
    fz_log = fz.log.logger()  # "fz": its own console handler, not propagated to the root (fz/log.py)
    fz_log.addHandler(caplog.handler)
    engine = _engine(1)
    try:
        with caplog.at_level(logging.WARNING, logger="fz"):
            assert engine.load_checkpoint(tmp_path / "absent") == (None, None)
            (tmp_path / "d" / "global_step5").mkdir(parents=True)
            assert engine.load_checkpoint(tmp_path / "d") == (None, None)
    finally:
        fz_log.removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and all("nothing loaded" in s and "returns (None, None)" in s for s in said), said
    assert f"{tmp_path / 'absent'} does not exist" in said[0]
    assert "has no 'latest' file (its folders: global_step5; pass tag=... to load one)" in said[1]
    assert engine.global_steps == 1  # the engine keeps what it had


def test_a_tag_deepspeed_wrote_stays_readable_while_fz_replaces_it(tmp_path):
    """A run DeepSpeed started, continued on fz, saving the same tag: DeepSpeed's folder, set aside
    (a save cut off there), still loads; the next save puts it back, then replaces it."""
    from support import ds_models as m
    from support.ds_import_jobs import DATA, ROWS
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "stage3_fp32" / "ckpt", ckpt)
    os.replace(ckpt / "global_step3", ckpt / "global_step3.old")
    cfg = {**m.ds_config(2, "fp32"), "train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS}
    engine, *_ = deepspeed.initialize(model=m.TinyLM(seed=5), config=cfg)
    path, client = engine.load_checkpoint(ckpt)
    assert path == str(ckpt / "global_step3") and _client(client) == {"step": 3, "note": "x"}
    assert engine.global_steps == 3
    engine.save_checkpoint(ckpt, client_state=client)  # global_step3 again
    assert sorted(os.listdir(ckpt)) == ["global_step3", "latest", "zero_to_fp32.py", "zero_to_torch.py"]  # as DeepSpeed
    assert (ckpt / "global_step3" / "manifest.json").is_file()  # fz's now
    again, *_ = deepspeed.initialize(model=m.TinyLM(seed=6), config=cfg)
    assert _client(again.load_checkpoint(ckpt)[1]) == {"step": 3, "note": "x"}
    assert _same(_weights(again), _weights(engine))


@pytest.mark.parametrize("name", ["stage0_fp32", "stage1_fp32", "stage2_fp32", "stage3_fp32", "stage0_fp32_groups",
                                  "stage1_fp32_groups", "stage2_bf16_groups", "stage3_bf16_groups"])
def test_load_checkpoint_returns_the_fields_deepspeeds_own_file_holds(tmp_path, name):
    """DeepSpeed's load_checkpoint returns its file's own fields beside the client's keys (scripts read
    ds_config or global_samples, Megatron-DeepSpeed its client key "iteration"). The engine returns
    them from a DeepSpeed checkpoint, and from its own the same values for the same model and stage,
    its param_shapes one per parameter group the script gave (Hugging Face's two, in `_groups`)."""
    from support import ds_models as m
    from support.ds_import_jobs import DATA, ROWS
    stage, precision = (m.FIXTURES | m.GROUPED)[name]
    cfg = {**m.ds_config(stage, precision), "train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS}

    def initialize(seed):
        model = m.TinyLM(seed=seed)
        groups = m.param_groups(model, name in m.GROUPED)
        return deepspeed.initialize(model=model, config=cfg, model_parameters=groups)[0]
    engine = initialize(5)
    _, theirs = engine.load_checkpoint(DATA / name / "ckpt")
    assert engine.global_samples == theirs["global_samples"] == 12  # the file's count, as DeepSpeed's engine takes it
    engine.save_checkpoint(tmp_path, client_state={"iteration": 7})
    _, ours = initialize(6).load_checkpoint(tmp_path)
    assert set(ours) == set(theirs) - {"step", "note"} | {"iteration"} and ours["iteration"] == 7

    def plain(v):  # shapes as tuples (DeepSpeed's torch.Size, read back as tuples), in their order
        shapes = isinstance(v, dict) and all(isinstance(s, tuple) for s in v.values())
        return [(n, tuple(s)) for n, s in v.items()] if shapes else v
    for k in ("buffer_names", "frozen_param_shapes", "shared_params", "checkpoint_parallel_dimensions",
              "frozen_param_fragments", "ds_version", "global_samples"):
        assert plain(ours[k]) == plain(theirs[k]), k
    assert [plain(g) for g in ours["param_shapes"] or []] == [plain(g) for g in theirs["param_shapes"] or []]
    if stage:
        assert len(theirs["param_shapes"]) == (2 if name in m.GROUPED else 1)
    assert ours["ds_config"] == cfg and theirs["ds_config"] == m.ds_config(stage, precision)


def test_a_client_state_saved_back_does_not_carry_stale_deepspeed_fields(tmp_path):
    """Scripts save back the client state they loaded: its DeepSpeed fields (global_samples 12 of the
    file) are left out, and the next load computes them for the engine as it is then."""
    from support import ds_models as m
    from support.ds_import_jobs import DATA, ROWS
    cfg = {**m.ds_config(2, "fp32"), "train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS}
    engine, *_ = deepspeed.initialize(model=m.TinyLM(seed=5), config=cfg)
    _, client = engine.load_checkpoint(DATA / "stage2_fp32" / "ckpt")
    tokens = m.batch(3, 0)
    engine.backward(m.lm_loss(engine(tokens), tokens))
    engine.step()
    engine.save_checkpoint(tmp_path, client_state=client)
    again, *_ = deepspeed.initialize(model=m.TinyLM(seed=6), config=cfg)
    _, ours = again.load_checkpoint(tmp_path)
    assert again.global_samples == ours["global_samples"] == 12 + ROWS and ours["step"] == 3
    assert ours["ds_config"] == cfg  # the config as the script gave it


def test_fields_follow_deepspeeds_walk_of_a_submodule_shared_by_two_parents():
    """DeepSpeed walks named_children from each parent: a norm used by both halves is listed under
    both paths (buffers), its parameters as tied to the first path's."""
    from fz.deepspeed.checkpoints import ds_fields
    norm = nn.BatchNorm1d(3)
    model = nn.Module()
    model.enc, model.dec = nn.Sequential(nn.Linear(3, 3), norm), nn.Sequential(norm, nn.Linear(3, 3))
    f = ds_fields(model, {}, 2, 0, "v")
    assert f["shared_params"] == {"dec.0.weight": "enc.1.weight", "dec.0.bias": "enc.1.bias"}
    assert [b for b in f["buffer_names"] if "running_mean" in b] == ["enc.1.running_mean", "dec.0.running_mean"]
    assert list(f["param_shapes"][0]) == ["enc.0.weight", "enc.0.bias", "enc.1.weight", "enc.1.bias",
                                          "dec.1.weight", "dec.1.bias"]


def test_a_planted_latest_tmp_link_is_not_written_through(tmp_path):
    """A save_dir (one downloaded, shared) holding `latest.tmp` as a link out of it: the save
    replaces the link, and the file it leads to keeps its contents."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    (save_dir / "latest.tmp").symlink_to(victim)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    engine.save_checkpoint(str(save_dir), tag="t1")
    assert victim.read_text() == "mine"
    assert (save_dir / "latest").read_text() == "t1" and not (save_dir / "latest").is_symlink()
    assert not os.path.lexists(save_dir / "latest.tmp")


def test_load_universal_reads_latest_universal_and_adams_step(tmp_path):
    """With the config's checkpoint.load_universal the engine reads the tag `latest_universal` names
    (it read `latest`, found none, and trained from scratch), and a ZeRO-3 universal checkpoint's
    Adam step (it restarted at 0: every later update differed); without the file, an error, as in
    DeepSpeed. It equals loading the checkpoint the universal one was made from."""
    from support import ds_models as m
    from support.ds_import_jobs import DATA, ROWS
    shutil.copytree(DATA / "stage3_fp32" / "universal" / "global_step3", tmp_path / "uc" / "global_step3")
    (tmp_path / "uc" / "latest_universal").write_text("global_step3")
    cfg = {**m.ds_config(3, "fp32"), "train_micro_batch_size_per_gpu": ROWS, "train_batch_size": ROWS}

    def trained(path, **extra):
        engine = deepspeed.initialize(model=m.TinyLM(seed=5), config={**cfg, **extra})[0]
        engine.load_checkpoint(path)
        tokens = m.batch(3, 0)
        engine.backward(m.lm_loss(engine(tokens), tokens))
        engine.step()
        return engine.global_steps, fz.full_params(engine.state)
    steps, universal = trained(tmp_path / "uc", checkpoint={"load_universal": True})
    want_steps, want = trained(DATA / "stage3_fp32" / "ckpt")
    assert steps == want_steps == 4 and _same(universal, want)
    with pytest.raises(fz.CheckpointError, match=r"latest_universal does not exist \(the config's checkpoint"):
        deepspeed.initialize(model=m.TinyLM(seed=5), config={**cfg, "checkpoint": {"load_universal": True}}
                             )[0].load_checkpoint(DATA / "stage3_fp32" / "ckpt")


def test_exclude_frozen_saves_them_too_with_a_warning_and_a_non_strict_load_takes_the_overlap(tmp_path, caplog):
    """Both were refused; DeepSpeed's scripts pass them (LoRA runs save without the frozen base). fz's
    checkpoint holds the whole state (it says so); load_module_strict=False loads what both models
    hold and warns naming the rest (fz.restore(strict=False))."""
    def engine(extra: int = 0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2 + extra))
        model[0].requires_grad_(False)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        return deepspeed.initialize(model=model, config=cfg,
                                    model_parameters=[p for p in model.parameters() if p.requires_grad])[0]
    first = engine()
    first.backward(first(torch.ones(2, 4)).square().mean())
    first.step()
    with caplog.at_level(logging.WARNING):
        assert first.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    assert "fz saves the frozen parameters too" in caplog.text
    again = engine()
    again.load_checkpoint(tmp_path)
    assert _same(fz.full_params(again.state), fz.full_params(first.state))
    other = engine(extra=1)  # its head has another shape
    with pytest.warns(fz.ckpt.PartialRestoreWarning, match=r"1.weight"):
        other.load_checkpoint(tmp_path, load_module_strict=False)
    assert torch.equal(fz.full_params(other.state)["0.weight"], fz.full_params(first.state)["0.weight"])
