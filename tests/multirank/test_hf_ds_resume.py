"""fz.hf.Trainer resumes from a checkpoint-N that transformers + DeepSpeed 0.19.8 wrote
(tests/data/hf_deepspeed/, made by tests/support/hf_ds_resume.py): the same script with fz's
import goes on from DeepSpeed's checkpoint-2 at world 2 and logs what transformers + DeepSpeed's
own resumed run logged (losses, gradient norms, learning rates, epochs), ending at its weights. The
ZeRO-3 fixture crosses an epoch's end after the resume; the ZeRO-2 one (BERT's masked LM, with
dropout) draws its masks and dropout from the generators DeepSpeed's run saved.
"""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fz.testing.spawn import run_ranks  # noqa: E402

from support.hf_ds_resume import FIXTURES, OUT, SAVED, fz_rank  # noqa: E402


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_resumes_where_deepspeed_stopped(name, tmp_path):
    record = json.loads((OUT / name / "record.json").read_text())
    checkpoint = tmp_path / f"checkpoint-{SAVED}"
    shutil.copytree(OUT / name / f"checkpoint-{SAVED}", checkpoint)
    runs = run_ranks(2, fz_rank, name, str(checkpoint), str(tmp_path / "run"), timeout=300)
    expected = record["resumed"]
    for run in runs:
        assert len(run["history"]) == len(expected)
        for ours, theirs in zip(run["history"], expected):
            assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    from safetensors.torch import load_file

    final = load_file(str(OUT / name / "weights.safetensors"))
    ours = runs[0]["weights"]
    assert set(ours) >= set(final)
    worst = max(float((ours[k] - final[k]).abs().max()) for k in final)
    assert worst < 1e-5, worst
    assert (tmp_path / "run" / f"checkpoint-{record['steps']}" / "fz").is_dir()  # fz's own checkpoints from then on


def test_a_deepspeed_checkpoint_is_found_by_resume_true(tmp_path):
    """resume_from_checkpoint=True in an output_dir that transformers + DeepSpeed filled takes its last."""
    from fz.hf import checkpoint_dirs as dirs

    shutil.copytree(OUT / "z3_lm" / f"checkpoint-{SAVED}", tmp_path / f"checkpoint-{SAVED}")
    assert dirs.to_resume(True, str(tmp_path)) == str(tmp_path / f"checkpoint-{SAVED}")


def test_a_damaged_generator_state_is_refused(tmp_path):
    """rng_state_{rank}.pth is read with weights_only (nothing in it runs) and checked."""
    import torch

    from fz.errors import CheckpointError
    from fz.hf.deepspeed_resume import read_generators

    folder = OUT / "z2_mlm_dropout" / f"checkpoint-{SAVED}"
    args = type("Args", (), {"process_index": 1, "world_size": 2})()
    rng, host = read_generators(str(folder), args, torch.device("cpu"))
    assert rng.dtype == torch.uint8 and callable(host)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)

    class Runs:  # a pickle that would run code if unpickled without weights_only
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"cpu": Runs()}, bad / "rng_state_1.pth")
    with pytest.raises(CheckpointError, match=r"rng_state_1.pth is not what transformers writes"):
        read_generators(str(bad), args, torch.device("cpu"))
    torch.save({"cpu": torch.zeros(3)}, bad / "rng_state_1.pth")
    with pytest.raises(CheckpointError, match="holds no CPU generator state"):
        read_generators(str(bad), args, torch.device("cpu"))
    saved = torch.load(folder / "rng_state_1.pth", weights_only=False)
    name, keys, _, gauss, cached = saved["numpy"]
    saved["numpy"] = (name, keys, 20_000_000, gauss, cached)  # numpy takes it, and reads past its 624 words
    torch.save(saved, bad / "rng_state_1.pth")
    with pytest.raises(CheckpointError, match="numpy's is not a Mersenne Twister state"):
        read_generators(str(bad), args, torch.device("cpu"))
    (bad / "rng_state_1.pth").unlink()
    (bad / "rng_state_1.pth").symlink_to(folder / "rng_state_1.pth")
    with pytest.raises(CheckpointError, match="outside"):
        read_generators(str(bad), args, torch.device("cpu"))
    (bad / "rng_state_1.pth").unlink()
    assert read_generators(str(bad), args, torch.device("cpu")) is None  # none saved: transformers goes on too
