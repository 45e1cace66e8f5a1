"""The dense Linears' Hessians of one layer's calibration pass, the same bytes on any number of ranks.

One Hessian per distinct input: Linears fed the very same tensor (q/k/v, gate/up) share one, so each input's
x^T x is computed once per sample. Inputs wait until gptq.BATCH_ROWS of them can go in one product.

The samples are split in distributed.GROUPS fixed groups and a rank forwards whole groups. Each group's sums
start from zero, and the groups' sums are added along one fixed binary tree over the groups (pairs, then pairs
of pairs): a rank adds the nodes that lie within its groups as soon as both halves are there, and rank 0 the
ones that span ranks. Float sums depend on their order, and this order depends only on the groups, so the
Hessians (and so the codes) are the same bytes on one rank as on sixteen. Held at once: the current group's
sums and at most log2(GROUPS) + 1 finished nodes.
"""

from dataclasses import dataclass

import torch
from torch import nn

from quantize.engine.distributed import GROUPS, group_members, owned_groups, recv, recv_any, recv_text, send, send_any, send_text
from quantize.quant import gptq


@dataclass
class Node:
    """The sums of the groups lo..hi-1 (None: those groups had no samples), one per input."""

    lo: int
    hi: int
    sums: dict[str, torch.Tensor] | None


def merge(left: Node, right: Node) -> Node:
    if left.sums is None or right.sums is None:
        return Node(left.lo, right.hi, left.sums if right.sums is None else right.sums)
    for k, h in right.sums.items():
        if k in left.sums:
            left.sums[k].add_(h)
        else:
            left.sums[k] = h
    return Node(left.lo, right.hi, left.sums)


def push(stack: list[Node], node: Node) -> None:
    """Add a node after the last one, merging while the last two are the halves of one node of the tree."""
    stack.append(node)
    while len(stack) > 1:
        a, b = stack[-2], stack[-1]
        size = b.hi - b.lo
        if a.hi != b.lo or a.hi - a.lo != size or a.lo % (2 * size):
            break
        stack[-2:] = [merge(a, b)]


class Hessians:
    """The Hessians of one rank's samples (`rank` of `world`), `n_samples` in all, filled by forward pre-hooks."""

    def __init__(self, device: torch.device, n_samples: int, rank: int = 0, world: int = 1, amax: bool = False):
        self.device, self.rank, self.world = device, rank, world
        # amax: also the largest |x| each input reached (NVFP4 activations' global scale), max over the ranks
        self.amax: dict[str, torch.Tensor] | None = {} if amax else None
        self.key: dict[str, str] = {}  # module -> the first module fed the same input (whose name keys its sums)
        self._group_of = {s: g for g in range(GROUPS) for s in group_members(g, n_samples)}
        self._groups = owned_groups(rank, world)
        self._next = self._groups.start  # the group being filled
        self._sums: dict[str, torch.Tensor] = {}
        self._stack: list[Node] = []
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (input kept alive, first module fed it)
        self._pending: dict[str, tuple[list[torch.Tensor], int]] = {}  # key -> (inputs, rows)

    def hook(self, name: str, _module: nn.Module, args: tuple) -> None:
        x = args[0]
        first = self._seen.get(id(x))
        if first is None:
            self._seen[id(x)] = (x, name)
        key = self.key.setdefault(name, name if first is None else first[1])
        if key == name:
            self._add(key, x)
            if self.amax is not None:
                m = x.abs().amax()
                self.amax[key] = m if key not in self.amax else torch.maximum(self.amax[key], m)

    def start_sample(self, s: int) -> None:
        while self._next < self._group_of[s]:
            self._end_group()
        self._seen.clear()

    def finish(self) -> None:
        """After the last sample: the rank's remaining groups end, and rank 0 receives and adds the others'."""
        self._seen.clear()
        while self._next < self._groups.stop:
            self._end_group()
        if self.rank == 0:
            for r in range(1, self.world):
                self._receive(r)
        else:
            self._send()

    def by_module(self) -> dict[str, torch.Tensor]:
        """Rank 0, after finish: each module's Hessian (shared by the modules fed the same input)."""
        (root,) = self._stack
        return {m: root.sums[k] for m, k in self.key.items()} if root.sums is not None else {}

    def amax_by_module(self) -> dict[str, torch.Tensor]:
        """Rank 0, after finish: each module's input amax over every rank's samples."""
        return {m: self.amax[k] for m, k in self.key.items() if k in self.amax}

    def _add(self, key: str, x: torch.Tensor) -> None:
        xs, rows = self._pending.get(key, ([], 0))
        xs.append(x)
        rows += x.numel() // x.shape[-1]
        self._pending[key] = (xs, rows)
        if rows >= gptq.BATCH_ROWS:
            self._flush(key)

    def _flush(self, key: str) -> None:
        xs, _ = self._pending.pop(key)
        if key not in self._sums:
            with torch.inference_mode(False):  # GPTQ updates it in place later, outside the forward's inference mode
                self._sums[key] = torch.zeros(xs[0].shape[-1], xs[0].shape[-1], dtype=torch.float32,
                                              device=self.device)
        gptq.add_batch(self._sums[key], torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]))

    def _end_group(self) -> None:
        for key in list(self._pending):
            self._flush(key)
        push(self._stack, Node(self._next, self._next + 1, self._sums or None))
        self._sums = {}
        self._next += 1

    # -- the exchange: each rank's finished nodes to rank 0, in group order -----------------------------------
    def _send(self) -> None:
        keys = sorted({k for n in self._stack if n.sums for k in n.sums})
        dims = {k: next(n.sums[k].shape[0] for n in self._stack if n.sums and k in n.sums) for k in keys}
        nodes = " ".join(f"{n.lo}:{n.hi}:{','.join(sorted(n.sums)) if n.sums else ''}" for n in self._stack)
        modules = " ".join(f"{m}={k}" for m, k in sorted(self.key.items()))
        send_text(f"{nodes}\n{modules}\n{' '.join(f'{k}={dims[k]}' for k in keys)}", 0)
        for n in self._stack:
            for k in sorted(n.sums or {}):
                send(n.sums[k], 0)
        self._stack = []
        if self.amax is not None:
            keys = sorted(self.amax)
            send_text(" ".join(keys), 0)
            send_any(torch.stack([self.amax[k] for k in keys]) if keys else None, 0)

    def _receive(self, r: int) -> None:
        nodes, modules, dims = recv_text(r).split("\n")
        for pair in modules.split():
            m, k = pair.split("=")
            self.key.setdefault(m, k)
        size = {k: int(d) for k, d in (x.split("=") for x in dims.split())}
        for spec in nodes.split():
            lo, hi, keys = spec.split(":")
            sums = None
            if keys:
                sums = {}
                for k in keys.split(","):
                    with torch.inference_mode(False):
                        sums[k] = recv(torch.empty(size[k], size[k], dtype=torch.float32, device=self.device), r)
            push(self._stack, Node(int(lo), int(hi), sums))
        if self.amax is not None:
            keys = recv_text(r).split()
            theirs = recv_any(r, self.device)
            for k, m in zip(keys, theirs if theirs is not None else [], strict=True):
                self.amax[k] = m if k not in self.amax else torch.maximum(self.amax[k], m)
