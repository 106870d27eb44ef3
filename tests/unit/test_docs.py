"""README.md and every page under docs/ run as written. Each page's python blocks run in order as one
session (its own process, in a temporary directory where `examples/` and `tests/` link to the
repository's, so paths read as from the repository root), with its `.venv/bin/fz ...` lines run
between them; pages run two at a time. Each page's first python block says what it needs and sets
it up. Each page shows what its fz commands print; its commands use the venv's binaries and name
files that exist; its relative links resolve. The README's set-up and test commands are the ones CI
runs, and the README links every page."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# What a page's session must print (stdout) and leave behind (files), beyond running cleanly.
EXPECT = {
    "README.md": (["step 50  loss"], []),
    "docs/model.md": (["step 200  loss", "epoch=1, index=2304"], []),  # the resumed loader's position, as it says
    "docs/checkpoints.md": (["fz: saved checkpoints/run/step_30"], ["model.safetensors"]),
    "docs/deepspeed.md": (["updates: 16", "resumed at update 5 after micro-batch 9",
                           "imported step 3 the script's step 3 by DeepSpeed 0.19.8"],
                          ["ds_ckpt/latest", "ds_weights.safetensors"]),
    "docs/huggingface.md": (["'eval_loss'", "TrainingArguments.learning_rate", "the logits of from_pretrained: True",
                             "token accuracy logged: True", "the logits of PeftModel.from_pretrained: True"],
                            ["out/model.safetensors", "adapter/adapter_model.safetensors"]),
}
# The pages that show an fz command's output (a one-line bash block, then a text block), and which commands.
SHOWN = {"docs/planning.md": [["estimate"], ["estimate"], ["estimate"]]}


def text(page: str) -> str:
    return (REPO / page).read_text()


def blocks(page: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text(page))]


def shown_outputs(page: str) -> list[tuple[list[str], str]]:
    """(argv, text) for each bash block of one `.venv/bin/fz` line followed directly by a text block:
    the output the page shows for it."""
    src = text(page)
    found = list(BLOCK.finditer(src))
    out = []
    for m, nxt in zip(found, found[1:]):
        lines = m.group(2).splitlines()
        if m.group(1) == "bash" and len(lines) == 1 and lines[0].startswith(".venv/bin/fz ") \
                and nxt.group(1) == "text" and not src[m.end():nxt.start()].strip():
            out.append((shlex.split(lines[0], comments=True)[1:], nxt.group(2)))
    return out


def session(page: str) -> str | None:
    """The page's python blocks, with each `.venv/bin/fz ...` line as a subprocess call; None when
    the page has no python block (then there is nothing to run, and that is fine)."""
    if not any(lang == "python" for lang, _ in blocks(page)):
        return None
    parts = ["import subprocess as _sp, sys as _sys\n"]
    n = 0
    for lang, code in blocks(page):
        if lang == "python":
            parts.append(code)
        elif lang == "bash":
            for line in code.splitlines():
                if line.startswith(".venv/bin/fz "):
                    argv = shlex.split(line, comments=True)[1:]
                    # its output printed, and kept in fz_out_<n>.txt for the page's shown output
                    parts.append(f"_r = _sp.run([_sys.executable, '-m', 'fz', *{argv!r}], stdout=_sp.PIPE, "
                                 f"text=True)\nprint(_r.stdout, end='')\n"
                                 f"open('fz_out_{n}.txt', 'w').write(_r.stdout)\n_r.check_returncode()\n")
                    n += 1
    return "\n".join(parts)


def fz_lines(page: str) -> list[list[str]]:
    """The argv of each `.venv/bin/fz ...` line of the page, in the order its session runs them."""
    return [shlex.split(line, comments=True)[1:] for lang, code in blocks(page) if lang == "bash"
            for line in code.splitlines() if line.startswith(".venv/bin/fz ")]


def run_session(page: str, where: Path) -> tuple[subprocess.CompletedProcess, Path]:
    for d in ("examples", "tests"):  # the pages' paths are from the repository root
        (where / d).symlink_to(REPO / d)
    (where / "page.py").write_text(session(page))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "page.py"], cwd=where, env=env, capture_output=True, text=True,
                          timeout=300), where


@pytest.fixture(scope="module")
def sessions(request, tmp_path_factory):
    """Starts the sessions of the pages this run selected, two at a time; each test waits for its own."""
    wanted = [item.callspec.params["page"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_page_runs_as_written" and hasattr(item, "callspec")]
    wanted = [page for page in wanted if session(page) is not None]
    wanted.sort(key=lambda page: -session(page).count("_sp.run("))  # the longest first (each fz line: a process)
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {page: pool.submit(run_session, page, tmp_path_factory.mktemp(Path(page).stem)) for page in wanted}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_written(page, sessions):
    if page not in sessions:
        assert session(page) is None  # no python block (a page of prose, tables and commands): nothing to run
        return
    first = next(code for lang, code in blocks(page) if lang == "python")
    assert first.startswith("# Needs: "), f"{page}: the first python block's first line says what the page needs"
    out, where = sessions[page].result()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    printed, files = EXPECT.get(page, ([], []))
    for s in printed:
        assert s in out.stdout, (page, s, out.stdout[-2000:])
    for f in files:
        assert (where / f).exists(), (page, f)


@pytest.mark.parametrize("page", PAGES)
def test_page_shows_what_its_fz_commands_print(page, sessions):
    """A block of output under an fz command is that command's output (as the page's session ran it,
    or run here for a page without one): when the output changes, the page's block is refreshed from
    the message below."""
    shown = shown_outputs(page)
    assert [argv[:1] for argv, _ in shown] == SHOWN.get(page, [])
    ran = fz_lines(page)
    for argv, want in shown:
        if page in sessions:
            out, where = sessions[page].result()
            assert out.returncode == 0, out.stderr[-4000:]
            printed = (where / f"fz_out_{ran.index(argv)}.txt").read_text()
        else:
            done = subprocess.run([sys.executable, "-m", "fz", *argv], cwd=REPO, capture_output=True, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            printed = done.stdout
        assert printed == want, f"{page} shows another output for fz {' '.join(argv)}; it prints:\n{printed}"


def bash_lines(page: str) -> list[str]:
    return [ln for lang, code in blocks(page) if lang == "bash" for ln in code.splitlines() if ln.strip()]


@pytest.mark.parametrize("page", PAGES)
def test_page_commands_use_the_venv_and_existing_files(page):
    lines = bash_lines(page)[2:] if page == "README.md" else bash_lines(page)  # README's first two: below
    for ln in lines:
        words = shlex.split(ln, comments=True)
        assert words[0].startswith(".venv/bin/") or "=" in words[0] and words[1].startswith(".venv/bin/"), ln
        for w in words:
            if w.endswith((".py", ".json")):
                assert (REPO / w).exists(), ln


def test_readme_commands_are_what_ci_runs():
    setup, test = bash_lines("README.md")[:2]
    for cmd in (setup, test):
        assert cmd.startswith(
            "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install"
        )
    assert setup.endswith(".venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py")
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci  # CI runs exactly the README's test command


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = BLOCK.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", prose, re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_page_links_resolve(page):
    prose = BLOCK.sub("", text(page))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (REPO / page).parent / file if file else REPO / page
        assert path.resolve().exists(), f"{page}: {target}"
        if anchor:
            assert anchor in anchors(path), f"{page}: {target}: no such heading"


def test_readme_links_every_page():
    linked = set(re.findall(r"\]\((docs/[\w\-]+\.md)\)", text("README.md")))
    assert linked == set(PAGES[1:])


@pytest.mark.slow
def test_a_block_that_says_it_runs_on_n_ranks_does_at_world_2(tmp_path):
    """docs/deepspeed.md's first block says it runs on N ranks under `fz run --num_gpus N`: at
    world 2 it saved at a micro-batch no rank reached, then loaded nothing and failed. Run so."""
    page, code = next((p, c) for p in PAGES for lang, c in blocks(p) if lang == "python" and "runs on N ranks" in c)
    (tmp_path / "block.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-m", "fz", "run", "--num_gpus", "2", "block.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (page, res.stdout[-2000:], res.stderr[-3000:])
    assert res.stdout.count("resumed at update 5 after micro-batch 9") == 2, res.stdout[-2000:]
