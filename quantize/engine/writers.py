"""A rank's writers: one thread per shard stream the rank owns, writing and hashing what this rank computed.

A calibrated plan's shards come in streams (tensor_plan.calibrated_keys): stream 0 holds all but the routed
experts and is rank 0's; the routed experts of group g are stream 1 + g, written by the rank that solved them
(distributed.stream_owner), so no expert's codes cross to rank 0 and no rank waits while one alone hashes and
writes. Each writer takes its stream's shards in order, asking the layer loop (layerwise.produce) for each
calibrated tensor, which waits for its layer: the loop runs at most one layer ahead of the slowest writer.

Rank 0 keeps the resume state. Another rank says what it finished in a receipt, one small JSON file per shard
in OUT.partial/receipts (written whole, then renamed: a receipt exists only for a shard on disk), which rank 0
folds into the state at the end or on a --resume.
"""

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from quantize.engine import devices, distributed, shard
from quantize.tensor_plan import Plan

RECEIPTS = "receipts"


def receipt_path(partial: Path, name: str) -> Path:
    return partial / RECEIPTS / f"{name}.json"


def write_receipt(partial: Path, name: str, written: tuple) -> None:
    """What a rank wrote of shard `name`, per output of the pair: (size, sha256, tensors) or None."""
    path = receipt_path(partial, name)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump([list(w) if w is not None else None for w in written], f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_receipts(partial: Path) -> dict[str, list]:
    """Shard name -> what its receipt says, per output (a receipt half written is not one: it has no name yet)."""
    folder = partial / RECEIPTS
    if not folder.is_dir():
        return {}
    return {p.name.removesuffix(".json"): json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


class Stopped(Exception):
    """The layer loop ended before a writer's layer (another writer failed): that writer stops quietly."""


def own_todo(plan: Plan, todo: list[int], rank: int, world: int) -> list[int]:
    """The shards of `todo` that this rank writes (distributed.stream_owner)."""
    return [i for i in todo if distributed.stream_owner(plan.stream_of(i), world) == rank]


def run(plan: Plan, prefill: Plan | None, partials: list[Path], todo: list[list[int]], shards: list[int], engine,
        device: torch.device, on_written: Callable[[int, tuple], None],
        advance: Callable[[int], None] = lambda n: None) -> list[dict]:
    """Write `shards` (this rank's share of what `todo` still holds, per output), a thread per stream; returns
    each writer's seconds: `busy` writing and hashing, `waiting` for the layer loop. An error in one writer stops
    the loop (engine.stop_loop) and the others, and is raised here once every writer has ended."""
    by_stream: dict[int, list[int]] = defaultdict(list)
    for i in shards:
        by_stream[plan.stream_of(i)].append(i)
    names = plan.shard_names
    pending = [set(t) for t in todo]
    stats: dict[int, dict] = {}
    errors: list[BaseException] = []

    def write(s: int, mine: list[int]) -> None:
        devices.follow()
        t0, n, waited = time.perf_counter(), 0, [0.0]

        def produce(e):  # runs in the pool's thread: what this writer waits for the layer loop
            t = time.perf_counter()
            try:
                return engine.produce(e)
            finally:
                waited[0] += time.perf_counter() - t
        try:
            with devices.pool(1) as pool:  # the next tensor is read and packed while this one is written
                for i in mine:
                    paths = tuple(p / names[i] if i in t else None for p, t in zip(partials, pending, strict=True))
                    paths = paths + (None,) * (2 - len(paths))
                    written = shard.write_shard_pair(plan, prefill, i, paths, device, advance, pool, depth=2,
                                                      calibrated=produce)
                    n += sum(w[0] for w in written if w is not None)
                    on_written(i, written)
        except BaseException as e:
            errors.append(e)
            engine.stop_loop()
        finally:
            total = time.perf_counter() - t0
            stats[s] = {"stream": s, "shards": len(mine), "bytes": n, "seconds": round(total, 3),
                        "waiting_for_layers": round(waited[0], 3), "busy": round(max(total - waited[0], 0.0), 3)}

    threads = [threading.Thread(target=write, args=(s, mine), name=f"writer-{s}", daemon=True)
               for s, mine in sorted(by_stream.items())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:

        raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
    return [stats[s] for s in sorted(stats)]
