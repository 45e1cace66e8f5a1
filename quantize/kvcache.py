"""FP8 (e4m3) KV cache scales, calibrated on what really enters the cache.

One per-tensor scale per layer for K and one for V (`self_attn.k_scale`, `self_attn.v_scale`), as vLLM and
SGLang read them with `kv_cache_scheme` {num_bits 8, type float, strategy tensor, symmetric} in the
quantization_config. The scale never clips what was observed: compressed-tensors' `calculate_qparams`
(max|x| / 448) or a larger one with less round-trip error (see `scales`).

What is observed:
- GQA / MHA: the K (after rotary embedding) and V handed to attention, which are what the cache stores.
- MLA (DeepSeek V3, Kimi K2, GLM-5): the cache holds the latent, the normalized compressed KV
  (kv_a_layernorm's output) and the rotary key, in one tensor. vLLM quantizes that whole latent with the layer's
  k_scale (v_scale is unused), so k_scale comes from max|latent|; v_scale is written equal to it for loaders
  that expect both. Expanded K/V are never cached by these engines and are not observed.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from quantize import hf

FP8_MAX = 448.0


def scheme_args():
    QuantizationArgs = hf.compressed_tensors().QuantizationArgs
    return QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)


class Amax:
    """What one layer's K and V looked like: running max |x| (float32) and an evenly strided sample of values
    (at most SAMPLE_PER_CALL per call) on which the scale is chosen."""

    SAMPLE_PER_CALL = 4096

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.values: dict[str, list[torch.Tensor]] = {"k": [], "v": []}

    def update(self, which: str, x: torch.Tensor) -> None:
        x = x.detach()
        m = x.abs().amax().float()
        old = getattr(self, which)
        setattr(self, which, m if old is None else torch.maximum(old, m))
        flat = x.reshape(-1)
        self.values[which].append(flat[:: max(1, flat.numel() // self.SAMPLE_PER_CALL)].float().cpu())

@contextlib.contextmanager
def observe(attention: nn.Module, mla_nope_dim: int | None) -> Iterator[Amax]:
    """Record max |K| and |V| entering `attention`'s cache while the block runs; `mla_nope_dim` is
    qk_nope_head_dim for MLA attention (the rotary key is the tail of the expanded key), None for GQA.

    The SDPA entry of transformers' attention registry is wrapped for the duration, so what is observed is
    exactly what the model passes to attention, after its own rotary embedding."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    amax = Amax()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def observed(module, query, key, value, *args, **kwargs):
        if module is attention:
            if mla_nope_dim is None:
                amax.update("k", key)
                amax.update("v", value)
            else:
                amax.update("k", key[..., mla_nope_dim:])  # the rotary key, shared by every head
        return sdpa(module, query, key, value, *args, **kwargs)

    hooks = []
    if mla_nope_dim is not None:
        hooks.append(attention.kv_a_layernorm.register_forward_hook(lambda _m, _a, out: amax.update("k", out)))
    ALL_ATTENTION_FUNCTIONS["sdpa"] = observed
    try:
        yield amax
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
        for h in hooks:
            h.remove()


def scales(amax: Amax, dtype: torch.dtype, mla: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale), each [1] in the model's dtype as llm-compressor writes them.

    The smallest scale that never clips is compressed-tensors' own (`calculate_qparams`: max / 448). FP8 keeps
    ~2^-4 relative precision over its whole normal range, so that scale is not by itself better than the
    engines' default 1.0 (on SmolLM2's real K/V it was better in only 6 of 30 layers): where a value lands
    inside a binade moves its rounding error. So the scale is chosen, among that one times 2^(j/4) for
    j = 0..39 and 1.0 (when 1.0 does not clip either), as the one with the least round-trip error on the
    sampled values; none of them clips."""
    calculate_qparams = hf.compressed_tensors().utils.calculate_qparams

    def one(m: torch.Tensor | None, values: list[torch.Tensor]) -> torch.Tensor:
        if m is None or not float(m) > 0:  # nothing (or only zeros) seen: the engines' default 1.0, never eps
            return torch.ones(1, dtype=dtype)
        m = m.reshape(1).float().cpu()
        base, _ = calculate_qparams(-m, m, scheme_args())
        floor = float(base)
        candidates = [base.to(dtype)] + [(base * 2 ** (j / 4)).to(dtype) for j in range(1, 40)]
        candidates = [c for c in candidates if float(c) >= floor] + ([torch.ones(1, dtype=dtype)] if 1.0 >= floor else [])
        sample = torch.cat(values)
        errors = [fp8_roundtrip_error(sample, float(c)) for c in candidates]
        return candidates[min(range(len(candidates)), key=errors.__getitem__)].reshape(1)

    k = one(amax.k, amax.values["k"])
    return k, (k.clone() if mla else one(amax.v, amax.values["v"]))


def fp8_roundtrip_error(x: torch.Tensor, scale: float) -> float:
    """Relative error of x stored as e4m3 with `scale` (x / scale saturated to +-448) and read back."""
    x = x.float()
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return float((q - x).norm() / x.norm().clamp(min=1e-30))
