"""The dtype that layer forwards and evaluation compute in: the model's own, unless this device computes it slowly.

Machines of the same kind differ: on an x86 CPU without native bf16 (torch reports `AVX2`: AMD EPYC of some
generations), a bf16 or fp16 GEMM is 50-100x slower than float32 (512x576 @ 576x1536: 756 ms vs 7.6 ms), so a
calibration forward or an lm-eval run crawls. There, forwards run in float32: bf16 and fp16 widen to float32
exactly, so the weights are the same numbers, and the weights that get quantized are narrowed back to the model's
dtype first, so that RTN's scales stay those of compressed-tensors. Only the forwards' rounding differs.
"""

import contextlib

import torch

from quantize.machine import cores  # noqa: F401  (compute.cores: the engines' name for it)

CHOICES = ("auto", "model", "float32")


def cpu_capability() -> str:
    """torch's name for this CPU's vector unit (AVX2, AVX512, ...), as benchmarks and test logs record it."""
    return torch.backends.cpu.get_cpu_capability()


def native(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `device` computes GEMMs in `dtype` at full speed."""
    if torch.device(device).type != "cpu" or dtype == torch.float32:
        return True
    if cpu_capability() in ("DEFAULT", "AVX2"):
        return False
    if dtype == torch.bfloat16:  # oneDNN's check (AVX-512 core or AMX); honours ONEDNN_MAX_CPU_ISA
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def choose(model_dtype: torch.dtype, device: torch.device | str, request: str = "auto") -> torch.dtype:
    """`auto`: the model's dtype where it is native on `device`, else float32; `model` or `float32` as asked."""
    if request not in CHOICES:
        raise ValueError(f"compute dtype {request!r}: expected one of {', '.join(CHOICES)}")
    if request == "float32" or (request == "auto" and not native(model_dtype, device)):
        return torch.float32
    return model_dtype


def describe(model_dtype: torch.dtype, chosen: torch.dtype, device: torch.device | str) -> str:
    """One line for a run's summary: what was chosen, and why when it is not the model's dtype."""
    name = str(chosen).removeprefix("torch.")
    if chosen == model_dtype:
        return name
    why = (f"{str(model_dtype).removeprefix('torch.')} is slow on this CPU ({cpu_capability()})"
           if not native(model_dtype, device) else "as asked")
    return f"{name} ({why}; weights keep their dtype on disk)"


@contextlib.contextmanager
def widened_linears():
    """Within it, a Linear whose weight is narrower than its input (a bf16 weight in a float32 forward) widens the
    weight to the input's dtype, exactly. compressed-tensors (0.19) decompresses an NVFP4 or MXFP4 checkpoint's
    weights in bf16 whatever dtype the model was loaded in (unpack_fp4_from_uint8's default), and its offloading
    puts them on the module inside each forward, where model.to() cannot reach: so a float32 evaluation of an
    FP4 checkpoint, as on an AVX2 CPU, stopped at its first GEMM (float != BFloat16)."""
    from torch.nn import functional as F

    linear = F.linear

    def widened(x, weight, bias=None):
        if weight.dtype != x.dtype and x.dtype == torch.float32 and weight.is_floating_point():
            weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        return linear(x, weight, bias)

    F.linear = widened
    try:
        yield
    finally:
        F.linear = linear
