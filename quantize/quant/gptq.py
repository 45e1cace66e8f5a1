"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize the columns of W one at a time and spread each
column's error over the columns not yet quantized, weighted by the inverse Hessian of the layer inputs.

Names follow the paper and IST-DASLab's reference (`H`, `Hinv`, `W`, `Q`, `Err1`, `blocksize`, `percdamp`).
Scales come from the original weight's groups (compressed-tensors' static min-max observer, `rtn.group_qparams`)
and stay fixed during the updates, as in llm-compressor; activation ordering `static` visits columns by
descending Hessian diagonal while every column keeps its own group, so no g_idx is needed to serve it.
"""

import torch

from quantize.quant.rtn import int_range


def add_batch(H: torch.Tensor, x: torch.Tensor) -> int:
    """Accumulate inputs x [..., in] into the float32 H [in, in], batch after batch in order; returns rows added.

    The product is float32 too: products rounded to bf16 (5x faster on CPU) break positive definiteness of the
    low-rank Hessians of experts that see few tokens, by more than the 1% dampening repairs.
    """
    x = x.reshape(-1, x.shape[-1]).to(H.dtype)
    H.addmm_(x.t(), x)
    return x.shape[0]


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    num_bits: int = 4,
    blocksize: int = 128,
    percdamp: float = 0.01,
    actorder: bool = True,
) -> tuple[torch.Tensor, bool]:
    """Integer codes [out, in] int8 for W [out, in] under fixed per-group scale [out, in/group].

    H: sum of x x^T over the calibration inputs, [in, in]. Returns (codes, fallback): fallback is True when
    H was not positive definite even after dampening, in which case the codes are plain RTN.
    """
    out_features, in_features = W.shape
    assert H.shape == (in_features, in_features), f"H {tuple(H.shape)} for W {tuple(W.shape)}"
    n_groups = scale.shape[1]
    group_size = in_features // n_groups
    q_min, q_max = int_range(num_bits)
    W = W.to(torch.float32).clone()
    H = H.to(torch.float32).clone()
    s_cols = scale.to(torch.float32).repeat_interleave(group_size, dim=1)  # [out, in]: each column's group scale
    z_cols = None if zero_point is None else zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    perm = None
    if actorder:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H, s_cols = W[:, perm], H[perm][:, perm], s_cols[:, perm]
        z_cols = None if z_cols is None else z_cols[:, perm]

    damp = percdamp * torch.mean(torch.diag(H))
    H.diagonal().add_(damp)
    L, info = torch.linalg.cholesky_ex(H)
    fallback = bool(info.item() != 0)
    if fallback:
        Hinv = torch.eye(in_features, dtype=torch.float32, device=W.device)
    else:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    # Work on W^T: column i of W is row i here, contiguous, and each update is one in-place rank-1 addr_.
    WT, ST = W.t().contiguous(), s_cols.t().contiguous()
    ZT = None if z_cols is None else z_cols.t().contiguous()
    QT = torch.zeros_like(WT)
    for i1 in range(0, in_features, blocksize):
        i2 = min(i1 + blocksize, in_features)
        W1 = WT[i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, s = W1[i], ST[i1 + i]
            if ZT is None:
                q = torch.clamp(torch.round(w / s), q_min, q_max) * s
            else:
                z = ZT[i1 + i]
                q = (torch.clamp(torch.round(w / s + z), q_min, q_max) - z) * s
            QT[i1 + i] = q
            err = (w - q) / Hinv1[i, i]
            W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
            Err1[i] = err
        WT[i2:] -= Hinv[i1:i2, i2:].t() @ Err1
    Q = QT.t()

    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    codes = torch.round(Q / scale.to(torch.float32).repeat_interleave(group_size, dim=1))
    if zero_point is not None:
        codes = codes + zero_point.to(torch.float32).repeat_interleave(group_size, dim=1)
    return torch.clamp(codes, q_min, q_max).to(torch.int8), fallback
