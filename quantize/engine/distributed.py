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

import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quantize import compute
from quantize.engine import devices
from quantize.errors import QuantizeError, UsageError

GROUPS = 16  # at most this many ranks share a layer's work


def group_members(g: int, n: int) -> range:
    """The items (samples, or a layer's experts) of group g of n."""
    return range(n * g // GROUPS, n * (g + 1) // GROUPS)


def group_of(item: int, n: int) -> int:
    """The group whose members (group_members) hold item of n."""
    return (GROUPS * (item + 1) - 1) // n


def stream_owner(stream: int, world: int) -> int:
    """The rank that writes a calibrated plan's shard stream (tensor_plan.calibrated_keys): rank 0 stream 0, and
    the routed experts of group g (stream 1 + g) the rank that solves them (expert_groups)."""
    return 0 if stream == 0 else (stream - 1) % world


def owned_groups(rank: int, world: int) -> range:
    """A rank's groups of samples: consecutive, so that its samples are one contiguous run of tokens."""
    return range(GROUPS * rank // world, GROUPS * (rank + 1) // world)


def expert_groups(rank: int, world: int) -> range:
    """A rank's groups of a layer's experts: every world-th. Rank 0 adds the groups' routed outputs in group
    order, so with strided groups every rank computes its next group while rank 0 takes the one before (with
    consecutive groups the others would wait, each send blocked, until rank 0 had done all of its own: the
    routed output of 2 CPU ranks took as long as one rank's)."""
    return range(rank, GROUPS, world)


class Refused(QuantizeError):
    """A refusal every rank reached together (agreed): rank 0 says it; the others end without a word."""


def share(rank: int, world: int, n: int) -> range:
    """The items of n that a rank owns: its groups' members, contiguous and in order."""
    groups = owned_groups(rank, world)
    return range(group_members(groups.start, n).start, group_members(groups.stop - 1, n).stop)


# Point to point and broadcast as bytes, so that any dtype crosses (gloo has no float8 or bfloat16 sums, and a
# byte copy is exact); NCCL needs the tensor on the rank's GPU.
def _wire(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as one flat uint8 view (what is received into it lands in t)."""
    return (t.contiguous().view(-1) if t.dim() == 0 else t.contiguous()).reshape(-1).view(torch.uint8)


# Every message crosses in pieces of this many bytes at most, on every backend and from any device: the pieces
# of a message are fixed by its size alone, which both sides know, so a sender staging from the host and a
# receiver writing into its GPU (or the other way round) always issue the same calls. Under NCCL a host piece is
# staged on the rank's GPU, one piece at a time (memory.py counts one). Ranks adopt rank 0's value (agree_terms).
STAGE_BYTES = 256 << 20


def _staged(piece: torch.Tensor) -> bool:
    """Whether this side copies the piece through its GPU: NCCL reads and writes only the rank's own GPU."""
    return dist.get_backend() == "nccl" and piece.device.type != "cuda"


def _pieces(wire: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of STAGE_BYTES (writing into one writes into the message)."""
    return wire.split(STAGE_BYTES) if wire.numel() else (wire,)


class _Works:
    """The pending broadcasts of one message's pieces."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()


def send(t: torch.Tensor, dst: int) -> None:
    for piece in _pieces(_wire(t)):
        dist.send(piece.to(devices.bound()) if _staged(piece) else piece, dst)


def recv(t: torch.Tensor, src: int) -> torch.Tensor:
    """Into t (contiguous), from rank src."""
    for piece in _pieces(_wire(t)):  # views of t: t is contiguous
        if _staged(piece):
            buf = torch.empty_like(piece, device=devices.bound())
            dist.recv(buf, src)
            piece.copy_(buf)
        else:
            dist.recv(piece, src)
    return t


def broadcast(t: torch.Tensor, src: int = 0, async_op: bool = False):
    """t (contiguous) from rank src to all; with async_op (on src only) returns the pending work and the buffer
    it reads, which must be kept until the work is done (a staged piece goes at once)."""
    wire = _wire(t)
    works = []
    for piece in _pieces(wire):
        if _staged(piece):
            buf = piece.to(devices.bound()) if dist.get_rank() == src else torch.empty_like(piece, device=devices.bound())
            dist.broadcast(buf, src=src)
            piece.copy_(buf)
        else:
            works.append(dist.broadcast(piece, src=src, async_op=async_op))
    return (_Works(works), wire) if async_op else None


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
    return recv_any(src, torch.device("cpu")).numpy().tobytes().decode()


def broadcast_text(text: str | None) -> str:
    """Rank 0's text on every rank (the others pass None)."""
    data = text.encode() if dist.get_rank() == 0 else b""
    (n,) = agree([len(data)])
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(n, dtype=torch.uint8)
    if n:
        broadcast(buf, 0)
    return buf.numpy().tobytes().decode()


# A collective's wait, at most. A rank waits in one while rank 0 plans, tokenizes, rehashes the finished shards
# on --resume (a Kimi K2 output, ~600 GB at ~1 GB/s: 10 minutes, NCCL's default timeout) and, each layer, while
# rank 0 solves the dense Linears and writes. A rank that dies is not waited for (`watch`, `_watch_parent`): the
# timeout bounds only a rank that hangs alive. `convert --rank-timeout` sets it.
DEFAULT_TIMEOUT_S = 3600.0


@dataclass
class Job:
    """What a rank needs to rebuild rank 0's plan exactly (the samples, the offload and what to run come from
    rank 0 once it is ready: engine/agreement.py)."""

    src: str
    recipe: dict
    max_shard_size: int
    devices: list[str]
    offload: str
    allow_nonfinite: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    prefill_recipe: dict | None = None  # the second output of a pair (its shards are paired with the main ones)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_threads() -> int:
    """The torch threads of a CPU rank's math: every core of the machine, whatever the number of ranks. A CPU
    GEMM's bits can depend on its thread count (oneDNN and MKL split the reduction by threads: on an Intel AMX
    CPU, one rank and two gave other bytes when two ranks split the cores), so the count is fixed by the
    machine, never by the ranks: CPU ranks on one machine oversubscribe its cores (they are the CPU twin of GPU
    ranks, each of which has a GPU of its own)."""
    return compute.cores()


POLL_S = 0.5  # how often rank 0 looks at the ranks it started, and a rank at rank 0
layer = [None]  # the decoder layer this rank is on, for the line that names a dead rank


def _init(rank: int, world: int, device: str, init_method: str | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    devices.bind(device)
    if backend == "gloo":
        torch.set_num_threads(cpu_threads())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_torchrun(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Join the process group torchrun set up, on this rank's device (devices.torchrun_device); returns the rank.
    Ranks on GPUs first check, through torchrun's store (no NCCL: it would fail on a shared GPU in its own words
    at the first collective), that no two of them share a GPU. A rank that dies is torchrun's to handle: its
    agent sees the exit and stops every other rank of the job."""
    _init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, timeout_s=timeout_s)
    if device.startswith("cuda"):
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"quantize/gpu/{rank}", f"{socket.gethostname()} {torch.cuda.get_device_properties(device).uuid}")
        shared = devices.shared_gpu([store.get(f"quantize/gpu/{r}").decode() for r in range(world)])
        if shared is not None:
            a, b = shared
            raise UsageError(f"torchrun ranks {a} and {b} run on the same GPU ({devices.visible_gpus()} visible to "
                             "each process): NCCL refuses two ranks on one GPU; use --nproc-per-node "
                             f"{devices.visible_gpus()} or fewer, or give each rank a GPU of its own")
    return dist.get_rank()


def how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"killed by {name}" + (" (the OOM killer sends it too)" if name == "SIGKILL" else "")
    return f"exit {exitcode}"


def death_line(rank: int, device: str, exitcode: int) -> str:
    where = f" during layer {layer[0]}" if layer[0] is not None else " before the first layer"
    return (f"rank {rank} ({device}) died ({how_it_ended(exitcode)}){where}; every rank stops: rerun with --resume "
            "to continue from the last finished layer")


def watch(processes: list, devices_of: list[str], on_death: Callable[[str], None], stopped: threading.Event) -> None:
    """Until `stopped`, look at the ranks every POLL_S; the first that ended with an error calls on_death with
    the line that names it. NCCL does not notice a dead peer: without this, rank 0 would wait in its next
    collective until the timeout."""
    while not stopped.wait(POLL_S):
        for i, p in enumerate(processes):
            if p.exitcode not in (None, 0):
                on_death(death_line(i + 1, devices_of[i + 1], p.exitcode))
                return


def _abort(line: str, processes: list) -> None:
    """A rank died: say so once, stop the others and end this process as SIGKILL would (what is finished stays:
    shards, state and the layer checkpoints are written whole or not at all, so --resume continues)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    for p in processes:
        if p.exitcode is None:
            p.kill()
    os._exit(1)


class Launch:
    """Ranks 1.. for job.devices[1:], each calling run(job, its device), started in the background: a rank needs
    seconds to import torch and transformers' model code and to plan, which rank 0 spends planning and tokenizing
    meanwhile (on the MoE bench, 2.6 s of 27 that rank 0 waited). `join` when the ranks are needed; `close` if
    they never were."""

    def __init__(self, job: Job, run: Callable[[Job, torch.device], None]):
        # rank 0 keeps its cores for planning, writing and verifying: its calibration threads take their share
        # (layerwise.LayerwiseQuantizer.threads)
        first = job.devices[0]
        devices.bind(first)
        init = f"tcp://127.0.0.1:{_free_port()}"
        world = len(job.devices)
        # from this thread: torch.multiprocessing's children get SIGINT when the thread that started them ends
        ctx = mp.start_processes(_worker_main, args=(world, init, job, run, os.getpid()), nprocs=world - 1,
                                 join=False, start_method="spawn")
        self._out: dict = {"ctx": ctx}
        self.stopped = threading.Event()
        self._watcher = threading.Thread(target=watch, daemon=True, args=(
            ctx.processes, job.devices, lambda line: _abort(line, ctx.processes), self.stopped))
        self._watcher.start()
        backend = "nccl" if first.startswith("cuda") else "gloo"
        self._thread = threading.Thread(target=self._start, args=(backend, init, world, job.timeout_s), daemon=True)
        self._thread.start()
        self.devices = job.devices

    def _start(self, backend: str, init: str, world: int, timeout_s: float) -> None:
        devices.follow()
        try:
            dist.init_process_group(backend, init_method=init, rank=0, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except BaseException as e:  # raised in the caller's thread, by join
            self._out["error"] = e

    def dead(self, wait_s: float = 2 * POLL_S) -> str | None:
        """The line naming a rank that died, if one did (waiting up to wait_s for its exit to show: gloo tells
        rank 0 of a dead peer before its process is reaped); None while every rank lives."""
        deadline = time.monotonic() + wait_s
        while True:
            for i, p in enumerate(self._out["ctx"].processes):
                if p.exitcode not in (None, 0):
                    return death_line(i + 1, self.devices[i + 1], p.exitcode)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def join(self) -> mp.ProcessContext:
        self._thread.join()
        if "error" in self._out:
            self.stopped.set()
            ctx = self._out.get("ctx")
            if ctx is not None:
                for p in ctx.processes:
                    p.terminate()
            raise self._out["error"]
        return self._out["ctx"]

    def close(self) -> None:
        """The ranks were started but never given work (rank 0 failed or had nothing to calibrate): stop them."""
        self.stopped.set()
        self._thread.join()
        finish(self._out.get("ctx"), ok=False)


def leave(ok: bool) -> None:
    """Leave the process group. After a failure it is never waited on: NCCL's destroy_process_group blocks while
    work is pending (a collective a failed or diverged peer never joins), so the group is aborted (NCCL: its
    communicators end at once) or dropped (gloo: its sockets close with the process)."""
    if not dist.is_initialized():
        return
    if ok:
        dist.destroy_process_group()
    elif dist.get_backend() == "nccl":
        from torch.distributed import distributed_c10d

        try:
            distributed_c10d._abort_process_group()
        except Exception:  # an experimental API: the process ends anyway, and ending it is what frees the GPU
            pass


def finish(ctx: mp.ProcessContext | None, ok: bool = True, stopped: threading.Event | None = None,
           devices_of: list[str] | None = None) -> None:
    """Leave the group and wait for the ranks started here. After a failure on rank 0 the other ranks would wait
    forever, so they are stopped. A rank that ended with an error after all is a QuantizeError naming it: rank 0
    never reports success for a run one of its ranks did not finish."""
    if stopped is not None:
        stopped.set()  # what follows ends the ranks: the watch must not take it for a death
    if ctx is not None and not ok:
        for p in ctx.processes:
            p.terminate()
    leave(ok)
    if ctx is None:
        return
    for p in ctx.processes:
        p.join()
    if ok:
        for i, p in enumerate(ctx.processes):
            if p.exitcode != 0:
                where = f" ({devices_of[i + 1]})" if devices_of else ""
                raise QuantizeError(f"rank {i + 1}{where} failed ({how_it_ended(p.exitcode)}); its error is printed "
                                    "above: rerun with --resume to continue from the last finished layer")


def exit_now(code: int) -> None:
    """End this process at once with `code`, its output flushed: after a failure in a process with a group, where
    interpreter shutdown would run the group's destructor (which may wait on pending work)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _orphaned(rank: int, parent: int) -> None:
    """This rank's rank 0 is gone: one line, and the end of the process (nothing of a rank > 0 is kept)."""
    where = f"during layer {layer[0]}" if layer[0] is not None else "before the first layer"
    print(f"rank {rank}: rank 0 (PID {parent}) is gone {where}; stopping", file=sys.stderr, flush=True)
    os._exit(1)


def _gone(parent: int, wait_s: float = 1.0) -> bool:
    """Whether rank 0 is gone, waiting up to wait_s for the kernel to say so: a dead process's sockets close
    (gloo's error here) and its SIGINT arrives before this process is handed to its new parent."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _watch_parent(rank: int, parent: int) -> None:
    """A rank whose rank 0 is gone (SIGKILL, the OOM killer) stops at once. torch.multiprocessing sends it SIGINT
    then (PR_SET_PDEATHSIG), but Python runs the handler only when the main thread leaves C++: a thread waiting
    in an NCCL collective would wait until the timeout."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _orphaned(rank, parent)


def _worker_main(index: int, world: int, init: str, job: Job, run: Callable[[Job, torch.device], None],
                 parent: int) -> None:
    rank = index + 1

    def on_sigint(signum, frame):
        if _gone(parent):
            _orphaned(rank, parent)
        raise KeyboardInterrupt  # Ctrl-C reaches every rank; rank 0 reports it

    signal.signal(signal.SIGINT, on_sigint)
    threading.Thread(target=_watch_parent, args=(rank, parent), daemon=True).start()
    _init(rank, world, job.devices[rank], init, job.timeout_s)
    try:
        run(job, torch.device(job.devices[rank]))
    except KeyboardInterrupt:
        exit_now(130)  # Ctrl-C reaches every rank; rank 0 reports it
    except Exception as e:
        if _gone(parent):  # gloo's error for the connection rank 0 held: one line says what happened
            _orphaned(rank, parent)
        # torch.multiprocessing keeps a child's traceback for a join that rank 0 never makes (it learns of the
        # failure from the watch): say here what went wrong. A refusal rank 0 also reached is rank 0's to print.
        if isinstance(e, Refused):
            exit_now(0)  # rank 0 says it and stops: an exit 1 here would race it, as a death, to the watch
        print(f"rank {rank} ({job.devices[rank]}) failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        exit_now(1)  # never through destroy_process_group: under NCCL it waits for work that never completes
    leave(True)
