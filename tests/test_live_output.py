"""A live job holds its output: a second job into it is refused at once, whatever its flags, naming the first;
the first then finishes as if alone. The hold dies with its process, so a killed job never blocks --resume."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECIPES
from test_gptq import calibration_samples

from quantize import lock
from quantize.errors import UsageError


def wait_for(cond, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, "the first job ended before it was caught writing"
        assert time.monotonic() < deadline, "the first job never started writing"
        time.sleep(0.005)


def stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of `pid` is stopped: kill(SIGSTOP) returns before the signal takes effect, and a
    writer thread may finish its write after it (once, a .tmp shard grew 0 -> 4096 bytes between the snapshot taken
    right after kill and the check)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, IndexError):
                continue  # a thread that ended
        if all(st in "TtZX" for st in states):  # stopped, or gone (nothing left to write: no task, or a zombie)
            return
        assert time.monotonic() < deadline, f"PID {pid} did not stop: {states}"
        time.sleep(0.005)


def family(pid: int) -> list[int]:
    """pid and every process it started, and theirs: a job on two ranks is rank 0 and the rank it started, which
    writes shards of its own (a SIGSTOP of rank 0 alone once left rank 1 making its .tmp shards under B's check)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def signal_if_alive(pid: int, sig: int) -> None:
    """A helper process of the job may end between family()'s scan and the signal."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


JOBS = {
    "rtn": ("kimi-k2-fp8", ["--recipe", str(RECIPES / "kimi-k2-w4a16.yaml")]),
    "gptq on two ranks": ("glm5-bf16", ["--scheme", "w4a16", "--group-size", "32", "--method", "gptq", "--num-samples", "8",
                                        "--seq-len", "64", "--devices", "cpu,cpu"]),
}


@pytest.mark.parametrize("job", JOBS)
def test_a_second_job_into_a_live_output_is_refused_whatever_its_flags(job, fixtures_dir, tmp_path):
    kind, extra = JOBS[job]
    if "--method" in extra:
        extra = [*extra, "--calib", str(calibration_samples(tmp_path, n=16))]
    out = tmp_path / "out"
    partial = out.with_name("out.partial")
    cmd = [sys.executable, "-m", "quantize", "convert", str(fixtures_dir / kind), str(out), *extra,
           "--max-shard-size", "200KB", "--workers", "1", "--device", "cpu"]
    a = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # caught writing, then stopped: a stopped process still holds its lock, and nothing moves under B
        wait_for(lambda: (partial / "state.json").exists(), a)
        for p in family(a.pid):
            signal_if_alive(p, signal.SIGSTOP)
        for p in family(a.pid):  # one started just before the stop is stopped too
            signal_if_alive(p, signal.SIGSTOP)
            stopped(p)
        before = tree(partial)
        for flags in ([], ["--overwrite"], ["--resume"]):
            t0 = time.monotonic()
            b = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=60)
            took = time.monotonic() - t0
            assert b.returncode == 2, b.stderr
            lines = b.stderr.strip().splitlines()
            assert len(lines) == 1, b.stderr
            assert f"{partial} is being written by PID {a.pid} on {socket.gethostname()} since " in lines[0], lines[0]
            assert "quantize convert" in lines[0] and "wait for it or stop it" in lines[0], lines[0]
            assert "interrupted" not in lines[0]
            assert took < 20, took
            assert tree(partial) == before, flags  # B touched nothing of A's
    finally:
        for p in family(a.pid):
            signal_if_alive(p, signal.SIGCONT)
    _, err = a.communicate(timeout=300)
    assert a.returncode == 0, err[-3000:]
    v = subprocess.run([sys.executable, "-m", "quantize", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0 and "clean" in v.stdout, v.stdout + v.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))) == ["out"]  # lock gone


def _record(path: Path, **fields) -> None:
    rec = lock.Record.mine().__dict__ | fields
    path.write_text(json.dumps(rec))


def test_on_a_network_filesystem_a_record_from_another_host_is_refused_until_deleted(tmp_path, monkeypatch):
    """There flock may stay on one machine (NFS nolock, Lustre localflock): a free lock proves nothing about
    another host's job, so its record is refused, with the way out; a record of a dead process here is stale."""
    monkeypatch.setattr(lock, "_network", lambda path: True)
    out = tmp_path / "out"
    path = lock.lock_path(out)
    _record(path, host="gpu-node-17", pid=4242, command="quantize convert a b")
    for attempt in (lambda: lock.check_free(out), lambda: lock.hold(out)):
        with pytest.raises(lock.Held) as e:
            attempt()
        msg = str(e.value)
        assert "PID 4242 on gpu-node-17" in msg and "cannot tell whether that job still runs" in msg
        assert f"delete {path}" in msg and "\n" not in msg
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(path, pid=dead.pid, proc_start=None)  # this host, a process that has ended
    lock.check_free(out)
    with lock.hold(out) as h:
        assert json.loads(path.read_text())["pid"] == os.getpid() and h.count == 1
    assert not path.exists()


def test_where_flock_is_refused_the_record_alone_holds(tmp_path, monkeypatch):
    """Lustre without -o flock answers ENOSYS: a live job's record on this host still refuses a second job."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _record(lock.lock_path(out), pid=live.pid, proc_start=lock._proc_start(live.pid), command="quantize convert x y")
        with pytest.raises(lock.Held, match=f"PID {live.pid} on {socket.gethostname()}.*wait for it or stop it"):
            lock.hold(out)
    finally:
        live.kill()
        live.wait()
    with lock.hold(out):  # its process gone, the record is stale
        pass


def test_holds_are_counted_within_a_process_and_refused_across_processes(tmp_path):
    out = tmp_path / "deep" / "out"  # the parent is made for the lock file
    outer = lock.hold(out)
    inner = lock.hold(out)
    assert inner is outer and outer.count == 2
    lock.check_free(out)  # this process's own hold is no refusal
    code = (f"from quantize import lock; from pathlib import Path\n"
            f"try:\n    lock.hold(Path({str(out)!r}))\nexcept lock.Held as e:\n    print(e)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert f"is being written by PID {os.getpid()}" in other.stdout, other.stdout + other.stderr
    inner.release()
    assert lock.lock_path(out).exists()
    outer.release()
    assert not lock.lock_path(out).exists()
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert other.stdout == "" and other.returncode == 0, other.stdout + other.stderr
    assert issubclass(lock.Held, UsageError)  # exit 2
