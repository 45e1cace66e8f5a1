"""AWQ (Lin et al., 2023, arXiv:2306.00978): per input channel scales s that move quantization difficulty from
weights to activations. A smooth layer's output is divided by s and the Linears that consume it (the balance
layers) are multiplied by s, which leaves the float model unchanged; s is picked by a grid search that
minimizes the error of the quantized balance layers on recorded inputs.

The search space follows llm-compressor's AWQModifier (duo scaling, 20 grid points, the identity first):
s = x_mean^r / (w_mean^(1-r) + 1e-4), normalized by sqrt(max * min). The loss is a callable: the engine measures
it at the output of the module that holds the balance layers (attention, MLP), `linear_loss` at each layer's own
output.
"""

from collections.abc import Callable

import torch
from torch.nn import functional as F

from quantize.quant.rtn import fake_quantize


def grid(n_grid: int = 20) -> list[tuple[float, bool]]:
    """(ratio, duo_scaling) pairs: the identity (0, plain) first, then n_grid - 1 duo-scaled ratios in [0, 1]."""
    return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]


def weight_sums(weights: list[torch.Tensor], group_size: int) -> tuple[torch.Tensor | int, int]:
    """The sum over output rows of |W| normalized by its group's max, per input channel (float64), and the rows:
    weight_mean's parts, which a MoE layer's expert groups add up on their own ranks."""
    total, rows = 0, 0
    for w in weights:
        g = w.float().abs().reshape(-1, group_size)
        g = (g / (g.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape)
        total = total + g.sum(0, dtype=torch.float64)
        rows += w.shape[0]
    return total, rows


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over output rows of |W| normalized by its group's max, per input channel, over all balance layers."""
    total, rows = weight_sums(weights, group_size)
    return (total / rows).float()


def candidate(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool) -> torch.Tensor:
    if duo:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(ratio).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    s[torch.isinf(s) | torch.isnan(s)] = 1
    return s


def scaled_fake_quant(w: torch.Tensor, s: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """Q(W * s) / s in w's dtype: what the balance layer computes after smoothing and quantization."""
    ws = (w.float() * s).to(w.dtype)
    return (fake_quantize(ws, group_size, symmetric=symmetric).float() / s).to(w.dtype)


def linear_loss(layers: list[tuple[torch.Tensor, torch.Tensor]], group_size: int, symmetric: bool = True):
    """Loss over scales: mean squared error of each balance layer's own output, [(W [out, in], X [tokens, in])]."""
    layers = [(w, x.to(w.dtype)) for w, x in layers]  # outputs in the model's dtype, as the served layer computes them
    refs = [(x @ w.t()).float() for w, x in layers]

    def loss(s: torch.Tensor) -> float:
        err, n = 0.0, 0
        for (w, x), ref in zip(layers, refs, strict=True):
            out = (x @ scaled_fake_quant(w, s, group_size, symmetric).t()).float()
            err += float((out - ref).pow(2).sum())
            n += ref.numel()
        return err / max(n, 1)

    return loss


def candidates(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int = 20) -> list[tuple[float, torch.Tensor]]:
    """(ratio, scales) of every grid point, the identity first."""
    return [(ratio, candidate(x_mean, w_mean, ratio, duo)) for ratio, duo in grid(n_grid)]


def pick(cands: list[tuple[float, torch.Tensor]], losses: list[float]) -> tuple[torch.Tensor, float, float, float]:
    """(scales, ratio, loss with identity scales, best loss): the first candidate of least loss."""
    best = (None, -1.0, float("inf"))
    for (ratio, s), value in zip(cands, losses, strict=True):
        if value < best[2]:
            best = (s.clone(), ratio, value)
    return best[0], best[1], losses[0], best[2]


def search(
    x_mean: torch.Tensor,
    weights: list[torch.Tensor],
    loss: Callable[[torch.Tensor], float],
    group_size: int,
    n_grid: int = 20,
) -> tuple[torch.Tensor, float, float, float]:
    """Best scales [in] (float32) for balance layer weights sharing one input of mean |x| `x_mean` [in].

    `loss(s)` is the error with every quantized balance layer computing Q(W * s) / s. Returns (scales, best
    ratio, loss with identity scales, best loss).
    """
    cands = candidates(x_mean, weight_mean(weights, group_size), n_grid)
    return pick(cands, [loss(s) for _, s in cands])


ERROR_ROWS = 8192  # an expert's tokens go into expert_errors this many rows at a time (fixed: the same sums always)


def expert_errors(x: torch.Tensor, route_weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, act_fn, scales: list[torch.Tensor], group_size: int,
                  symmetric: bool = True, quantized: tuple[bool, bool] = (True, True)) -> torch.Tensor:
    """One routed expert's share of the loss of a norm that feeds it, for each candidate scales s: the squared
    error of its weighted output, sum over rows of ||w (E_s(x) - E(x))||^2 (float64, [len(scales)]), where E_s's
    gate and up compute Q(W * s) / s. x [rows, in] are the tokens routed to it and route_weights [rows] the
    router's weights of it; the weights are in the compute dtype, as the layer runs them. `quantized`: whether
    gate and up are quantized (a balance layer left float is scaled, never rounded)."""
    def forward(g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(act_fn(F.linear(rows, g)) * F.linear(rows, u), down).float() * w[:, None]

    blocks = [(x[r:r + ERROR_ROWS], route_weights[r:r + ERROR_ROWS].float()) for r in range(0, x.shape[0], ERROR_ROWS)]
    refs = [forward(gate, up, rows, w) for rows, w in blocks]
    out = torch.zeros(len(scales), dtype=torch.float64)
    for c, s in enumerate(scales):
        g, u = (scaled_fake_quant(w, s, group_size, symmetric) if q else w
                for w, q in zip((gate, up), quantized, strict=True))
        for (rows, w), ref in zip(blocks, refs, strict=True):
            out[c] += float((forward(g, u, rows, w) - ref).pow(2).sum(dtype=torch.float64))
    return out
