"""One job per output: a live job holds its folder, and a second job is refused at once, naming the first.

The hold is an OS lock (`flock`) on a hidden file beside the folder, `.NAME.quantize-lock`, which also records
who holds it: PID, host, start time and command. The kernel drops the lock when its process dies (SIGKILL and
the OOM killer included), so a dead job never blocks `--resume`; the record is only for the message. The file
sits beside the folder, not in it, so that emptying the folder (--overwrite) or renaming it (OUT.partial becomes
OUT) never loses the lock while it is held; a job that ends removes it.

Network filesystems. NFS carries flock to the server as a byte-range lock, but a `nolock` mount keeps it on one
machine; Lustre keeps it on one node with `localflock` and refuses it without `flock`; CIFS and FUSE vary. There
a free lock proves nothing about another host, so the record decides: a record left by another host is refused
(this host cannot prove that job dead), with the way out: delete the lock file once that job is known to be
gone. A record left on this host is stale when its process is gone (or its PID now runs another process).
Where flock itself is refused, the record alone is the lock.

This module imports no torch: a refusal costs no start-up time.
"""

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from quantize.errors import UsageError

SUFFIX = ".quantize-lock"
# filesystems whose flock may not reach other machines (see the module docstring)
NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "gpfs", "beegfs", "9p", "afs",
              "fuse.sshfs", "fuse.glusterfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.juicefs", "fuse.ceph")


class Held(UsageError):
    """Another live job holds the folder (exit 2): nothing of it is touched."""


def lock_path(folder: Path) -> Path:
    folder = Path(folder).absolute()
    return folder.parent.resolve() / f".{folder.name}{SUFFIX}"


@dataclass(frozen=True)
class Record:
    pid: int
    host: str
    started: float
    command: str
    boot_id: str | None = None
    proc_start: str | None = None  # the process's start time in clock ticks since boot: a reused PID differs

    @classmethod
    def mine(cls) -> "Record":
        pid = os.getpid()
        return cls(pid, socket.gethostname(), time.time(), _command(), _boot_id(), _proc_start(pid))

    def alive_here(self) -> bool | None:
        """On this host: is the recorded process still running? None when the record is another host's."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return False  # the machine rebooted since
        now = _proc_start(self.pid)
        if now is not None:
            return self.proc_start is None or now == self.proc_start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def describe(self) -> str:
        t = time.localtime(self.started)
        when = time.strftime("%H:%M" if time.strftime("%Y%m%d", t) == time.strftime("%Y%m%d") else "%Y-%m-%d %H:%M", t)
        return f"PID {self.pid} on {self.host} since {when} ({self.command})"


def _command() -> str:
    argv = [Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]
    if argv[0] in ("__main__.py", "-m"):
        argv[0] = "quantize"
    text = shlex.join(argv)
    return text if len(text) <= 160 else text[:157] + "..."


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, after the command name (which may hold spaces)


def _read(path: Path) -> Record | None:
    try:
        raw = json.loads(path.read_text())
        return Record(**{k: raw.get(k) for k in Record.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def filesystem(path: Path) -> str:
    """The type of the filesystem that holds path (the longest mount point above it), or "" if unknown."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    target, best, kind = str(Path(path).resolve()), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _network(path: Path) -> bool:
    kind = filesystem(path)
    return kind.startswith("nfs") or kind in NETWORK_FS


def _refusal(shown: Path, doing: str, rec: Record | None, lock: Path, proven: bool = True) -> Held:
    who = rec.describe() if rec else "another job (its record is unreadable)"
    if proven:
        return Held(f"{shown} is {doing} by {who}; wait for it or stop it")
    return Held(f"{shown} was {doing} by {who}, and this host cannot tell whether that job still runs ({lock.parent} is "
                f"on a network filesystem); if it is gone, delete {lock} and rerun")


def check_free(folder: Path, doing: str = "being written", shown: Path | None = None) -> None:
    """Raise Held when a live job holds folder; takes nothing and creates nothing (a check before the work)."""
    path = lock_path(folder)
    if str(path) in _holds:
        return  # this process holds it
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(shown or Path(folder), doing, _read(path), path) from None
        except OSError:
            pass  # no flock here: the record alone says
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            if not _network(path):
                return
        rec = _read(path)
        alive = rec.alive_here() if rec is not None else False
        if alive is not False:
            raise _refusal(shown or Path(folder), doing, rec, path, proven=alive is True)
    finally:
        os.close(fd)


class Hold:
    """A folder held by this process; `release` ends it. Holds are counted: the CLI holds OUT from its first check,
    and the engine it calls holds it again, which only counts."""

    def __init__(self, folder: Path, path: Path, fd: int):
        self.folder, self.path, self.fd, self.count = folder, path, fd, 1

    def release(self) -> None:
        with _lock:
            self.count -= 1
            if self.count:
                return
            del _holds[str(self.path)]
        try:
            same = os.stat(self.path)
            mine = os.fstat(self.fd)
            if (same.st_dev, same.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self.path)  # while still locked: a job that opens it now finds it gone and starts over
        except OSError:
            pass
        os.close(self.fd)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_holds: dict[str, Hold] = {}
_lock = threading.Lock()


def hold(folder: Path, doing: str = "being written", shown: Path | None = None) -> Hold:
    """Hold folder for this process, or raise Held naming the live job that holds it. `shown` is the folder the
    message names (OUT.partial for a conversion into OUT), `doing` what that job does to it."""
    path = lock_path(folder)
    shown = shown or Path(folder)
    with _lock:
        if str(path) in _holds:
            h = _holds[str(path)]
            h.count += 1
            return h
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise UsageError(f"cannot create {path} to hold {shown}: {e.strerror}") from e
            flocked = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _refusal(shown, doing, _read(path), path) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    os.close(fd)
                    raise UsageError(f"cannot lock {path} to hold {shown}: {e.strerror}") from e
                flocked = False  # Lustre without -o flock: the record alone is the lock
            try:
                if (os.stat(path).st_ino, os.stat(path).st_dev) == (os.fstat(fd).st_ino, os.fstat(fd).st_dev):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder before us removed it as we opened it: open the new one
        rec = _read(path)
        if rec is not None and (not flocked or _network(path)):
            alive = rec.alive_here()
            if alive is not False:
                os.close(fd)
                raise _refusal(shown, doing, rec, path, proven=alive is True)
        data = json.dumps(Record.mine().__dict__).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        h = _holds[str(path)] = Hold(Path(folder), path, fd)
        return h
