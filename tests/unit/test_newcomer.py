"""What a newcomer reads holds: the README's install gets a CPU or a CUDA torch on any machine,
the docs and examples use no internal words, `import fz` imports no DeepSpeed (and the docs say
whose the DeepSpeed warning of an fz.hf run is), and only token models report tokens/s."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _read(rel: str) -> str:
    return (REPO / rel).read_text()


def test_the_readme_install_gets_a_cpu_torch_anywhere_and_a_cuda_one():
    readme = _read("README.md")
    pinned = re.search(r"pip install -q torch==([\d.]+)", readme).group(1)
    assert f"`.venv/bin/pip install torch=={pinned} --index-url {CPU_INDEX}`" in readme
    assert re.search(r"pip install 'torch>=2\.11,<2\.16' --index-url https://download\.pytorch\.org/whl/cu\d+", readme)
    assert "so pip takes the CPU build" not in readme  # true only where a local CPU wheel is configured
    assert "on Linux it takes the CUDA build" in readme


def test_docs_and_examples_name_no_internal_design_notes():
    pages = ["README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
             *(f"examples/{p.name}" for p in (REPO / "examples").iterdir() if p.is_file())]
    found = [(page, m.group(0)) for page in pages
             for m in re.finditer(r"\bseed \d{3}\b|\bseed's\b|\bseeds? (?:article|note|design)", _read(page))]
    assert not found, found


def test_import_fz_and_its_deepspeed_shell_import_no_deepspeed(tmp_path):
    """A `deepspeed` package on the path (as where DeepSpeed is installed) stays unimported."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("print('deepspeed imported')\n")
    code = ("import sys; import fz, fz.deepspeed, fz.ckpt, fz.cli, fz.planning.ladder\n"
            "print('deepspeed' in sys.modules)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stdout + out.stderr[-2000:]


@pytest.mark.skipif(not os.environ.get("FZ_DEEPSPEED_PYTHON"),
                    reason="set FZ_DEEPSPEED_PYTHON to a python with DeepSpeed and the hf extra to check the docs' "
                           "account of DeepSpeed's warning live")
def test_the_deepspeed_warning_of_an_fz_hf_run_is_where_the_docs_say(tmp_path):
    """huggingface.md: accelerate imports DeepSpeed when the Trainer unwraps its model, DeepSpeed
    prints its accelerator warning then, and DS_ACCELERATOR=cpu silences it."""
    assert "`export DS_ACCELERATOR=cpu`" in _read("docs/huggingface.md")
    code = ("import sys\nimport torch\nfrom transformers import GPT2Config, GPT2LMHeadModel\n"
            "from fz.hf import Trainer, TrainingArguments\n"
            "assert 'deepspeed' not in sys.modules\n"
            "model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))\n"
            "rows = [{'input_ids': torch.arange(8) % 64, 'labels': torch.arange(8) % 64} for _ in range(8)]\n"
            "args = TrainingArguments('out', max_steps=1, per_device_train_batch_size=2, use_cpu=True, "
            "report_to='none')\n"
            "Trainer(model=model, args=args, train_dataset=rows).train()\n"
            "print('imported by accelerate:', 'deepspeed' in sys.modules)\n")
    said = {}
    for accel in ("", "cpu"):
        env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **({"DS_ACCELERATOR": accel} if accel else {}))
        out = subprocess.run([os.environ["FZ_DEEPSPEED_PYTHON"], "-c", code], capture_output=True, text=True,
                             env=env, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        said[accel] = out.stdout + out.stderr
    assert "imported by accelerate: True" in said[""] and "Setting accelerator to CPU" in said[""]
    assert "imported by accelerate: True" in said["cpu"] and "Setting accelerator to CPU" not in said["cpu"]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_batches_of_token_ids_count_tokens():
    import fz
    from fz.observe.monitor import batch_counts
    task = _example("finetune_frozen").Task(64, seed=0)  # features and one class label per row
    batch = next(iter(fz.data.loader(task, fz.Spec(micro_batch=16), shuffle=False)))
    assert batch_counts(batch) == (16, None)
    assert batch_counts({"x": torch.randn(4, 16), "y": torch.randint(0, 4, (4,))}) == (4, None)  # docs/deepspeed.md's
    tokens = torch.randint(0, 256, (4, 33))
    assert batch_counts(tokens) == (4, 132)
    assert batch_counts({"input_ids": tokens, "labels": tokens}) == (4, 132)
