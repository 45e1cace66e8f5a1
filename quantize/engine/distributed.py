"""Several ranks, one conversion: torch.distributed is the engine (gloo on CPU, NCCL on GPUs).

`convert --devices cuda:0,cuda:1,...` makes this process rank 0 and spawns one rank per further device; the same
command also runs under `torchrun --nproc-per-node N` (RANK / WORLD_SIZE in the environment). Rank 0 reads and
writes. Under GPTQ every layer's calibration samples are split over the ranks (data parallel forwards), and
within each MoE layer the routed experts are (engine/experts.py).

Work is split in GROUPS fixed groups, and a rank owns whole groups: whatever is summed across samples or
experts is summed group by group in one order, fixed by the groups and never by the number of ranks, so the
bytes are the same on 1 rank as on 16. What a rank runs is given to `spawn` (engine/layerwise.run_rank), so
this module imports no engine.
"""

import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quantize import compute

GROUPS = 16  # at most this many ranks share a layer's work


def group_members(g: int, n: int) -> range:
    """The items (samples, or a layer's experts) of group g of n."""
    return range(n * g // GROUPS, n * (g + 1) // GROUPS)


def owned_groups(rank: int, world: int) -> range:
    """A rank's groups of samples: consecutive, so that its samples are one contiguous run of tokens."""
    return range(GROUPS * rank // world, GROUPS * (rank + 1) // world)


def expert_groups(rank: int, world: int) -> range:
    """A rank's groups of a layer's experts: every world-th. Rank 0 adds the groups' routed outputs in group
    order, so with strided groups every rank computes its next group while rank 0 takes the one before (with
    consecutive groups the others would wait, each send blocked, until rank 0 had done all of its own: the
    routed output of 2 CPU ranks took as long as one rank's)."""
    return range(rank, GROUPS, world)


def share(rank: int, world: int, n: int) -> range:
    """The items of n that a rank owns: its groups' members, contiguous and in order."""
    groups = owned_groups(rank, world)
    return range(group_members(groups.start, n).start, group_members(groups.stop - 1, n).stop)


# Point to point and broadcast as bytes, so that any dtype crosses (gloo has no float8 or bfloat16 sums, and a
# byte copy is exact); NCCL needs the tensor on the rank's GPU.
def _wire(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().view(-1) if t.dim() == 0 else t.contiguous()  # a view: what is received lands in t
    return t.view(torch.uint8) if t.is_floating_point() and t.dtype.itemsize > 1 else t


def _on_backend(t: torch.Tensor) -> torch.Tensor:
    if dist.get_backend() == "nccl" and t.device.type != "cuda":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def send(t: torch.Tensor, dst: int) -> None:
    dist.send(_on_backend(_wire(t)), dst)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    """Into t (contiguous), from rank src."""
    wire = _wire(t)  # a view of t: t is contiguous
    buf = _on_backend(wire)
    dist.recv(buf, src)
    if buf is not wire:
        wire.copy_(buf)
    return t


def broadcast(t: torch.Tensor, src: int = 0, async_op: bool = False):
    """t (contiguous) from rank src to all; with async_op (on src only) returns the pending work and the buffer
    it reads, which must be kept until the work is done."""
    wire = _wire(t)
    buf = _on_backend(wire)
    work = dist.broadcast(buf, src=src, async_op=async_op)
    if async_op:
        return work, buf
    if buf is not wire:
        wire.copy_(buf)
    return None


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
           torch.uint8, torch.bool, torch.float64]
_MAX_DIMS = 6


def send_any(t: torch.Tensor | None, dst: int) -> None:
    """A tensor whose shape and dtype the receiver does not know (or None): a header, then the bytes."""
    head = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    if t is not None:
        assert t.dim() <= _MAX_DIMS
        head[0], head[1] = _DTYPES.index(t.dtype) + 1, t.dim()
        head[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    send(head, dst)
    if t is not None and t.numel():
        send(t, dst)


def recv_any(src: int, device: torch.device) -> torch.Tensor | None:
    head = recv(torch.empty(2 + _MAX_DIMS, dtype=torch.int64), src).tolist()
    if head[0] == 0:
        return None
    t = torch.empty(head[2:2 + head[1]], dtype=_DTYPES[head[0] - 1], device=device)
    return recv(t, src) if t.numel() else t


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype)


def code_dtype(code: int) -> torch.dtype:
    return _DTYPES[code]


def agree(values: list[int]) -> list[int]:
    """Rank 0's few integers, on every rank (what the others pass is replaced)."""
    t = torch.tensor(values, dtype=torch.int64)
    broadcast(t, 0)
    return t.tolist()


def share_samples(samples: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """Rank 0's calibration samples (token ids [1, n] each) on every rank (the others pass None): they neither
    load a tokenizer nor read the calibration data."""
    n = agree([len(samples) if samples is not None else 0])[0]
    lengths = torch.tensor([s.shape[1] for s in samples] if samples is not None else [0] * n, dtype=torch.int64)
    broadcast(lengths, 0)
    ids = (torch.cat([s.reshape(-1).to("cpu", torch.int64) for s in samples]) if samples is not None
           else torch.empty(int(lengths.sum()), dtype=torch.int64))
    broadcast(ids, 0)
    return samples if samples is not None else [t.reshape(1, -1) for t in ids.split(lengths.tolist())]


def send_text(text: str, dst: int) -> None:
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
    send_any(data, dst)


def recv_text(src: int) -> str:
    return bytes(recv_any(src, torch.device("cpu")).tolist()).decode()


@dataclass
class Job:
    """What a rank needs to rebuild rank 0's plan exactly (the samples and where to start come from rank 0 once
    it is ready: share_samples, agree)."""

    src: str
    recipe: dict
    max_shard_size: int
    devices: list[str]
    offload: str
    allow_nonfinite: bool = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cores_per_rank(cpu_ranks: int) -> int:
    """Ranks on the CPU split its cores: each with all of them would run 2N threads on N cores, slower than one
    rank (2 CPU ranks on 2 cores: 20.2 s against 18.0 s for one, measured)."""
    return max(1, compute.cores() // max(1, cpu_ranks))


def share_cores(devices: list[str]) -> None:
    cpu_ranks = sum(1 for d in devices if not d.startswith("cuda"))
    if cpu_ranks > 1:
        torch.set_num_threads(cores_per_rank(cpu_ranks))


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


class Launch:
    """Ranks 1.. for job.devices[1:], each calling run(job, its device), started in the background: a rank needs
    seconds to import torch and transformers' model code and to plan, which rank 0 spends planning and tokenizing
    meanwhile (on the MoE bench, 2.6 s of 27 that rank 0 waited). `join` when the ranks are needed; `close` if
    they never were."""

    def __init__(self, job: Job, run: Callable[[Job, torch.device], None]):
        # rank 0 keeps its cores for planning, writing and verifying: its calibration threads take their share
        # (layerwise.LayerwiseQuantizer.threads)
        first = job.devices[0]
        if first.startswith("cuda"):
            torch.cuda.set_device(torch.device(first))
        init = f"tcp://127.0.0.1:{_free_port()}"
        world = len(job.devices)
        # from this thread: torch.multiprocessing's children get SIGINT when the thread that started them ends
        self._out: dict = {"ctx": mp.start_processes(_worker_main, args=(world, init, job, run), nprocs=world - 1,
                                                     join=False, start_method="spawn")}
        backend = "nccl" if first.startswith("cuda") else "gloo"
        self._thread = threading.Thread(target=self._start, args=(backend, init, world), daemon=True)
        self._thread.start()

    def _start(self, backend: str, init: str, world: int) -> None:
        try:
            dist.init_process_group(backend, init_method=init, rank=0, world_size=world)
        except BaseException as e:  # raised in the caller's thread, by join
            self._out["error"] = e

    def join(self) -> mp.ProcessContext:
        self._thread.join()
        if "error" in self._out:
            ctx = self._out.get("ctx")
            if ctx is not None:
                for p in ctx.processes:
                    p.terminate()
            raise self._out["error"]
        return self._out["ctx"]

    def close(self) -> None:
        """The ranks were started but never given work (rank 0 failed or had nothing to calibrate): stop them."""
        self._thread.join()
        finish(self._out.get("ctx"), ok=False)


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
    except Exception:
        # torch.multiprocessing keeps a child's traceback for a join that rank 0 never makes (it learns of the
        # failure as a closed connection): say here what went wrong
        print(f"rank {rank} ({job.devices[rank]}) failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()
