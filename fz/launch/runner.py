"""Running the node commands: signals are forwarded, the first failure ends the job, and its
exit code is the launcher's (as DeepSpeed's launcher and torchrun do). Nothing started here
outlives the launcher: on Linux each child gets SIGTERM when the launcher dies, even by SIGKILL
(torchrun passes it on to its workers); remote jobs stop when ssh's standard input closes."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

GRACE_S = 30.0  # after the first failure (or a signal), how long the other nodes get to stop


@dataclass
class NodeProcess:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None  # None: inherit this process's environment
    watch_stdin: bool = False  # ssh/pdsh: closing its stdin stops the remote job
    runs: str | None = None  # ssh/pdsh: the command the host runs, readable (--dry-run shows it, argv apart)


SSH_FAILED = 255  # ssh's own failure (could not connect, lost the connection), not the remote command's


def _die_with(parent: int) -> Callable[[], None] | None:
    """A preexec_fn: SIGTERM this child when the launcher dies (Linux's PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _ssh_failed(node: NodeProcess, returncode: int | None) -> None:
    if returncode == SSH_FAILED and os.path.basename(node.argv[0]) == "ssh":
        print(f"fz run: ssh to {node.name} failed (exit {SSH_FAILED}): ssh could not connect to the host or lost "
              f"the connection (its message is above); check the host name, --ssh-port and --ssh-opts "
              f"(fz's defaults, which --ssh-opts overrides: -o ConnectTimeout=30 -o ServerAliveInterval=15)",
              file=sys.stderr, flush=True)


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            if p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def run_nodes(nodes: list[NodeProcess]) -> int:
    """Start every node's command; return 0 if all succeed, else the first failure's code
    (128 + N for a signal N), after stopping the others."""
    me = os.getpid()
    procs = [subprocess.Popen(n.argv, env=n.env, stdin=subprocess.PIPE if n.watch_stdin else None,
                              preexec_fn=_die_with(me)) for n in nodes]
    received: list[int] = []
    reported: set[int] = set()

    def forward(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        _stop(procs, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    code, deadline = 0, None
    try:
        while any(p.poll() is None for p in procs):
            for i, (n, p) in enumerate(zip(nodes, procs)):
                if p.returncode is not None and i not in reported:
                    reported.add(i)
                    _ssh_failed(n, p.returncode)
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if (failed or received) and deadline is None:
                code = code or _exit_code(-received[0] if received else failed[0])  # a signal wins
                _stop(procs, signal.SIGTERM)
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for i, (n, p) in enumerate(zip(nodes, procs)):
        if i not in reported:
            _ssh_failed(n, p.returncode)
    if code == 0:
        failed = [p.returncode for p in procs if p.returncode != 0]
        code = _exit_code(failed[0]) if failed else (_exit_code(-received[0]) if received else 0)
    return code


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
