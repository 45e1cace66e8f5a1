"""Scales chosen by the Hessian: per group, the candidate step whose round-to-nearest error, weighted by the
group's block of the inputs' Hessian H = sum x x^T (or by its diagonal, E[x^2] per input channel), is least.

llm-compressor fixes every scale from the weight's min/max before GPTQ runs, so GPTQ can only choose codes under
scales that ignore the inputs. Here the error e of a group (one output row, `group_size` input columns) under a
step costs e^T H_g e, H_g the group's diagonal block of H: the output error its inputs see (NVIDIA ModelOpt's
local-Hessian search; searching on the weights alone regressed GSM8K in llm-compressor's issue #2094). GPTQ then
runs unchanged under the chosen, fixed steps, and the stored format is the same: positive scales in the model's
dtype (INT4), e4m3 micro-scales under the global scale (NVFP4), e8m0 exponents (MXFP4).

Candidates: INT4, the min/max scale times each clip ratio of RATIOS (1.07 makes the top code 7 rather than 7.5);
NVFP4, the e4m3 neighbours of the min/max micro-scale (the same range of ratios: e4m3 has three mantissa bits; the
global scale is kept, since the engines fuse it across q/k/v and gate/up); MXFP4, the min/max exponent and the ones
on either side of it. The min/max scale is the first candidate and a tie keeps it,
so a group whose error no other step lowers keeps compressed-tensors' scale exactly. Everything runs on a stack
of matrices at once [E, out, in] (a chunk of experts, as their GPTQ solve does).
"""

import torch

from quantize.quant import fp4

RATIOS = (1.0, *(round(0.70 + 0.02 * i, 2) for i in range(19) if i != 15), 1.07)  # 0.70, 0.72, ..., 1.06, 1.07
NVFP4_ULPS = (0, -1, -2, -3, 1)  # e4m3 neighbours of the min/max micro-scale: 3 mantissa bits, so 0.72-1.125 of it
# elements of a piece of the stack searched at a time. The search is a dozen elementwise passes per candidate,
# bound by memory traffic: on a CPU a piece that stays in cache (2M elements: 8 MB a float32 temporary) is 2x
# faster than the whole stack at once (a 2048 x 7168 expert at group 32: 3.4 -> 1.7 s on 2 AVX2 cores), with the
# same result, since every group's choice is its own; a GPU wants few, large launches
CHUNK = {"cpu": 1 << 21, "cuda": 1 << 27}


def diagonal_blocks(H: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [group_size, group_size] blocks on the diagonal of H [E, in, in] (complete, not only its upper
    blocks: gptq.mirror_upper), as [E, groups, group_size, group_size] float32."""
    E, n, _ = H.shape
    G = n // group_size
    blocks = torch.diagonal(H.reshape(E, G, group_size, G, group_size), dim1=1, dim2=3)  # [E, gs, gs, G]
    return blocks.permute(0, 3, 1, 2).float()


def _loss(e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """e [E, out, G, gs]; weights: H blocks [E, G, gs, gs] or a diagonal [E, G, gs]. Per group [E, out, G]."""
    if weights.dim() == 4:
        return torch.einsum("eogi,egij,eogj->eog", e, weights, e)
    return (e * e * weights[:, None]).sum(-1)


def _search(w: torch.Tensor, candidates, dequant, weights: torch.Tensor) -> torch.Tensor:
    """The index of the best candidate per group [E, out, G]: `dequant(k, piece, w_groups)` gives candidate k's
    round-to-nearest weight of w_groups = w[piece] [e, o, G, gs], piece = (experts, rows) slices, searched in
    pieces of CHUNK elements."""
    E, out, G, gs = w.shape
    best = torch.empty(E, out, G, dtype=torch.long, device=w.device)
    budget = CHUNK.get(w.device.type, CHUNK["cuda"])
    rows = max(1, min(out, budget // max(1, G * gs)))
    step = max(1, budget // max(1, out * G * gs))  # whole experts at a time when several fit
    pieces = [(slice(a, a + step), slice(0, out)) for a in range(0, E, step)] if rows == out else \
        [(slice(a, a + 1), slice(r, r + rows)) for a in range(E) for r in range(0, out, rows)]
    for piece in pieces:
        wg, at = w[piece].float(), weights[piece[0]]
        lowest = None
        for k in candidates:
            loss = _loss(wg - dequant(k, piece, wg), at)
            if lowest is None:
                lowest, best[piece] = loss, k
            else:
                better = loss < lowest  # strictly: a tie keeps the earlier candidate, min/max first
                lowest = torch.where(better, loss, lowest)
                best[piece] = torch.where(better, k, best[piece])
    return best


def int4(w: torch.Tensor, base: torch.Tensor, weights: torch.Tensor, num_bits: int = 4,
         extra: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric INT4 scales [E, out, G] in w's dtype for w [E, out, in] whose min/max scales are `base`;
    extra [E, out, G]: one more candidate per group (an INT4 source's step, quant/lattice.py), tried last."""
    E, out, n = w.shape
    G = base.shape[-1]
    q_min, q_max = -(2.0 ** (num_bits - 1)), 2.0 ** (num_bits - 1) - 1
    eps = torch.finfo(w.dtype).eps
    cand = [(base * r).to(w.dtype) if r != 1.0 else base for r in RATIOS]
    if extra is not None:
        cand.append(extra.to(w.dtype))
    cand = [torch.where(c == 0, torch.tensor(eps, dtype=w.dtype, device=w.device), c) for c in cand]

    groups = w.reshape(E, out, G, n // G)

    def dequant(k: int, piece: tuple[slice, slice], wg: torch.Tensor) -> torch.Tensor:
        # rtn.quantize_groups and dequantize_groups exactly: in the weight's dtype, as the codes will be made
        s = cand[k][piece][..., None]
        return (torch.round(torch.clamp(groups[piece] / s, q_min, q_max)) * s).float()

    best = _search(groups, range(len(cand)), dequant, weights)
    return torch.gather(torch.stack(cand, -1), -1, best[..., None])[..., 0]


def nvfp4(w: torch.Tensor, base: torch.Tensor, gscale: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """NVFP4 micro-scales [E, out, G] (e4m3 values in w's dtype) under global scales gscale [E] for w [E, out, in]
    whose min/max micro-scales are `base`; a group's step is scale / gscale."""
    E, out, n = w.shape
    G = base.shape[-1]
    g = gscale.reshape(E, 1, 1).float()
    bits = base.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    cand = []
    for ulps in NVFP4_ULPS:  # adjacent codes of a positive e4m3 are adjacent values, across exponents too
        b = bits + ulps
        ok = (b > 0) & (b < 0x7F) & (base > 0)  # 0x7f is NaN; zero is no step
        cand.append(torch.where(ok, b.clamp(1, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).to(w.dtype), base))

    def dequant(k: int, piece: tuple[slice, slice], wg: torch.Tensor) -> torch.Tensor:
        step = (cand[k][piece].float() / g[piece[0]])[..., None]
        return fp4.VALUES.to(w.device)[fp4.codes(wg.flatten(-2), step.squeeze(-1)).long()].unflatten(-1, (G, -1)) * step

    best = _search(w.reshape(E, out, G, n // G), range(len(cand)), dequant, weights)
    return torch.gather(torch.stack(cand, -1), -1, best[..., None])[..., 0]


def mxfp4(w: torch.Tensor, base: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """MXFP4 scales [E, out, G] (powers of two in w's dtype) for w [E, out, in] whose min/max scales are `base`:
    that exponent, the one above (fewer values clipped at 6, coarser steps) or the one below (finer steps, the
    largest clipped)."""
    E, out, n = w.shape
    G = base.shape[-1]
    cand = [base, base * 2, base / 2]

    def dequant(k: int, piece: tuple[slice, slice], wg: torch.Tensor) -> torch.Tensor:
        step = cand[k][piece].float()[..., None]
        return fp4.VALUES.to(w.device)[fp4.codes(wg.flatten(-2), step.squeeze(-1)).long()].unflatten(-1, (G, -1)) * step

    best = _search(w.reshape(E, out, G, n // G), range(len(cand)), dequant, weights)
    return torch.gather(torch.stack(cand, -1), -1, best[..., None])[..., 0]
