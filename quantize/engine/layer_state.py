"""Checkpoints of the layerwise engine, in OUT.partial/calib/, so that `--resume` continues from a layer instead
of recalibrating from the first.

A calibrated plan's shards break at its segments (tensor_plan.calibrated_keys): runs of layers whose shards all
close together. So a finished layer needs no checkpoint of its results: they are in its shards, or they are
computed again. What a resume needs is the calibration batch as it enters a segment: `activations-{L}.safetensors`,
saved in the background after layer L-1 (never after the last layer: nothing follows it), each tensor with its
crc32. It counts only once every shard of the layers before L is finished: then `layers.json` names it (with
the stats of the layers before it), the commit record, written last, so a kill anywhere leaves the previous
checkpoint or the new one, never half of one; the older activations go. The folder is removed before the
output is verified and renamed into place.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize.errors import QuantizeError, UsageError
from quantize.safetensors_file import DTYPE_NAMES, TensorSpec, read_header, read_tensor
from quantize.verify import tensor_crc
from quantize.writer import ShardWriter, write_json

CALIB_DIR = "calib"
META_NAME = "layers.json"


def samples_key(samples: list[torch.Tensor], device: torch.device, compute_dtype: torch.dtype) -> str:
    """What the checkpoint's numbers depend on beyond the state fingerprint: the calibration tokens, the kind
    of device and the compute dtype (CPU and CUDA kernels, bf16 and float32 forwards round differently, so a
    run is only byte-identical on its own kind)."""
    h = hashlib.sha256(f"{device.type} {compute_dtype}".encode())
    for s in samples:
        h.update(s.to("cpu", torch.int64).contiguous().numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


@dataclass
class Resume:
    next_layer: int
    stats: dict
    activations: dict = field(default_factory=dict)  # file, crc32 per tensor


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """One safetensors file, fsynced and renamed into place; returns the crc32 of each tensor's bytes."""
    specs = [TensorSpec(n, DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    w = ShardWriter(path, specs, sha256=False)
    try:
        for n, t in tensors.items():
            w.write(n, t)
        w.close()
    except BaseException:
        w.abort()
        raise
    return {n: rec["crc32"] for n, rec in w.tensors.items()}


def read_checked(path: Path, crcs: dict[str, int]):
    """Tensors of a checkpoint file, each checked against the crc32 recorded when it was written."""
    header = read_header(path)
    for name in crcs:
        info = header.get(name)
        if info is None:
            raise QuantizeError(f"{path.name}: {name} is missing; the checkpoint is damaged: rerun with --overwrite")
        t = read_tensor(info)
        if tensor_crc(t) != crcs[name]:
            raise QuantizeError(f"{path.name}: {name} does not match its checksum; the checkpoint is damaged: "
                                "rerun with --overwrite")
        yield name, t


class LayerCheckpoint:
    def __init__(self, folder: Path, key: str):
        self.folder, self.key = folder, key
        self.meta: dict = {"samples": key, "next_layer": 0, "activations": {}, "stats": {}}

    def load(self) -> Resume | None:
        """The committed point to continue from, or None when there is none; refuses another run's checkpoint."""
        path = self.folder / META_NAME
        if not path.is_file():
            return None
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise QuantizeError(f"{path}: unreadable ({e}); rerun with --overwrite to start over") from e
        if meta.get("samples") != self.key:
            raise UsageError(f"{self.folder.parent} was calibrated with other samples or on another kind of device; "
                             "resume with the same --calib, --num-samples, --seq-len, --seed and --device, or "
                             "rerun with --overwrite")
        self.meta = meta
        return Resume(meta["next_layer"], meta["stats"], meta["activations"])

    def save(self, layer: int, activations: dict[str, torch.Tensor]) -> dict:
        """The activations entering `layer`, written and fsynced; returns their record for `commit`."""
        self.folder.mkdir(exist_ok=True)
        name = f"activations-{layer}.safetensors"
        return {"file": name, "crc32": write_tensors(self.folder / name, activations)}

    def commit(self, layer: int, record: dict, stats: dict) -> None:
        """Make the saved activations entering `layer` the point a resume continues from (every shard of the
        layers before it is finished); the older ones go."""
        self.meta = {"samples": self.key, "next_layer": layer, "activations": record, "stats": stats}
        write_json(self.folder / META_NAME, self.meta)
        for p in self.folder.glob("activations-*.safetensors"):
            if p.name != record["file"] and int(p.name.split("-")[1].split(".")[0]) < layer:
                p.unlink(missing_ok=True)

    def activations(self, resume: Resume):
        """(name, tensor) of the saved activations, in the order they were written."""
        return read_checked(self.folder / resume.activations["file"], resume.activations["crc32"])
