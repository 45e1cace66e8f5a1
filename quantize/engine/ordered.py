"""Work spread over a thread pool, its results taken in order with a bounded number ahead: the writer's output
tensors (engine/stream.py) and, on the CPU, the chunks of routed experts solved at once (engine/experts.py)."""

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from quantize.engine import devices


def in_order(pool: ThreadPoolExecutor, fn: Callable, items: Iterable, depth: int) -> Iterator:
    """fn over items on the pool, results in item order, at most `depth` in flight (memory stays bounded).
    When the caller stops early or a result raises, the work not yet started is cancelled."""
    pending: deque[Future] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


@contextlib.contextmanager
def single_threaded(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of `workers` threads, each running torch on one thread; the caller's thread count is restored
    after (MKL's count is process-wide, and each worker sets it to one)."""
    threads = torch.get_num_threads()
    try:
        with devices.pool(workers, then=lambda: torch.set_num_threads(1)) as pool:
            yield pool
    finally:
        torch.set_num_threads(threads)
