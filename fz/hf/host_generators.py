"""Python's and numpy's generators in fz.hf.Trainer's checkpoints, as transformers' rng_state files hold them.

transformers saves `random`'s and numpy's global generators with torch's and sets them all when it
resumes (a collator may draw from them: numpy's masks, python's shuffles). fz's checkpoint keeps
torch's in the State; these two ride in `state.data` (each rank's data file, JSON), and are checked
before they are set: a state of the wrong length, a word past 32 bits, a position past the
twister's words, a state of zeros or a cached normal draw no generator gives is a CheckpointError,
never a generator reading beyond its state or drawing only zeros.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from fz.errors import CheckpointError
from fz.rng import MT_WORDS as _WORDS

KEY = "generators"  # state.data[KEY]


def as_json(python: Any, numpy: Any) -> dict[str, Any]:
    """`random.getstate()`'s and `np.random.get_state()`'s tuples (or a file's copies of them) as
    JSON lists, which `setter` checks (a TypeError, IndexError or ValueError where they are not)."""
    return {"python": [python[0], list(python[1]), python[2]],
            "numpy": [numpy[0], [int(k) for k in numpy[1]], int(numpy[2]), int(numpy[3]), float(numpy[4])]}


def captured() -> dict[str, Any]:
    """This process's python and numpy generators, as JSON."""
    return as_json(random.getstate(), np.random.get_state())


def _word(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**32


_GAUSS = 64.0  # a cached normal draw past this is none a double's Box-Muller gives (at most about 9)


def _degenerate(words: list[int]) -> bool:
    """A twister state that draws only zeros: its bits (mt[0]'s top one and mt[1:]) all 0, which no
    seeded generator reaches."""
    return not words[0] >> 31 and not any(words[1:_WORDS])


def _problem(saved: Any) -> str | None:
    if not isinstance(saved, dict) or set(saved) != {"python", "numpy"}:
        return "not an object of 'python' and 'numpy'"
    py, nump = saved["python"], saved["numpy"]
    if not (isinstance(py, list) and len(py) == 3 and py[0] == 3 and isinstance(py[1], list)
            and len(py[1]) == _WORDS + 1 and all(_word(w) for w in py[1]) and py[1][-1] <= _WORDS
            and (py[2] is None or (isinstance(py[2], float) and math.isfinite(py[2])))):
        return "python's is not a Mersenne Twister state random.getstate gives"
    if not (isinstance(nump, list) and len(nump) == 5 and nump[0] == "MT19937" and isinstance(nump[1], list)
            and len(nump[1]) == _WORDS and all(_word(w) for w in nump[1]) and type(nump[2]) is int
            and 0 <= nump[2] <= _WORDS and nump[3] in (0, 1) and isinstance(nump[4], (int, float))
            and math.isfinite(nump[4])):
        return "numpy's is not a Mersenne Twister state np.random.get_state gives"
    if _degenerate(py[1]) or _degenerate(nump[1]):
        return "a Mersenne Twister state of zeros, which draws nothing but zeros (no seeded generator is in it)"
    if (py[2] is not None and abs(py[2]) > _GAUSS) or (nump[3] and abs(nump[4]) > _GAUSS):
        return f"a cached normal draw past {_GAUSS:g}, which no generator gives"
    return None


def setter(saved: Any, where: str) -> Callable[[], None] | None:
    """A function setting the generators `saved` holds (None: a checkpoint without them, as an older
    fz wrote); a CheckpointError naming `where` if they are not what `captured` writes."""
    if saved is None:
        return None
    why = _problem(saved)
    if why is not None:
        raise CheckpointError(f"{where}: state.data[{KEY!r}]: {why}: damaged or altered")
    py, nump = saved["python"], saved["numpy"]

    def set_them() -> None:
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state((nump[0], np.asarray(nump[1], dtype=np.uint32), nump[2], nump[3], float(nump[4])))

    return set_them
