"""Several ranks, one conversion: torch.distributed is the engine (gloo on CPU, NCCL on GPUs).

`convert --devices cuda:0,cuda:1,...` makes this process rank 0 and spawns one rank per further device; the same
command also runs under `torchrun --nproc-per-node N` (RANK / WORLD_SIZE in the environment). Rank 0 reads,
calibrates and writes; within each MoE layer the routed experts are split over the ranks (engine/experts.py).
What a rank runs is given to `spawn` (engine/layerwise.run_rank), so this module imports no engine.
"""

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class Job:
    """What a rank needs to rebuild rank 0's plan and samples exactly."""

    src: str
    recipe: dict
    max_shard_size: int
    samples: list[list[int]]
    devices: list[str]
    offload: str
    allow_nonfinite: bool = False
    start_layer: int = 0  # a resumed run continues from rank 0's layer checkpoint
    compute_dtype: str = "auto"  # rank 0's choice (compute.py), so that every rank computes alike


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share_cores(devices: list[str]) -> None:
    """Ranks on the CPU split its cores: each with all of them would run 2N threads on N cores, slower than one
    rank (2 CPU ranks on 2 cores: 20.2 s against 18.0 s for one, measured)."""
    cpu_ranks = sum(1 for d in devices if not d.startswith("cuda"))
    if cpu_ranks > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // cpu_ranks))


def _init(rank: int, world: int, device: str, init_method: str | None = None, devices: list[str] | None = None) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        share_cores(devices or [device] * world)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_torchrun(device: str) -> int:
    """Join the process group torchrun set up; returns this rank."""
    world = int(os.environ["WORLD_SIZE"])
    _init(int(os.environ["RANK"]), world, device, devices=[device] * int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return dist.get_rank()


def spawn(job: Job, run: Callable[[Job, torch.device], None]) -> mp.ProcessContext:
    """Start ranks 1.. for job.devices[1:], each calling run(job, its device), and join the group as rank 0."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    world = len(job.devices)
    ctx = mp.start_processes(_worker_main, args=(world, init, job, run), nprocs=world - 1, join=False,
                             start_method="spawn")
    _init(0, world, job.devices[0], init, job.devices)
    return ctx


def finish(ctx: mp.ProcessContext | None, ok: bool = True) -> None:
    """Leave the group; after a failure on rank 0 the other ranks would wait forever, so they are stopped."""
    if ctx is not None and not ok:
        for p in ctx.processes:
            p.terminate()
    if dist.is_initialized():
        dist.destroy_process_group()
    if ctx is not None:
        for p in ctx.processes:
            p.join()


def _worker_main(index: int, world: int, init: str, job: Job, run: Callable[[Job, torch.device], None]) -> None:
    rank = index + 1
    _init(rank, world, job.devices[rank], init, job.devices)
    try:
        run(job, torch.device(job.devices[rank]))
    finally:
        dist.destroy_process_group()
