"""`fz run`: hostfiles, include/exclude, env files, --dry-run, Slurm, and real launches (two
node agents on this machine; two "hosts" through a real sshd on 127.0.0.1)."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fz
from fz.cli import main
from fz.errors import ConfigError
from fz.launch import commands
from fz.launch.envfile import node_env
from fz.launch.hostfile import expand_nodelist, parse_hostfile, read_hostfile, select

from support.fifo import fed_fifo
from support.timing import slowdown

ROOT = Path(fz.__file__).parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
SEED_HOSTS = "worker-1 slots=4\nworker-2 slots=4\n"  # seed 003's hostfile
THREE = "# the cluster\nworker-1 slots=4\n\nworker-2 slots=4  # spare\nworker-3 slots=4\n"


def test_hostfile_and_filters_as_in_seed_003():
    hosts = parse_hostfile(THREE)
    assert hosts == {f"worker-{i}": [0, 1, 2, 3] for i in (1, 2, 3)}
    assert select(parse_hostfile(SEED_HOSTS), include="worker-2:0,1") == {"worker-2": [0, 1]}
    assert select(hosts, exclude="worker-2:0@worker-3:0,1") == {"worker-1": [0, 1, 2, 3], "worker-2": [1, 2, 3],
                                                               "worker-3": [2, 3]}
    assert select(hosts, include="worker-2:0@worker-3") == {"worker-2": [0], "worker-3": [0, 1, 2, 3]}
    assert select(hosts, exclude="worker-1") == {"worker-2": [0, 1, 2, 3], "worker-3": [0, 1, 2, 3]}
    assert select(hosts, num_nodes=2, num_gpus=1) == {"worker-1": [0], "worker-2": [0]}
    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    names = "node-1.cluster.local slots=1\n10.0.0.2 slots=1\nfe80::1%eth0 slots=1\nme@gpu_3 slots=1\n"
    assert list(parse_hostfile(names)) == ["node-1.cluster.local", "10.0.0.2", "fe80::1%eth0", "me@gpu_3"]


@pytest.mark.parametrize("text, kw, message", [
    ("worker-1 slots=4\nworker-2 4\n", {}, r"hostfile, line 2: 'worker-2 4' is not 'HOST slots=N'"),
    ("worker-1 slots=4\nworker-1 slots=2\n", {}, r"line 2: host 'worker-1' is listed twice"),
    ("# nothing\n\n", {}, r"lists no hosts"),
    ("worker-1 slots=4\n-F/tmp/x slots=1\n", {}, r"line 2: host '-F/tmp/x' starts with '-': ssh and pdsh would "
                                                 "read it as an option"),
    ("worker-1 slots=100000000000\n", {}, r"line 1: 'worker-1' has slots=100000000000, over the 1024 devices a host "
                                          "can have"),
    ("worker-1 slots=" + "9" * 5000 + "\n", {}, r"line 1: 'worker-1' has slots=9{20}\.\.\., over the 1024"),
    # pdsh reads a range or a list as many hosts: one line would be many nodes, one --master-addr none
    ("w[1-64] slots=1\nw99 slots=1\n", {}, r"^hostfile, line 1: host 'w\[1-64\]' has '\[', not a host name "
                                             r"character .*; list each host on its own line$"),
    ("w0 slots=1\nw1,w2 slots=1\n", {}, r"^hostfile, line 2: host 'w1,w2' has ','"),
    ("w]1 slots=1\n", {}, r"line 1: host 'w\]1' has '\]'"),
    ("w1;reboot slots=1\n", {}, r"line 1: host 'w1;reboot' has ';'"),
    ("^/etc/hosts slots=1\n", {}, r"line 1: host '\^/etc/hosts' has '\^'"),
    (THREE, {"include": "worker-9"}, r"--include 'worker-9': host 'worker-9' is not in the hostfile"),
    (THREE, {"exclude": "worker-2:7"}, r"--exclude 'worker-2:7': 'worker-2' has no slot 7"),
    (THREE, {"include": "worker-1", "exclude": "worker-2"}, r"--include and --exclude cannot be used together"),
    (THREE, {"exclude": "worker-1@worker-2@worker-3"}, r"no slots are selected"),
    (THREE, {"include": "worker-1", "num_nodes": 1}, r"cannot be combined with --include/--exclude"),
])
def test_errors_name_the_cause(text, kw, message):
    with pytest.raises(ConfigError, match=message):
        select(parse_hostfile(text), **kw)


def test_env_files_from_home_and_working_directory(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nNCCL_SOCKET_IFNAME=eth0\n")  # seed 003's example
    (cwd / ".fz_env").write_text("# ours\nexport NCCL_SOCKET_IFNAME=ib0\nMY_FLAG=a b\n")
    env = node_env({"PYTHONPATH": "/src", "HOME": "/root", "NCCL_DEBUG": "INFO"}, cwd=cwd, home=home)
    assert env == {"PYTHONPATH": "/src", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "ib0",
                   "MY_FLAG": "a b", "THP_MEM_ALLOC_ENABLE": "1"}  # fz's one default: torch's huge pages
    assert node_env({"THP_MEM_ALLOC_ENABLE": "0"}, cwd=cwd, home=home)["THP_MEM_ALLOC_ENABLE"] == "0"  # the user's wins
    (cwd / ".fz_env").write_text("NOT A LINE\n")
    with pytest.raises(ConfigError, match=r"\.fz_env, line 1: 'NOT A LINE' is not KEY=VALUE"):
        node_env({}, cwd=cwd, home=home)


def test_a_variable_name_that_is_not_a_shell_name_never_reaches_a_node(tmp_path, caplog):
    """The names of the launching environment's FZ_*/NCCL_* variables went unquoted into each node's shell
    line: one named `FZ_X$(touch f)` ran `touch f` on every node. Now it is left out, with a warning."""
    marker = tmp_path / "ran"
    environ = {"PATH": os.environ["PATH"], f"FZ_X$(touch {marker})": "1", "FZ_OK": "a b"}
    with caplog.at_level("WARNING", logger="fz.launch.envfile"):
        env = node_env(environ, cwd=tmp_path, home=tmp_path)
    assert env == {"FZ_OK": "a b", "THP_MEM_ALLOC_ENABLE": "1"}
    assert "'FZ_X$(touch" in caplog.text and "not passed to the nodes: not a shell variable's name" in caplog.text
    job = commands.Job({"worker-1": [0]}, "train.py", [], "worker-1", 29500, env, str(tmp_path), python="/bin/true")
    subprocess.run(["sh", "-c", commands.shell_line(job, 0, "worker-1", watch_stdin=False)],
                   stdin=subprocess.DEVNULL, timeout=60 * slowdown(), check=True)
    assert not marker.exists()
    (tmp_path / ".fz_env").write_text("FZ_é=1\n")  # a name isalnum() took, which no shell assigns
    with pytest.raises(ConfigError, match=r"line 1: 'FZ_é=1' is not KEY=VALUE"):
        node_env({}, cwd=tmp_path, home=tmp_path)


@pytest.mark.parametrize("nodes, message", [
    ("node[0-x]", r"the range '0-x' is not N or N-M"),
    ("node[0-99999999]", r"names more than 65536 nodes"),
    ("node[0-" + "9" * 5000 + "]", r"is not N or N-M"),  # int() of it was Python's own ValueError
    ("n$(reboot)[1-2]", r"'n\$\(reboot\)' has '\$', not a host name character"),
])
def test_a_slurm_node_list_that_is_not_one_is_named(nodes, message):
    """A raw ValueError, a list of 10**11 names built, a shell character taken as a host name: each now a
    ConfigError naming SLURM_JOB_NODELIST."""
    with pytest.raises(ConfigError, match=rf"SLURM_JOB_NODELIST .*{message}"):
        expand_nodelist(nodes)


def test_hostfile_and_env_file_are_small_regular_utf8_files(tmp_path):
    """Before, bytes that are not UTF-8 crashed `fz run` with a UnicodeDecodeError traceback and a
    FIFO named as the hostfile hung it: each is now a ConfigError naming the file (and the line)."""
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"worker-1 slots=2\n\xff\xfe bad\n")
    with pytest.raises(ConfigError, match=rf"^hostfile {hosts}, line 2: byte 0xff is not UTF-8 text; save"):
        read_hostfile(str(hosts))
    hosts.write_bytes(b"\xef\xbb\xbfworker-1 slots=2\n")  # a BOM, as some editors write: skipped
    assert read_hostfile(str(hosts)) == {"worker-1": [0, 1]}
    hosts.write_bytes(b"# padding\n" * 200_000)
    with pytest.raises(ConfigError, match=rf"^hostfile {hosts} is over 1 MiB"):
        read_hostfile(str(hosts))
    start = time.monotonic()
    with fed_fifo(tmp_path / "fifo"), pytest.raises(ConfigError, match=r"fifo is not a regular file \(a FIFO\)"):
        read_hostfile(str(tmp_path / "fifo"))
    assert time.monotonic() - start < 60
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (cwd / ".fz_env").write_bytes(b"A=1\nB=\x80\n")
    with pytest.raises(ConfigError, match=rf"^env file {cwd / '.fz_env'}, line 2: byte 0x80 is not UTF-8 text"):
        node_env({}, cwd=cwd, home=home)
    (cwd / ".fz_env").unlink()
    with fed_fifo(home / ".deepspeed_env"), pytest.raises(ConfigError, match=r"\.deepspeed_env is not a regular file"):
        node_env({}, cwd=cwd, home=home)


def _dry(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", *argv, "--dry-run", "train.py", "--deepspeed", "--deepspeed_config", "ds.json"]) == 0
    return capsys.readouterr().out.splitlines()


def test_dry_run_prints_each_nodes_exact_command(tmp_path, capsys, monkeypatch):
    (tmp_path / "hosts").write_text(THREE)
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n")
    out = _dry(["--hostfile", "hosts", "--exclude", "worker-2:0@worker-3:0,1", "--master_port", "29555"],
               capsys, tmp_path, monkeypatch)
    assert [line for line in out if line.startswith("# node")] == ["# node 0: worker-1", "# node 1: worker-2",
                                                                   "# node 2: worker-3"]
    cmds = [line for line in out if not line.startswith("#")]
    through = [line for line in out if line.startswith("#   through ")]
    for rank, (host, devices) in enumerate([("worker-1", "0,1,2,3"), ("worker-2", "1,2,3"), ("worker-3", "2,3")]):
        c, t = cmds[rank], through[rank].split(": ", 1)[1]
        assert t.startswith(f"ssh -o BatchMode=yes -o ConnectTimeout=30 -o ServerAliveInterval=15 "
                            f"-o ServerAliveCountMax=4 {host} ") or t.startswith(f"pdsh -S -w {host} "), t
        assert c.startswith(f"cd {tmp_path} && ") and "'" not in c, c  # readable: no shell quoting layers
        assert f"CUDA_VISIBLE_DEVICES={devices} " in c and "NCCL_IB_DISABLE=1" in c, c
        assert f"--nnodes=3 --nproc-per-node={len(devices.split(','))} --node-rank={rank} " \
               f"--master-addr=worker-1 --master-port=29555 train.py --deepspeed --deepspeed_config ds.json" in c, c
    local = _dry(["--num_gpus", "2"], capsys, tmp_path, monkeypatch)  # one machine: torchrun --standalone
    assert local[1] == (f"CUDA_VISIBLE_DEVICES=0,1 {sys.executable} -u -m torch.distributed.run --standalone "
                        "--nproc-per-node=2 train.py --deepspeed --deepspeed_config ds.json")
    elastic = _dry(["--num_gpus", "1", "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "127.0.0.1:29400"], capsys, tmp_path, monkeypatch)
    assert "--max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 train.py" in elastic[1], elastic


def test_deepspeeds_launcher_flags_fz_run_has_not_are_named(tmp_path, capsys, monkeypatch):
    """They were argparse's bare "unrecognized arguments"; a script's own flag of that name is the script's."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--force_multi", "--autotuning", "run", "--dry-run", "train.py"]) != 0
    assert "fz run: error: --force_multi, --autotuning: DeepSpeed's launcher flags that fz run does not have" in \
        capsys.readouterr().err
    assert main(["run", "--dry-run", "train.py", "--autotuning", "run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("train.py --autotuning run")


def test_inside_slurm_nodes_and_ranks_come_from_slurm(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    out = _dry([], capsys, tmp_path, monkeypatch)
    assert out[1].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 sh -c "), out
    assert "--nnodes=2 --nproc-per-node=4 --node-rank=$SLURM_NODEID --master-addr=gpu07" in out[1], out
    assert "CUDA_VISIBLE_DEVICES" not in out[1]  # Slurm sets it
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "9" * 5000)  # int() of it was Python's own ValueError
    assert main(["run", "--dry-run", "train.py"]) != 0
    assert "fz run: error: SLURM_GPUS_ON_NODE='9999" in capsys.readouterr().err
    assert "--nproc-per-node=2" in _dry(["--num_gpus", "2"], capsys, tmp_path, monkeypatch)[1]  # then not read


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv, cwd) -> str:
    """`fz run ... train_gpt.py --ci` (tiny model, 10 steps at world 2): the run's summary lines."""
    res = subprocess.run([sys.executable, "-m", "fz", "run", *argv, str(EXAMPLE), "--ci", "--logdir", "",
                          "--steps", "10"], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if re.match(r"(loss .* over steps|step 10  eval/loss|.*; world)", ln)]
    assert any("world 2" in ln for ln in lines), res.stdout[-2000:]
    return "\n".join(re.sub(r" \([\d.]+ s\)$", "", ln) for ln in lines)  # wall time differs


def _start_sshd(d: Path, port: int):
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        pytest.skip("no sshd here (CI installs Debian's openssh-server: see .ci/run)")
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "id.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nStrictModes no\nUsePAM no\nPermitRootLogin yes\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nLogLevel ERROR\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + slowdown() * 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
    raise AssertionError("sshd did not start")


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_two_node_agents_and_two_ssh_hosts_train_as_one_node_does(tmp_path):
    """World 2 three ways, the same losses: one node (2 processes), two node agents (node ranks
    0 and 1, one rendezvous) on this machine, and two "hosts" (localhost, 127.0.0.1) over ssh."""
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    one = _launch(["--nproc-per-node", "2"], tmp_path)
    two = _launch(["--hostfile", "hosts", "--master-port", str(_free_port())], tmp_path)
    assert two == one, (one, two)
    port = _free_port()
    sshd = _start_sshd(tmp_path, port)
    try:
        opts = f"-i {tmp_path / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
        over_ssh = _launch(["--hostfile", "hosts", "--launcher", "ssh", "--ssh-port", str(port), f"--ssh-opts={opts}",
                            "--master-port", str(_free_port())], tmp_path)
    finally:
        sshd.terminate()
        sshd.wait(timeout=10)
    assert over_ssh == one, (one, over_ssh)


@pytest.mark.slow  # the slow tier (.ci/run: -m slow)
def test_exit_codes_and_signals_are_forwarded(tmp_path):
    """A failing job's exit code is fz run's (torchrun's: 1 when a worker fails); SIGTERM to fz run
    stops every node's processes and exits 128 + 15."""
    (tmp_path / "fail.py").write_text("import sys; sys.exit(3)\n")
    (tmp_path / "sleep.py").write_text("import os, time\nopen(f'started{os.environ[\"RANK\"]}', 'w').close()\n"
                                       "time.sleep(120)\n")
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    res = subprocess.run([sys.executable, "-m", "fz", "run", "--nproc-per-node", "1", "fail.py"], cwd=tmp_path,
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "exitcode  : 3" in res.stderr, res.stderr[-2000:]
    p = subprocess.Popen([sys.executable, "-m", "fz", "run", "--hostfile", "hosts", "--master-port", str(_free_port()),
                          "sleep.py"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + slowdown() * 60  # a quiet machine's bound, scaled
    while not ((tmp_path / "started0").exists() and (tmp_path / "started1").exists()):
        assert time.monotonic() < deadline and p.poll() is None, "the two nodes did not start"
        time.sleep(0.1)
    p.send_signal(15)
    assert p.wait(timeout=slowdown() * 60) == 128 + 15
    time.sleep(1)
    assert not [
        ln
        for ln in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
        if "sleep.py" in ln and "pytest" not in ln
    ], "a node's process outlived the launcher"


SSH_DEFAULT_S = 30  # fz's own ConnectTimeout: what ignoring the user's 2 s would take


def test_ssh_to_a_host_that_never_answers_fails_within_connect_timeout_naming_it(tmp_path):
    """A host that accepts TCP but never speaks ssh: the launcher ends within seconds (the user's
    -o ConnectTimeout=2 before fz's default 30; ssh takes the first) with an error naming the host."""
    if shutil.which("ssh") is None:
        pytest.skip("ssh is not installed here (no ssh client on PATH)")
    import threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    held: list[socket.socket] = []

    def accept_and_sleep() -> None:
        try:
            while True:
                held.append(listener.accept()[0])  # never answers
        except OSError:
            pass

    threading.Thread(target=accept_and_sleep, daemon=True).start()
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n")
    start = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "fz", "run", "--hostfile", "hosts", "--launcher", "ssh",
                              "--ssh-port", str(listener.getsockname()[1]),
                              "--ssh-opts=-o ConnectTimeout=2 -o StrictHostKeyChecking=no "
                              "-o UserKnownHostsFile=/dev/null", "sleep.py"],
                             cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    finally:
        listener.close()
        for c in held:
            c.close()
    assert time.monotonic() - start < SSH_DEFAULT_S, "the launcher waited for ssh far past ConnectTimeout"
    assert res.returncode == 255, res.stderr[-2000:]
    assert "fz run: ssh to 127.0.0.1 failed (exit 255): ssh could not connect" in res.stderr, res.stderr[-2000:]


def test_sigkill_of_the_launcher_stops_torchrun_and_its_workers(tmp_path):
    """Nothing fz run started outlives it, even when it is SIGKILLed: its children get SIGTERM
    (PR_SET_PDEATHSIG) and torchrun stops its workers."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    (tmp_path / "sleep.py").write_text(
        "import os, time\nopen(f'pids{os.environ[\"RANK\"]}', 'w').write(f'{os.getppid()} {os.getpid()}')\n"
        "while True:\n    time.sleep(0.2)\n")
    p = subprocess.Popen([sys.executable, "-m", "fz", "run", "--num_gpus", "2", "sleep.py"], cwd=tmp_path,
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + slowdown() * 60  # a quiet machine's bound, scaled
        while not all((tmp_path / f"pids{r}").exists() and (tmp_path / f"pids{r}").read_text() for r in (0, 1)):
            assert time.monotonic() < deadline and p.poll() is None, "the two workers did not start"
            time.sleep(0.1)
        pids = {int(x) for r in (0, 1) for x in (tmp_path / f"pids{r}").read_text().split()}
        assert len(pids) == 3, pids  # torchrun's agent and two workers
        p.kill()
        p.wait(timeout=10)
        deadline = time.monotonic() + slowdown() * 10
        while (alive := {q for q in pids if _alive(q)}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"these outlived the SIGKILLed launcher: {sorted(alive)}"
    finally:
        for q in pids:
            if _alive(q):
                os.kill(q, 9)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False
