"""fz's messages go through `logging.getLogger("fz")`: on stdout by default, routed like any log.

Until something uses it, importing fz configures nothing. At first use, if the "fz" logger has
no handler of its own, fz gives it one that writes the bare message to the current stdout
(what a `print` did: `fz: saved ckpt/step_100 (12.3 MB in 0.21 s)`; warnings to stderr) at
level INFO, and stops it propagating to the root logger (so a configured root does not print
it twice). To route
or silence: `logging.getLogger("fz").setLevel(logging.WARNING)`, or give it handlers of your
own before fz logs (dictConfig included) and fz adds none.
"""
from __future__ import annotations

import logging
import sys

NAME = "fz"


class _Console(logging.Handler):
    """Messages to the current sys.stdout, warnings and errors to the current sys.stderr (looked up
    at each record, so pytest's capture and redirected streams get them)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: a failing handler never raises
            self.handleError(record)


def logger(child: str | None = None) -> logging.Logger:
    """The "fz" logger (or its `child`), with fz's default handler if nobody configured one."""
    root = logging.getLogger(NAME)
    if not root.handlers:
        handler = _Console()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.propagate = False
        if root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
    return root if child is None else root.getChild(child)
