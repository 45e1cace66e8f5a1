"""Integrity of an output folder: every file against the manifest (size, sha256), every tensor against it
(dtype, shape, crc32 of its bytes), the index against the shards, the quantized modules against the
config's scheme, the scales for NaN / Inf / zero; `deep` dequantizes against the source.

Each problem is one `Finding` (file, tensor, what is wrong); a clean folder has none. Files are read once,
front to back, in parallel threads (hashing releases the GIL): the file's sha256 and the crc32 of each tensor
come from the same pass.
"""

import json
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantize.checkpoint import INDEX_NAME
from quantize.errors import QuantizeError
from quantize.safetensors_file import TensorInfo, read_header, read_tensor
from quantize.writer import MANIFEST_NAME

CHUNK = 16 * 2**20
QUANTIZED_SUFFIX = ".weight_packed"
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
FORMATS = ("pack-quantized", "float-quantized", *FP4_FORMATS)


@dataclass(frozen=True)
class Finding:
    file: str
    tensor: str | None
    problem: str

    def line(self) -> str:
        return f"{self.file}: {self.tensor + ': ' if self.tensor else ''}{self.problem}"


@dataclass
class Report:
    folder: str
    findings: list[Finding] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    bytes_hashed: int = 0
    quantized_modules: int = 0
    deep_checked: int = 0

    @property
    def clean(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict:
        return asdict(self) | {"clean": self.clean}


def hash_file(path: Path, tensors: dict[str, TensorInfo], advance: Callable[[int], None] | None = None):
    """(sha256 of the file, {tensor: crc32 of its bytes}) in one front-to-back pass."""
    import hashlib

    sha = hashlib.sha256()
    spans = sorted((t.start, t.end, name) for name, t in tensors.items())
    crcs = {name: 0 for name in tensors}
    pos, k = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            end = pos + len(chunk)
            view = memoryview(chunk)
            while k < len(spans) and spans[k][1] <= pos:
                k += 1  # spans that ended before this chunk
            j = k
            while j < len(spans) and spans[j][0] < end:
                start, stop, name = spans[j]
                lo, hi = max(start, pos), min(stop, end)
                if lo < hi:
                    crcs[name] = zlib.crc32(view[lo - pos : hi - pos], crcs[name])
                j += 1
            pos = end
            if advance:
                advance(len(chunk))
    return sha.hexdigest(), crcs


def tensor_crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().to("cpu").contiguous().view(torch.uint8).numpy())


def verify(folder: Path, source: Path | None = None, deep: bool = False, rehash: bool = True, workers: int = 4,
           progress: Callable[[int, int], None] | None = None, unlisted_ok: frozenset[str] = frozenset()) -> Report:
    """Check `folder`; `rehash=False` trusts the file hashes (convert computed them as it wrote the bytes)."""
    folder = Path(folder)
    report = Report(str(folder))
    find = report.findings.append

    manifest = _json(folder / MANIFEST_NAME, report)
    index = _json(folder / INDEX_NAME, report)
    config = _json(folder / "config.json", report)
    if manifest is None or index is None or config is None:
        return report
    files = manifest.get("files") or {}
    recorded = manifest.get("tensors") or {}
    weight_map = index.get("weight_map") or {}

    # files: present, sizes, nothing extra
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST_NAME, *unlisted_ok}
    for name in sorted(present - set(files)):
        find(Finding(name, None, "not in the manifest"))
    for name in sorted(set(files) - present):
        find(Finding(name, None, "in the manifest but missing"))
    for name in sorted(set(files) & present):
        size = (folder / name).stat().st_size
        if size != files[name].get("size"):
            find(Finding(name, None, f"{size} bytes, the manifest says {files[name].get('size')}"))

    # shards: headers parse, tensors match the index and the manifest
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
            find(Finding(shard, None, "named by the index but missing"))
            continue
        try:
            headers[shard] = read_header(folder / shard)
        except QuantizeError as e:
            find(Finding(shard, None, f"unreadable header ({str(e).split(': ', 1)[-1]})"))
    named = set(weight_map.values())
    for shard in sorted(p.name for p in folder.glob("*.safetensors") if p.name not in named):
        find(Finding(shard, None, "a shard the index does not name"))
    where = {t: s for s, h in headers.items() for t in h}
    for t, s in sorted(weight_map.items()):
        if s in headers and t not in headers[s]:
            find(Finding(s, t, "named by the index but not in the shard"))
    for t, s in sorted(where.items()):
        if weight_map.get(t) != s:
            find(Finding(s, t, f"the index says {weight_map[t]}" if t in weight_map else "in the shard but not in the index"))
    for t, rec in sorted(recorded.items()):
        info = headers.get(rec.get("file"), {}).get(t)
        if info is None:
            if rec.get("file") in headers:
                find(Finding(rec["file"], t, "in the manifest but not in the shard"))
            continue
        if info.dtype != rec.get("dtype") or list(info.shape) != list(rec.get("shape", [])):
            said = f"{rec.get('dtype')} {rec.get('shape')}"
            find(Finding(rec["file"], t, f"{info.dtype} {list(info.shape)}, the manifest says {said}"))
    report.tensors = sum(len(h) for h in headers.values())

    # bytes: sha256 per file, crc32 per tensor
    if rehash:
        total = sum((folder / n).stat().st_size for n in set(files) & present)
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            if progress:
                progress(done[0], total)

        def check(name: str) -> list[Finding]:
            out = []
            sha, crcs = hash_file(folder / name, headers.get(name, {}), advance)
            if sha != files[name].get("sha256"):
                out.append(Finding(name, None, "sha256 differs from the manifest (the file changed or is corrupt)"))
            for t, crc in crcs.items():
                want = recorded.get(t, {}).get("crc32")
                if want is not None and crc != want:
                    out.append(Finding(name, t, "its bytes differ from the manifest's crc32"))
            return out

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for found in pool.map(check, sorted(set(files) & present)):
                report.findings.extend(found)
        report.bytes_hashed = done[0]
    report.files = len(present)

    _check_quantized(headers, config, report)
    if deep:
        _deep(headers, source, manifest, report)
    return report


def _json(path: Path, report: Report) -> dict | None:
    try:
        doc = json.loads(path.read_text())
        if isinstance(doc, dict):
            return doc
        report.findings.append(Finding(path.name, None, "not a JSON object"))
    except FileNotFoundError:
        report.findings.append(Finding(path.name, None, "missing"))
    except (OSError, ValueError) as e:
        report.findings.append(Finding(path.name, None, f"unreadable ({e})"))
    return None


def _schemes(config: dict) -> list[dict]:
    qc = config.get("quantization_config") or {}
    return [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]


def _check_quantized(headers: dict[str, dict[str, TensorInfo]], config: dict, report: Report) -> None:
    """Every packed module has its scale and shape, sized as the scheme says, and finite nonzero scales."""
    find = report.findings.append
    qc = config.get("quantization_config") or {}
    if qc.get("format") not in FORMATS or not _schemes(config):
        find(Finding("config.json", None, f"no compressed-tensors quantization_config of a format in {FORMATS}"))
        return
    infos = {t: info for h in headers.values() for t, info in h.items()}
    if qc.get("format") == "float-quantized":
        _check_fp8_blocks(infos, config, report)
        return
    if qc.get("format") in FP4_FORMATS:
        acts = [g.get("input_activations") for g in (qc.get("config_groups") or {}).values()]
        _check_fp4(infos, qc["format"], any(a and a.get("type") == "float" and a.get("num_bits") == 4 for a in acts),
                   report)
        return
    groups = {w.get("group_size") for w in _schemes(config)}
    symmetric = {bool(w.get("symmetric", True)) for w in _schemes(config)}
    for name, packed in sorted(infos.items()):
        if not name.endswith(QUANTIZED_SUFFIX):
            continue
        report.quantized_modules += 1
        module = name[: -len(QUANTIZED_SUFFIX)]
        file = packed.path.name
        scale, shape, zp = (infos.get(f"{module}.{s}") for s in ("weight_scale", "weight_shape", "weight_zero_point"))
        if f"{module}.weight" in infos:
            find(Finding(file, module, "has both a float weight and a packed one"))
        if scale is None or shape is None:
            find(Finding(file, module, f"packed weight without its {'weight_scale' if scale is None else 'weight_shape'}"))
            continue
        if packed.dtype != "I32" or shape.dtype != "I64" or shape.shape != (2,):
            find(Finding(file, module, f"weight_packed {packed.dtype} / weight_shape {shape.dtype} {list(shape.shape)}"))
            continue
        out_f, in_f = (int(v) for v in read_tensor(shape))
        if packed.shape != (out_f, -(-in_f // 8)):
            find(Finding(file, module, f"weight_packed {list(packed.shape)} does not hold [{out_f}, {in_f}] int4"))
        g = next((g for g in groups if g and in_f % g == 0 and scale.shape == (out_f, in_f // g)), None)
        if g is None:
            find(Finding(file, module, f"weight_scale {list(scale.shape)} fits no group size of the scheme "
                         f"({', '.join(map(str, sorted(g for g in groups if g)))}) for [{out_f}, {in_f}]"))
            continue
        if (zp is None) != (symmetric == {True}):
            what = "missing for an asymmetric scheme" if zp is None else "present for a symmetric scheme"
            find(Finding(file, module, f"zero point {what}"))
        _check_scale(scale, module, report)


def _check_fp4(infos: dict[str, TensorInfo], fmt: str, w4a4: bool, report: Report) -> None:
    """nvfp4- / mxfp4-pack-quantized: every uint8 weight_packed [out, in/2] has its weight_scale [out, in/group]
    (e4m3 for NVFP4, e8m0 bytes for MXFP4) and, for NVFP4, a finite positive float32 weight_global_scale [1]; with
    NVFP4 activations (w4a4) an input_global_scale of the same kind too (vLLM's CompressedTensorsW4A4Fp4
    registers it, and the MoE's w13/w2_input_global_scale)."""
    find = report.findings.append
    nv = fmt == "nvfp4-pack-quantized"
    group, scale_dtype = (16, "F8_E4M3") if nv else (32, "U8")
    for name, packed in sorted(infos.items()):
        if not name.endswith(QUANTIZED_SUFFIX):
            continue
        report.quantized_modules += 1
        module, file = name[: -len(QUANTIZED_SUFFIX)], packed.path.name
        scale, gscale = infos.get(f"{module}.weight_scale"), infos.get(f"{module}.weight_global_scale")
        if scale is None or (nv and gscale is None):
            find(Finding(file, module, f"FP4 weight without its {'weight_scale' if scale is None else 'weight_global_scale'}"))
            continue
        out_f, in_f = packed.shape[0], 2 * packed.shape[-1]
        if packed.dtype != "U8" or scale.dtype != scale_dtype or scale.shape != (out_f, in_f // group):
            find(Finding(file, module, f"weight_packed {packed.dtype} {list(packed.shape)} / weight_scale "
                         f"{scale.dtype} {list(scale.shape)} are not {fmt} (uint8 [out, in/2], {scale_dtype} "
                         f"[out, in/{group}])"))
            continue
        if nv:
            bad = False
            for which in ("weight_global_scale", "input_global_scale") if w4a4 else ("weight_global_scale",):
                info = infos.get(f"{module}.{which}")
                g = None if info is None else read_tensor(info).float()
                if g is None or info.dtype != "F32" or g.shape != (1,) or not bool(torch.isfinite(g).all() and (g > 0).all()):
                    what = "missing" if g is None else f"{info.dtype} {list(g.shape)}, not one finite positive float32"
                    find(Finding(file, module, f"{which} {what}"))
                    bad = True
            if bad:
                continue
            _check_scale(scale, module, report)


def _check_scale(scale: TensorInfo, module: str, report: Report) -> None:
    s = read_tensor(scale).float()
    bad = [what for what, m in (("NaN", s.isnan()), ("Inf", s.isinf()), ("zero", s == 0)) if bool(m.any())]
    if bad:
        report.findings.append(Finding(scale.path.name, f"{module}.weight_scale", f"{' and '.join(bad)} scale(s)"))


def _check_fp8_blocks(infos: dict[str, TensorInfo], config: dict, report: Report) -> None:
    """float-quantized FP8 blocks: every e4m3 weight has its weight_scale, one per block of the scheme's
    block_structure (edge blocks partial), with finite nonzero scales; nothing is also packed."""
    from quantize.quant import fp8

    find = report.findings.append
    blocks = {tuple(w["block_structure"]) for w in _schemes(config) if w.get("block_structure")}
    if len(blocks) != 1:
        find(Finding("config.json", None, f"float-quantized scheme without one block_structure ({sorted(blocks)})"))
        return
    block = blocks.pop()
    for name, w in sorted(infos.items()):
        if name.endswith(QUANTIZED_SUFFIX):
            find(Finding(w.path.name, name, "an INT4 packed weight in a float-quantized (FP8) checkpoint"))
        if not name.endswith(".weight") or w.dtype not in ("F8_E4M3", "F8_E5M2"):
            continue
        report.quantized_modules += 1
        module = name[: -len(".weight")]
        scale = infos.get(f"{module}.weight_scale")
        if scale is None:
            find(Finding(w.path.name, module, "FP8 weight without its weight_scale"))
            continue
        if len(w.shape) != 2 or scale.shape != fp8.block_grid(w.shape, block):
            find(Finding(w.path.name, module, f"weight_scale {list(scale.shape)} is not one per {block[0]}x{block[1]} "
                         f"block of weight {list(w.shape)}"))
            continue
        _check_scale(scale, module, report)


def _deep(headers: dict[str, dict[str, TensorInfo]], source: Path | None, manifest: dict, report: Report) -> None:
    """Dequantize each packed weight and compare it with the source's: RTN within half a scale step per element,
    GPTQ (whose codes may move by more than a step) within a relative error of 0.5 per tensor. AWQ outputs
    are smoothed (columns rescaled), so they are compared after the least-squares column scale is fitted."""
    from quantize.checkpoint import Checkpoint
    from quantize.quant import pack, rtn

    find = report.findings.append
    if source is None:
        find(Finding("-", None, "--deep needs --source SRC to compare against"))
        return
    try:
        ckpt = Checkpoint(Path(source), allow_nonfinite=True)  # a NaN in the source shows up as a finding
    except QuantizeError as e:
        find(Finding(str(source), None, f"cannot read the source ({e})"))
        return
    method = (manifest.get("recipe") or {}).get("method", "rtn")
    infos = {t: info for h in headers.values() for t, info in h.items()}
    scheme = (manifest.get("recipe") or {}).get("scheme") or {}
    block = scheme.get("block_structure")
    if block:
        _deep_fp8(infos, ckpt, tuple(block), report)
        return
    if scheme.get("type") == "float" and scheme.get("num_bits") == 4:
        _deep_fp4(infos, ckpt, scheme.get("strategy") == "tensor_group", method, report)
        return
    for name in sorted(t for t in infos if t.endswith(QUANTIZED_SUFFIX)):
        module = name[: -len(QUANTIZED_SUFFIX)]
        src_name = f"{module}.weight"
        if src_name not in ckpt.tensors:
            find(Finding(infos[name].path.name, module, "has no weight in the source"))
            continue
        w = ckpt.decode(ckpt.tensors[src_name], torch.device("cpu")).float()
        codes = pack.unpack_int4(read_tensor(infos[name]))[:, : w.shape[1]]
        scale = read_tensor(infos[f"{module}.weight_scale"])
        zp_info = infos.get(f"{module}.weight_zero_point")
        zp = pack.unpack_int4(read_tensor(zp_info), packed_dim=0)[: w.shape[0]] if zp_info else None
        deq = rtn.dequantize_groups(codes, scale, zp).float()
        report.deep_checked += 1
        if not torch.isfinite(deq).all():
            find(Finding(infos[name].path.name, module, "dequantizes to NaN or Inf"))
            continue
        if method == "rtn":
            step = scale.float().repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
            excess = (w - deq).abs() - (0.5 * step * (1 + 2**-7) + w.abs() * 2**-7)
            # a scale chosen by calibration (or any below min/max) clips: a code at the grid's edge may stand
            # for a weight further out, on its own side
            q = 2 ** (int(scheme.get("num_bits") or 4) - 1)
            edge = (codes == -q) | (codes == q - 1) if zp is None else torch.zeros_like(w, dtype=torch.bool)
            excess = torch.where(edge & ((w - deq) * deq > 0), 0.0, excess)
            if bool((excess > 0).any()):
                find(Finding(infos[name].path.name, module, f"{int((excess > 0).sum())} elements further than half a "
                             "scale step from the source"))
            continue
        if method == "awq":
            w = w * ((deq * w).sum(0) / (w * w).sum(0).clamp(min=1e-30))
        rel = float((w - deq).norm() / w.norm().clamp(min=1e-30))
        if rel > 0.5:
            find(Finding(infos[name].path.name, module, f"relative error {rel:.2f} against the source (> 0.5)"))


def _deep_fp8(infos: dict[str, TensorInfo], ckpt, block: tuple[int, int], report: Report) -> None:
    """Each FP8 block weight, dequantized, within e4m3's rounding of the source: 2^-4 relative (3 mantissa bits)
    plus the model-dtype division and scale (2^-7), and one subnormal step (2^-9 of the block scale)."""
    from quantize.quant import fp8

    find = report.findings.append
    for name in sorted(t for t, i in infos.items() if i.dtype == "F8_E4M3" and f"{t}_scale" in infos):
        file = infos[name].path.name
        if name not in ckpt.tensors:
            find(Finding(file, name, "has no weight in the source"))
            continue
        w = ckpt.decode(ckpt.tensors[name], torch.device("cpu")).float()
        scale = read_tensor(infos[f"{name}_scale"]).float()
        deq = fp8.dequantize_block(read_tensor(infos[name]), scale, block, torch.float32)
        report.deep_checked += 1
        if not torch.isfinite(deq).all():
            find(Finding(file, name, "dequantizes to NaN or Inf"))
            continue
        step = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
        excess = (w - deq).abs() - (w.abs() * (2**-4 + 2**-7) + step * 2**-9)
        if bool((excess > 0).any()):
            find(Finding(file, name, f"{int((excess > 0).sum())} elements further from the source than FP8 rounding"))


def _deep_fp4(infos: dict[str, TensorInfo], ckpt, nvfp4: bool, method: str, report: Report) -> None:
    """Each FP4 weight, dequantized by compressed-tensors' own compressor, within e2m1's rounding of the source:
    half the widest gap of e2m1 (1, between 4 and 6) of its group's effective scale, plus the scale's own rounding
    (e4m3: 2^-4 relative, so up to 2^-4 of |w| where the clamp at 6 bites; e8m0 rounds the scale up, never down).
    GPTQ's codes may move further: within a relative error of 0.5 per tensor, as for INT4."""
    from quantize.quant import fp4

    find = report.findings.append
    for name in sorted(t for t in infos if t.endswith(QUANTIZED_SUFFIX)):
        module = name[: -len(QUANTIZED_SUFFIX)]
        file = infos[name].path.name
        if f"{module}.weight" not in ckpt.tensors:
            find(Finding(file, module, "has no weight in the source"))
            continue
        w = ckpt.decode(ckpt.tensors[f"{module}.weight"], torch.device("cpu")).float()
        parts = {k: read_tensor(infos[f"{module}.{k}"]) for k in ("weight_packed", "weight_scale", "weight_global_scale")
                 if f"{module}.{k}" in infos}
        deq, step = fp4.dequantize(parts, nvfp4)
        report.deep_checked += 1
        if not torch.isfinite(deq).all():
            find(Finding(file, module, "dequantizes to NaN or Inf"))
            continue
        if method != "rtn":
            rel = float((w - deq).norm() / w.norm().clamp(min=1e-30))
            if rel > 0.5:
                find(Finding(file, module, f"relative error {rel:.2f} against the source (> 0.5)"))
            continue
        step = step.repeat_interleave(w.shape[1] // step.shape[1], dim=1)
        excess = (w - deq).abs() - (step * (1 + 2**-3) + w.abs() * 2**-4 + 2**-20)
        edge = deq.abs() >= 6 * step * (1 - 2**-10)  # the largest e2m1 value: a calibrated scale clips there
        excess = torch.where(edge & ((w - deq) * deq > 0), 0.0, excess)
        if bool((excess > 0).any()):
            find(Finding(file, module, f"{int((excess > 0).sum())} elements further from the source than FP4 rounding"))
