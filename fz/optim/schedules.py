"""Learning-rate schedules: pure functions of the step, passed to any optimizer as `lr=`.

Step convention. fz calls `schedule(count)` with `count` = the number of updates already
applied (0 on the first step), as optax does. DeepSpeed builds its scheduler before
training and calls `scheduler.step()` after each optimizer step, so its k-th update
(k = 0, 1, ...) uses `get_lr()` with `last_batch_iteration = k - 1`. The DeepSpeed-named
schedules here return exactly that value for `count = k`: a run with
`WarmupLR(...)` applies the same lr on every step as DeepSpeed with the same JSON. (One
consequence, also DeepSpeed's: warmups apply `warmup_min_lr` on the first two steps, and
`WarmupCosineLR` applies lr 0 on the first.) Formulas follow
deepspeed/runtime/lr_schedules.py (2025).

Each schedule is a frozen dataclass, so it prints its parameters and pickles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fz.errors import ConfigError

WARMUP_TYPES = ("log", "linear")


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    # 0 is fine: DeepSpeed warms up over max(2, warmup_num_steps) steps
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
        raise ConfigError(f"warmup_num_steps: {warmup_num_steps!r} must be an integer >= 0")
    if warmup_type not in WARMUP_TYPES:
        raise ConfigError(f"warmup_type: {warmup_type!r} is not one of {', '.join(WARMUP_TYPES)}")


def _warmup_gamma(it: int, steps: int, kind: str) -> float:
    """DeepSpeed's warmup fraction at last_batch_iteration `it` (0 <= it < steps)."""
    if kind == "log":
        return math.log(it + 1) / math.log(steps)
    return it / steps


@dataclass(frozen=True)
class constant:
    """The same lr on every step."""

    value: float

    def __call__(self, count: int) -> float:
        return float(self.value)


@dataclass(frozen=True)
class linear:
    """optax.linear_schedule: init_value -> end_value over transition_steps, then flat."""

    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __call__(self, count: int) -> float:
        if self.transition_steps <= 0:
            return float(self.init_value)
        t = min(max(count - self.transition_begin, 0), self.transition_steps)
        frac = 1 - t / self.transition_steps
        return float((self.init_value - self.end_value) * frac + self.end_value)


@dataclass(frozen=True)
class cosine:
    """optax.cosine_decay_schedule: init_value * ((1-alpha) * cos_decay**exponent + alpha)."""

    init_value: float
    decay_steps: int
    alpha: float = 0.0
    exponent: float = 1.0

    def __post_init__(self) -> None:
        if self.decay_steps <= 0:
            raise ConfigError(f"cosine.decay_steps: {self.decay_steps!r} must be > 0")

    def __call__(self, count: int) -> float:
        t = min(max(count, 0), self.decay_steps)
        decay = 0.5 * (1 + math.cos(math.pi * t / self.decay_steps))
        return float(self.init_value * ((1 - self.alpha) * decay ** self.exponent + self.alpha))


@dataclass(frozen=True)
class warmup_linear:
    """The Hugging Face Trainer's default schedule ("linear"): 0 -> `lr` over `warmup_steps`, then
    linear decay to 0 at `total_steps`; without `total_steps`, flat after warmup ("constant_with_warmup").

    transformers' lr_lambda at the Trainer's step k (fz's count): k / max(1, W) during warmup, then
    max(0, (T - k) / max(1, T - W)). Unlike DeepSpeed's warmups, W = 0 means no warmup at all.
    """

    lr: float
    warmup_steps: int = 0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps: {self.warmup_steps!r} must be an integer >= 0")
        if self.total_steps is not None and (isinstance(self.total_steps, bool)
                                             or not isinstance(self.total_steps, int) or self.total_steps < 1):
            raise ConfigError(f"total_steps: {self.total_steps!r} must be None or an integer >= 1")

    def __call__(self, count: int) -> float:
        if count < self.warmup_steps:
            return float(self.lr * count / max(1, self.warmup_steps))
        if self.total_steps is None:
            return float(self.lr)
        return float(self.lr * max(0.0, (self.total_steps - count) / max(1, self.total_steps - self.warmup_steps)))


@dataclass(frozen=True)
class WarmupLR:
    """DeepSpeed WarmupLR: warmup_min_lr -> warmup_max_lr over warmup_num_steps, then flat.

    'log' warmup: min + (max - min) * ln(it + 1) / ln(N); 'linear': it / N, with
    it = count - 1 and N = max(2, warmup_num_steps). DeepSpeed's default warmup_max_lr is
    the optimizer's lr (the config reader passes it).
    """

    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 0.001
    warmup_num_steps: int = 1000
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        _check_warmup(self.warmup_num_steps, self.warmup_type)

    @property
    def _steps(self) -> int:
        return max(2, self.warmup_num_steps)

    def _gamma(self, it: int) -> float:
        return _warmup_gamma(it, self._steps, self.warmup_type) if it < self._steps else 1.0

    def __call__(self, count: int) -> float:
        it = count - 1
        if it < 0:
            return float(self.warmup_min_lr)
        return float(self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self._gamma(it))


@dataclass(frozen=True)
class WarmupDecayLR(WarmupLR):
    """DeepSpeed WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps.

    After warmup the fraction is max(0, (total - it) / max(1, total - N)).
    """

    total_num_steps: int = field(kw_only=True)  # required, by keyword (as in DeepSpeed's JSON)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.total_num_steps, bool) or not isinstance(self.total_num_steps, int) \
                or self.total_num_steps < 1:
            raise ConfigError(f"total_num_steps: {self.total_num_steps!r} must be a positive integer")

    def _gamma(self, it: int) -> float:
        if it < self._steps:
            return _warmup_gamma(it, self._steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self._steps))


@dataclass(frozen=True)
class WarmupCosineLR:
    """DeepSpeed WarmupCosineLR: ratios of the optimizer's `lr` (warmup, then cosine).

    Warmup ratio: warmup_min_ratio + (1 - warmup_min_ratio) * gamma(it); then
    cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2 with
    p = min(1, (it - N + 1) / max(1, total - N)). Before the first scheduler step
    (count 0) DeepSpeed's ratio is 0.
    """

    total_num_steps: int
    lr: float = 0.001  # the optimizer's lr, which the ratios scale
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"

    def __post_init__(self) -> None:
        _check_warmup(self.warmup_num_steps, self.warmup_type)

    def ratio(self, count: int) -> float:
        it = count - 1
        steps = max(2, self.warmup_num_steps)
        if it < 0:
            return 0.0
        if it < steps:
            gamma = _warmup_gamma(it, steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - steps + 1) / max(1, self.total_num_steps - steps))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def __call__(self, count: int) -> float:
        return float(self.lr * self.ratio(count))


@dataclass(frozen=True)
class OneCycle:
    """DeepSpeed OneCycle: min -> max over the first half cycle, back over the second, then decay.

    At batch b = count (DeepSpeed's last_batch_iteration + 1) inside the cycle of
    T = first + second steps: x = b/T - floor(b/T); scale = x / r on the way up (x <= r,
    r = first/T), (x - 1)/(r - 1) on the way down; lr = min + (max - min) * scale. Stair
    counts quantise scale to floor(position * stairs) / stairs. After the cycle,
    lr = min / (1 + decay_lr_rate * (count - T) / decay_step_size) (no decay when
    decay_step_size or decay_lr_rate is 0).

    Momentum: `momentum(count)` gives DeepSpeed's cycled beta1 (max - (max - min) * scale,
    then max * (1 + decay_mom_rate * d / decay_step_size)); fz optimizers keep beta1
    fixed, so the config reader lists cycle_momentum as not supported.
    """

    cycle_min_lr: float
    cycle_max_lr: float
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0

    def __post_init__(self) -> None:
        second = self.cycle_second_step_size
        if not self.cycle_first_step_size > 0 or (second is not None and not second > 0):
            raise ConfigError("OneCycle: cycle_first_step_size and cycle_second_step_size must be > 0")
        if self.decay_step_size < 0:
            raise ConfigError(f"OneCycle: decay_step_size {self.decay_step_size!r} must be >= 0")

    @property
    def _first(self) -> float:
        return float(self.cycle_first_step_size)

    @property
    def _second(self) -> float:
        s = self.cycle_second_step_size
        return float(s) if s is not None else self._first

    @property
    def _total(self) -> float:
        return self._first + self._second

    def _scale(self, b: int) -> float:
        total, ratio = self._total, self._first / self._total
        x = 1.0 + b / total - math.floor(1 + b / total)
        if x <= ratio:
            scale, stairs = x / ratio, self.cycle_first_stair_count
        else:
            scale = (x - 1) / (ratio - 1)
            second = self.cycle_second_stair_count
            stairs = self.cycle_first_stair_count if second is None else second
        if stairs > 0:
            ci = b % total
            if ci <= self._first:
                position = ci * stairs / self._first
            else:
                position = (total - ci) * stairs / self._second
            scale = math.floor(position) / stairs
        return scale

    def _decay(self, count: int) -> float | None:
        """Decay intervals after the cycle, or None while still inside it."""
        if count - 1 < self._total:
            return None
        return (count - self._total) / self.decay_step_size if self.decay_step_size else 0.0

    def __call__(self, count: int) -> float:
        d = self._decay(count)
        if d is None:
            return float(self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self._scale(count))
        if self.decay_step_size == 0 or math.isclose(self.decay_lr_rate, 0):
            return float(self.cycle_min_lr)
        return float(self.cycle_min_lr / (1 + self.decay_lr_rate * d))

    def momentum(self, count: int) -> float | None:
        """DeepSpeed's beta1 for this step, or None when cycle_momentum is off."""
        if not self.cycle_momentum:
            return None
        d = self._decay(count)
        if d is None:
            return float(self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * self._scale(count))
        if self.decay_step_size == 0 or math.isclose(self.decay_mom_rate, 0):
            return float(self.cycle_max_mom)
        return float(self.cycle_max_mom * (1 + self.decay_mom_rate * d))


@dataclass(frozen=True)
class LRRangeTest:
    """DeepSpeed LRRangeTest: min_lr * (1 + step_rate * count / step_size), floored if staircase."""

    lr_range_test_min_lr: float = 0.001
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False

    def __post_init__(self) -> None:
        if not self.lr_range_test_step_size > 0:
            raise ConfigError(f"lr_range_test_step_size: {self.lr_range_test_step_size!r} must be > 0")

    def __call__(self, count: int) -> float:
        interval = count / self.lr_range_test_step_size
        if self.lr_range_test_staircase:
            interval = math.floor(interval)
        return float(self.lr_range_test_min_lr * (1 + self.lr_range_test_step_rate * interval))
