"""Where the layerwise engine keeps calibration activations: on the compute device, in host memory or in
memory-mapped files, decided once per run by engine/memory.py's account.

`ActivationStore` holds one tensor per calibration sample (the hidden states carried from layer to layer);
`TokenBuffer` holds all tokens of one MoE layer's input as a single [tokens, hidden] tensor, from which each
routed expert gathers its own rows (moved to the device once per layer, never once per expert).
"""

import ctypes
import ctypes.util
import itertools
import math
from pathlib import Path

import torch


def _libc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Hand memory freed by torch back to the OS. glibc keeps freed mid-sized blocks in its heap, and the many
    short-lived GPTQ buffers of varied sizes fragment it: without this, resident memory grows by ~100 MB over
    the first layers of even a 135M model and never comes back."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_names = itertools.count()


def _mapped(path: Path, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class ActivationStore:
    """One tensor per calibration sample, kept where the engine decided: gpu, cpu or disk (memory-mapped)."""

    def __init__(self, kind: str, device: torch.device, folder: Path | None = None):
        self.kind, self.device, self.folder = kind, device, folder
        self.items: list = []

    def append(self, t: torch.Tensor) -> None:
        self.items.append(None)
        self[len(self.items) - 1] = t

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        """Store t as sample i; a layer's output replaces its input, so one copy of the activations is held."""
        old = self.items[i]
        if isinstance(old, torch.Tensor) and (old.dtype, old.shape) == (t.dtype, t.shape):
            # written into the input's memory: a fresh tensor per sample would hold all the old ones until the
            # allocator reuses them (+70% of the activations in layer 0's pass, measured), and re-pin each one
            old.copy_(t.detach())
        elif self.kind == "gpu":
            self.items[i] = t.detach()
        elif self.kind == "cpu":
            cpu = t.detach().to("cpu")
            self.items[i] = cpu.pin_memory() if self.device.type == "cuda" else cpu
        elif self.items[i] is not None and self.items[i][1:] == (t.dtype, tuple(t.shape)):
            _mapped(*self.items[i]).copy_(t.detach())  # same file, rewritten through its mapping
        else:
            path = self.folder / f"sample-{next(_names)}.bin"
            t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tofile(path)
            self.items[i] = (path, t.dtype, tuple(t.shape))

    def __getitem__(self, i: int) -> torch.Tensor:
        item = self.items[i]
        if self.kind == "disk":
            item = _mapped(*item)
        return item.to(self.device, non_blocking=True)

    def host(self, i: int) -> torch.Tensor:
        """Sample i where it is kept, not moved (what a checkpoint saves from)."""
        item = self.items[i]
        return _mapped(*item) if self.kind == "disk" else item

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        if self.kind == "disk":
            for path, _, _ in self.items:
                path.unlink(missing_ok=True)
        self.items = []


class TokenBuffer:
    """[rows, width] of one dtype, kept as an ActivationStore of the same kind keeps samples; filled by row
    ranges, read by row indices onto the compute device."""

    def __init__(self, kind: str, device: torch.device, folder: Path | None, rows: int, width: int,
                 dtype: torch.dtype):
        self.device, self.path = device, None
        if kind == "gpu":
            self.t = torch.empty(rows, width, dtype=dtype, device=device)
        elif kind == "cpu":
            self.t = torch.empty(rows, width, dtype=dtype, pin_memory=device.type == "cuda")
        else:
            self.path = folder / f"tokens-{next(_names)}.bin"
            with open(self.path, "wb") as f:
                f.truncate(rows * width * dtype.itemsize)
            self.t = _mapped(self.path, dtype, (rows, width))

    def write(self, start: int, x: torch.Tensor) -> None:
        self.t[start:start + x.shape[0]].copy_(x.reshape(-1, self.t.shape[1]))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.t[index.to(self.t.device)].to(self.device, non_blocking=True)

    def close(self) -> None:
        self.t = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
