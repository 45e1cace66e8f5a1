"""Where a conversion's time goes: seconds per phase (read, decode, quantize, crc32, sha256, write, ...) summed
over the threads that spend them, so that the next bottleneck of the stream engine is a number, not a guess.

A phase's seconds are thread-seconds: with 2 workers decoding at once, decode can pass the wall time. `waited`
phases are a thread idle for another (the writer waiting for the next tensor). Each phase also has the CPU time its
threads spent in it (`cpu`): on a loaded machine a thread's wall seconds include the time it waited for a core, and
a write's include the disk's; the CPU seconds divided into the bytes are the per-core rates an estimate scales."""

import threading
import time
from collections import defaultdict
from contextlib import contextmanager


class Phases:
    def __init__(self):
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def add(self, name: str, seconds: float, cpu: float = 0.0) -> None:
        with self._lock:
            self.seconds[name] += seconds
            self.cpu[name] += cpu

    @contextmanager
    def __call__(self, name: str):
        t, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t, time.thread_time() - c)

    def to_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: round(v, 4) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}

    def cpu_dict(self) -> dict[str, float]:
        """CPU seconds per phase, in to_dict's order."""
        with self._lock:
            return {k: round(self.cpu[k], 4) for k, _ in sorted(self.seconds.items(), key=lambda kv: -kv[1])}


@contextmanager
def _nothing(_name: str):
    yield


def timer(phases: "Phases | None"):
    """`phases` itself, or a timer that records nothing (callers without a profile)."""
    return phases if phases is not None else _nothing
