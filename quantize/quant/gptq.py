"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize the columns of W one at a time and spread each
column's error over the columns not yet quantized, weighted by the inverse Hessian of the layer inputs.

Names follow the paper and IST-DASLab's reference (`H`, `Hinv`, `W`, `Q`, `Err1`, `blocksize`, `percdamp`).
Scales come from the original weight's groups (compressed-tensors' static min-max observer, `rtn.group_qparams`)
and stay fixed during the updates, as in llm-compressor; activation ordering `static` visits columns by
descending Hessian diagonal while every column keeps its own group, so no g_idx is needed to serve it.
"""

import contextlib

import torch

from quantize.quant import fp4 as e2m1
from quantize.quant import precision
from quantize.quant.rtn import int_range


def add_batch(H: torch.Tensor, x: torch.Tensor) -> int:
    """Accumulate inputs x [..., in] into the float32 H [in, in], batch after batch in order; returns rows added.

    H stays float32 and so do the sums. When x is bfloat16 on a GPU the product runs on the TF32 tensor cores:
    every bf16 x bf16 product is exact there and the sums are float32, so the result is the float32 product of
    the same numbers, sooner (on a CPU, oneDNN's bf16 inputs were about 3x sooner, but see below). Rounding the
    *output* to bf16 is what must never happen: it breaks positive definiteness of the low-rank Hessians of
    experts that see few tokens.

    H is symmetric, so for wide inputs only its row blocks from the diagonal rightwards are computed; the
    blocks below are left stale until `mirror_upper` (which gptq_quantize calls) copies them across.
    """
    # only on CUDA: the switch is process-wide, and on a CPU whose oneDNN takes bf16 inputs (AMX) the chunk
    # workers' and writer threads' float32 matmuls ran in bf16 meanwhile (GPTQ on the Kimi fixture: other bytes
    # on every run); a GPU run solves its experts on one thread
    exact_bf16 = x.dtype == torch.bfloat16 and H.device.type == "cuda"
    x = x.reshape(-1, x.shape[-1]).to(H.dtype)
    with precision.bf16_products(H.device) if exact_bf16 else contextlib.nullcontext():
        for r1, r2 in _row_blocks(H.shape[0]):
            H[r1:r2, r1:].addmm_(x[:, r1:r2].t(), x[:, r1:])
    return x.shape[0]


# Rows per Hessian product. Each product reads and writes all of H, so a few rows at a time is bound by memory,
# not arithmetic: on SmolLM2's calibration pass (512-token samples), 1024-row batches took the Hessians from 0.77
# to 0.58 s per layer (2048: 0.66 s, and more memory). An expert that gets ~10 routed tokens per sample would
# otherwise cost one pass over its whole [in, in] H (205 MB at 7168 wide) per sample.
BATCH_ROWS = 1024


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
def _thread_invariant(device: torch.device):
    """One CPU thread: LAPACK's Cholesky rounds differently with another thread count (the only step of the
    solve that does, measured), and the bytes must not depend on the machine's core count either, where the
    solve alone can promise it. 7168 wide: 1.75 s on one thread against 0.95 s on two."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def damping(base: float, tokens: int, width: int, most: float = 0.1) -> float:
    """The dampening fraction of a Hessian summed from `tokens` rows of `width` inputs: `base` when the rows
    outnumber the inputs; for fewer, base x width / tokens, at most `most` (MoE-Quant, behind the best public
    DeepSeek-R1 W4A16, damps every Hessian 0.1): a Hessian of few tokens has rank below its width, its small
    eigenvalues are noise, and GPTQ would spread errors along them."""
    if tokens >= width:
        return base
    return min(most, max(base, base * width / max(tokens, 1)))


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None,
                  consume: bool = False, **params) -> tuple[torch.Tensor, bool]:
    """Codes [out, in] int8 for W [out, in] under fixed per-group scale [out, in/group]: the solve of
    gptq_quantize_batched (its `params`) with a stack of one, so the same codes as in any stack.

    H: sum of x x^T over the calibration inputs, [in, in], as add_batch leaves it (completed here, in place).
    Returns (codes, fallback): fallback is True when H was not positive definite even after dampening, or held a
    NaN or an infinity, in which case the codes are plain RTN.
    consume: the caller's last use of H; its storage is released as soon as the working copy exists.
    values (in `params`): a list that receives GPTQ's values before rounding, [1, out, in] float32: each weight
    over its step as updated when its column was rounded (quant/signround.py starts from them).
    """
    assert H.shape == (W.shape[1], W.shape[1]), f"H {tuple(H.shape)} for W {tuple(W.shape)}"
    codes, fallback = _quantize(W[None], H[None], scale[None], None if zero_point is None else zero_point[None],
                                H if consume else None, **params)
    return codes[0], bool(fallback[0])


def gptq_quantize_batched(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    num_bits: int = 4,
    blocksize: int = 128,
    percdamp: float | list[float] = 0.01,
    actorder: bool = True,
    consume: bool = False,
    fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gptq_quantize of a stack of same-shape matrices (the routed experts of a layer): W [E, out, in],
    H [E, in, in], scale [E, out, groups]. Returns codes [E, out, in] int8 and fallback [E] bool.

    One Cholesky call, one column loop and one block update per step for the whole stack, so the number of
    kernel launches does not grow with E. Every step is per matrix (elementwise ops, batched products and
    factorizations), so each expert's codes are those of solving it alone (tests/test_gptq.py).

    fp4: the codes are e2m1 (NVFP4, MXFP4: 4-bit codes of fp4.VALUES), `scale` each group's effective step
    (NVFP4's e4m3 scale over its global scale), num_bits and zero_point unused: w / step is clamped to +-6 and
    rounded to the nearest e2m1 value, as llm-compressor's GPTQ fake-quantizes an FP4 column."""
    assert H.shape == (W.shape[0], W.shape[2], W.shape[2]), f"H {tuple(H.shape)} for W {tuple(W.shape)}"
    return _quantize(W, H, scale, zero_point, H if consume else None, num_bits, blocksize, percdamp, actorder, fp4)


def _quantize(W, H, scale, zero_point, release: torch.Tensor | None, num_bits: int = 4, blocksize: int = 128,
              percdamp: float | list[float] = 0.01, actorder: bool = True,
              fp4: bool = False, values: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The working copy, then `release` (the caller's Hessian tensor, whose storage goes), then the solve."""
    work, perm = _working_copy(H, actorder)
    if release is not None:
        release.set_()
    return _solve(W, work, perm, scale, zero_point, num_bits, blocksize, percdamp, fp4, values)


def _working_copy(H: torch.Tensor, actorder: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 copy of a stack of Hessians [E, in, in] that the solve factors in place, permuted by
    descending diagonal (activation order; a stable sort, so ties keep their column order), and the order.
    Memory: H is the big one ([in, in] float32: 205 MB for a 7168-wide input). At most two of its size are
    alive per matrix past this copy (L, then its inverse), three while the caller keeps its own."""
    for h in H:
        mirror_upper(h)
    if not actorder:
        return H.to(torch.float32, copy=True), None
    perm = torch.argsort(H.diagonal(dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
    n = H.shape[-1]
    # rows, then columns: two gathers, 2.5x sooner than one 3-index gather (8 x 512 x 512: 4.4 against 11 ms)
    rows = H.gather(1, perm[:, :, None].expand(-1, -1, n))
    return rows.gather(2, perm[:, None, :].expand(-1, n, -1)).float(), perm


def non_finite(H: torch.Tensor) -> torch.Tensor:
    """[E] bool: which Hessians of a stack [E, n, n] hold a NaN or an infinity (calibration inputs that
    overflowed). Checked before factoring, whatever the solver says: cuSOLVER's Cholesky returns info == 0 for
    a NaN input (pytorch #64818) where LAPACK flags it, and the codes would be NaN cast to int8."""
    return ~torch.isfinite(H).flatten(1).all(1)


def inverse_factor(H: torch.Tensor, broken: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """U, the upper Cholesky factor of H^-1, for a stack of damped Hessians [E, n, n] (H is consumed), and
    which of them were not positive definite, or `broken` (non_finite) as given: their U is the identity, so
    their codes are plain RTN.

    With P the order-reversing permutation and P H P = L L^T, U = P L^-1 P: one factorization and one
    triangular solve, where cholesky_inverse and a second Cholesky cost 2.3x as much (and cholesky_inverse runs
    4x slower again off the main thread, where the writer threads call the engine: 190 against 48 ms for 32
    matrices of 512, measured).

    On a GPU each matrix is factored and solved alone: cuSOLVER and cuBLAS run a stack through their batched
    kernels (potrfBatched, trsmBatched: made for small matrices) and one matrix through others, so a stack's
    factors would depend on how many experts share it; one at a time, an expert's factor is the same in any
    stack, and Kimi K2's [24, 7168, 7168] stacks get the kernels meant for their size."""
    E, n, _ = H.shape
    # LAPACK factors column-major matrices: a row-major H would be copied to that layout and back, and its
    # triangle zeroed across the grain (8 x 512 x 512: 23 ms against 19). So the flipped H is made column-major
    # here, in one copy (flip keeps the transposed layout of its input), and L comes back row-major for the
    # solve. The factor reads the same triangle as before, so the bytes are the same even where the products
    # left H not exactly symmetric.
    H = H.mT.flip(-2, -1).contiguous().mT
    info = torch.empty(E, dtype=torch.int32, device=H.device)
    if H.device.type == "cuda":
        for e in range(E):
            L_e, info[e] = torch.linalg.cholesky_ex(H[e])
            H[e] = L_e
            del L_e
        L = H
    else:
        with _thread_invariant(H.device):
            L, info = torch.linalg.cholesky_ex(H, out=(H, info))  # in place
    del H
    L = L.contiguous()
    fallback = info != 0
    if broken is not None:
        fallback |= broken.to(fallback.device)
    eye = torch.eye(n, dtype=torch.float32, device=L.device)
    if fallback.any():
        L[fallback] = eye
    if L.device.type == "cuda":
        for e in range(E):
            L[e] = torch.linalg.solve_triangular(L[e], eye, upper=False)
        return L.flip(-2, -1), fallback
    return torch.linalg.solve_triangular(L, eye.expand(E, -1, -1), upper=False).flip(-2, -1), fallback


# Rows padded to this many elements: two vectors of the widest CPU kernels (AVX-512, 16 floats), and more.
_LANES = 64
_SUB_BLOCK = 16  # columns per sub-block of a GPTQ block (32 x 1024 x 512 experts: 16 took 0.38 s, 32 0.48, 8 0.46)


def _solve(W, H, perm, scale, zero_point, num_bits, blocksize, percdamp, fp4=False,
           values: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    E, out_features, in_features = W.shape
    group_size = in_features // scale.shape[-1]
    q_min, q_max = (-6.0, 6.0) if fp4 else int_range(num_bits)
    broken = non_finite(H)
    if broken.any():  # solved as RTN (inverse_factor's fallback); the identity keeps NaN out of every step
        H[broken] = torch.eye(in_features, dtype=H.dtype, device=H.device)
    d = H.diagonal(dim1=-2, dim2=-1)
    dead = d == 0
    d.masked_fill_(dead, 1)

    # Work on W^T: column i of W is row i here, contiguous, so each column's update is one row-block op. Rows
    # are padded to a multiple of 64 (zero weights, unit scales): every elementwise kernel then runs vectorized
    # to the end of each row, with no scalar tail whose rounding might differ (a fused multiply-add), so a
    # stack of E rounds exactly as E stacks of one, whose flattened rows would put the tails elsewhere.
    width = -(-out_features // _LANES) * _LANES
    WT = torch.zeros(E, in_features, width, dtype=torch.float32, device=W.device)
    WT[..., :out_features] = W.transpose(1, 2)
    group_of = torch.arange(in_features, device=W.device).expand(E, -1) // group_size
    if perm is not None:
        WT = WT.gather(1, perm[:, :, None].expand(-1, -1, width))
        group_of = perm // group_size
    WT.masked_fill_(dead[:, :, None], 0)
    ST = torch.ones(E, scale.shape[-1], width, dtype=torch.float32, device=W.device)
    ST[..., :out_features] = scale.transpose(1, 2)  # [E, n_groups, out]: row g holds group g's scales
    ZT = None
    if zero_point is not None:
        ZT = torch.zeros_like(ST)
        ZT[..., :out_features] = zero_point.transpose(1, 2)

    if not isinstance(percdamp, float):  # one per matrix of the stack (damping)
        percdamp = torch.tensor(percdamp, dtype=torch.float32, device=d.device).reshape(-1, 1)
    d.add_(percdamp * d.mean(-1, keepdim=True))
    Hinv, fallback = inverse_factor(H, broken)
    del H, d

    codes_t = torch.empty(E, in_features, width, dtype=torch.int8, device=W.device)
    values_t = torch.empty(E, in_features, width, dtype=torch.float32, device=W.device) if values is not None else None
    for i1 in range(0, in_features, blocksize):
        i2 = min(i1 + blocksize, in_features)
        W1 = WT[:, i1:i2].clone()
        Q1, Err1 = torch.empty_like(W1), torch.empty_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]
        d1 = Hinv1.diagonal(dim1=-2, dim2=-1)
        g1 = group_of[:, i1:i2, None].expand(-1, -1, width)
        S1 = ST.gather(1, g1)  # the scales of each column's own group, [E, block, out]
        Z1 = None if ZT is None else ZT.gather(1, g1)
        b = i2 - i1
        for j1 in range(0, b, _SUB_BLOCK):
            # A column's error reaches the rest of its sub-block one rank-1 update at a time, and the rest of
            # the block by one product per sub-block: the same arithmetic as rank-1 updates to the block's end,
            # with an eighth of the elementwise work (which, unlike products, runs a kernel per column).
            j2 = min(j1 + _SUB_BLOCK, b)
            for i in range(j1, j2):
                w, s, c, err = W1[:, i], S1[:, i], Q1[:, i], Err1[:, i]
                torch.div(w, s, out=c)
                if values_t is not None:
                    values_t[:, i1 + i] = c
                if fp4:
                    e2m1.round_e2m1_(c.clamp_(q_min, q_max))
                    torch.addcmul(w, c, s, value=-1, out=err)
                elif Z1 is None:
                    c.round_().clamp_(q_min, q_max)
                    torch.addcmul(w, c, s, value=-1, out=err)  # w - q, q = c * s
                else:
                    c.add_(Z1[:, i]).round_().clamp_(q_min, q_max)
                    torch.addcmul(w, c - Z1[:, i], s, value=-1, out=err)  # q = (c - z) * s
                err.div_(d1[:, i, None])
                W1[:, i:j2].addcmul_(Hinv1[:, i, i:j2, None], err[:, None, :], value=-1)
            if j2 < b:
                W1[:, j2:].sub_(torch.bmm(Hinv1[:, j1:j2, j2:].transpose(1, 2), Err1[:, j1:j2]))
        codes_t[:, i1:i2] = e2m1.value_codes(Q1) if fp4 else Q1
        if i2 < in_features:
            WT[:, i2:].sub_(torch.bmm(Hinv[:, i1:i2, i2:].transpose(1, 2), Err1))

    codes_t = codes_t[..., :out_features]
    if perm is not None:
        codes_t = codes_t.gather(1, torch.argsort(perm, dim=-1)[:, :, None].expand(-1, -1, out_features))
    if values_t is not None:
        values_t = values_t[..., :out_features]
        if perm is not None:
            values_t = values_t.gather(1, torch.argsort(perm, dim=-1)[:, :, None].expand(-1, -1, out_features))
        values.append(values_t.transpose(1, 2).contiguous())
    return codes_t.transpose(1, 2).contiguous(), fallback
