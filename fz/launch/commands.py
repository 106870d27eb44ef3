"""The exact command each node runs: torchrun (`python -m torch.distributed.run`) with its
node's rank, its slots in CUDA_VISIBLE_DEVICES and the job's environment, started over ssh,
pdsh, srun or locally.

Node ranks are static (`--nnodes N --node-rank i --master-addr A --master-port P`), as with
DeepSpeed's launcher, so the hostfile's order is the rank order. torchrun's elastic flags
(`--max-restarts`, `--monitor-interval`, `--rdzv-*`) pass through: with `--rdzv-backend c10d`
the agents rendezvous on the endpoint and torchrun restarts failed workers.
"""
from __future__ import annotations

import shlex
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from fz.launch.hostfile import Hosts

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
# ssh's defaults here: fail within ConnectTimeout when a host accepts TCP but never answers, and
# notice a dead connection within ServerAliveInterval * ServerAliveCountMax. They follow the
# user's --ssh-opts, and ssh takes the first value it is given, so the user's win.
SSH_DEFAULTS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "ServerAliveInterval=15",
                "-o", "ServerAliveCountMax=4")


@dataclass(frozen=True)
class Job:
    hosts: Hosts  # selected hosts and slots, in node-rank order
    script: str
    args: Sequence[str]
    master_addr: str
    master_port: int
    env: dict[str, str]
    cwd: str
    torchrun_args: Sequence[str] = ()  # elastic and rendezvous flags, passed as given
    python: str = sys.executable
    module: bool = False  # `-m pkg.mod` instead of a script path
    set_visible_devices: bool = True
    ssh_opts: Sequence[str] = field(default_factory=tuple)


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def torchrun_argv(job: Job, node_rank: int, slots: list[int]) -> list[str]:
    """This node's torchrun command line."""
    argv = [job.python, "-u", "-m", "torch.distributed.run", f"--nnodes={len(job.hosts)}",
            f"--nproc-per-node={len(slots)}"]
    if not any(a.startswith("--rdzv") for a in job.torchrun_args):
        argv += [f"--node-rank={node_rank}", f"--master-addr={job.master_addr}", f"--master-port={job.master_port}"]
    argv += list(job.torchrun_args)
    argv += (["-m"] if job.module else []) + [job.script, *job.args]
    return argv


def node_env(job: Job, slots: list[int]) -> dict[str, str]:
    env = dict(job.env)
    if job.set_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    return env


def shell_line(job: Job, node_rank: int, host: str, watch_stdin: bool = True) -> str:
    """The node's command as one POSIX shell line (what ssh and pdsh run remotely). The job
    ends if the launcher goes away: when ssh's standard input closes, torchrun gets SIGTERM."""
    slots = job.hosts[host]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(node_env(job, slots).items()))
    run = " ".join(shlex.quote(a) for a in torchrun_argv(job, node_rank, slots))
    inner = (f"cd {shlex.quote(job.cwd)} && exec env {exports} {run}" if exports
             else f"cd {shlex.quote(job.cwd)} && exec {run}")
    if not watch_stdin:
        return inner
    # a background job's stdin is /dev/null in sh: the watcher reads ssh's stdin through fd 3
    return (f"exec 3<&0; sh -c {shlex.quote(inner)} </dev/null & p=$!; "
            f"(cat <&3 >/dev/null; kill -TERM $p 2>/dev/null) & w=$!; exec 3<&-; "
            f"wait $p; s=$?; kill $w 2>/dev/null; exit $s")


def readable_line(job: Job, node_rank: int, host: str) -> str:
    """The command `host` runs, as a person would type it there (what --dry-run shows first)."""
    slots = job.hosts[host]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(node_env(job, slots).items()))
    run = shlex.join(torchrun_argv(job, node_rank, slots))
    return f"cd {shlex.quote(job.cwd)} && " + (f"{exports} {run}" if exports else run)


def remote_argv(job: Job, node_rank: int, host: str, launcher: str) -> list[str]:
    """ssh or pdsh, running the node's shell line on `host`."""
    line = shell_line(job, node_rank, host)
    if launcher == "pdsh":
        return ["pdsh", "-S", "-w", host, line]
    return ["ssh", *job.ssh_opts, *SSH_DEFAULTS, host, line]


def srun_argv(job: Job, nodes: list[str]) -> list[str]:
    """Inside a Slurm allocation: one torchrun per node via srun, node rank from SLURM_NODEID."""
    any_host = nodes[0]
    line = shell_line(job, 0, any_host, watch_stdin=False).replace("--node-rank=0", "--node-rank=$SLURM_NODEID")
    return ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1", "sh", "-c", line]
