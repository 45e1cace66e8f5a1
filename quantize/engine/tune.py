"""A decoder layer's dense Linears tuned on the layer's output after GPTQ (quant/signround.py), on rank 0.

GPTQ has chosen every code against its Linear's own inputs; the tuning moves the codes near a rounding boundary
and the groups' scales so that the whole layer's output, through attention and the MLP's gate, comes closer to the
float layer's output on the same inputs. The float outputs are computed here, from the layer before any of its
quantized weights is committed. The samples tuned on are a fixed subset of all the samples (never of one rank's
share), and the batches are drawn from them by a seeded generator: the same bytes on any number of ranks.

The result is kept only if it lowers the layer's output error over the whole subset: a layer the tuning does
not help keeps GPTQ's codes and scales exactly.
"""

from collections.abc import Callable

import torch

from quantize.quant import signround
from quantize.quant.signround import Tunable


def subset(n_samples: int, count: int) -> list[int]:
    """`count` sample indices spread evenly over n_samples (all of them when there are no more)."""
    if count >= n_samples:
        return list(range(n_samples))
    return [k * n_samples // count for k in range(count)]


def tune_layer(forward: Callable[[int, dict[str, torch.Tensor] | None], torch.Tensor], samples: list[int],
               tunables: dict[str, Tunable], iters: int, batch: int, dtype: torch.dtype,
               seed: int) -> tuple[float, float]:
    """Tune `tunables` (by their module names in the layer) on the layer's output over `samples`.

    forward(s, weights): the layer's output for sample s, its modules' weights replaced by `weights` (module
    name -> weight; None: the layer as it is, its float weights); run with gradients enabled when `weights`
    needs them. Returns the mean squared output error over the samples before and after; when after is not
    lower, every tunable is reset to GPTQ's codes and scales."""
    with torch.no_grad():
        targets = {s: _output(forward(s, None)) for s in samples}

    def weights() -> dict[str, torch.Tensor]:
        return {f"{m}.weight": t.weight(dtype) for m, t in tunables.items()}

    def error() -> float:
        with torch.no_grad():
            return sum(float(_loss(forward(s, weights()), targets[s])) for s in samples) / len(samples)

    before = error()
    gen = torch.Generator().manual_seed(seed)
    for it in range(iters):
        order = torch.randperm(len(samples), generator=gen)[:batch].tolist()
        with torch.enable_grad():
            for k in order:
                s = samples[k]
                (_loss(forward(s, weights()), targets[s]) / len(order)).backward()
        lr = signround.schedule(it, iters)
        for t in tunables.values():
            t.step(lr)
    after = error()
    if after >= before:
        for t in tunables.values():
            t.reset()
    return before, after


def _output(y) -> torch.Tensor:
    return y[0] if isinstance(y, tuple) else y


def _loss(y, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(_output(y).float(), target.float())
