"""What every rank of a calibrated run uses, decided once by rank 0 before the first message of a layer.

NCCL hangs where ranks diverge: a send whose size or device differs from its recv, a collective that one rank
skips. gloo raises there instead, and every CPU rank of a test sees the same machine, so divergence never shows
on CPU unless it is forced. So nothing a message depends on is decided by a rank alone:
- `setup`: rank 0's compute dtype, staging size (distributed.STAGE_BYTES) and calibration samples;
- `memory`: where activations live (the offload), from every rank's own reading of its memory: the first kind
  that fits on every rank, its device and its share of the host (the host's free memory is shared by the ranks
  on it), or one refusal naming the rank that cannot;
- `run`: the layers that have work (up to the last with targets or KV scales: a rank never waits for a layer
  rank 0 skips), where a resume starts, and which shards are still to write.
With one rank the same decisions are taken, without a message.
"""

import json
import socket
from dataclasses import dataclass

import psutil
import torch

from quantize.engine import distributed, memory
from quantize.errors import QuantizeError

KINDS = ("gpu", "cpu", "disk")


def world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def setup(compute: torch.dtype | None, samples: list[torch.Tensor] | None) -> tuple[torch.dtype, list[torch.Tensor]]:
    """Rank 0's compute dtype, staging size and samples on every rank (the others pass None)."""
    rank, size = world()
    if size == 1:
        return compute, samples
    code, stage = distributed.agree([distributed.dtype_code(compute) if rank == 0 else 0, distributed.STAGE_BYTES])
    distributed.STAGE_BYTES = stage
    return distributed.code_dtype(code), distributed.share_samples(samples)


@dataclass(frozen=True)
class Reading:
    """One rank's memory, read by itself: its account under each offload kind (engine/memory.py) and what the
    host must hold besides (the activations under cpu offload, twice for headroom, and the writers' results)."""

    rank: int
    device: str
    host: str
    host_free: int
    accounts: dict[str, memory.Account]
    host_need: dict[str, int]

    def to_dict(self) -> dict:
        return {"rank": self.rank, "device": self.device, "host": self.host, "host_free": self.host_free,
                "accounts": {k: [a.device, a.offload, a.layer, a.parts, a.free] for k, a in self.accounts.items()},
                "host_need": self.host_need}

    @classmethod
    def from_dict(cls, d: dict) -> "Reading":
        return cls(d["rank"], d["device"], d["host"], d["host_free"],
                   {k: memory.Account(*v) for k, v in d["accounts"].items()}, d["host_need"])


def read(rank: int, device: torch.device, accounts: dict[str, memory.Account], host_need: dict[str, int]) -> Reading:
    return Reading(rank, str(device), socket.gethostname(), psutil.virtual_memory().available, accounts, host_need)


def decide(readings: list[Reading], asked: str) -> tuple[str, str | None]:
    """(offload, None) for the first kind (`asked`, or for auto gpu when every rank is on a GPU, then cpu, then
    disk) under which every rank's layer fits its device and every host holds what its ranks need there; or
    (kind, refusal) when none does, the refusal naming the first rank that cannot."""
    per_host: dict[str, int] = {}
    for r in readings:
        per_host[r.host] = per_host.get(r.host, 0) + 1
    several = len(readings) > 1

    def why_not(kind: str) -> str | None:
        for r in readings:
            share = per_host[r.host]
            a = r.accounts[kind]
            if not r.device.startswith("cuda"):  # a CPU rank's device is its share of the host
                a = memory.Account(a.device, a.offload, a.layer, a.parts, min(a.free, r.host_free) // share)
            who = f"rank {r.rank} ({r.device}): " if several else ""
            if not memory.fits(a):
                return who + memory.refusal(a)
            if r.host_need[kind] > r.host_free // share:
                shared = f" (its share of {r.host}, whose {share} ranks share it)" if share > 1 else ""
                return (f"{who}the host needs {memory.gib(r.host_need[kind])} for layer {a.layer} with activations "
                        f"offloaded to {kind} but {memory.gib(r.host_free // share)} is free{shared}; pass --offload "
                        "disk, or use a host with more memory")
        return None

    if asked != "auto":
        return asked, why_not(asked)
    kinds = [k for k in KINDS if k != "gpu" or all(r.device.startswith("cuda") for r in readings)]
    for k in kinds:
        if why_not(k) is None:
            return k, None
    # none fits: refuse under cpu offload when the hosts could hold the activations (the device is what is
    # short), else under disk
    last = "cpu" if all(r.host_need["cpu"] <= r.host_free // per_host[r.host] for r in readings) else "disk"
    return last, why_not(last)


def _gather(text: str) -> list[str] | None:
    """Every rank's text, in rank order, on rank 0 (None on the others): one message from each rank."""
    rank, size = world()
    if rank != 0:
        distributed.send_text(text, 0)
        return None
    return [text] + [distributed.recv_text(r) for r in range(1, size)]


def _verdict(found: str | None) -> None:
    """Rank 0's verdict, on every rank: a refusal ends them all (rank 0 says it, the others end quietly)."""
    rank, _ = world()
    if found is not None:
        raise (QuantizeError if rank == 0 else distributed.Refused)(found)


def memory_terms(mine: Reading, asked: str) -> str:
    """The offload every rank runs under, from every rank's reading; raises (the same refusal on every rank:
    rank 0 says it, distributed.Refused on the others) when some rank cannot run any."""
    _, size = world()
    if size == 1:
        offload, refusal = decide([mine], asked)
    else:
        texts = _gather(json.dumps(mine.to_dict()))
        verdict = json.dumps(decide([Reading.from_dict(json.loads(t)) for t in texts], asked)) if texts else None
        offload, refusal = json.loads(distributed.broadcast_text(verdict))
    _verdict(refusal)
    return offload


def run_terms(values: dict | None) -> dict:
    """Rank 0's plan of the run (`start`, `stop`, the shards each output still writes) on every rank."""
    rank, size = world()
    if size == 1:
        return values
    return json.loads(distributed.broadcast_text(json.dumps(values) if rank == 0 else None))


def check_all(problem: str | None) -> None:
    """Every rank's own check, then one verdict for all: the first problem of any rank ends every rank (rank 0
    says it), so that no rank goes on alone into a message that the others never send."""
    _, size = world()
    if size > 1:
        texts = _gather(problem or "")
        problem = distributed.broadcast_text(next((t for t in texts if t), "") if texts else None) or None
    _verdict(problem)
