"""`fz run [options] script.py args...`: one machine, a hostfile's hosts, or a Slurm allocation.

    fz run --nproc-per-node 2 train.py                       # this machine (torchrun --standalone)
    fz run --hostfile hosts --include worker-2:0,1@worker-3 train.py --lr 1e-3
    fz run --hostfile hosts --dry-run train.py               # print each node's exact command
DeepSpeed's spellings work too (--num_gpus, --num_nodes, --master_addr, --master_port).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil

from fz.errors import ConfigError
from fz.launch import commands, envfile, hostfile
from fz.launch.commands import Job
from fz.launch.runner import NodeProcess, run_nodes

_ELASTIC = ("max_restarts", "monitor_interval", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf")
# DeepSpeed 0.19's launcher flags fz run has not (a flag, or one taking a value): parsed to be refused by name,
# not argparse's bare "unrecognized arguments"
_DEEPSPEED_ONLY = {"no_python": False, "no_local_rank": False, "no_ssh": False, "no_ssh_check": False,
                   "force_multi": False, "save_pid": False, "bind_cores_to_rank": False, "node_rank": True,
                   "launcher_args": True, "enable_each_rank_log": True, "autotuning": True, "bind_core_list": True,
                   "venv_script": True, "log_level": True}


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("run", help="launch a training script on this machine or many (torchrun underneath)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--nproc-per-node", "--nproc_per_node", "--num-gpus", "--num_gpus", dest="num_gpus", type=int,
                   default=-1, help="processes per node (default: the node's GPUs, else 1; with a hostfile: its slots)")
    r.add_argument("--num-nodes", "--num_nodes", dest="num_nodes", type=int, default=-1,
                   help="use the hostfile's first N hosts")
    r.add_argument("--hostfile", "-H", default=None, help="DeepSpeed hostfile: 'HOST slots=N' lines")
    r.add_argument("--include", "-i", default="", help="only these hosts/slots, e.g. worker-2:0,1@worker-3")
    r.add_argument("--exclude", "-e", default="", help="all but these hosts/slots (same syntax)")
    r.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="rendezvous host (default: the first selected host)")
    r.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=29500)
    r.add_argument("--launcher", choices=["auto", "local", "ssh", "pdsh", "slurm"], default="auto",
                   help="how node commands start (auto: local for this machine's hosts, srun inside Slurm, "
                        "else pdsh if installed, else ssh)")
    r.add_argument("--ssh-port", "--ssh_port", dest="ssh_port", type=int, default=None)
    r.add_argument("--ssh-opts", dest="ssh_opts", default="", help="extra ssh options, e.g. '-i key -o ...'")
    r.add_argument("--no-visible-devices", dest="visible", action="store_false",
                   help="do not set CUDA_VISIBLE_DEVICES from the slots")
    r.add_argument("--module", "-m", action="store_true", help="the script is a module (python -m)")
    for name in _ELASTIC:
        r.add_argument("--" + name.replace("_", "-"), "--" + name, dest=name, default=None,
                       help="passed to torchrun")
    r.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                   help="print each node's command instead of running it")
    for name, valued in _DEEPSPEED_ONLY.items():
        flags = ("--" + name, "--" + name.replace("_", "-"))
        if valued:
            r.add_argument(*flags, dest="ds_" + name, default=None, help=argparse.SUPPRESS)
        else:
            r.add_argument(*flags, dest="ds_" + name, default=None, action="store_const", const=True,
                           help=argparse.SUPPRESS)
    r.add_argument("script", help="the training script (or module with -m)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    r.set_defaults(fn=run)


def _slurm_nodes() -> list[str]:
    text = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    return hostfile.expand_nodelist(text) if text else []


def _local_slots(num_gpus: int) -> list[int]:
    if num_gpus >= 0:
        return list(range(num_gpus))
    try:
        import torch
        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch or no driver: one process
        count = 0
    return list(range(count or 1))


def _torchrun_args(args: argparse.Namespace) -> list[str]:
    return [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in _ELASTIC if getattr(args, n) is not None]


def plan_nodes(args: argparse.Namespace) -> list[NodeProcess]:
    """The node commands `args` asks for (what --dry-run prints)."""
    given = [f"--{n}" for n in _DEEPSPEED_ONLY if getattr(args, "ds_" + n, None) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: DeepSpeed's launcher flag{'s' if len(given) > 1 else ''} that fz run "
                          "does not have (`fz run --help` lists its own); leave them out")
    env = envfile.node_env(os.environ)
    slurm = _slurm_nodes() if args.launcher in ("auto", "slurm") and not args.hostfile else []
    if args.launcher == "slurm" and not slurm:
        raise ConfigError("--launcher slurm: SLURM_JOB_NODELIST is not set (run inside an allocation: salloc/sbatch)")
    if args.hostfile:
        hosts = hostfile.select(hostfile.read_hostfile(args.hostfile), args.include, args.exclude, args.num_nodes,
                                args.num_gpus)
    elif slurm:
        per_node = args.num_gpus
        if per_node < 0:  # Slurm's count, read only when used
            gpus = os.environ.get("SLURM_GPUS_ON_NODE", "0") or "0"
            if not (gpus.isascii() and gpus.isdigit() and len(gpus) <= 4) or int(gpus) > hostfile.MAX_SLOTS:
                raise ConfigError(f"SLURM_GPUS_ON_NODE={gpus[:40]!r}: not a count of devices from 0 to "
                                  f"{hostfile.MAX_SLOTS}")
            per_node = int(gpus) or 1
        hosts = {n: list(range(per_node)) for n in slurm}
    else:
        if args.num_nodes > 1:
            raise ConfigError(f"--num-nodes {args.num_nodes} needs a --hostfile (or a Slurm allocation)")
        one = {"localhost": _local_slots(args.num_gpus if not (args.include or args.exclude) else -1)}
        hosts = hostfile.select(one, args.include, args.exclude)
    names = list(hosts)
    first = names[0]
    master = args.master_addr or ("127.0.0.1" if commands.is_local(first) else first)
    ssh_opts = shlex.split(args.ssh_opts) + (["-p", str(args.ssh_port)] if args.ssh_port else [])
    job = Job(hosts, args.script, list(args.args), master, args.master_port, env, os.getcwd(), _torchrun_args(args),
              module=args.module, set_visible_devices=args.visible and not slurm, ssh_opts=tuple(ssh_opts))
    if slurm:
        return [NodeProcess("slurm", commands.srun_argv(job, names))]
    launcher = args.launcher
    if launcher == "auto":
        launcher = "local" if all(commands.is_local(h) for h in names) else ("pdsh" if shutil.which("pdsh") else "ssh")
    out = []
    for rank, host in enumerate(names):
        if launcher == "local":
            argv = commands.torchrun_argv(job, rank, hosts[host])
            if len(names) == 1 and not any(a.startswith("--rdzv") for a in job.torchrun_args) \
                    and args.master_addr is None:
                argv = [a for a in argv if not a.startswith(("--node-rank", "--master-", "--nnodes"))]
                argv.insert(4, "--standalone")
            out.append(NodeProcess(host, argv, dict(os.environ, **commands.node_env(job, hosts[host]))))
        else:
            out.append(NodeProcess(host, commands.remote_argv(job, rank, host, launcher), watch_stdin=True,
                                   runs=commands.readable_line(job, rank, host)))
    return out


def run(args: argparse.Namespace) -> int:
    if args.args and args.args[0] == "--":
        args.args = args.args[1:]
    nodes = plan_nodes(args)
    if args.dry_run:
        for i, n in enumerate(nodes):
            env = n.env or {}
            shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
                             if k == "CUDA_VISIBLE_DEVICES") if n.env is not None else ""
            print(f"# node {i}: {n.name}")
            if n.runs is not None:  # remote: what the host runs, then how it gets there (quoted for the shell)
                print(n.runs)
                print(f"#   through {n.argv[0]} (stopped when the launcher exits): {shlex.join(n.argv)}")
            else:
                print((shown + " " if shown else "") + shlex.join(n.argv))
        return 0
    return run_nodes(nodes)
