"""Where a conversion's time goes: seconds per phase (read, decode, quantize, crc32, sha256, write, ...) summed
over the threads that spend them, so that the next bottleneck of the stream engine is a number, not a guess.

A phase's seconds are thread-seconds: with 2 workers decoding at once, decode can pass the wall time. `waited`
phases are a thread idle for another (the writer waiting for the next tensor)."""

import threading
import time
from collections import defaultdict
from contextlib import contextmanager


class Phases:
    def __init__(self):
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def to_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: round(v, 4) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}


@contextmanager
def _nothing(_name: str):
    yield


def timer(phases: "Phases | None"):
    """`phases` itself, or a timer that records nothing (callers without a profile)."""
    return phases if phases is not None else _nothing
