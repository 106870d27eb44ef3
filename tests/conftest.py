"""Shared set-up: one thread per process, the machine's measured load for bounds on wall time
(`load`), and the suite's two tiers. The default run (the README's test command) leaves out the
tests marked `slow`: fault injection with real timeouts, end-to-end scripts and launchers,
peak-memory measurements of large models; so it stays within minutes as the suite grows.
`-m slow` runs them alone, as .ci/run does right after the default run (every test runs in CI);
`FZ_SLOW=1` runs both tiers."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from support.timing import Slowdown  # noqa: E402

torch.set_num_threads(1)

SLOW_TIER = ".venv/bin/python -m pytest -q -m slow"


# Started first: the docs' sessions run in a pool of their own for minutes, so on the README's two
# pytest workers (`-n 2 --dist loadfile`, one file to a worker) they overlap the rest rather than end it.
FIRST = ("unit/test_docs.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.split("::")[0].endswith(FIRST))  # stable: the rest keep their order
    if os.environ.get("FZ_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return  # both tiers, or a selection that names the slow one
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config._fz_slow_left = len(slow)
        if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller prints the summary
            config.workeroutput["fz_slow_left"] = len(slow)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: each worker collected the whole suite; the slow tier it left out."""
    left = getattr(node, "workeroutput", {}).get("fz_slow_left", 0)
    node.config._fz_slow_left = max(getattr(node.config, "_fz_slow_left", 0), left)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = getattr(config, "_fz_slow_left", 0)
    if left:
        terminalreporter.write_line(f"{left} tests of the slow tier not run here: `{SLOW_TIER}` runs them "
                                    "(.ci/run does, after this run)")


@pytest.fixture(scope="module")
def load() -> Slowdown:
    """The machine's slowdown around a module's multi-rank runs (tests/support/timing.py): the
    fixture that runs them does it `with load:`, and a test bounds a time by `load.scaled(quiet_s)`."""
    return Slowdown()
