"""Output folder: safetensors shards written a tensor at a time, index, config, copied side files, manifest;
everything lands in OUT.partial/ and becomes OUT/ by one rename."""

import errno
import fcntl
import hashlib
import json
import mmap
import os
import queue
import shutil
import threading
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


# A shard's bytes go to the disk through an aligned buffer of STAGING bytes with O_DIRECT: no page cache. Written
# through the page cache, a 1.6 GB output cost 1.2-3.2 s of CPU on the 2-core bench machine (the kernel's page
# allocation, reclaim and writeback), staged and direct 0.25 s, and a terabyte of output does not push the source
# out of the page cache. Where the filesystem refuses O_DIRECT (tmpfs, some FUSE), the bytes are written as
# usual, and every WRITEBACK bytes the kernel is asked to start writing them out (posix_fadvise DONTNEED: an
# asynchronous writeback of the range), so that the fsync at the end waits for the last few MB, not the shard.
STAGING = 8 * 2**20
WRITEBACK = 64 * 2**20
_ALIGN = 4096  # a multiple of any logical block size O_DIRECT asks for


class _File:
    """A new file written front to back: O_DIRECT through a page-aligned staging buffer where the filesystem
    takes it, else buffered with early writeback (STAGING above)."""

    def __init__(self, path: Path):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if not self.direct or e.errno != errno.EINVAL:
                raise
            self.direct, self.fd = False, os.open(path, flags, 0o644)
        self.stage = mmap.mmap(-1, STAGING) if self.direct else None  # mmap memory is page-aligned
        self.fill = self.size = self.flushed = self.on_disk = 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        self.size += len(data)
        if not self.direct:
            return self._buffered(data)
        while len(data):
            n = min(len(data), STAGING - self.fill)
            self.stage[self.fill:self.fill + n] = data[:n]
            self.fill += n
            data = data[n:]
            if self.fill == STAGING:
                self._write_stage(STAGING)
                self.fill = 0
                if not self.direct:  # the filesystem refused O_DIRECT: the rest goes straight through
                    return self._buffered(data)

    def _write_stage(self, n: int) -> None:
        view = memoryview(self.stage)[:n]
        try:
            while len(view):
                done = os.write(self.fd, view)
                self.on_disk += done
                view = view[done:]
        except OSError as e:
            if e.errno != errno.EINVAL or self.on_disk:
                raise
            # the filesystem opened the file O_DIRECT but refuses its writes: nothing is on disk yet; go buffered
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            self._buffered(view)

    def _buffered(self, data) -> None:
        while len(data):
            data = data[os.write(self.fd, data):]
        end = os.lseek(self.fd, 0, os.SEEK_CUR)
        if end - self.flushed >= WRITEBACK and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.flushed, end - self.flushed, os.POSIX_FADV_DONTNEED)
            self.flushed = end

    def finish(self) -> None:
        """The last bytes written (a direct file's last block padded, then cut to its size) and synced."""
        if self.direct and self.fill:
            padded = -(-self.fill // _ALIGN) * _ALIGN
            self.stage[self.fill:padded] = bytes(padded - self.fill)
            self._write_stage(padded)
            self.fill = 0
            os.ftruncate(self.fd, self.size)  # (also where that last write went buffered, padding and all)
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.stage is not None:
            self.stage.close()
            self.stage = None


class _Hasher:
    """sha256 of a shard's bytes in a thread of its own, in the order they were written: the writer thread only
    writes. At most `depth` buffers wait (each holds its tensor's memory until hashed)."""

    def __init__(self, phases, depth: int = 8):
        self.sha = hashlib.sha256()
        self.timed = timer(phases)
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (data := self.queue.get()) is not None:
            with self.timed("sha256"):
                self.sha.update(data)

    def update(self, data) -> None:
        self.queue.put(data)

    def hexdigest(self) -> str:
        self.queue.put(None)
        self.thread.join()
        return self.sha.hexdigest()


def tensor_bytes(tensor: torch.Tensor):
    """A tensor's bytes as the file holds them (on the CPU, contiguous), as a numpy uint8 array."""
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()


def crc32(tensor: torch.Tensor, phases=None) -> tuple[torch.Tensor, int]:
    """(the tensor on the CPU, the crc32 of its bytes): what ShardWriter.write takes, made in the worker that made
    the tensor so that the writer thread only writes."""
    cpu = tensor.detach().to("cpu").contiguous()
    with timer(phases)("crc32"):
        return cpu, zlib.crc32(tensor_bytes(cpu))


class ShardWriter:
    """Writes one safetensors file whose header (all shapes and dtypes) is known before its tensors are.

    Tensors must arrive in header order; bytes go to `<name>.tmp`, hashed as they are written (in a thread of
    their own), and the file takes its name only after an fsync in `close`. `sha256=False` (files only this tool
    reads back, checked by their crc32s) skips the file hash: at 0.5-1 GB/s it was half the cost of the layer
    checkpoints.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], sha256: bool = True, phases=None):
        self.path, self.specs, self._next = path, specs, 0
        self.timed = timer(phases)  # quantize/phases.py: write, crc32, sha256
        self.tmp = path.with_name(path.name + ".tmp")
        self.sha = _Hasher(phases) if sha256 else None
        self.tensors: dict[str, dict] = {}  # name -> dtype, shape, crc32 of its bytes (for the manifest)
        self.f = None
        try:
            self.f = _File(self.tmp)
            self._write(encode_header(specs))
        except OSError as e:
            self.abort()  # nothing of a shard that did not start stays behind
            raise disk_full(self.path, e) from e

    def _write(self, data) -> None:
        with self.timed("write"):
            self.f.write(data)
        if self.sha is not None:
            self.sha.update(data)

    def write(self, name: str, tensor: torch.Tensor, crc: int | None = None) -> None:
        """Append the next tensor; `crc`: its bytes' crc32 already taken (crc32() above, in a worker)."""
        spec = self.specs[self._next]
        if name != spec.name or tensor.dtype != DTYPES[spec.dtype] or tuple(tensor.shape) != spec.shape:
            raise AssertionError(
                f"{self.path.name}: expected {spec.name} {spec.dtype} {spec.shape}, "
                f"got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        self._next += 1
        data = tensor_bytes(tensor)
        if crc is None:
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
                self.f.finish()
            self.f.close()
            digest = self.sha.hexdigest() if self.sha is not None else ""
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise disk_full(self.path, e) from e
        return self.path.stat().st_size, digest

    def _stop_hashing(self) -> None:
        if self.sha is not None and self.sha.thread.is_alive():
            self.sha.hexdigest()

    def abort(self) -> None:
        self._stop_hashing()
        if self.f is not None:
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
