"""FP4 (e2m1) weights as compressed-tensors writes them: NVFP4 (an e4m3 scale per 16 weights under one float32
global scale per tensor, or per set of tensors an engine fuses) and MXFP4 (an e8m0 scale per 32 weights).

The arithmetic is compressed-tensors' own (`calculate_qparams`, `generate_gparam`, its range, unpacking and MX
scale encoding), called with the dtypes its model-free path gives them: the weight's dtype for the group min/max
and the local scales, float32 for the global scale; only the e2m1 cast and packing are ours (`codes`, `pack`:
faster, the same bytes; `round_e2m1_`: GPTQ's rounding of one column). So the bytes are the library's
(tests/test_fp4.py compares them with llm-compressor's model_free_ptq converter tensor by tensor); what is ours is
the streaming and the fused sets' shared global scale, computed from every member's max without a second pass.
"""

import functools

import torch

from quantize import hf
from quantize.quant import rtn

NVFP4_GROUP = 16
MXFP4_GROUP = 32


@functools.cache
def _ct():
    ct = hf.compressed_tensors()
    from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils import calculate_qparams, calculate_range, generate_gparam

    presets = ct.quant_scheme.PRESET_SCHEMES
    return {"nvfp4": presets["NVFP4A16"]["weights"], "mxfp4": presets["MXFP4A16"]["weights"],
            "qparams": calculate_qparams, "gparam": generate_gparam, "range": calculate_range,
            "unpack": unpack_fp4_from_uint8, "mx_scale": compress_mx_scale,
            "mx_unscale": decompress_mx_scale}


def _groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(-max |w|, max |w|) per group of w [out, in] in w's dtype, [out, in / group_size]: what calculate_qparams
    needs of a symmetric scheme's min and max (it takes max(|min(lo, 0)|, |max(hi, 0)|), which is max |w|, exactly),
    from rtn.group_absmax's integer maxima: amin and amax, short reductions, took two thirds of the scales' time."""
    a = rtn.group_absmax(w.unflatten(-1, (-1, group_size)))
    return -a, a


def absmax(w: torch.Tensor) -> torch.Tensor:
    """max |w| in w's dtype: what a fused set's members contribute to their shared NVFP4 global scale."""
    return torch.max(w.max(), -w.min())


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 global scale [1] for a tensor (or fused set) whose largest magnitude is amax:
    448 * 6 / amax, so that the largest group's e4m3 scale uses e4m3's whole range."""
    return _ct()["gparam"](-amax.reshape(1), amax.reshape(1))


def set_global_scale(weights) -> torch.Tensor:
    """The one global scale of a set of weights an engine fuses into one GEMM (q/k/v, gate/up): from the
    largest magnitude of any member, so that each member's codes dequantize under the fused tensor's scale."""
    return global_scale(torch.stack([absmax(w) for w in weights]).max())


def nvfp4_scale(w: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """NVFP4's local scales [out, in/16] of w under global scale gscale: e4m3 values, in w's dtype (the dtype of
    the module's weight_scale parameter); a group's step is scale / gscale."""
    lo, hi = _groups(w, NVFP4_GROUP)
    scale, _ = _ct()["qparams"](lo, hi, _ct()["nvfp4"], global_scale=gscale)
    return scale.to(w.dtype)


def mxfp4_scale(w: torch.Tensor) -> torch.Tensor:
    """MXFP4's scales [out, in/32] of w: powers of two, in w's dtype; a group's step is its scale."""
    lo, hi = _groups(w, MXFP4_GROUP)
    scale, _ = _ct()["qparams"](lo, hi, _ct()["mxfp4"])
    return scale.to(w.dtype)


def mx_bytes(scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 scales as the e8m0 bytes weight_scale stores."""
    return _ct()["mx_scale"](scale, torch.uint8)


# e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and where |x| moves to the next one: compressed-tensors' cast_to_fp4
# rounds ties to even, so a tie at 0.25, 1.25, 2.5 or 5 stays below and one at 0.75, 1.75 or 3.5 goes above (the
# boundary just under it, so that bucketize's x <= boundary sends the tie up)
_BELOW = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_BOUNDS = torch.where(torch.tensor([False, True, False, True, False, True, False]),
                      torch.nextafter(_BELOW, torch.tensor(0.0)), _BELOW)


def codes(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' FP4 quantize of w [out, in] under per-group steps [out, groups] (w / step, clamped to
    +-6, cast to e2m1), as 4-bit codes [out, in] uint8: the magnitude's index in VALUES, the sign in bit 3. The
    library's eager CPU path runs 15 masked writes; counting the boundaries |x| passes gives the same codes
    (tests/test_fp4.py), a 2048 x 7168 expert in 0.29 s against 0.53 (torch.bucketize, one thread: 0.50)."""
    q_min, q_max = _ct()["range"](_ct()["nvfp4"], w.device)
    group = w.shape[-1] // step.shape[-1]
    scaled = torch.clamp(w.unflatten(-1, (-1, group)) / step.unsqueeze(-1), q_min, q_max).flatten(-2)
    mag = scaled.abs().float()  # exact; a bf16 comparison would round the boundaries just under a tie up to it
    out = torch.zeros(mag.shape, dtype=torch.uint8, device=w.device)
    for bound in _BOUNDS.tolist():  # how many boundaries |x| is above (bucketize, but multi-threaded)
        out += mag > bound
    out |= torch.signbit(torch.sign(scaled)).to(torch.uint8) << 3  # sign(x) * e2m1: the sign of -0.0 too
    return out


def pack(codes: torch.Tensor) -> torch.Tensor:
    """FP4 packing, as compressed-tensors': two 4-bit codes a byte, the first in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# the value of each 4-bit code: the e2m1 magnitudes, then the same negated (bit 3 the sign)
VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def spacing(x: torch.Tensor) -> torch.Tensor:
    """e2m1's grid spacing where each of x lies: 0.5 below 2, 1 below 4, 2 up to 6 (by |x|)."""
    a = x.abs()
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def round_e2m1_(x: torch.Tensor) -> torch.Tensor:
    """x (within +-6) rounded in place to the nearest e2m1 value, ties to even, signed zeros as the library's
    (-0.0 for a small negative): compressed-tensors' cast_to_fp4 in six elementwise ops, where it takes fifteen. The
    spacing is 0.5 below 2, 1 below 4 and 2 up to 6, and x / spacing is exact, so round-half-even of it is the
    cast's rounding (the tie at 0.25 goes to 0, at 0.75 to 1, at 2.5 to 2 and at 5 to 4; tests/test_fp4.py)."""
    x.add_(0.0)  # -0.0 becomes +0.0, as the cast's |x| * sign(x) makes it; a small negative still rounds to -0.0
    step = spacing(x)
    return x.div_(step).round_().mul_(step)


def value_codes(v: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of GPTQ's e2m1 values (round_e2m1_'s) as llm-compressor's GPTQ output holds them: it keeps
    the dequantized weight and compressed-tensors casts that again at save, where an exact -0.0 becomes +0, so a
    zero is always code 0 (round to nearest gives a small negative code 8: `codes`)."""
    out = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    mag = v.abs()
    for bound in _BOUNDS.tolist():
        out += mag > bound
    return out | ((v < 0).to(torch.uint8) << 3)


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
