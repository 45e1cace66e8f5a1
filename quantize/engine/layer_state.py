"""Checkpoints of the layerwise engine, in OUT.partial/calib/, so that `--resume` continues from the last
finished layer instead of recalibrating from the first.

After layer L: `results-L.safetensors` holds the tensors L produced (packed weights, scales, AWQ-rescaled
norms), `activations-{L+1}.safetensors` the calibration batch as it enters layer L+1, and `layers.json` says
which of them count, each tensor with its crc32. The json is written last, so a kill anywhere leaves either
the previous checkpoint or the new one, never half of one. The activations of earlier layers are deleted; a
layer's results once every output shard holding them is finished. The folder is removed before the output is
verified and renamed into place.
"""

import hashlib
import itertools
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
    results: dict[int, dict] = field(default_factory=dict)  # layer -> file, crc32 per tensor


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


def read_checked(path: Path, crcs: dict[str, int], names=None, header: dict | None = None):
    """Tensors of a checkpoint file, each checked against the crc32 recorded when it was written."""
    header = header if header is not None else read_header(path)
    for name in names if names is not None else crcs:
        info = header.get(name)
        if info is None or name not in crcs:
            raise QuantizeError(f"{path.name}: {name} is missing; the checkpoint is damaged: rerun with --overwrite")
        t = read_tensor(info)
        if tensor_crc(t) != crcs[name]:
            raise QuantizeError(f"{path.name}: {name} does not match its checksum; the checkpoint is damaged: "
                                "rerun with --overwrite")
        yield name, t


class LayerCheckpoint:
    def __init__(self, folder: Path, key: str):
        self.folder, self.key = folder, key
        self.meta: dict = {"samples": key, "next_layer": 0, "activations": {}, "results": {}, "stats": {}}
        self._headers: dict[str, dict] = {}  # a results file's header, parsed once for all its tensors

    def load(self) -> Resume | None:
        """The saved point to continue from, or None when there is none; refuses another run's checkpoint."""
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
        return Resume(meta["next_layer"], meta["stats"], meta["activations"],
                      {int(k): v for k, v in meta["results"].items()})

    def save(self, layer: int, results: dict[str, list[torch.Tensor]], activations: dict[str, torch.Tensor],
             stats: dict, finished: set[str], layer_names: set[str]) -> None:
        """Record layer `layer` as done: its results, the activations entering layer+1, the stats so far.
        `finished`: tensor names already in finished output shards (their layers' results can go);
        `layer_names`: every tensor of the layer, so that one computed but not kept is known as such."""
        self.folder.mkdir(exist_ok=True)
        flat = {f"{name}#{k}": t for name, ts in results.items() for k, t in enumerate(ts)}
        res_file = f"results-{layer}.safetensors"
        act_file = f"activations-{layer + 1}.safetensors"
        res = {"file": res_file, "tensors": sorted(results), "released": sorted(layer_names & finished),
               "crc32": write_tensors(self.folder / res_file, flat)}
        act = {"file": act_file, "crc32": write_tensors(self.folder / act_file, activations)}
        old_act = self.meta["activations"].get("file")
        kept = {int(k): v for k, v in self.meta["results"].items()}
        kept[layer] = res
        gone = [j for j, v in kept.items() if j != layer and set(v["tensors"]) <= finished]
        for j in gone:
            kept.pop(j)
        self.meta = {"samples": self.key, "next_layer": layer + 1, "activations": act,
                     "results": {str(j): v for j, v in sorted(kept.items())}, "stats": stats}
        write_json(self.folder / META_NAME, self.meta)
        if old_act and old_act != act_file:
            (self.folder / old_act).unlink(missing_ok=True)
        for j in gone:
            (self.folder / f"results-{j}.safetensors").unlink(missing_ok=True)

    def result(self, layer: int, name: str) -> list[torch.Tensor] | None:
        """The saved output tensors of entry `name`, computed by `layer` before the resume; None when the layer
        left that tensor as it is in the source."""
        rec = self.meta["results"].get(str(layer))
        if rec is None or name in rec["released"]:
            raise QuantizeError(f"{name}: layer {layer}'s results were released once its shard was finished, but "
                                "that shard must be written again; rerun with --overwrite")
        if name not in rec["tensors"]:
            return None
        crcs = rec["crc32"]
        wanted = list(itertools.takewhile(crcs.__contains__, (f"{name}#{k}" for k in itertools.count())))
        path = self.folder / rec["file"]
        if rec["file"] not in self._headers:
            self._headers[rec["file"]] = read_header(path)
        return [t for _, t in read_checked(path, crcs, wanted, self._headers[rec["file"]])]

    def activations(self, resume: Resume):
        """(name, tensor) of the saved activations, in the order they were written."""
        return read_checked(self.folder / resume.activations["file"], resume.activations["crc32"])
