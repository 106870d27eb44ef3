"""A stage-0 DeepSpeed file lists its optimizer's parameters unnamed, group after group: fz places
them in the module by shape (fz/ckpt/deepspeed/match.py), then by the masters' values and the target's
trainable names, and never guesses between two placements (that would put one tensor's moments on
another)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fz
from fz.ckpt.deepspeed.checkpoint import DeepSpeedCheckpoint
from fz.ckpt.deepspeed.match import assign
from fz.ckpt.export import consolidate
from fz.errors import CheckpointError

from support import ds_models as m

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
SHAPES = {"a.w": (4, 2), "a.b": (4,), "n.w": (2,), "c.w": (4, 2), "c.b": (4,), "f.w": (3, 3)}
NAMES = list(SHAPES)


def test_interleaved_groups_are_placed_where_a_greedy_walk_fails():
    # Hugging Face's groups: weights with decay, then biases and norms without; f.w frozen
    groups = [[(4, 2), (4, 2)], [(4,), (2,), (4,)]]
    placed, sure = assign(NAMES, SHAPES, groups, "f")
    assert placed == [["a.w", "c.w"], ["a.b", "n.w", "c.b"]] and sure


def test_two_placements_are_reported_and_fits_chooses():
    shapes = {"x": (4,), "y": (4,), "z": (4,)}
    placed, sure = assign(list(shapes), shapes, [[(4,), (4,)]], "f")  # which of the three is frozen?
    assert not sure
    placed, sure = assign(list(shapes), shapes, [[(4,), (4,)]], "f", fits=lambda n, g, j: (g < 0) == (n == "x"))
    assert (placed, sure) == ([["y", "z"]], True)


def test_no_placement_names_the_file():
    with pytest.raises(CheckpointError, match=r"^ckpt\.pt: the optimizer's 2 parameters \(1 group\(s\)\) do not match"):
        assign(NAMES, SHAPES, [[(3, 3), (4, 2)]], "ckpt.pt")  # f.w comes after both (4, 2) tensors
    with pytest.raises(CheckpointError, match="the optimizer has 7 parameters, the module only 6 tensors"):
        assign(NAMES, SHAPES, [[(4,)] * 7], "ckpt.pt")


def test_bf16_masters_are_placed_by_value_without_a_target():
    """stage0_bf16: blocks.1.down.bias and frozen.bias are both (12,); the masters' values tell them apart."""
    with DeepSpeedCheckpoint(DATA / "stage0_bf16" / "ckpt") as ck:
        assert "blocks.1.down.bias" in ck.params and "frozen.bias" in ck.frozen and ck.unplaced is None
        assert ck.moments == ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("name", ["stage0_fp32", "stage0_fp32_groups"])
def test_fp32_weights_are_read_and_moments_left_unplaced_when_nothing_tells(name: str, tmp_path: Path) -> None:
    with DeepSpeedCheckpoint(DATA / name / "ckpt") as ck:
        assert ck.moments == () and ck.optimizer_step == 3
        assert "more than one way by shape" in ck.unplaced and "cannot be placed" in ck.unplaced
    out = tmp_path / "w.safetensors"
    consolidate(DATA / name / "ckpt", out)  # the weights are named: right whichever way
    engine = load_file(DATA / name / "engine.safetensors")
    got = load_file(out)
    assert all(torch.equal(got[k.split("/", 1)[1]], v) for k, v in engine.items() if k.startswith("fp32/"))


def test_import_with_other_frozen_parameters_refuses_rather_than_misplacing_moments():
    model = m.TinyLM()
    model.frozen.requires_grad_(True)  # the file's model froze it: the trainable names no longer decide
    model.blocks[1].down.bias.requires_grad_(False)
    state = fz.init(model, fz.Spec(optimizer=fz.optim.adamw(1e-2)))
    with pytest.raises(CheckpointError, match="cannot be placed .*do not tell them apart"):
        fz.import_deepspeed(state, DATA / "stage0_fp32_groups" / "ckpt")


def test_a_file_whose_shapes_fit_too_many_ways_is_refused_before_its_search_grows():
    """800 same-shape tensors and two groups of 160 with no state (any shape fits): a 66 KB file whose
    search kept N x K^2 placements (3 GB, a minute) is refused once it holds MAX_KEPT in all, while a
    7B-Llama-like layout with Hugging Face's two groups and frozen tensors places at once."""
    names = [f"p{i}" for i in range(800)]
    with pytest.raises(CheckpointError, match="partial ways by shape; the file does not name them"):
        assign(names, dict.fromkeys(names, (1,)), [[None] * 160, [None] * 160], "f")
    shapes: dict[str, tuple[int, ...]] = {"embed": (100, 64)}
    for i in range(32):
        shapes |= {f"{i}.{k}": (64, 64) for k in "qkvo"} | {f"{i}.gate": (96, 64), f"{i}.up": (96, 64),
                                                            f"{i}.down": (64, 96), f"{i}.n1": (64,), f"{i}.n2": (64,)}
    shapes |= {"norm": (64,), "head": (100, 64)}
    frozen = {"0.q", "5.v", "31.down", "head"}
    groups = [[s for n, s in shapes.items() if len(s) == 2 and n not in frozen],
              [s for n, s in shapes.items() if len(s) == 1]]
    placed, _ = assign(list(shapes), shapes, groups, "f")
    assert [len(g) for g in placed] == [len(g) for g in groups]  # one of the ways (same shapes: several)
