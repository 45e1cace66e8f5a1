"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize the columns of W one at a time and spread each
column's error over the columns not yet quantized, weighted by the inverse Hessian of the layer inputs.

Names follow the paper and IST-DASLab's reference (`H`, `Hinv`, `W`, `Q`, `Err1`, `blocksize`, `percdamp`).
Scales come from the original weight's groups (compressed-tensors' static min-max observer, `rtn.group_qparams`)
and stay fixed during the updates, as in llm-compressor; activation ordering `static` visits columns by
descending Hessian diagonal while every column keeps its own group, so no g_idx is needed to serve it.
"""

import contextlib
from collections.abc import Iterable, Iterator

import torch

from quantize.quant.rtn import int_range


def add_batch(H: torch.Tensor, x: torch.Tensor) -> int:
    """Accumulate inputs x [..., in] into the float32 H [in, in], batch after batch in order; returns rows added.

    H stays float32 and so do the sums. When x is bfloat16 the product runs on the bf16 units (AMX / tensor
    cores): every bf16 x bf16 product is exact in float32 and the sums are float32, so the result is the float32
    product of the same numbers, about 3x sooner on CPU. Rounding the *output* to bf16 is what must never
    happen: it breaks positive definiteness of the low-rank Hessians of experts that see few tokens.

    H is symmetric, so for wide inputs only its row blocks from the diagonal rightwards are computed; the
    blocks below are left stale until `mirror_upper` (which gptq_quantize calls) copies them across.
    """
    exact_bf16 = x.dtype == torch.bfloat16
    x = x.reshape(-1, x.shape[-1]).to(H.dtype)
    with _reduced_precision_fp32_matmul(H.device) if exact_bf16 else contextlib.nullcontext():
        for r1, r2 in _row_blocks(H.shape[0]):
            H[r1:r2, r1:].addmm_(x[:, r1:r2].t(), x[:, r1:])
    return x.shape[0]


# Rows per Hessian product. Each product reads and writes all of H, so a few rows at a time is bound by memory,
# not arithmetic: on SmolLM2's calibration pass (512-token samples), 1024-row batches took the Hessians from 0.77
# to 0.58 s per layer (2048: 0.66 s, and more memory). An expert that gets ~10 routed tokens per sample would
# otherwise cost one pass over its whole [in, in] H (205 MB at 7168 wide) per sample.
BATCH_ROWS = 1024


def batched_rows(xs: Iterable[torch.Tensor], rows: int = BATCH_ROWS) -> Iterator[torch.Tensor]:
    """Consecutive inputs [..., in] joined into [n, in] batches of at least `rows` rows (the last may have fewer),
    in order: what add_batch should be given."""
    pending, n = [], 0
    for x in xs:
        x = x.reshape(-1, x.shape[-1])
        if x.shape[0] == 0:
            continue
        pending.append(x)
        n += x.shape[0]
        if n >= rows:
            yield torch.cat(pending) if len(pending) > 1 else pending[0]
            pending, n = [], 0
    if pending:
        yield torch.cat(pending) if len(pending) > 1 else pending[0]


def mirror_upper(H: torch.Tensor) -> torch.Tensor:
    """Complete in place a Hessian that add_batch filled on and above its diagonal blocks."""
    for r1, r2 in _row_blocks(H.shape[0])[:-1]:
        H[r2:, r1:r2] = H[r1:r2, r2:].t()
    return H


def _row_blocks(n: int, block: int = 384) -> list[tuple[int, int]]:
    """Row blocks of an [n, n] Hessian. Up to 1024 wide, one block (the whole product: splitting measured no
    faster); wider, blocks of about `block` rows, so that about half the products are skipped (1536 wide:
    4.9 -> 2.8 ms per 512 bf16 rows on 2 CPU cores)."""
    if n < 1024:
        return [(0, n)]
    k = -(-n // block)
    edges = [n * j // k for j in range(k + 1)]
    return list(zip(edges, edges[1:], strict=False))


@contextlib.contextmanager
def _reduced_precision_fp32_matmul(device: torch.device):
    """float32 matmuls with bf16 (CPU, oneDNN) or TF32 (CUDA) inputs and float32 accumulation and output.
    Exact for inputs that are bf16 values: both formats hold a bf16 mantissa whole."""
    backend = torch.backends.cuda.matmul if device.type == "cuda" else torch.backends.mkldnn.matmul
    before = backend.fp32_precision
    backend.fp32_precision = "tf32" if device.type == "cuda" else "bf16"
    try:
        yield
    finally:
        backend.fp32_precision = before


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    num_bits: int = 4,
    blocksize: int = 128,
    percdamp: float = 0.01,
    actorder: bool = True,
    consume: bool = False,
) -> tuple[torch.Tensor, bool]:
    """Integer codes [out, in] int8 for W [out, in] under fixed per-group scale [out, in/group].

    H: sum of x x^T over the calibration inputs, [in, in], as add_batch leaves it (completed here, in place).
    Returns (codes, fallback): fallback is True when H was not positive definite even after dampening, in which
    case the codes are plain RTN.
    consume: the caller's last use of H; its storage is released as soon as the working copy exists.
    """
    out_features, in_features = W.shape
    assert H.shape == (in_features, in_features), f"H {tuple(H.shape)} for W {tuple(W.shape)}"
    n_groups = scale.shape[1]
    group_size = in_features // n_groups
    q_min, q_max = int_range(num_bits)
    # Memory: H is the big one ([in, in] float32: 205 MB for a 7168-wide input). At most two of its size are
    # alive past this copy (L, then its inverse), three while the caller keeps its own (a shared Hessian).
    mirror_upper(H)
    perm = torch.argsort(torch.diag(H), descending=True) if actorder else None
    # one gather makes the permuted working copy (no intermediate); without actorder, a plain copy
    work = H[perm.unsqueeze(1), perm.unsqueeze(0)].float() if perm is not None else H.to(torch.float32, copy=True)
    if consume:
        H.set_()
    H = work
    dead = torch.diag(H) == 0
    H[dead, dead] = 1

    # Work on W^T: column i of W is row i here, contiguous, and each update is one in-place rank-1 addr_.
    WT = torch.empty(in_features, out_features, dtype=torch.float32, device=W.device).copy_(W.t())  # row-major
    group_of = torch.arange(in_features, device=W.device) // group_size
    if perm is not None:
        WT, group_of = WT[perm], group_of[perm]
    WT[dead] = 0
    group_of = group_of.tolist()
    ST = scale.t().to(torch.float32)  # [n_groups, out]: row g holds group g's scales
    ZT = None if zero_point is None else zero_point.t().to(torch.float32)

    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
    L, info = torch.linalg.cholesky_ex(H, out=(H, torch.empty((), dtype=torch.int32, device=H.device)))  # in place
    del H
    fallback = bool(info.item() != 0)
    if fallback:
        del L
        Hinv = torch.eye(in_features, dtype=torch.float32, device=W.device)
    else:
        Hinv = torch.cholesky_inverse(L)
        del L
        Hinv = torch.linalg.cholesky(Hinv, upper=True, out=Hinv)

    codes_t = torch.empty(in_features, out_features, dtype=torch.int8, device=W.device)
    for i1 in range(0, in_features, blocksize):
        i2 = min(i1 + blocksize, in_features)
        W1 = WT[i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, g = W1[i], group_of[i1 + i]
            s = ST[g]
            if ZT is None:
                c = torch.clamp(torch.round(w / s), q_min, q_max)
                q = c * s
            else:
                c = torch.clamp(torch.round(w / s + ZT[g]), q_min, q_max)
                q = (c - ZT[g]) * s
            codes_t[i1 + i] = c
            err = (w - q) / Hinv1[i, i]
            W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
            Err1[i] = err
        WT[i2:] -= Hinv[i1:i2, i2:].t() @ Err1

    if perm is not None:
        codes_t = codes_t[torch.argsort(perm)]
    return codes_t.t().contiguous(), fallback
