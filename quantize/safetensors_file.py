"""The safetensors file format, read and written a tensor at a time.

The safetensors library reads through mmap (every page touched stays in RSS until the map is dropped) and
writes only whole dicts held in memory; a converter that streams a 1 TB checkpoint needs neither. The
format is small: 8-byte little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}},
then the bytes. Every header is validated before a byte of data is trusted.
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quantize.errors import QuantizeError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: `start`/`end` are absolute file offsets."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a shard's header; raise QuantizeError naming the file and the problem."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise QuantizeError(f"{path.name}: file is {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise QuantizeError(
                    f"{path.name}: header length {n} runs past the end of the {size}-byte file "
                    "(truncated or not safetensors); download it again"
                )
            raw = f.read(n)
    except OSError as e:
        raise QuantizeError(f"{path.name}: cannot read ({e.strerror})") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantizeError(f"{path.name}: header is not valid JSON ({e}); the file is corrupt") from e
    if not isinstance(header, dict):
        raise QuantizeError(f"{path.name}: header is not a JSON object; the file is corrupt")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + n, size - 8 - n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        infos[name] = _tensor_info(path, name, entry, data_start, data_len)
    spans = sorted((i.start, i.end, i.name) for i in infos.values() if i.end > i.start)
    for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:], strict=False):
        if start < prev_end:
            raise QuantizeError(f"{path.name}: tensors {prev} and {name} overlap; the file is corrupt")
    return infos


def _tensor_info(path: Path, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    def bad(what: str) -> QuantizeError:
        return QuantizeError(f"{path.name}: tensor {name}: {what}; the file is corrupt")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise bad(f"invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise bad(f"data_offsets {offsets} fall outside the {data_len} data bytes (truncated file?)")
    if end - begin != math.prod(shape) * itemsize(dtype):
        raise bad(f"{end - begin} bytes do not hold {dtype} of shape {shape}")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """The tensor's bytes read with pread into fresh memory (no mmap), as a CPU tensor of its dtype/shape."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy()) if info.nbytes else memoryview(b"")
    fd = os.open(info.path, os.O_RDONLY)
    try:
        done = 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.start + done)
            if got <= 0:
                raise QuantizeError(f"{info.path.name}: tensor {info.name}: file ended early (truncated)")
            done += got
    finally:
        os.close(fd)
    return buf.view(DTYPES[info.dtype]).reshape(info.shape)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def encode_header(specs: list[TensorSpec]) -> bytes:
    """Header bytes (length prefix included) for tensors written back to back in the given order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw
