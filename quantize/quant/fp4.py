"""FP4 (e2m1) weights as compressed-tensors writes them: NVFP4 (an e4m3 scale per 16 weights under one float32
global scale per tensor, or per set of tensors an engine fuses) and MXFP4 (an e8m0 scale per 32 weights).

The arithmetic is compressed-tensors' own (`calculate_qparams`, `generate_gparam`, `quantize`, the FP4 packer and
the MX scale encoding), called with the dtypes its model-free path gives them: the weight's dtype for the group
min/max and the local scales, float32 for the global scale. So the bytes are the library's (tests/test_fp4.py
compares them with llm-compressor's model_free_ptq converter tensor by tensor); what is ours is the streaming
and the fused sets' shared global scale, computed from every member's max without a second pass.
"""

import functools

import torch

from quantize import hf

NVFP4_GROUP = 16
MXFP4_GROUP = 32


@functools.cache
def _ct():
    ct = hf.compressed_tensors()
    from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    presets = ct.quant_scheme.PRESET_SCHEMES
    return {"nvfp4": presets["NVFP4A16"]["weights"], "mxfp4": presets["MXFP4A16"]["weights"],
            "qparams": calculate_qparams, "gparam": generate_gparam, "quantize": quantize,
            "pack": pack_fp4_to_uint8, "unpack": unpack_fp4_from_uint8, "mx_scale": compress_mx_scale,
            "mx_unscale": decompress_mx_scale}


def _groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group min and max of w [out, in] in w's dtype, [out, in / group_size]."""
    g = w.unflatten(-1, (-1, group_size))
    return torch.amin(g, dim=-1), torch.amax(g, dim=-1)


def absmax(w: torch.Tensor) -> torch.Tensor:
    """max |w| in w's dtype: what a fused set's members contribute to their shared NVFP4 global scale."""
    return torch.max(w.max(), -w.min())


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 global scale [1] for a tensor (or fused set) whose largest magnitude is amax:
    448 * 6 / amax, so that the largest group's e4m3 scale uses e4m3's whole range."""
    return _ct()["gparam"](-amax.reshape(1), amax.reshape(1))


def nvfp4(w: torch.Tensor, gscale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 [out, in/2], weight_scale e4m3 [out, in/16], weight_global_scale float32 [1]) of
    w [out, in]; gscale: the global scale of w's fused set (default: w's own)."""
    ct = _ct()
    args = ct["nvfp4"]
    if gscale is None:
        gscale = global_scale(absmax(w))
    lo, hi = _groups(w, NVFP4_GROUP)
    scale, _ = ct["qparams"](lo, hi, args, global_scale=gscale)
    scale = scale.to(w.dtype)  # the module's weight_scale parameter is in the weight's dtype
    q = ct["quantize"](x=w, scale=scale, zero_point=None, args=args, global_scale=gscale)
    return ct["pack"](q), scale.to(torch.float8_e4m3fn), gscale


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 [out, in/2], weight_scale e8m0 as uint8 [out, in/32]) of w [out, in]."""
    ct = _ct()
    args = ct["mxfp4"]
    lo, hi = _groups(w, MXFP4_GROUP)
    scale, _ = ct["qparams"](lo, hi, args)
    scale = scale.to(w.dtype)
    q = ct["quantize"](x=w, scale=scale, zero_point=None, args=args)
    return ct["pack"](q), ct["mx_scale"](scale, torch.uint8)


def dequantize(parts: dict[str, torch.Tensor], nvfp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float32 weight [out, in], each group's effective scale [out, groups]) of a module's stored FP4
    tensors (weight_packed, weight_scale and, for NVFP4, weight_global_scale), by compressed-tensors' unpacking
    and scale decoding."""
    ct = _ct()
    packed = parts["weight_packed"]
    values = ct["unpack"](packed, packed.shape[0], packed.shape[1] * 2).float()
    if nvfp4:
        step = parts["weight_scale"].float() / parts["weight_global_scale"].float()
    else:
        step = ct["mx_unscale"](parts["weight_scale"]).float()
    return values * step.repeat_interleave(values.shape[1] // step.shape[1], dim=1), step
