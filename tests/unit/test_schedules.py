"""Each schedule equals a table worked out by hand from DeepSpeed's / optax's formulas.

Step convention: schedule(count) with count = updates already applied; for the DeepSpeed
names that is DeepSpeed's get_lr() at last_batch_iteration = count - 1 (its scheduler
steps after each optimizer step), so `it` below is count - 1.
"""
from __future__ import annotations

import math
import pickle

import pytest
import torch

import fz
from fz.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    constant,
    cosine,
    linear,
    warmup_linear,
)

L = math.log
CASES = {
    # min 0.1, max 1.1, N = 5, log: lr = 0.1 + 1.0 * ln(it + 1) / ln(5); count 0 is before any step.
    "warmup_log": (WarmupLR(warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=5),
                   {0: 0.1, 1: 0.1, 2: 0.1 + L(2) / L(5), 3: 0.1 + L(3) / L(5), 5: 1.1, 6: 1.1, 1000: 1.1}),
    # linear, N = 4: gamma = it / 4.
    "warmup_linear": (WarmupLR(warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4, warmup_type="linear"),
                      {0: 0.1, 1: 0.1, 2: 0.35, 4: 0.85, 5: 1.1, 9: 1.1}),
    # N = max(2, 1) = 2: it = 1 gives ln 2 / ln 2 = 1.
    "warmup_one_step": (WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1),
                        {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}),
    # N = max(2, 0) = 2 (DeepSpeed): the Hugging Face Trainer's default warmup_steps=0 is valid.
    "warmup_zero": (WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=0),
                    {0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}),
    # transformers' linear schedule: k / 4 while k < 4, then (10 - k) / (10 - 4), floored at 0.
    "hf_linear": (warmup_linear(1.0, warmup_steps=4, total_steps=10),
                  {0: 0.0, 2: 0.5, 4: 1.0, 7: 0.5, 10: 0.0, 12: 0.0}),
    # warmup 0 is no warmup there (not DeepSpeed's 2 steps): (8 - k) / 8 from the first step.
    "hf_linear_no_warmup": (warmup_linear(2.0, warmup_steps=0, total_steps=8), {0: 2.0, 2: 1.5, 8: 0.0}),
    # no total: constant_with_warmup.
    "hf_constant_with_warmup": (warmup_linear(1.0, warmup_steps=2), {0: 0.0, 1: 0.5, 2: 1.0, 100: 1.0}),
    # total 10, N = 4, linear warmup; then (10 - it) / (10 - 4), floored at 0.
    "warmup_decay": (WarmupDecayLR(total_num_steps=10, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
                                   warmup_type="linear"),
                     {0: 0.0, 1: 0.0, 2: 0.25, 4: 0.75, 5: 1.0, 6: 5 / 6, 10: 1 / 6, 11: 0.0, 15: 0.0}),
    "warmup_decay_log": (WarmupDecayLR(total_num_steps=8, warmup_max_lr=2.0, warmup_num_steps=3),
                         {2: 2.0 * L(2) / L(3), 4: 2.0, 6: 2.0 * 3 / 5}),
    # lr 2, warmup ratio 0.1 + 0.9 * it / 4, then 0.05 + 0.95 * (1 + cos(pi * (it - 3) / 6)) / 2.
    "warmup_cosine": (WarmupCosineLR(total_num_steps=10, lr=2.0, warmup_min_ratio=0.1, warmup_num_steps=4,
                                     cos_min_ratio=0.05, warmup_type="linear"),
                      {0: 0.0, 1: 0.2, 2: 0.65, 4: 2.0 * (0.1 + 0.9 * 0.75),
                       5: 2.0 * (0.05 + 0.95 * (1 + math.cos(math.pi / 6)) / 2),
                       7: 2.0 * (0.05 + 0.95 * (1 + math.cos(math.pi * 3 / 6)) / 2), 10: 0.1, 20: 0.1}),
    # T = 4 + 2 = 6, up-ratio 2/3: count 2 -> x = 1/3 -> scale 1/2; count 5 -> x = 5/6 -> scale 1/2;
    # after the cycle: 0.1 / (1 + 0.5 * (count - 6) / 3).
    "one_cycle": (OneCycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4, cycle_second_step_size=2,
                           decay_lr_rate=0.5, decay_step_size=3),
                  {0: 0.1, 2: 0.3, 4: 0.5, 5: 0.3, 6: 0.1, 7: 0.1 / (1 + 0.5 / 3), 9: 0.1 / 1.5}),
    # Two stairs per half of an 8-step cycle: floor(position * 2) / 2.
    "one_cycle_stairs": (OneCycle(cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                                  cycle_first_stair_count=2),
                         {0: 0.0, 1: 0.0, 2: 0.5, 3: 0.5, 4: 1.0, 5: 0.5, 6: 0.5, 7: 0.0, 8: 0.0, 9: 0.0}),
    "one_cycle_no_decay": (OneCycle(cycle_min_lr=0.2, cycle_max_lr=0.4, cycle_first_step_size=2),
                           {1: 0.3, 2: 0.4, 3: 0.3, 5: 0.2, 50: 0.2}),
    # min 0.01 * (1 + 2 * count / 4); staircase floors count / 4.
    "range_test": (LRRangeTest(lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0),
                   {0: 0.01, 2: 0.02, 4: 0.03, 8: 0.05}),
    "range_test_stairs": (LRRangeTest(lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                                      lr_range_test_step_rate=2.0, lr_range_test_staircase=True),
                          {0: 0.01, 2: 0.01, 4: 0.03, 7: 0.03}),
    "constant": (constant(0.3), {0: 0.3, 7: 0.3, 10**6: 0.3}),
    # optax.linear_schedule(1, 0, 4, transition_begin=2).
    "linear": (linear(1.0, 0.0, 4, transition_begin=2), {0: 1.0, 2: 1.0, 3: 0.75, 5: 0.25, 6: 0.0, 10: 0.0}),
    # optax.cosine_decay_schedule(1, 4, alpha=0.1): 0.1 + 0.9 * (1 + cos(pi * t / 4)) / 2.
    "cosine": (cosine(1.0, 4, alpha=0.1), {0: 1.0, 1: 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 2: 0.55,
                                           4: 0.1, 8: 0.1}),
    "cosine_exponent": (cosine(2.0, 2, exponent=2.0), {1: 2.0 * 0.25, 2: 0.0}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_hand_table(name):
    schedule, table = CASES[name]
    for count, want in table.items():
        assert schedule(count) == pytest.approx(want, rel=1e-12, abs=1e-15), (name, count)


def test_one_cycle_momentum_is_the_inverse_cycle():
    s = OneCycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4, cycle_second_step_size=2,
                 cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.3, decay_step_size=3)
    assert [s.momentum(c) for c in (0, 2, 4, 6)] == pytest.approx([0.9, 0.85, 0.8, 0.9])
    assert s.momentum(9) == pytest.approx(0.9 * (1 + 0.3 * 3 / 3))
    assert OneCycle(0.1, 0.2, cycle_momentum=False).momentum(3) is None


def test_schedules_print_their_parameters_and_pickle():
    s = WarmupDecayLR(total_num_steps=100, warmup_max_lr=0.01, warmup_num_steps=10)
    assert "total_num_steps=100" in repr(s) and "warmup_max_lr=0.01" in repr(s)
    assert pickle.loads(pickle.dumps(s))(7) == s(7)


@pytest.mark.parametrize("make, match", [
    (lambda: WarmupLR(warmup_num_steps=-1), "warmup_num_steps: -1 must be an integer >= 0"),
    (lambda: warmup_linear(1.0, warmup_steps=-1), "warmup_steps"),
    (lambda: warmup_linear(1.0, total_steps=0), "total_steps"),
    (lambda: WarmupLR(warmup_type="cubic"), "warmup_type: 'cubic' is not one of log, linear"),
    (lambda: WarmupDecayLR(total_num_steps=0), "total_num_steps"),
    (lambda: cosine(1.0, 0), "decay_steps"),
    (lambda: OneCycle(0.1, 0.2, cycle_first_step_size=0), "cycle_first_step_size"),
])
def test_bad_schedule_parameters_are_config_errors(make, match):
    with pytest.raises(fz.ConfigError, match=match):
        make()


def test_a_schedule_drives_any_optimizer_and_current_lr_reports_it():
    """sgd(lr=schedule): update k is -schedule(k) * g; the state records that lr."""
    schedule = WarmupLR(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=3, warmup_type="linear")
    opt = fz.optim.sgd(lr=schedule)
    params = {"w": torch.zeros(3)}
    state = opt.init(params)
    assert fz.optim.current_lr(state) == schedule(0)
    for k in range(6):
        g = torch.full((3,), 2.0)
        u, state = opt.update({"w": g.clone()}, state, params)
        torch.testing.assert_close(u["w"], -schedule(k) * g)
        assert fz.optim.current_lr(state) == pytest.approx(schedule(k), rel=1e-15)


def test_a_schedules_lr_far_below_zero_is_refused():
    """A schedule may go below 0 (a user's lambda), but not past -LR_MAX: a count wrapped to -2**63 by a
    crafted checkpoint made warmup's lr -9e15, and the weights jumped by 4.5e19."""
    from fz.optim.base import lr_at
    assert lr_at(lambda count: -0.5, 3) == -0.5
    with pytest.raises(fz.ConfigError,
                       match=r"learning rate -9223372036854776.0 \(the schedule's, at update -9223372036854775808"):
        lr_at(fz.optim.warmup_linear(1e-2, 10, 100), -2**63)
