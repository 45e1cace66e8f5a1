"""ShardWriter's file: O_DIRECT through an aligned staging buffer where the filesystem takes it, buffered where it
does not, the same bytes and sha256 either way, and a full disk a clear error that leaves no .tmp behind."""

import errno
import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

from quantize import writer
from quantize.errors import QuantizeError
from quantize.safetensors_file import TensorSpec

# sizes around the 4096-byte blocks and the staging buffer: a last block to pad and cut, a tensor across two stages
SIZES = [1, 4095, 4097, writer.STAGING + 3, 2 * writer.STAGING, 3]


def _write(path, sizes=SIZES):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for i, n in enumerate(sizes)}
    w = writer.ShardWriter(path, [TensorSpec(k, "U8", tuple(v.shape)) for k, v in tensors.items()])
    for k, v in tensors.items():
        w.write(k, v)
    direct = w.f.direct
    size, sha = w.close()
    return tensors, size, sha, direct


def _check(path, tensors, size, sha):
    data = path.read_bytes()
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest()
    got = load_file(path)
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())


def test_direct_writes_are_exact(tmp_path):
    """Odd sizes: the file is exactly the tensors (the padded last block cut off), its sha256 the hasher's."""
    path = tmp_path / "s.safetensors"
    tensors, size, sha, direct = _write(path)
    assert direct == hasattr(os, "O_DIRECT")
    _check(path, tensors, size, sha)
    assert not path.with_name(path.name + ".tmp").exists()


def test_a_filesystem_without_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT at open (EINVAL) or at the first write (some FUSE filesystems) gets the
    same bytes written through the page cache."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("this platform has no O_DIRECT: every write is buffered, as the other test shows")
    real_open, real_write = os.open, os.write

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct_open)
    path = tmp_path / "a.safetensors"
    tensors, size, sha, direct = _write(path)
    assert not direct
    _check(path, tensors, size, sha)
    monkeypatch.setattr(os, "open", real_open)

    import fcntl

    def no_direct_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", no_direct_write)
    for name, sizes in (("b", SIZES), ("c", [3 * writer.STAGING + 5, 7])):  # c: the first tensor spans 3 stages
        path = tmp_path / f"{name}.safetensors"
        tensors, size, sha, direct = _write(path, sizes)
        assert not direct
        _check(path, tensors, size, sha)


def test_a_full_disk_mid_shard_is_one_clear_error_and_no_tmp(tmp_path, monkeypatch):
    """ENOSPC from the kernel partway through a shard: the disk-full error names the shard, and abort removes
    its .tmp."""
    real_write, budget = os.write, [writer.STAGING + 1]

    def fills_up(fd, data):
        budget[0] -= len(data)
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fills_up)
    path = tmp_path / "full.safetensors"
    with pytest.raises(QuantizeError, match="disk full while writing full.safetensors"):
        try:
            _write(path, [writer.STAGING, writer.STAGING, 5])
        except QuantizeError:
            assert path.with_name(path.name + ".tmp").exists()  # the caller (engine/shard.py) aborts it
            raise
    w = writer.ShardWriter(path, [TensorSpec("t", "U8", (3,))])
    w.abort()
    assert not path.with_name(path.name + ".tmp").exists() and not path.exists()
