"""The device each rank computes on: chosen and checked once, bound once, and followed by every thread.

CUDA's current device is a property of the calling thread: `torch.cuda.set_device` in the main thread leaves a
worker thread on GPU 0, where whatever it makes on a bare "cuda" lands (staging for NCCL, a pinned buffer's
context). So a rank binds its device once (`bind`: a spawned rank its --devices entry, a torchrun rank the GPU
of its LOCAL_RANK, rank 0 the first entry), every thread the engine starts calls `follow` first (as a pool's
initializer), and what is staged for NCCL goes to `bound()`, never to `current_device()`.
"""

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from quantize.errors import UsageError

_bound: torch.device | None = None


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_index(d: str) -> int | None:
    """N of "cuda:N", else None."""
    kind, _, index = d.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def check_devices(devices: list[str], visible: int) -> None:
    """--devices as NCCL and gloo can run it: each entry cpu or cuda:N of a visible GPU, one backend for every
    rank, no GPU twice. Raises UsageError (exit 2) naming the entry."""
    where = f"{visible} GPU(s) are visible" + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                                              if "CUDA_VISIBLE_DEVICES" in os.environ else "")
    for d in devices:
        if d == "cuda":
            raise UsageError("--devices cuda: name each rank's GPU (cuda:0,cuda:1,...); a bare cuda is whichever "
                             "GPU a thread has current")
        if d != "cpu" and _gpu_index(d) is None:
            raise UsageError(f"--devices {d}: expected cpu or cuda:N")
        if _gpu_index(d) is not None and _gpu_index(d) >= visible:
            raise UsageError(f"--devices {d}: {where}")
    kinds = {d.partition(":")[0] for d in devices}
    if len(kinds) > 1:
        raise UsageError("--devices mixes cpu and cuda ranks: the ranks of one job share one backend (NCCL on GPUs, "
                         "gloo on CPUs); give all GPUs or all cpu")
    gpus = [d for d in devices if d != "cpu"]
    twice = next((d for d in gpus if gpus.count(d) > 1), None)
    if twice:
        raise UsageError(f"--devices names {twice} twice: NCCL refuses two ranks on one GPU; give each rank its own")


def torchrun_device(device: str, env: dict, visible: int) -> str:
    """This torchrun rank's device. `cuda` and `auto` (where GPUs are visible) mean the GPU of its LOCAL_RANK
    among the visible ones, or the one visible GPU of a launcher that gives each process its own (SLURM's
    --gpus-per-task=1, a CUDA_VISIBLE_DEVICES per rank). LOCAL_WORLD_SIZE is not needed (multi-node launchers may
    not set it): ranks that would share a GPU are refused once the group is up (distributed.init_torchrun).
    Raises UsageError."""
    try:
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", 0))
    except ValueError as e:
        raise UsageError(f"torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE are not numbers ({e})") from None
    if device == "cpu" or (device == "auto" and not visible):
        return "cpu"
    if device not in ("auto", "cuda"):
        if local_world > 1 and visible > 1:
            raise UsageError(f"--device {device} under torchrun puts all {local_world} ranks of this machine on one "
                             "GPU, which NCCL refuses; pass --device cuda: each rank takes the GPU of its LOCAL_RANK")
        return device
    if visible == 1:
        return "cuda:0"
    if local_rank >= visible:
        raise UsageError(f"torchrun's LOCAL_RANK is {local_rank} but {visible} GPU(s) are visible to this process: "
                         f"NCCL refuses two ranks on one GPU; use --nproc-per-node {visible} or fewer")
    return f"cuda:{local_rank}"


def shared_gpu(seen: list[str]) -> tuple[int, int] | None:
    """The first two ranks that name the same GPU, from each rank's "host uuid" in rank order; None if none do."""
    first: dict[str, int] = {}
    for rank, gpu in enumerate(seen):
        if gpu in first:
            return first[gpu], rank
        first[gpu] = rank
    return None


def explicit(device: str) -> str:
    """A bare `cuda` as the GPU it means now (this thread's current one): what threads and staging follow."""
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device


def bind(device: torch.device | str) -> torch.device:
    """This process's device (one rank, one device), current in the calling thread from now on."""
    global _bound
    device = torch.device(explicit(str(device)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _bound = device
    return device


def follow() -> None:
    """Make the bound device current in this thread (the initializer of every pool the engine starts)."""
    if _bound is not None and _bound.type == "cuda":
        torch.cuda.set_device(_bound)


def bound() -> torch.device:
    return _bound if _bound is not None else torch.device("cpu")


def pool(workers: int, then: Callable[[], None] | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads have the bound device current (and run `then` once each): every pool of the
    engine is made here."""
    def start() -> None:
        follow()
        if then is not None:
            then()

    return ThreadPoolExecutor(max_workers=workers, initializer=start)
