"""A 4-bit scheme's weights as codes under fixed per-group steps, and the codes as the tensors compressed-tensors
stores: where round-to-nearest (engine/stream.py), GPTQ of the dense Linears (engine/layerwise.py) and of the
routed experts (engine/experts.py) meet the formats, INT4 (pack-quantized) and FP4 (nvfp4- and mxfp4-pack-quantized).

The codes are int8 [out, in]: INT4's integers, or FP4's 4-bit e2m1 codes (fp4.VALUES), so that GPTQ's column loop
and the engines' buffers are one shape for both. The steps are fixed from the original weight's groups before any
GPTQ update, as llm-compressor's observers fix them (for NVFP4, under the global scale of the weight's fused set).
"""

from dataclasses import dataclass

import torch

from quantize.quant import fp4, pack, rtn, scales


@dataclass
class Params:
    step: torch.Tensor  # [out, groups]: a code's value times its group's step is the dequantized weight
    zero_point: torch.Tensor | None  # INT4 asymmetric: int8 [out, groups]
    stored: tuple[torch.Tensor, ...]  # the scale tensors written after weight_packed, in the plan's order


def params(scheme, w: torch.Tensor, gscale: torch.Tensor | None = None, held=None) -> Params:
    """The steps of w [out, in] (in the model's dtype); gscale: NVFP4's global scale of w's fused set; held: an
    INT4 source's lattice (quant/lattice.py), whose steps replace min/max's where the target groups hold it."""
    if scheme.fp4 == "nvfp4":
        gscale = fp4.global_scale(fp4.absmax(w)) if gscale is None else gscale
        scale = fp4.nvfp4_scale(w, gscale)
        return Params(scale / gscale, None, (scale.to(torch.float8_e4m3fn), gscale))
    if scheme.fp4 == "mxfp4":
        scale = fp4.mxfp4_scale(w)
        return Params(scale.float(), None, (fp4.mx_bytes(scale),))
    scale, zero_point = rtn.group_qparams(w, scheme.group_size, scheme.num_bits, scheme.symmetric)
    if held is not None and scheme.symmetric:
        scale = keep_lattice(scale, held)
    return Params(scale, zero_point, (scale,))


def keep_lattice(scale: torch.Tensor, held) -> torch.Tensor:
    """scale [out, groups] with the source lattice's steps where the target groups hold it (and the step is
    exact in scale's dtype, so that round to nearest gives back the source's codes)."""
    step, mask = held
    same = step.to(scale.dtype)
    return torch.where(mask & (same.to(step.dtype) == step), same, scale)


def searched(scheme, ws: list[torch.Tensor], gscales: list[torch.Tensor | None], weights: torch.Tensor,
             lattices: list | None = None) -> list[Params]:
    """The Params of each of the same-shape weights ws [out, in], their steps chosen by the input statistics
    `weights` (quant/scales.py: H's diagonal blocks [E, groups, group, group] or E[x^2] [E, groups, group])
    rather than by min/max. Asymmetric INT4 keeps min/max (its zero point moves with the scale). lattices: each
    weight's INT4 source lattice or None (quant/lattice.py): the groups that hold it keep its step, unsearched,
    and the others' candidates include the largest source step inside them."""
    lattices = lattices or [None] * len(ws)
    base = [params(scheme, w, g, h) for w, g, h in zip(ws, gscales, lattices, strict=True)]
    if (not scheme.fp4 and not scheme.symmetric) or ws[0].shape[-1] != base[0].step.shape[-1] * scheme.group_size:
        return base  # a last partial group (in not a multiple of the group size) keeps min/max too
    W = torch.stack(ws)
    if scheme.fp4 == "nvfp4":
        g = torch.stack([b.stored[1] for b in base]).reshape(-1)
        chosen = scales.nvfp4(W, torch.stack([b.stored[0].to(W.dtype) for b in base]), g, weights)
        return [Params(c / gs, None, (c.to(torch.float8_e4m3fn), gs)) for c, gs in zip(chosen, g.split(1), strict=True)]
    if scheme.fp4 == "mxfp4":
        chosen = scales.mxfp4(W, torch.stack([b.step.to(W.dtype) for b in base]), weights)
        return [Params(c.float(), None, (fp4.mx_bytes(c),)) for c in chosen]
    extra = None
    if any(h is not None for h in lattices):  # a weight without a lattice offers its min/max step again
        extra = torch.stack([b.step if h is None else h[0].to(b.step.dtype) for b, h in zip(base, lattices, strict=True)])
    chosen = scales.int4(W, torch.stack([b.step for b in base]), weights, scheme.num_bits, extra)
    chosen = [c if h is None else keep_lattice(c, h) for c, h in zip(chosen, lattices, strict=True)]
    return [Params(c, None, (c,)) for c in chosen]


def rtn_codes(scheme, w: torch.Tensor, p: Params) -> torch.Tensor:
    """Round-to-nearest codes of w under p."""
    if scheme.fp4:
        return fp4.codes(w, p.step).to(torch.int8)
    return rtn.quantize_groups(w, p.step, p.zero_point, scheme.num_bits)


def dequantize(scheme, codes: torch.Tensor, p: Params) -> torch.Tensor:
    """The weight the codes stand for: INT4 in the scale's dtype, FP4 in float32."""
    if scheme.fp4:
        values = fp4.VALUES.to(codes.device)[codes.long()]
        return values * p.step.repeat_interleave(codes.shape[1] // p.step.shape[1], dim=1)
    return rtn.dequantize_groups(codes, p.step, p.zero_point)


def outputs(scheme, codes: torch.Tensor, p: Params, shape: tuple[int, int],
            input_amax: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The tensors that replace the weight, in tensor_plan.quantized_specs' order. input_amax: NVFP4 W4A4's
    largest calibration input magnitude (in the model's dtype, as llm-compressor's observer sees the inputs),
    whose global scale is input_global_scale."""
    if scheme.w4a4:
        assert input_amax is not None, "NVFP4 activations need the calibration inputs' amax"
        return [fp4.pack(codes.to(torch.uint8)), *p.stored, fp4.global_scale(input_amax)]
    if scheme.fp4:
        return [fp4.pack(codes.to(torch.uint8)), *p.stored]
    out = [pack.pack_int4(codes), p.step, torch.tensor(shape, dtype=torch.int64)]
    if p.zero_point is not None:
        out.append(pack.pack_int4(p.zero_point, packed_dim=0))
    return out


def from_outputs(scheme, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The dequantized weight of a Linear's stored tensors (outputs' list), on their device."""
    if scheme.fp4:
        names = ("weight_packed", "weight_scale", "weight_global_scale")
        return fp4.dequantize(dict(zip(names, tensors, strict=False)), scheme.fp4 == "nvfp4")[0]
    packed, scale = tensors[0], tensors[1]
    codes = pack.unpack_int4(packed)[:, :scale.shape[1] * scheme.group_size]
    zp = None if len(tensors) < 4 else pack.unpack_int4(tensors[3], packed_dim=0)[:codes.shape[0]]
    return rtn.dequantize_groups(codes, scale, zp)
