"""Checkpoint files in one process (world 1): damaged and foreign checkpoints, pruning,
the `fz consolidate` / `fz inspect` CLI with its memory bound, and load_weights."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import fz
from fz.ckpt import Checkpointer, PartialRestoreWarning, restore, save
from fz.ckpt.commit import Target, prepare
from fz.ckpt.hf.safetensors_io import load_weights
from fz.cli import main
from fz.errors import ConfigError
from fz.testing.gpt import GPT, GPTConfig

from support.helpers import CFG, make_model, spec, train_fz

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _equal_params(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    state, _ = train_fz(0, 1, 3, 1, steps=2)
    save(state, root / "ck")
    return root, fz.full_params(state)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


DAMAGE = {  # name: (how, file named in the error, word in the error)
    "truncated shard": (lambda d: os.truncate(d / "__0_0.distcp", 1000), "__0_0.distcp", "truncated"),
    "flipped shard": (lambda d: _flip(d / "__0_0.distcp", 5000), "__0_0.distcp", "corrupted"),
    "deleted shard": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp", "missing"),
    "truncated dcp metadata": (lambda d: os.truncate(d / ".metadata", 10), ".metadata", "truncated"),
    "flipped fz.json": (lambda d: _flip(d / "fz.json", 20), "fz.json", "corrupted"),
    "deleted manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json", "missing"),
    "flipped manifest": (lambda d: _flip(d / "manifest.json", 40), "manifest.json", "damaged"),
}


def test_damaged_checkpoint_is_a_clear_error_and_the_original_still_restores(small, tmp_path):
    root, want = small
    src = root / "ck" / "step_2"
    for name, (damage, fname, word) in DAMAGE.items():
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(src, d)
        damage(d)
        with pytest.raises(fz.CheckpointError) as e:
            restore(fz.init(make_model(1), spec(3, 1)), d)
        assert fname in str(e.value) and word in str(e.value), (name, str(e.value))
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "latest").write_text("step_9")
    with pytest.raises(fz.CheckpointError, match="step_9, which does not exist"):
        restore(fz.init(make_model(1), spec(3, 1)), tmp_path / "dangling")
    with pytest.raises(fz.CheckpointError, match="does not exist"):
        restore(fz.init(make_model(1), spec(3, 1)), tmp_path / "nowhere")
    assert _equal_params(fz.full_params(restore(fz.init(make_model(1), spec(0, 1)), root / "ck")), want)


def test_checkpoint_of_another_model_lists_differences_or_restores_the_overlap(small):
    root, want = small
    other = GPT(GPTConfig(vocab=CFG.vocab, seq=CFG.seq, dim=CFG.dim, heads=CFG.heads, layers=3))
    with pytest.raises(ConfigError) as e:
        restore(fz.init(other, spec(3, 1)), root / "ck")
    msg = str(e.value)
    assert not isinstance(e.value, fz.CheckpointError)  # the checkpoint is fine: the model differs
    assert "missing in checkpoint: model/blocks.2." in msg and "strict=False" in msg and "more" in msg, msg
    wider = GPT(GPTConfig(vocab=CFG.vocab + 8, seq=CFG.seq, dim=CFG.dim, heads=CFG.heads, layers=CFG.layers))
    with pytest.raises(ConfigError, match=r"shape mismatch: model/wte.weight is \(64, 32\) in the checkpoint"):
        restore(fz.init(wider, spec(3, 1)), root / "ck")
    with pytest.warns(PartialRestoreWarning, match="blocks.2") as caught:
        state = restore(fz.init(other, spec(3, 1)), root / "ck", strict=False)
    got = fz.full_params(state)
    assert int(state.step) == 2 and all(torch.equal(got[k], want[k]) for k in want)
    skipped = caught[0].message.skipped  # every skipped tensor, not only the ones the message shows
    assert len(skipped) > 5 and all("blocks.2." in line for line in skipped), skipped


def test_an_unrelated_checkpoint_is_never_adopted_and_the_optimizer_is_named(small):
    """strict=False with nothing of the model in common is an error (it would only adopt the
    step); a checkpoint of the same model with another optimizer blames the optimizer."""
    root, _ = small
    unrelated = GPT(GPTConfig(vocab=CFG.vocab + 8, seq=CFG.seq, dim=CFG.dim + 8, heads=CFG.heads, layers=CFG.layers))
    fresh = fz.init(unrelated, spec(3, 1))
    with pytest.raises(ConfigError, match="holds none of this model's parameters"):
        restore(fresh, root / "ck", strict=False)
    sgd = fz.init(make_model(1), spec(3, 1, optimizer=fz.optim.sgd(0.1, momentum=0.9)))
    with pytest.raises(ConfigError) as e:
        restore(sgd, root / "ck")
    msg = str(e.value)
    assert "does not match this optimizer (the model matches: the checkpoint was saved with another optimizer" in msg, (
        msg
    )


def test_master_weights_are_the_source_of_truth(tmp_path):
    state, _ = train_fz(0, 1, 1, 1, steps=1, precision="bf16")
    shifted = state.replace(master=pytree.tree_map(lambda m: m + 1, state.master))  # master != params
    want = {k: m.full_tensor() for k, m in shifted.master.items()}
    save(shifted, tmp_path)  # the checkpoint keeps the master
    mixed = restore(fz.init(make_model(), spec(2, 1, precision="bf16")), tmp_path)
    assert _equal_params({k: m.full_tensor() for k, m in mixed.master.items()}, want)
    want["head.weight"] = want["wte.weight"]  # full_params: every name of the state_dict, tied ones too
    assert _equal_params(fz.full_params(restore(fz.init(make_model(), spec(3, 1)), tmp_path)), want)
    assert _equal_params(fz.full_params(mixed), want)  # the fp32 master by default
    assert _equal_params(fz.full_params(mixed, dtype="compute"), {k: v.to(torch.bfloat16) for k, v in want.items()})


def _latest(root) -> str:
    return (root / "latest").read_text().split()[0]


def test_keep_last_latest_and_resaving(tmp_path):
    state, _ = train_fz(0, 1, 1, 1, steps=1)
    for step in (2, 4, 6):
        save(state, tmp_path, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_6"]
    assert _latest(tmp_path) == "step_6"
    later, _ = train_fz(0, 1, 1, 1, steps=2)
    save(later, tmp_path, step=6)  # the step `latest` names, saved again (a script run twice): replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_6"]
    assert int(restore(fz.init(make_model(), spec(1, 1)), tmp_path).step) == 2  # the new copy
    save(state, tmp_path, step=4)  # a step `latest` does not name may be replaced; `latest` = the last save
    assert _latest(tmp_path) == "step_4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_6"]
    with pytest.raises(ConfigError, match="neither JSON-able nor a tensor"):
        save(state, tmp_path, step=8, client_state={"bad": object()})
    assert not (tmp_path / "step_8").exists() and not (tmp_path / "step_8.tmp").exists()
    with pytest.raises(ConfigError, match="writing checkpoint .*step_8.tmp failed: rank 0: NotImplementedError"):
        save(state, tmp_path, step=8, client_state={"sparse": torch.eye(2).to_sparse()})  # DCP fails inside
    assert not (tmp_path / "step_8.tmp").exists() and _latest(tmp_path) == "step_4"
    assert int(restore(fz.init(make_model(), spec(1, 1)), tmp_path, step=4).step) == 1


def test_checkpointer_steps_validation_and_close(tmp_path):
    state, _ = train_fz(0, 1, 1, 1, steps=1)
    with pytest.raises(ConfigError, match="keep_last=0") as e:
        fz.Checkpointer(tmp_path, keep_last=0)
    assert not isinstance(e.value, fz.CheckpointError)  # a setting, not a checkpoint
    ck = fz.Checkpointer(tmp_path / "ck", keep_last=2)
    assert ck.latest_step() is None and ck.all_steps() == []
    with pytest.raises(ConfigError, match="Checkpointer.save step=-1"):
        ck.save(state, step=-1)
    for step in (3, 5, 7):
        ck.save(state, step=step)
    assert ck.latest_step() == 7 and ck.all_steps() == [5, 7]
    (tmp_path / "ck" / "latest").unlink()  # without `latest`: the newest committed step, as restore reads
    assert ck.latest_step() == 7
    assert int(ck.restore(fz.init(make_model(), spec(2, 1)), step=5).step) == 1
    ck.close()
    with pytest.raises(ConfigError, match="is closed"):
        ck.restore(fz.init(make_model(), spec(2, 1)))


def test_stream_writer_takes_boxes_in_any_order(tmp_path):
    from safetensors.torch import load_file

    from fz.ckpt.hf.safetensors_io import StreamWriter

    a, b, c = torch.arange(60.).reshape(3, 4, 5), torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor(7.)
    w = StreamWriter(tmp_path / "x.safetensors", [("a", a.dtype, a.shape), ("b", b.dtype, b.shape), ("c", c.dtype, ())])
    for off, box in [((1, 0, 2), (2, 4, 3)), ((0, 0, 0), (1, 4, 5)), ((1, 0, 0), (2, 4, 2))]:  # columns, rows
        w.write_chunk("a", off, a[tuple(slice(o, o + n) for o, n in zip(off, box))])
    w.write_chunk("b", (1, 0), b[1:])
    w.write("c", c)
    with pytest.raises(ConfigError, match="not written completely"):
        w.close()
    w.write_chunk("b", (0, 0), b[:1])
    with pytest.raises(ConfigError, match="expected a part of b"):
        w.write_chunk("b", (1, 1), b)
    w.close()
    got = load_file(tmp_path / "x.safetensors")
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and torch.equal(got["c"], c)


def _max_rss_mb(args) -> float:
    """Peak RSS of one child process running `args` (measured from a clean parent)."""
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *args], env=ENV, check=True, capture_output=True, text=True)
    return int(out.stdout.split()[-1]) / 1024


def test_consolidate_cli_memory_output_and_load_weights(tmp_path, capsys):
    cfg = GPTConfig(vocab=16384, seq=16, dim=512, heads=4, layers=1)  # wte: 32 MiB, the largest tensor
    torch.manual_seed(0)
    state = fz.init(GPT(cfg), spec(0, 1))
    save(state, tmp_path / "ck")
    want = fz.full_params(state)
    largest = max(t.numel() * t.element_size() for t in want.values()) / 2**20
    # the reference: the same command on a checkpoint of a tiny model (every import, no tensor of size)
    save(fz.init(GPT(GPTConfig(vocab=16, seq=4, dim=8, heads=2, layers=1)), spec(0, 1)), tmp_path / "tiny")
    base = _max_rss_mb([sys.executable, "-m", "fz.cli", "consolidate", str(tmp_path / "tiny"), str(tmp_path / "t.st")])
    out = tmp_path / "model.safetensors"
    peak = _max_rss_mb([sys.executable, "-m", "fz.cli", "consolidate", str(tmp_path / "ck"), str(out)])
    print(f"consolidate peak RSS {peak:.0f} MB, of a tiny model's {base:.0f} MB, largest tensor {largest:.0f} MB")
    assert peak < base + 1.5 * largest, (peak, base, largest)  # chunks are streamed: about 1x (2x if assembled)
    from safetensors.torch import load_file
    once = {k: v for k, v in want.items() if k != "head.weight"}  # the file holds the tied pair once
    assert _equal_params(load_file(out), once)

    bf16 = tmp_path / "bf16.safetensors"
    assert main(["consolidate", str(tmp_path / "ck"), str(bf16), "--dtype", "bf16"]) == 0
    assert _equal_params(load_file(bf16), {k: v.to(torch.bfloat16) for k, v in once.items()})

    torch.manual_seed(1)
    loaded = load_weights(fz.init(GPT(cfg), spec(3, 1)), out)
    assert _equal_params(fz.full_params(loaded), want)
    with pytest.raises(ConfigError, match="missing: blocks.1"):
        load_weights(fz.init(make_model(), spec(0, 1)), out)

    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "manifest       verified" in out and "world size     1" in out and "ZeRO stage     0" in out, out
    assert "step           0" in out and "model tensors  15 (" in out, out
    os.truncate(tmp_path / "ck" / "step_0" / "__0_0.distcp", 100)
    assert main(["inspect", str(tmp_path / "ck")]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "__0_0.distcp is truncated" in out, out
    assert main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "x.safetensors")]) == 2
    assert "__0_0.distcp is truncated" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()


def test_latest_records_its_manifest_checksum_and_one_changed_byte_is_caught(tmp_path):
    """`latest` is "step_N manifest-crc32=..." (issue 27, item 8): edited from step_4 to step_2,
    restore names what it says and what it should say; the old format ("step_N") still reads."""
    state, _ = train_fz(0, 1, 1, 1, steps=1)
    for step in (2, 4):
        save(state, tmp_path, step=step)
    text = (tmp_path / "latest").read_text()
    assert re.fullmatch(r"step_4 manifest-crc32=[0-9a-f]{8}\n", text), text
    (tmp_path / "latest").write_text(text.replace("step_4", "step_2"))  # one changed byte
    template = fz.init(make_model(), spec(1, 1))
    with pytest.raises(fz.CheckpointError, match=re.escape(
            f"{tmp_path / 'latest'} says step_2, but the manifest checksum it records (") +
            r"[0-9a-f]{8}\) is step_4's: it should say step_4 \(the file was edited or damaged\)\. Restore a "
            r"step explicitly \(step=4, or step=2 for the one it names"):
        restore(template, tmp_path)
    with pytest.raises(fz.CheckpointError, match=r"says step_2, .*it should say step_4"):
        Checkpointer(tmp_path).latest_step()
    assert int(restore(fz.init(make_model(), spec(1, 1)), tmp_path, step=4).step) == 1  # step= bypasses it
    (tmp_path / "latest").write_text(text.replace("step_4 manifest-crc32=", "step_4 manifest-crc32=0"))
    with pytest.raises(fz.CheckpointError, match=r"latest is corrupted: .*not 'step_<N> manifest-crc32=<crc>'"):
        restore(fz.init(make_model(), spec(1, 1)), tmp_path)
    crc = text.split("=")[1].strip()
    (tmp_path / "latest").write_text(text.replace(crc, "%08x" % (int(crc, 16) ^ 1)))  # no step has that crc
    with pytest.raises(fz.CheckpointError, match=r"latest says step_4, but it records manifest checksum "
                                                 r"[0-9a-f]{8} and step_4's manifest has " + crc +
                                                 r"; no committed step has"):
        restore(fz.init(make_model(), spec(1, 1)), tmp_path)
    for old in ("step_2", "step_4\n"):  # an older fz's `latest`: the name only
        (tmp_path / "latest").write_text(old)
        assert Checkpointer(tmp_path).latest_step() == int(old.strip()[5:])
        restore(fz.init(make_model(), spec(1, 1)), tmp_path)
    save(state, tmp_path, step=6)  # a save writes the new format again
    assert (tmp_path / "latest").read_text().startswith("step_6 manifest-crc32=")


def test_a_latest_that_is_a_fifo_is_refused_without_blocking(small, tmp_path):
    """fz's own pointer file is read as a regular file only: a FIFO named `latest` would block the reader."""
    ck = tmp_path / "ck"
    shutil.copytree(small[0] / "ck", ck)
    (ck / "latest").unlink()
    os.mkfifo(ck / "latest")
    state, _ = train_fz(0, 1, 3, 1, steps=0)
    with pytest.raises(fz.CheckpointError, match=r"latest is not a regular file \(a FIFO\)"):
        restore(state, ck)


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_step_tmp_that_is_a_file_or_symlink_is_removed_never_followed(tmp_path, planted):
    """A `step_N.tmp` file or symlink (left by hand, or planted) made every save of step N fail
    with a bare FileExistsError; a `step_N.old` symlink was taken for a replaced copy (a symlink out
    of the root failed the save, one inside it became step N). Each is unlinked like a stale folder
    is; a symlink's target is kept."""
    state, _ = train_fz(0, 1, 1, 1, steps=1)
    root, victim = tmp_path / "ck", tmp_path / "victim"
    root.mkdir(), victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    for name in ("step_2.tmp", "step_2.del", "step_2.old"):
        if planted == "file":
            (root / name).write_text("x")
        else:
            (root / name).symlink_to(victim, target_is_directory=True)
    save(state, root, step=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"] and _latest(root) == "step_2"
    assert [p.name for p in victim.iterdir()] == ["precious.txt"] and (victim / "precious.txt").read_text() == "keep me"
    assert int(restore(fz.init(make_model(), spec(1, 1)), root).step) == 1


def test_a_tag_tmp_in_a_deepspeed_save_dir_is_named_not_removed(tmp_path):
    """A DeepSpeed save_dir may hold others' files: `<tag>.tmp` that fz did not write is named, kept."""
    (tmp_path / "global_step2.tmp").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(fz.CheckpointError, match=rf"^fz.save: {tmp_path}/global_step2.tmp is in the way \(a symlink to "
                                              rf"{tmp_path}/elsewhere, not a leftover .*move or delete it"):
        prepare(Target(tmp_path, "global_step2", "tag"))
    assert (tmp_path / "global_step2.tmp").is_symlink()
