"""A sharded safetensors checkpoint, read lazily: headers up front, each tensor's bytes only when asked.

Source formats are decoded here to a float tensor on demand:
  float            bf16 / fp16 / fp32 tensors as stored
  fp8-block        DeepSeek V3 / Kimi K2: fp8 `X.weight` + float32 `X.weight_scale_inv`, 128x128 blocks
  ct-fp8           compressed-tensors float-quantized: fp8 `X.weight` + `X.weight_scale` (tensor or channel)
  ct-int4          compressed-tensors pack-quantized: `X.weight_packed`, `X.weight_scale`, `X.weight_shape`
  ct-nvfp4         compressed-tensors nvfp4-pack-quantized: uint8 `X.weight_packed` (two e2m1 codes a byte), e4m3
                   `X.weight_scale` per 16, float32 `X.weight_global_scale` (and, W4A4, `X.input_global_scale`)
  ct-mxfp4         compressed-tensors mxfp4-pack-quantized: `X.weight_packed`, e8m0 `X.weight_scale` bytes per 32
A weight's scale may sit in another shard than the weight; every part is looked up by name across shards.
"""

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize.arch import layout
from quantize.errors import QuantizeError
from quantize.hub import snapshot_roots
from quantize.phases import timer
from quantize.quant import fp4, fp8, lattice, pack, rtn
from quantize.safetensors_file import TensorInfo, read_header, read_tensor

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
FP4_PARTS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
FP4_FORMATS = {"nvfp4-pack-quantized": "ct-nvfp4", "mxfp4-pack-quantized": "ct-mxfp4"}


@dataclass(frozen=True)
class SourceFormat:
    """How the checkpoint stores its quantized weights, if any."""

    kind: str  # float | fp8-block | ct-fp8 | ct-int4 | ct-nvfp4 | ct-mxfp4
    block: tuple[int, int] | None = None  # fp8-block
    num_bits: int | None = None  # ct-int4
    group_size: int | None = None
    symmetric: bool | None = None
    ignore: tuple[str, ...] = ()
    w4a4: bool = False  # ct-nvfp4 with NVFP4 activations (each Linear's input_global_scale)


@dataclass(frozen=True)
class LogicalTensor:
    """One tensor as the model sees it (e.g. `X.weight`), with the stored parts that encode it."""

    name: str
    shape: tuple[int, ...]
    encoding: str  # float | fp8-block | ct-fp8 | ct-int4 | ct-nvfp4 | ct-mxfp4
    parts: dict[str, TensorInfo] = field(hash=False)

    @property
    def main(self) -> TensorInfo:
        return self.parts.get("weight_packed") or self.parts["tensor"]

    @property
    def stored_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def stored_dtype(self) -> str:
        return self.main.dtype


def _inside(root: Path, rel: str, named_by: str = INDEX_NAME) -> Path:
    """Resolve a file the index names, refusing anything that leaves the checkpoint folder (an HF-cache snapshot's
    links into its repo's blobs/ stay inside)."""
    if os.path.isabs(rel) or ".." in Path(rel).parts:
        raise QuantizeError(f"{named_by}: entry {rel!r} points outside the checkpoint folder; refusing to read it")
    path = root / rel
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError) as e:  # Python 3.11 raises RuntimeError on a loop, later versions OSError
        raise QuantizeError(f"{named_by}: {rel!r} is a symbolic link that loops; refusing to read it") from e
    if path.is_symlink() and not path.exists():
        raise QuantizeError(f"{named_by}: {rel!r} is a symbolic link that points nowhere; download the checkpoint again")
    if not any(resolved == base or base in resolved.parents for base in snapshot_roots(root)):
        raise QuantizeError(f"{named_by}: {rel!r} is a link that leaves the checkpoint folder; refusing to read it")
    return path


def _object(v, where: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise QuantizeError(f"config.json: {where} is {type(v).__name__}, expected an object; the config is broken")
    return v


def _block(v, where: str) -> tuple[int, int] | None:
    """A block size: two whole numbers from 1 to 65536 (the scale grid is derived from it)."""
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 65536
                                                       for x in v)):
        raise QuantizeError(f"config.json: {where} is {v!r}, expected two whole numbers from 1 to 65536 (e.g. [128, 128])")
    return tuple(v)


def _group_size(v, where: str) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65536):
        raise QuantizeError(f"config.json: {where} is {v!r}, expected a whole number from 1 to 65536")
    return v


def _source_format(config: dict) -> SourceFormat:
    qc = config.get("quantization_config") or _object(config.get("text_config"), "text_config").get("quantization_config")
    if not qc:
        return SourceFormat("float")
    qc = _object(qc, "quantization_config")
    method = qc.get("quant_method")
    if method == "fp8":
        return SourceFormat("fp8-block", block=_block(qc.get("weight_block_size"), "quantization_config.weight_block_size")
                            or (128, 128))
    if method == "compressed-tensors":
        ignore = qc.get("ignore") or ()
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            raise QuantizeError("config.json: quantization_config.ignore must be a list of module names or patterns")
        ignore = tuple(ignore)
        groups = list(_object(qc.get("config_groups"), "quantization_config.config_groups").values())
        fmt = qc.get("format")
        first = _object(groups[0], "quantization_config.config_groups's first group") if groups else {}
        weights = _object(first.get("weights"), "quantization_config's weights")
        fmt = first.get("format", fmt)
        if fmt == "float-quantized":
            block = _block(weights.get("block_structure"), "quantization_config's weights.block_structure")
            return SourceFormat("ct-fp8", block=block, ignore=ignore)
        if fmt == "pack-quantized":
            if weights.get("num_bits", 4) != 4:
                raise QuantizeError(f"pack-quantized with num_bits {weights.get('num_bits')!r} is not supported as input (4 is)")
            symmetric = weights.get("symmetric", True)
            if not isinstance(symmetric, bool):
                raise QuantizeError(f"config.json: quantization_config's weights.symmetric is {symmetric!r}, expected "
                                    "true or false")
            return SourceFormat(
                "ct-int4",
                num_bits=4,
                group_size=_group_size(weights.get("group_size"), "quantization_config's weights.group_size"),
                symmetric=symmetric,
                ignore=ignore,
            )
        if fmt in FP4_FORMATS:
            acts = _object(first.get("input_activations"), "quantization_config's input_activations")
            return SourceFormat(FP4_FORMATS[fmt], group_size=_group_size(weights.get("group_size"),
                                                                         "quantization_config's weights.group_size"),
                                ignore=ignore,
                                w4a4=acts.get("type") == "float" and acts.get("num_bits") == 4)
        raise QuantizeError(f"compressed-tensors format {fmt!r} is not supported as input (float-quantized, "
                            f"pack-quantized, {', '.join(FP4_FORMATS)} are)")
    raise QuantizeError(
        f"quantization_config.quant_method {method!r} is not supported as input "
        "(supported: none, fp8 with weight_block_size, compressed-tensors)"
    )


class Checkpoint:
    """A local Hugging Face model folder with safetensors weights.

    Opening reads config.json, the index and every shard header (validated); no tensor data is read.
    """

    def __init__(self, root: Path, allow_nonfinite: bool = False):
        self.root = Path(root)
        self.allow_nonfinite = allow_nonfinite  # NaN / Inf weights are refused unless the user says otherwise
        if not self.root.is_dir():
            raise QuantizeError(f"{self.root}: not a folder")
        config_path = self.root / "config.json"
        if not config_path.is_file():
            raise QuantizeError(f"{self.root}: no config.json; is this a Hugging Face model folder?")
        try:
            self.config: dict = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise QuantizeError(f"config.json: not valid JSON ({e})") from e
        layout.check_config(self.config)
        self.format = _source_format(self.config)
        self.shards = self._shard_paths()
        self.stored: dict[str, TensorInfo] = {}
        for shard in self.shards:
            for name, info in read_header(shard).items():
                if name in self.stored:
                    raise QuantizeError(f"{shard.name}: tensor {name} is also in {self.stored[name].path.name}")
                self.stored[name] = info
        self._check_index()
        self.tensors = self._logical_tensors()
        dtype_name = self.config.get("torch_dtype") or self.config.get("dtype") or (
            self.config.get("text_config") or {}
        ).get("torch_dtype", "bfloat16")
        self.dtype = TORCH_DTYPES.get(dtype_name, torch.bfloat16)

    def _shard_paths(self) -> list[Path]:
        index = self.root / INDEX_NAME
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise QuantizeError(f"{INDEX_NAME}: unreadable ({e}); download it again") from e
            if not isinstance(self.weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in self.weight_map.items()
            ):
                raise QuantizeError(f"{INDEX_NAME}: weight_map must map tensor names to shard file names; download it again")
            names = sorted(set(self.weight_map.values()))
            paths = [_inside(self.root, n) for n in names]
            for p in paths:
                if not p.is_file():
                    raise QuantizeError(
                        f"{INDEX_NAME} names shard {p.name}, which is missing; download the checkpoint again "
                        "(`quantize download` resumes)"
                    )
            return paths
        self.weight_map = {}
        paths = sorted(_inside(self.root, p.name, f"{self.root.name}/") for p in self.root.glob("*.safetensors")
                       if p.is_file() or p.is_symlink())
        if paths:
            return paths
        pickles = sorted(p.name for p in self.root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise QuantizeError(
                f"{self.root}: only pickle weights ({', '.join(pickles[:3])}); they can run arbitrary code and are "
                "never loaded. Convert them to safetensors in a sandbox first, or use a safetensors revision"
            )
        raise QuantizeError(f"{self.root}: no *.safetensors weights found")

    def _check_index(self) -> None:
        for name, rel in self.weight_map.items():
            info = self.stored.get(name)
            if info is None or info.path.name != Path(rel).name:
                raise QuantizeError(f"{INDEX_NAME}: tensor {name} is listed in {rel} but that shard does not hold it")

    def _logical_tensors(self) -> dict[str, LogicalTensor]:
        stored, fmt = self.stored, self.format.kind
        consumed: set[str] = set()
        out: dict[str, LogicalTensor] = {}
        for name, info in stored.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight_packed" and fmt in FP4_FORMATS.values():
                parts = {p: stored[f"{module}.{p}"] for p in FP4_PARTS if f"{module}.{p}" in stored}
                for p in ("weight_scale", *(("weight_global_scale",) if fmt == "ct-nvfp4" else ())):
                    if p not in parts:
                        raise QuantizeError(
                            f"{info.path.name}: {name} has no {module}.{p} in any shard; the checkpoint is incomplete"
                        )
                shape = (info.shape[0], 2 * info.shape[1])  # two codes a byte
                out[f"{module}.weight"] = LogicalTensor(f"{module}.weight", shape, fmt, parts)
                consumed.update(p.name for p in parts.values())
            elif leaf == "weight_packed":
                parts = {p: stored[f"{module}.{p}"] for p in PACKED_PARTS if f"{module}.{p}" in stored}
                for p in ("weight_scale", "weight_shape"):
                    if p not in parts:
                        raise QuantizeError(
                            f"{info.path.name}: {name} has no {module}.{p} in any shard; the checkpoint is incomplete"
                        )
                ws = parts["weight_shape"]
                if ws.shape != (2,) or ws.dtype not in ("I64", "I32"):
                    raise QuantizeError(f"{ws.path.name}: {ws.name} is {ws.dtype} {list(ws.shape)}, expected the two "
                                        "integers [out, in]; the checkpoint is inconsistent")
                shape = tuple(int(v) for v in read_tensor(ws).tolist())
                out[f"{module}.weight"] = LogicalTensor(f"{module}.weight", shape, "ct-int4", parts)
                consumed.update(p.name for p in parts.values())
            elif leaf == "weight" and info.dtype in ("F8_E4M3", "F8_E5M2"):
                scale_leaf = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
                scale = stored.get(f"{module}.{scale_leaf}")
                if scale is None:
                    raise QuantizeError(
                        f"{info.path.name}: FP8 weight {name} has no {module}.{scale_leaf} in any shard; "
                        "the checkpoint is incomplete, download it again"
                    )
                encoding = "fp8-block" if scale_leaf == "weight_scale_inv" else "ct-fp8"
                out[name] = LogicalTensor(name, info.shape, encoding, {"tensor": info, "scale": scale})
                consumed.update((name, scale.name))
                if f"{module}.input_scale" in stored:
                    consumed.add(f"{module}.input_scale")  # static activation scales do not survive re-quantization
        for name, info in stored.items():
            if name in consumed or name in out:
                continue
            leaf = name.rpartition(".")[2]
            if leaf in ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point", "input_scale",
                        "weight_global_scale", "input_global_scale"):
                raise QuantizeError(f"{info.path.name}: {name} has no weight it belongs to; the checkpoint is inconsistent")
            out[name] = LogicalTensor(name, info.shape, "float", {"tensor": info})
        for t in out.values():
            if t.encoding != "float":
                _check_parts(t, self.format)
        if fmt != "float" and not any(t.encoding == fmt for t in out.values()):
            raise QuantizeError(f"config.json: quantization_config says the weights are {fmt}, but no tensor is stored "
                                "that way; the config contradicts the weights")
        return dict(sorted(out.items(), key=lambda kv: (self.shards.index(kv[1].main.path), kv[1].main.start)))

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)

    def read_parts(self, t: LogicalTensor) -> dict[str, torch.Tensor]:
        return {k: read_tensor(v) for k, v in t.parts.items()}

    def decode(self, t: LogicalTensor, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               phases=None, check: bool = True) -> torch.Tensor:
        """The tensor as a float (for quantized encodings: dequantized to the model dtype) on `device`;
        `phases` (quantize/phases.Phases) gets the seconds of the read, the decode and the finite check.
        `check=False`: the caller checks finiteness itself, where it is cheaper (engine/shard.py: on the scales
        of a quantized weight, which a NaN or Inf in any of its groups makes non-finite)."""
        timed = timer(phases)
        with timed("read"):
            parts = self.read_parts(t)
        with timed("decode"):
            parts = {k: v.to(device) for k, v in parts.items()}
            w = decode_parts(t, parts, self.format, dtype or self.dtype)
        return self._checked(t, w, timed, check)

    def decode_rows(self, t: LogicalTensor, parts: dict[str, torch.Tensor], rows: tuple[int, int], phases=None,
                    check: bool = True) -> torch.Tensor:
        """Rows [r0, r1) of a tensor of a BANDED encoding, decoded on the CPU from its parts (read_parts), as
        `decode` gives the whole: engine/shard.py converts a large weight a band at a time, so that its float
        temporaries stay in the cache rather than being fresh pages each time."""
        timed = timer(phases)
        with timed("decode"):
            w = decode_parts(t, parts, self.format, self.dtype, rows)
        return self._checked(t, w, timed, check)

    def _checked(self, t: LogicalTensor, w: torch.Tensor, timed, check: bool) -> torch.Tensor:
        if check:
            with timed("finite check"):
                self.check_finite(t, w)
        if self.allow_nonfinite and w.is_floating_point():
            w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)  # what gets quantized keeps finite scales
        return w

    def lattice(self, t: LogicalTensor, group_size: int, device: torch.device | str = "cpu"):
        """A symmetric INT4 source weight's lattice under target groups of `group_size` (quant/lattice.py:
        (step, held) per target group), or None for any other source weight."""
        if t.encoding != "ct-int4" or "weight_zero_point" in t.parts or not group_size:
            return None
        return lattice.steps(read_tensor(t.parts["weight_scale"]).to(device), t.shape[1], group_size)

    def check_finite(self, t: LogicalTensor, w: torch.Tensor) -> None:
        """A NaN or Inf in a source weight would become a NaN scale, or a broken model that loads fine."""
        if self.allow_nonfinite or not w.is_floating_point():
            return
        if _all_finite(w):
            return
        bad = int((~torch.isfinite(w)).sum())
        if bad:
            raise QuantizeError(f"{t.main.path.name}: tensor {t.name} holds {bad} NaN/Inf value(s); the source is "
                                "broken (pass --allow-nonfinite to convert it anyway)")


def _all_finite(w: torch.Tensor) -> bool:
    """No NaN or Inf in w. For the usual float dtypes its min and max say it (a NaN makes both NaN), in one
    reduction with no transient: isfinite's bool mask, a million elements at a time, cost 24x more (2.2 ns an
    element of bf16 on one core, against 0.09)."""
    if w.numel() == 0:
        return True
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        low, high = torch.aminmax(w.reshape(-1))
        return bool(torch.isfinite(low) & torch.isfinite(high))
    return all(bool(torch.isfinite(c).all()) for c in w.reshape(-1).split(1 << 20))


def _check_parts(t: LogicalTensor, fmt: SourceFormat) -> None:
    """Every stored part of a quantized weight against the weight's shape, so that a scale that does not fit fails
    here, naming it, and not as a shape error deep in a decode."""
    def refuse(part: str, want) -> QuantizeError:
        info = t.parts[part]
        return QuantizeError(f"{info.path.name}: {info.name} is {info.dtype} {list(info.shape)} but its weight {t.name} "
                             f"{list(t.shape)} needs {want}; the checkpoint is inconsistent")

    main = t.main
    if len(t.shape) != 2 or not all(1 <= d <= 2**31 for d in t.shape):
        raise QuantizeError(f"{main.path.name}: quantized weight {t.name} has shape {list(t.shape)}; a quantized weight "
                            "is a matrix [out, in]; the checkpoint is inconsistent")
    out_f, in_f = t.shape
    scale = t.parts.get("scale") or t.parts.get("weight_scale")
    if t.encoding == "fp8-block":
        grid = fp8.block_grid(t.shape, fmt.block or (128, 128))
        if scale.shape != grid:
            raise refuse("scale", f"{list(grid)} (blocks of {list(fmt.block or (128, 128))})")
    elif t.encoding == "ct-fp8":
        fits = {(), (1,), (out_f,), (out_f, 1)} | ({fp8.block_grid(t.shape, fmt.block)} if fmt.block else set())
        if scale.shape not in fits:
            raise refuse("scale", "one scale, one per row [out, 1]" + (" or one per block" if fmt.block else ""))
    elif t.encoding == "ct-int4":
        if main.dtype != "I32" or main.shape != (out_f, -(-in_f // 8)):
            raise refuse("weight_packed", f"I32 {[out_f, -(-in_f // 8)]} (eight 4-bit codes an int32)")
        groups = scale.shape[1] if len(scale.shape) == 2 else 0
        if len(scale.shape) != 2 or scale.shape[0] != out_f or not groups or in_f % groups or (
                fmt.group_size and in_f // groups != fmt.group_size):
            g = fmt.group_size
            raise refuse("weight_scale", f"[{out_f}, {in_f // g}] (group_size {g})" if g else f"[{out_f}, in / group_size]")
        zp = t.parts.get("weight_zero_point")
        if zp is not None and zp.shape != (-(-out_f // 8), groups):
            raise refuse("weight_zero_point", [-(-out_f // 8), groups])
    else:  # FP4: two codes a byte, a scale per group of 16 (NVFP4) or 32 (MXFP4), NVFP4's global scale
        g = fmt.group_size or (16 if t.encoding == "ct-nvfp4" else 32)
        if main.dtype != "U8":
            raise refuse("weight_packed", f"U8 {list(main.shape)} (two 4-bit codes a byte)")
        if in_f % g or scale.shape != (out_f, in_f // g):
            raise refuse("weight_scale", f"[{out_f}, {in_f // g}] (a scale per {g})")
        for part in ("weight_global_scale", "input_global_scale"):
            if part in t.parts and math.prod(t.parts[part].shape) != 1:
                raise refuse(part, "one value")


BANDED = ("float", "fp8-block", "ct-fp8")  # the encodings whose rows decode alone (decode_parts' rows=)


def decode_parts(t: LogicalTensor, parts: dict[str, torch.Tensor], fmt: SourceFormat, dtype: torch.dtype,
                 rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The tensor from its read parts; rows=(r0, r1): those rows only (an encoding of BANDED, on the CPU)."""
    if rows is not None:
        assert t.encoding in BANDED and parts["tensor"].device.type == "cpu", f"{t.name} ({t.encoding}) is not banded"
    r0, r1 = rows or (0, t.shape[0] if t.shape else 0)
    if t.encoding == "float":
        return parts["tensor"][r0:r1] if rows else parts["tensor"]
    if t.encoding in ("fp8-block", "ct-fp8"):
        block, grid = _fp8_grid(t, parts["scale"], fmt)
        if parts["tensor"].device.type == "cpu":  # a table lookup: fp8.dequantize_rows
            return fp8.dequantize_rows(parts["tensor"][r0:r1].view(torch.uint8), grid, r0, block, dtype)
        if block[0] == 1 or block == tuple(t.shape):
            return fp8.dequantize_scaled(parts["tensor"], parts["scale"], dtype)
        return fp8.dequantize_block(parts["tensor"], grid, block, dtype)
    if t.encoding in FP4_FORMATS.values():
        return fp4.dequantize(parts, t.encoding == "ct-nvfp4")[0].to(dtype)
    q = pack.unpack_int4(parts["weight_packed"])[:, : t.shape[1]]
    zp = parts.get("weight_zero_point")
    if zp is not None:
        zp = pack.unpack_int4(zp, packed_dim=0)[: t.shape[0]]
    return rtn.dequantize_groups(q, parts["weight_scale"], zp).to(dtype)


def _fp8_grid(t: LogicalTensor, scale: torch.Tensor, fmt: SourceFormat) -> tuple[tuple[int, int], torch.Tensor]:
    """An fp8 weight's scale as a grid of blocks: (block [rows, cols] of one scale, the scales [n_r, n_c]):
    DeepSeek's blocks, compressed-tensors' blocks, one scale a row, or one for the tensor."""
    if t.encoding == "fp8-block":
        return fmt.block or (128, 128), scale
    if fmt.block and tuple(scale.shape) == fp8.block_grid(t.shape, fmt.block):
        return fmt.block, scale
    if scale.numel() == 1:
        return tuple(t.shape), scale.reshape(1, 1)
    return (1, t.shape[1]), scale.reshape(t.shape[0], 1)
