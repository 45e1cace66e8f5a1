"""The precision of float32 matmuls, set by the math that needs it rather than left to the process.

torch keeps it process-wide, and others change it: `torch.set_float32_matmul_precision("high")` in any library,
`TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1` in the environment (TF32 in every cuBLAS product), or
`torch.backends.mkldnn.matmul.fp32_precision = "bf16"` on a CPU (bf16 inputs to oneDNN's float32 GEMMs). Any of them
would move GPTQ's and AWQ's codes. So the calibrated engine runs each layer under `exact()` (IEEE float32), and
the one product that is exact in reduced precision (a Hessian of bf16 inputs) switches to it inside
(`bf16_products`). Both restore what was there before, and nothing else.

Both go through the legacy setter, which sets the legacy flag and the per-backend precisions together: on CUDA a
mix of the two APIs that disagree makes every cuBLAS matmul raise. The state is process-wide while threads
share it (experts' chunks), so each mode is entered by the first user and left by the last.
"""

import contextlib
import threading

import torch

_lock = threading.Lock()
_users = {"exact": 0, "bf16": 0}
_saved: dict[str, tuple] = {}


_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)


def _state() -> tuple:
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # the process mixed the two APIs: only the per-backend values can be read
        legacy = None
    return legacy, *(getattr(b, "fp32_precision", None) for b in _BACKENDS)


def _restore(state: tuple) -> None:
    legacy, *per_backend = state
    if legacy is not None:
        torch.set_float32_matmul_precision(legacy)
    for backend, value in zip(_BACKENDS, per_backend, strict=True):
        if value is not None and backend.fp32_precision != value:
            backend.fp32_precision = value


@contextlib.contextmanager
def _mode(name: str, legacy: str):
    with _lock:
        if _users[name] == 0:
            _saved[name] = _state()
            torch.set_float32_matmul_precision(legacy)
        _users[name] += 1
    try:
        yield
    finally:
        with _lock:
            _users[name] -= 1
            if _users[name] == 0:
                _restore(_saved.pop(name))


def exact():
    """float32 matmuls in IEEE float32 (no TF32, no bf16 inputs), whatever the process had set."""
    return _mode("exact", "highest")


def bf16_products(device: torch.device):
    """float32 matmuls with bf16 (CPU, oneDNN) or TF32 (CUDA) inputs and float32 accumulation and output: exact
    for inputs that are bf16 values, since both formats hold a bf16 mantissa whole."""
    return _mode("bf16", "high" if device.type == "cuda" else "medium")
