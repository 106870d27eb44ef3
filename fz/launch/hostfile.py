"""Which hosts and slots a job runs on: DeepSpeed's hostfile, `--include`/`--exclude`,
`--num-nodes`/`--num-gpus`, and Slurm's node list.

A hostfile lists one host per line, `worker-1 slots=4`, with `#` comments and blank lines.
A filter names hosts separated by `@`, each optionally with `:` and a comma list of slots:
`worker-2:0,1@worker-3` is slots 0 and 1 of worker-2 and every slot of worker-3. `--include`
keeps only what it names; `--exclude` removes it. Errors name the line or the unknown name.
A host is passed to ssh and pdsh as an argument, so one starting with '-' (which they would take
as an option, `-oProxyCommand=...`) is refused, as is one with a character no host name has
(pdsh's lists and ranges, `w[1-64]` or `w1,w2`, would be many hosts as one node). Slots are
devices of one host, bounded by MAX_SLOTS.
"""
from __future__ import annotations

import re

from fz.errors import ConfigError
from fz.launch.textfile import read_text

Hosts = dict[str, list[int]]  # host -> its slots (device indices), in hostfile order

MAX_SLOTS = 1024  # devices one host can have; more is a typo, and a list this long is made of it
MAX_NODES = 65536  # hosts of one job (a Slurm node list expanded): more is a typo, and a list this long is made of it
_LINE = re.compile(r"^(?P<host>[^\s=]+)\s+slots\s*=\s*(?P<slots>\d+)$")
# One machine's name: pdsh reads `w[1-64]` and `w1,w2` as many hosts (and `^file`, `/regex/`), so
# one hostfile line would start a node on each; shell characters have no place in a host name either.
_HOST_CHAR = re.compile(r"[^A-Za-z0-9._:%@-]")


def parse_hostfile(text: str, where: str = "hostfile") -> Hosts:
    """{host: [0 .. slots-1]} from a DeepSpeed hostfile's text."""
    hosts: Hosts = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise ConfigError(f"{where}, line {n}: {raw.strip()!r} is not 'HOST slots=N' (DeepSpeed's hostfile format)")
        host, digits = m["host"], m["slots"]
        if host.startswith("-"):
            raise ConfigError(f"{where}, line {n}: host {host[:80]!r} starts with '-': ssh and pdsh would read it as "
                              "an option, not a host name")
        slots = int(digits) if len(digits) <= len(str(MAX_SLOTS)) else MAX_SLOTS + 1
        if slots > MAX_SLOTS:
            shown = digits[:20] + ("..." if len(digits) > 20 else "")
            raise ConfigError(f"{where}, line {n}: {host!r} has slots={shown}, over the {MAX_SLOTS} devices a host "
                              "can have")
        if bad := _HOST_CHAR.search(host):
            raise ConfigError(f"{where}, line {n}: host {host[:80]!r} has {bad[0]!r}, not a host name character "
                              "(letters, digits, . - _ : @): pdsh reads `w[1-4]` or `a,b` as several hosts; list "
                              "each host on its own line")
        if host in hosts:
            raise ConfigError(f"{where}, line {n}: host {host!r} is listed twice")
        if slots < 1:
            raise ConfigError(f"{where}, line {n}: {host!r} has slots={slots}; a host needs at least one slot")
        hosts[host] = list(range(slots))
    if not hosts:
        raise ConfigError(f"{where} lists no hosts")
    return hosts


def read_hostfile(path: str) -> Hosts:
    """The hosts of the hostfile at `path`: a regular UTF-8 file of at most a MiB (textfile)."""
    return parse_hostfile(read_text(path, "hostfile"), f"hostfile {path}")


def _parse_filter(text: str, hosts: Hosts, flag: str) -> dict[str, list[int] | None]:
    """{host: slots or None (all)} named by an include/exclude string, checked against `hosts`."""
    out: dict[str, list[int] | None] = {}
    for part in text.split("@"):
        part = part.strip()
        if not part:
            raise ConfigError(f"{flag} {text!r}: an empty host between '@'")
        host, _, slots = part.partition(":")
        if host not in hosts:
            raise ConfigError(f"{flag} {text!r}: host {host!r} is not in the hostfile (hosts: {', '.join(hosts)})")
        if not slots:
            out[host] = None
            continue
        try:
            wanted = [int(s) for s in slots.split(",")]
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: slots of {host!r} must be integers, like {host}:0,1") from None
        unknown = [s for s in wanted if s not in hosts[host]]
        if unknown:
            raise ConfigError(f"{flag} {text!r}: {host!r} has no slot {unknown[0]} (its slots are "
                              f"{hosts[host][0]}-{hosts[host][-1]})")
        out[host] = sorted(set(wanted) | set(out.get(host) or []))
    return out


def select(hosts: Hosts, include: str = "", exclude: str = "", num_nodes: int = -1, num_gpus: int = -1) -> Hosts:
    """The hosts and slots the job uses, in hostfile order (DeepSpeed's rules)."""
    if include and exclude:
        raise ConfigError("--include and --exclude cannot be used together (name what to use, or what to leave out)")
    if (include or exclude) and (num_nodes >= 0 or num_gpus >= 0):
        raise ConfigError("--num-nodes/--num-gpus cannot be combined with --include/--exclude (DeepSpeed's rule): "
                          "name the slots with --include instead")
    chosen: dict[str, list[int]]
    if include:
        named = _parse_filter(include, hosts, "--include")
        chosen = {h: (list(s) if (n := named[h]) is None else n) for h, s in hosts.items() if h in named}
    elif exclude:
        named = _parse_filter(exclude, hosts, "--exclude")
        chosen = {}
        for h, slots in hosts.items():
            if h in named and named[h] is None:
                continue  # the whole host is excluded
            chosen[h] = [s for s in slots if s not in (named.get(h) or [])]
    else:
        chosen = {h: list(s) for h, s in hosts.items()}
        if num_nodes >= 0:
            chosen = dict(list(chosen.items())[:num_nodes])
        if num_gpus >= 0:
            chosen = {h: s[:num_gpus] for h, s in chosen.items()}
    chosen = {h: s for h, s in chosen.items() if s}
    if not chosen:
        raise ConfigError("no slots are selected: the hostfile, --include/--exclude and --num-nodes/--num-gpus leave "
                          "nothing to run on")
    return chosen


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed node list (`node[01-03,07],gpu5`) as host names, at most MAX_NODES of them."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", text):
        prefix, ranges = m.group(1), m.group(2)
        if bad := _HOST_CHAR.search(prefix):  # srun reads the list; the first becomes MASTER_ADDR
            raise ConfigError(f"SLURM_JOB_NODELIST {text[:200]!r}: {prefix[:80]!r} has {bad[0]!r}, not a host name "
                              "character")
        if not ranges:
            out.append(prefix)
            continue
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not all(n.isascii() and n.isdigit() and len(n) <= 9 for n in (lo, hi or lo)):
                raise ConfigError(f"SLURM_JOB_NODELIST {text[:200]!r}: the range {r[:40]!r} is not N or N-M "
                                  "(numbers of at most 9 digits)")
            if len(out) + int(hi or lo) - int(lo) + 1 > MAX_NODES:
                raise ConfigError(f"SLURM_JOB_NODELIST {text[:200]!r} names more than {MAX_NODES} nodes")
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{str(i).zfill(len(lo))}")
    return out
