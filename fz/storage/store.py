"""`DiskStore`: the NVMe tier's directory for one process, checked before anything is written.

Each process gets a directory of its own, `<path>/fz-offload-<host>-<pid>-<n>/`, with an
`owner` file; files in it are removed when the state holding them is dropped, and the
directory when the process exits. A directory left by a killed run (its owner process is
gone) is never mixed in: it is named in a warning and removed.
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import shutil
import socket
import stat
import warnings
from typing import Protocol

from fz.errors import ConfigError
from fz.storage.blob import Blob
from fz.storage.io import IOPool
from fz.storage.scratch import SCRATCH

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers
_STORES: dict[tuple[str, int], DiskStore] = {}
_counter = itertools.count()

log = logging.getLogger(__name__)


class IOSettings(Protocol):
    """What an I/O pool is made from: fz.offload.Offload's fields (a layer above storage)."""

    @property
    def buffers(self) -> int: ...
    @property
    def buffer_mb(self) -> float: ...
    @property
    def io_threads(self) -> int: ...
    @property
    def pin_memory(self) -> bool: ...


def check_directory(path: str, need_bytes: int) -> None:
    """A clear ConfigError unless `path` is a writable directory with room for `need_bytes`; one that
    does not exist is made (as DeepSpeed makes its nvme_path)."""
    if not path:
        raise ConfigError("fz.offload.nvme: path is empty; give a directory on a fast local disk")
    if not os.path.lexists(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"fz.offload.nvme: {path} does not exist and cannot be made ({e.strerror or e}); "
                              "give a directory on a fast local disk") from None
        log.info("fz.offload.nvme: made the directory %s", path)
    if not os.path.isdir(path):
        raise ConfigError(f"fz.offload.nvme: {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"fz.offload.nvme: {path} is not writable by this process")
    free = shutil.disk_usage(path).free
    if need_bytes > free:
        raise ConfigError(f"fz.offload.nvme: {path} has {free / 2**30:.2f} GiB free; this rank's offloaded state "
                          f"needs {need_bytes / 2**30:.2f} GiB (a step updates it in place: nothing more)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_OWNER_BYTES = 4096  # an owner file is a line of JSON


def _owner(d: str) -> dict:
    """The owner file of run directory `d`: a small regular file, opened without following a link and
    without blocking (a FIFO planted in a shared directory would hang the run), or {} if it is not one."""
    try:
        fd = os.open(os.path.join(d, "owner"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _OWNER_BYTES:
            return {}
        owner = json.loads(os.read(fd, _OWNER_BYTES))
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)


def _remove_stale(root: str) -> None:
    """Remove the run directories under `root` that a process of this host left and is gone. Only
    directories themselves: a link named like one (another user's, in a shared /tmp) is not followed."""
    host = socket.gethostname()
    with os.scandir(root) as entries:
        found = sorted((e.name, e.path) for e in entries if e.name.startswith("fz-offload-")
                       and e.is_dir(follow_symlinks=False))
    for _, d in found:
        owner = _owner(d)
        pid = owner.get("pid")
        if owner.get("host") == host and type(pid) is int and 0 < pid < 2**31 and not _pid_alive(pid):
            warnings.warn(f"fz.offload: {d} was left by a run that is gone (pid {pid}); it is not reused "
                          "and is being removed", stacklevel=3)
            shutil.rmtree(d, ignore_errors=True)


def _pin_mmap_threshold() -> None:
    """glibc raises its mmap threshold each time a large block is freed, after which freed
    tensors stay in the heap: the memory the disk tier saves comes back as fragmentation
    (measured: +0-90 MB of peak RSS from run to run). A fixed 1 MiB threshold keeps every
    large tensor mmapped, returned to the system when freed."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        return
    SCRATCH.enable()  # every large buffer is now a fresh mapping: reuse fz's own (fz/storage/scratch.py)


class DiskStore:
    def __init__(self, root: str, direct: bool):
        _pin_mmap_threshold()
        self.root = root
        _remove_stale(root)
        n = next(_counter)
        self.dir = os.path.join(root, f"fz-offload-{socket.gethostname()}-{os.getpid()}-{n}")
        try:
            os.makedirs(self.dir)
            with open(os.path.join(self.dir, "owner"), "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
        except OSError as e:
            raise ConfigError(f"fz.offload.nvme: cannot create {self.dir}: {e.strerror}") from e
        self.direct = direct and _direct_io_works(self.dir)
        self._names = itertools.count()
        self._pools: dict[tuple, IOPool] = {}
        atexit.register(shutil.rmtree, self.dir, True)

    def io_pool(self, policy: IOSettings) -> IOPool:
        """The I/O threads and buffers for `policy` (made once, reused by every step)."""
        key = (policy.buffers, int(policy.buffer_mb * 2**20), policy.io_threads, policy.pin_memory)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = IOPool(key[0], _round_up(key[1]), key[2], self.direct, key[3])
        return pool

    def new_blob(self, kind: str, nbytes: int) -> Blob:
        return Blob(self, os.path.join(self.dir, f"{kind}-{next(self._names)}.bin"), nbytes)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def store_for(root: str, direct: bool) -> DiskStore:
    """This process's store under `root` (one per root; made on first use)."""
    key = (os.path.abspath(root), os.getpid())
    if key not in _STORES:
        _STORES[key] = DiskStore(key[0], direct)
    return _STORES[key]


_warned: set[str] = set()


def _direct_io_works(directory: str) -> bool:
    """Whether O_DIRECT opens and writes here (tmpfs and some filesystems refuse it); warns once if not."""
    path = os.path.join(directory, "direct-io-probe")
    ok = False
    if hasattr(os, "O_DIRECT"):
        import mmap
        buf = mmap.mmap(-1, ALIGN)  # page-aligned
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                ok = os.pwrite(fd, buf, 0) == ALIGN
            finally:
                os.close(fd)
        except OSError:
            ok = False
        finally:
            buf.close()
            try:
                os.unlink(path)
            except OSError:
                pass
    if not ok and directory not in _warned:
        _warned.add(directory)
        warnings.warn(f"fz.offload.nvme: O_DIRECT does not work under {os.path.dirname(directory)}; using buffered "
                      "I/O (the page cache may hold offloaded bytes for a while)", stacklevel=3)
    return ok
