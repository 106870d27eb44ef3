"""The entry points: `fz --version` and `python -m fz` (the `fz` command's help)."""
from __future__ import annotations

import runpy
import sys

import pytest

import fz


def test_version_and_python_dash_m(capsys, monkeypatch):
    from fz.cli import main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith(f"fz {fz.__version__} (torch 2.")
    monkeypatch.setattr(sys, "argv", ["fz"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("fz", run_name="__main__")  # what `python -m fz` runs
    out = capsys.readouterr().out
    assert done.value.code == 0 and "consolidate" in out and "inspect" in out and "--version" in out
