"""DeepSpeed config messages: a wrong type names the expected type; explain() names a derived value's real source;
a config file that is a FIFO, nests too deep or repeats a key is a ConfigError naming it."""
from __future__ import annotations

import time

import pytest

import fz

from support.fifo import fed_fifo


@pytest.mark.parametrize("cfg, want", [
    ({"zero_optimization": {"stage": "3"}}, 'zero_optimization.stage: must be an integer, got the string "3"'),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage: must be an integer, got true"),
    ({"gradient_accumulation_steps": "2"}, 'gradient_accumulation_steps: must be an integer, got the string "2"'),
])
def test_wrong_type_names_the_expected_type(cfg, want):
    with pytest.raises(fz.ConfigError) as e:
        fz.Spec.from_deepspeed(cfg)
    assert str(e.value) == want


def _row(spec, field):
    return next(ln for ln in spec.explain().splitlines() if ln.startswith(field + " "))


def test_explain_names_where_a_derived_batch_size_came_from():
    derived = fz.Spec.from_deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, world_size=2)
    assert derived.grad_accum == 2
    assert "train_batch_size / (train_micro_batch_size_per_gpu * world_size)" in _row(derived, "grad_accum")
    assert derived.provenance.ds_keys["grad_accum"] != "gradient_accumulation_steps"
    assert dict(derived.provenance)["grad_accum"] == derived.provenance["grad_accum"]  # a Mapping: keys() works
    micro = fz.Spec.from_deepspeed({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=2)
    assert "train_batch_size / (gradient_accumulation_steps * world_size)" in _row(micro, "micro_batch")
    only = fz.Spec.from_deepspeed({"train_batch_size": 8}, world_size=2)
    assert "train_batch_size / world_size" in _row(only, "micro_batch")
    given = fz.Spec.from_deepspeed({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3})
    assert "gradient_accumulation_steps" in _row(given, "grad_accum") and "/" not in _row(given, "grad_accum")


def test_a_config_path_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    """A FIFO would block the read forever: it is opened without blocking and refused unread."""
    path = tmp_path / "ds.json"
    start = time.monotonic()
    with fed_fifo(path), pytest.raises(fz.ConfigError, match=rf"DeepSpeed config '{path}' is not a regular file "
                                                             r"\(a FIFO\): not read"):
        fz.Spec.from_deepspeed(path)
    assert time.monotonic() - start < 60


def test_a_config_nested_past_the_recursion_limit_is_a_config_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(fz.ConfigError, match=rf"DeepSpeed config '{path}' nests deeper than Python's recursion limit"):
        fz.Spec.from_deepspeed(path)


@pytest.mark.parametrize("text, where", [
    ('{"zero_optimization": {"stage": 3, "stage": 0}}', "zero_optimization.stage"),
    ('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}', "train_micro_batch_size_per_gpu"),
    ('{"x": [{"a": 1}, {"a": 1, "a": 2}]}', r"x\[1\]\.a"),
])
def test_a_repeated_key_is_refused_by_its_path(tmp_path, text, where):
    """json.loads keeps the last of a repeated key (stage 3, 0 read as 0); DeepSpeed refuses it, so fz does."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    want = rf"^DeepSpeed config '{path}': the key {where} appears twice .*: keep one$"
    with pytest.raises(fz.ConfigError, match=want):
        fz.Spec.from_deepspeed(path)
    with pytest.raises(fz.ConfigError, match=rf"^DeepSpeed config a JSON string: the key {where} appears twice"):
        fz.Spec.from_deepspeed(text)
