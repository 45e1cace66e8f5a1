"""A decoder layer's dense Linears tuned on the layer's output after GPTQ (quant/signround.py), on rank 0.

GPTQ has chosen every code against its Linear's own inputs; the tuning moves the codes near a rounding boundary
and the groups' scales so that the whole layer's output, through attention and the MLP's gate, comes closer to the
float model's. The target is the float model's own path (SignRound's): the float layer's output on the float
layers' inputs, while the quantized layer runs on the quantized layers' inputs. So each layer may also take back
some of the error its inputs carry from the layers before it. The engine keeps that float path for the tuned
samples (engine/layerwise.py) and hands the targets in. The samples tuned on are a fixed subset of all the
samples (never of one rank's share), and the batches are drawn from them by a seeded generator: the same bytes on
any number of ranks.

The result is kept only if it lowers the layer's output error over the whole subset below GPTQ's: a layer the
tuning does not help keeps GPTQ's codes and scales exactly, also where the tuning started from round to nearest
(quant/signround.py: START_FROM_RTN).
"""

from collections.abc import Callable

import torch

from quantize.quant import signround
from quantize.quant.signround import Tunable

# forward(samples, weights): the layer's output for each of `samples` (a list of [1, tokens, hidden]), its modules'
# weights replaced by `weights` (module name -> weight); run with gradients when `weights` needs them
Forward = Callable[[list[int], dict[str, torch.Tensor]], list[torch.Tensor]]


def subset(n_samples: int, count: int) -> list[int]:
    """`count` sample indices spread evenly over n_samples (all of them when there are no more)."""
    if count >= n_samples:
        return list(range(n_samples))
    return [k * n_samples // count for k in range(count)]


def tune_layer(forward: Forward, targets: dict[int, torch.Tensor], tunables: dict[str, Tunable], iters: int,
               batch: int, dtype: torch.dtype, seed: int,
               gptq: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
    """Tune `tunables` (by their module names in the layer) towards `targets` (sample -> the float path's output).

    Each step takes `batch` samples through one forward. gptq: GPTQ's dequantized weights by module name, where
    the tunables did not start from them (else their start is GPTQ's). Returns the mean squared output error over
    all the samples under GPTQ's weights and after the steps; when after is not lower, every tunable is reset to
    its start and the caller keeps GPTQ's codes and scales."""
    samples = list(targets)

    def weights(given: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        if given is not None:
            return {f"{m}.weight": w for m, w in given.items()}
        return {f"{m}.weight": t.weight(dtype) for m, t in tunables.items()}

    def loss(chunk: list[int], w: dict[str, torch.Tensor]) -> torch.Tensor:
        ys = forward(chunk, w)
        return sum(_mse(y, targets[s]) for s, y in zip(chunk, ys, strict=True)) / len(chunk)

    def error(given: dict[str, torch.Tensor] | None = None) -> float:
        with torch.no_grad():
            w = weights(given)
            return sum(float(loss(c, w)) * len(c) for c in chunks(samples, batch)) / len(samples)

    before = error(gptq)
    gen = torch.Generator().manual_seed(seed)
    for it in range(iters):
        order = torch.randperm(len(samples), generator=gen)[:batch].tolist()
        with torch.enable_grad():
            loss([samples[k] for k in order], weights()).backward()
        lr = signround.schedule(it, iters)
        for t in tunables.values():
            t.step(lr)
    after = error()
    if after >= before:
        for t in tunables.values():
            t.reset()
    return before, after


def chunks(xs: list[int], n: int) -> list[list[int]]:
    """xs in consecutive runs of n (the last may be shorter)."""
    return [xs[k:k + n] for k in range(0, len(xs), n)]


def _mse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(y.float(), target.float())
