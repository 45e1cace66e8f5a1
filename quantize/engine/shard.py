"""One output shard written from the plan: each tensor produced (decoded, quantized, packed, or taken from a
calibrated engine), in order, and streamed into the file; both sides of a prefill pair from one decode.

The stream engine (RTN) and each rank's writers (engine/writers.py) write their shards through here.
"""

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quantize.engine.ordered import in_order
from quantize.phases import Phases, timer
from quantize.quant import codec, fp4, fp8
from quantize.safetensors_file import read_tensor
from quantize.tensor_plan import Entry, Plan, band_rows
from quantize.writer import ShardWriter, crc32


def needs_decode(e: Entry) -> bool:
    return e.action in ("quantize", "dequantize")


def produce(plan: Plan, e: Entry, device: torch.device, w: torch.Tensor | None = None,
            phases: Phases | None = None) -> list[torch.Tensor]:
    """The output tensors of one plan entry, in the order of `e.outputs`; `w`, when given, is the source
    tensor already decoded (by the other plan of a pair: one read for both outputs). `phases` gets the seconds
    of its read, decode, finite check and quantize (quantize/phases.py)."""
    t = e.tensor
    timed = timer(phases)
    if e.action == "kv_scale":
        raise AssertionError(f"{t.name} is measured by the calibrated engine, which did not produce it")
    if e.action == "keep":
        with timed("read"):
            kept = read_tensor(t.main)
        with timed("finite check"):
            plan.ckpt.check_finite(t, kept)
        return [kept]
    if e.action == "passthrough":
        with timed("read"):
            return list(plan.ckpt.read_parts(t).values())
    # a weight to quantize is checked for NaN / Inf on its scales (a group holding one has a non-finite scale), not
    # element by element: that pass cost about as much as the quantization itself. MXFP4's power-of-two scales
    # lose a NaN, so its weights keep the element check.
    scales_tell = e.action == "quantize" and plan.recipe.scheme.fp4 != "mxfp4" and t.name not in plan.fused
    if w is None and (rows := band_rows(plan, e, device)):
        return _banded(plan, e, rows, scales_tell, phases)
    if w is None:
        w = plan.ckpt.decode(t, device, phases=phases, check=not scales_tell)
    w = w.to(plan.ckpt.dtype)
    if e.action == "dequantize":
        return [w]
    with timed("quantize"):
        out, scale = _quantized(plan, e, device, w)
    if scales_tell and scale is not None and not plan.ckpt.allow_nonfinite and not bool(torch.isfinite(scale).all()):
        plan.ckpt.check_finite(t, w)  # raises, naming the tensor and counting its NaN / Inf values
    return out


def _banded(plan: Plan, e: Entry, band: int, scales_tell: bool, phases: Phases | None) -> list[torch.Tensor]:
    """produce's outputs made a band of rows at a time: the same bytes as whole (every number of these schemes is
    made within a row, or within a band's whole blocks), the per-row outputs of the bands concatenated."""
    t, ckpt, timed = e.tensor, plan.ckpt, timer(phases)
    rows = t.shape[0]
    with timed("read"):
        parts = ckpt.read_parts(t)
    spans = [(r0, min(rows, r0 + band)) for r0 in range(0, rows, band)]
    if e.action == "dequantize":
        out = torch.empty(t.shape, dtype=ckpt.dtype)
        for r in spans:
            w = ckpt.decode_rows(t, parts, r, phases)
            with timed("decode"):
                out[r[0]:r[1]] = w
        return [out]
    s, gscale = plan.recipe.scheme, None
    ws = None
    if s.fp4 == "nvfp4":  # the global scale is the whole tensor's: its bands are decoded (and kept) first
        ws = [ckpt.decode_rows(t, parts, r, phases, check=not scales_tell).to(ckpt.dtype) for r in spans]
        with timed("quantize"):
            gscale = fp4.global_scale(functools.reduce(torch.maximum, map(fp4.absmax, ws)))
    made = []
    for k, r in enumerate(spans):
        w = ws[k] if ws is not None else ckpt.decode_rows(t, parts, r, phases, check=not scales_tell).to(ckpt.dtype)
        with timed("quantize"):
            out, scale = _quantized(plan, e, torch.device("cpu"), w, tuple(t.shape), gscale)
        if scales_tell and not ckpt.allow_nonfinite and not bool(torch.isfinite(scale).all()):
            ckpt.check_finite(t, ckpt.decode(t))  # raises, naming the tensor and counting its NaN / Inf values
        made.append(out)
        if ws is not None:
            ws[k] = None
    # a band's per-row outputs have fewer rows than the whole's; the others (weight_shape, NVFP4's global scale)
    # are the whole's already
    return [torch.cat(ts) if tuple(ts[0].shape) != spec.shape else ts[0]
            for spec, ts in zip(e.outputs, zip(*made, strict=True), strict=True)]


def _quantized(plan: Plan, e: Entry, device: torch.device, w: torch.Tensor, shape: tuple[int, int] | None = None,
               gscale: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The outputs of a weight to quantize and the float scales they were made with; `shape` and `gscale`, for a
    band of its rows (_banded): the whole weight's shape and NVFP4 global scale."""
    t = e.tensor
    s = plan.recipe.scheme
    if s.fp8_block:
        block = tuple(s.block_structure)
        scale = fp8.block_scale(w, block)
        return [fp8.quantize_with_block_scale(w, scale, block), scale], scale
    if s.w4a4:  # every NVFP4 W4A4 target is a GPTQ target, whose input_global_scale only calibration measures
        raise AssertionError(f"{t.name} needs calibrated activations (NVFP4 W4A4) but reached round to nearest")
    if s.fp4 == "nvfp4" and t.name in plan.fused:
        return _fused_outputs(plan, e, device, w), None  # its members were decoded with the element check
    return _rtn(s, w, gscale, held=None if s.fp4 else plan.ckpt.lattice(t, s.group_size, w.device), shape=shape)


def rtn_outputs(scheme, w: torch.Tensor, gscale: torch.Tensor | None = None, held=None) -> list[torch.Tensor]:
    """Round-to-nearest of w [out, in] in a 4-bit scheme, as the tensors that replace it; held: an INT4
    source's lattice (quant/lattice.py), kept where the target's groups hold it."""
    return _rtn(scheme, w, gscale, held)[0]


def _rtn(scheme, w: torch.Tensor, gscale: torch.Tensor | None = None, held=None, shape=None):
    """rtn_outputs, and the float steps they were made with; `shape`: the whole weight's, for a band of its rows."""
    p = codec.params(scheme, w, gscale, held)
    return codec.outputs(scheme, codec.rtn_codes(scheme, w, p), p, shape or tuple(w.shape)), p.step


class _Stash:
    """The outputs of fused-set members quantized with the first member asked for, until they are asked for."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ready: dict[str, list[torch.Tensor]] = {}


stashes: dict[int, _Stash] = {}  # by id of the plan, for one run (dropped by stream.run at its end)
stashes_lock = threading.Lock()


def _fused_outputs(plan: Plan, e: Entry, device: torch.device, w: torch.Tensor) -> list[torch.Tensor]:
    """NVFP4 outputs of a weight an engine fuses with others (plan.fused): the first member asked for decodes the
    others (each weight is still read once) and quantizes the whole set under one global scale, from the largest
    magnitude of any member, as model_free_ptq does for the sets it knows; the others' outputs wait here."""
    with stashes_lock:
        stash = stashes.setdefault(id(plan), _Stash())
    with stash.lock:
        if e.tensor.name not in stash.ready:
            members = plan.fused[e.tensor.name]
            ws = {m: w if m == e.tensor.name else plan.ckpt.decode(plan.ckpt.tensors[m], device).to(plan.ckpt.dtype)
                  for m in members}
            shared = fp4.set_global_scale(ws.values())
            for m, x in ws.items():
                stash.ready[m] = rtn_outputs(plan.recipe.scheme, x, shared)
        return stash.ready.pop(e.tensor.name)


def _waited(results, phases: Phases):
    """The results as they come, the writer's wait for each one timed ("writer waited": the workers are behind)."""
    it = iter(results)
    while True:
        t = time.perf_counter()
        try:
            made = next(it)
        except StopIteration:
            return
        phases.add("writer waited", time.perf_counter() - t)
        yield made


def write_shard(
    plan: Plan, index: int, path: Path, device: torch.device, advance: Callable[[int], None],
    pool: ThreadPoolExecutor | None = None, depth: int = 1, calibrated: Callable | None = None,
) -> tuple[int, str, dict]:
    """Write output shard `index`; with a pool, tensors are produced `depth` at a time while this thread writes.
    `calibrated(entry)` gives the tensors of entries a calibrated engine quantized (None for the others)."""
    return write_shard_pair(plan, None, index, (path, None), device, advance, pool, depth, calibrated)[0]


def write_shard_pair(
    plan: Plan, prefill: Plan | None, index: int, paths: tuple[Path | None, Path | None], device: torch.device,
    advance: Callable[[int], None], pool: ThreadPoolExecutor | None = None, depth: int = 1,
    calibrated: Callable | None = None, phases: Phases | None = None,
) -> tuple[tuple | None, tuple | None]:
    """Shard `index` of both outputs of a pair (tensor_plan.pair: the same source tensors in both), each source
    tensor read and decoded once for the two; a path of None is a side not written (already finished on a
    resume, or no prefill plan). Returns (size, sha256, tensors) per side, None for a side not written."""
    twins = {e.tensor.name: e for e in prefill.shards[index]} if prefill is not None and paths[1] else {}
    entries = plan.shards[index]
    writers = [ShardWriter(path, [s for e in p.shards[index] for s in e.outputs], phases=phases) if path else None
               for p, path in ((plan, paths[0]), (prefill, paths[1]))]

    def make(e: Entry) -> tuple[list | None, list | None]:
        twin = twins.get(e.tensor.name)
        main = (calibrated(e) if calibrated is not None else None) if paths[0] else None
        need_main = paths[0] is not None and main is None
        w = None
        if twin is not None and needs_decode(twin) and (not need_main or needs_decode(e)):
            w = plan.ckpt.decode(e.tensor, device, phases=phases)
        if need_main:
            main = produce(plan, e, device, w if needs_decode(e) else None, phases)
        second = produce(prefill, twin, device, w, phases) if twin is not None else None
        # each tensor on the CPU with its crc32, here in the worker: the writer thread only writes
        return tuple(None if made is None else [crc32(x, phases) for x in made] for made in (main, second))

    results = in_order(pool, make, entries, depth) if pool is not None else (make(e) for e in entries)
    results = _waited(results, phases) if phases is not None and pool is not None else results
    try:
        for e, made in zip(entries, results, strict=True):
            for writer, got, entry in zip(writers, made, (e, twins.get(e.tensor.name)), strict=True):
                if writer is not None and got is not None:
                    for spec, (tensor, crc) in zip(entry.outputs, got, strict=True):
                        writer.write(spec.name, tensor, crc)
            advance(e.tensor.stored_bytes)
        return tuple((*w.close(), w.tensors) if w is not None else None for w in writers)
    except BaseException:
        for w in writers:
            if w is not None:
                w.abort()
        raise
