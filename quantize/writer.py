"""Output folder: safetensors shards written a tensor at a time, index, config, copied side files, manifest;
everything lands in OUT.partial/ and becomes OUT/ by one rename."""

import errno
import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from quantize.checkpoint import INDEX_NAME, PICKLE_SUFFIXES
from quantize.errors import QuantizeError
from quantize.phases import timer
from quantize.safetensors_file import DTYPES, TensorSpec, encode_header

MANIFEST_NAME = "quantize-manifest.json"
HASH_CHUNK = 4 * 2**20


def disk_full(path: Path, e: OSError) -> QuantizeError:
    if e.errno == errno.ENOSPC:
        return QuantizeError(
            f"disk full while writing {path.name}; finished shards are kept in {path.parent}: "
            "free space and rerun with --resume"
        )
    return QuantizeError(f"cannot write {path}: {e.strerror or e}")


class ShardWriter:
    """Writes one safetensors file whose header (all shapes and dtypes) is known before its tensors are.

    Tensors must arrive in header order; bytes go to `<name>.tmp`, hashed as they are written, and the file
    takes its name only after an fsync in `close`. `sha256=False` (files only this tool reads back, checked by
    their crc32s) skips the file hash: at 0.5-1 GB/s it was half the cost of the layer checkpoints.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], sha256: bool = True, phases=None):
        self.path, self.specs, self._next = path, specs, 0
        self.timed = timer(phases)  # quantize/phases.py: write, crc32, sha256
        self.tmp = path.with_name(path.name + ".tmp")
        self.sha = hashlib.sha256() if sha256 else None
        self.tensors: dict[str, dict] = {}  # name -> dtype, shape, crc32 of its bytes (for the manifest)
        try:
            self.f = open(self.tmp, "wb")
            self._write(encode_header(specs))
        except OSError as e:
            raise disk_full(self.path, e) from e

    def _write(self, data) -> None:
        with self.timed("write"):
            self.f.write(data)
        if self.sha is not None:
            with self.timed("sha256"):
                self.sha.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[self._next]
        if name != spec.name or tensor.dtype != DTYPES[spec.dtype] or tuple(tensor.shape) != spec.shape:
            raise AssertionError(
                f"{self.path.name}: expected {spec.name} {spec.dtype} {spec.shape}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        self._next += 1
        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        with self.timed("crc32"):
            crc = zlib.crc32(data)
        self.tensors[name] = {"file": self.path.name, "dtype": spec.dtype, "shape": list(spec.shape), "crc32": crc}
        try:
            self._write(memoryview(data))
        except OSError as e:
            raise disk_full(self.path, e) from e

    def close(self) -> tuple[int, str]:
        """Finish the file; returns (size in bytes, sha256 hex or "" without sha256)."""
        if self._next != len(self.specs):
            raise AssertionError(f"{self.path.name}: {len(self.specs) - self._next} tensors were never written")
        try:
            with self.timed("write"):
                self.f.flush()
                os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise disk_full(self.path, e) from e
        return self.path.stat().st_size, self.sha.hexdigest() if self.sha is not None else ""

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """Streamed through one reused buffer: memory stays at HASH_CHUNK whatever the file's size."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise disk_full(path, e) from e


def output_config(config: dict, quantization_config: dict) -> dict:
    """config.json for the output: the source's own quantization_config (FP8, INT4) replaced by ours."""
    out = json.loads(json.dumps(config))
    out.pop("quantization_config", None)
    if isinstance(out.get("text_config"), dict):
        out["text_config"].pop("quantization_config", None)
    out["quantization_config"] = quantization_config
    return out


def side_files(src: Path) -> list[Path]:
    """Files copied as they are: tokenizer, chat template, generation config, remote-code .py, licence."""
    skip = {INDEX_NAME, "config.json", MANIFEST_NAME}
    return sorted(
        p
        for p in src.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.name not in skip
        and p.suffix != ".safetensors"
        and p.suffix not in PICKLE_SUFFIXES
    )


def copy_side_files(src: Path, out: Path) -> list[str]:
    names = []
    for p in side_files(src):
        try:
            shutil.copyfile(p, out / p.name)
        except OSError as e:
            raise disk_full(out / p.name, e) from e
        names.append(p.name)
    return names


def write_index(out: Path, weight_map: dict[str, str], total_size: int) -> None:
    write_json(out / INDEX_NAME, {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


def finalize(partial: Path, out: Path, overwrite: bool) -> None:
    """Move the finished folder to its final name; an existing OUT is replaced only with --overwrite."""
    old = None
    if out.exists():
        if not overwrite:
            raise QuantizeError(f"{out} appeared while converting; the result is kept in {partial}")
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
