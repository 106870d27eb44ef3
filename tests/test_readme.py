"""The README runs as written: its python blocks in order as one session from the repository
root, with its `.venv/bin/fz ...` lines run between them; its set-up and torchrun commands
use the venv's own binaries and name example files that exist; CI runs the README's test command."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks():
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(README)]


def shown_outputs():
    """(argv, text) for each bash block of one `.venv/bin/fz` line followed directly by a text block:
    the output the README shows for it."""
    found = list(BLOCK.finditer(README))
    out = []
    for m, nxt in zip(found, found[1:]):
        lines = m.group(2).splitlines()
        if m.group(1) == "bash" and len(lines) == 1 and lines[0].startswith(".venv/bin/fz ") \
                and nxt.group(1) == "text" and not README[m.end():nxt.start()].strip():
            out.append((shlex.split(lines[0], comments=True)[1:], nxt.group(2)))
    return out


def _session() -> str:
    """The README's python blocks, with each `.venv/bin/fz ...` line as a subprocess call."""
    parts = ["import subprocess as _sp, sys as _sys\n"]
    for lang, code in blocks():
        if lang == "python":
            parts.append(code)
        elif lang == "bash":
            for line in code.splitlines():
                if line.startswith(".venv/bin/fz "):
                    argv = shlex.split(line, comments=True)[1:]
                    parts.append(f"_sp.run([_sys.executable, '-m', 'fz', *{argv!r}], check=True)\n")
    return "\n".join(parts)


def test_readme_python_blocks_and_fz_lines_run_in_order(tmp_path):
    for d in ("examples", "tests"):  # the README's paths are from the repository root
        (tmp_path / d).symlink_to(REPO / d)
    (tmp_path / "readme.py").write_text(_session())
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "step 200  loss" in out.stdout and "fz: saved checkpoints/run/step_30" in out.stdout
    assert "epoch=1, index=2304" in out.stdout  # the resumed loader's position, as the README says
    assert (tmp_path / "model.safetensors").exists()


def test_readme_shows_what_its_fz_commands_print():
    """The estimate table beside DeepSpeed's is this command's output: when the estimate changes,
    the README's block is refreshed from the message below."""
    shown = shown_outputs()
    assert [argv[:1] for argv, _ in shown] == [["estimate"]]
    for argv, text in shown:
        out = subprocess.run([sys.executable, "-m", "fz", *argv], cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout == text, f"README.md shows another output for fz {' '.join(argv)}; it prints:\n{out.stdout}"


def test_readme_commands_use_the_venv_and_existing_examples():
    lines = [ln for lang, code in blocks() if lang == "bash" for ln in code.splitlines() if ln.strip()]
    setup, test = lines[0], lines[1]
    for cmd in (setup, test):
        assert cmd.startswith(
            "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install"
        )
    assert setup.endswith(".venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py")
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci  # CI runs exactly the README's test command
    for ln in lines[2:]:
        words = shlex.split(ln, comments=True)
        assert words[0].startswith(".venv/bin/") or "=" in words[0] and words[1].startswith(".venv/bin/"), ln
        for w in words:
            if w.endswith((".py", ".json")):
                assert (REPO / w).exists(), ln
