"""A decoder layer's dense Linears (all of them unless a recipe keeps the attention's inputs: `tuned`) tuned on the
layer's output after GPTQ (quant/signround.py), on rank 0.

GPTQ has chosen every code against its Linear's own inputs; the tuning moves the codes near a rounding boundary
and the groups' scales so that the whole layer's output, through attention and the MLP's gate, comes closer to the
float model's. The target is the float model's own path (SignRound's): the float layer's output on the float
layers' inputs, while the quantized layer runs on the quantized layers' inputs. So each layer may also take back
some of the error its inputs carry from the layers before it. The engine keeps that float path for the tuned
and held-out samples (engine/layerwise.py) and hands the targets in. Those are a fixed subset of all the
samples (never of one rank's share), and the batches are drawn from them by a seeded generator: the same bytes on
any number of ranks.

The error is each output channel's squared error over that channel's mean square in the targets (every tuned
and held-out sample's tokens), so that every channel weighs alike in relative terms. Plain squared error is set by
a few massive channels: Gemma 3 keeps one channel at 72 to 85% of its residual stream's energy on every token (the
median channel's mean square is 1e5 to 1e6 times smaller), and the steps then bought that channel's accuracy with
the other 639's. 1 / a channel's mean square is about what the next layer's RMSNorm weighs it by: on Gemma 3 its
log correlates with that of the next norm's squared weight at 0.84 to 0.96. The last layer has no next layer:
its error is measured through the model's final norm and lm_head, as the logits' KL divergence to second order
(Head), with smaller steps (HEAD_RATE); so is the error of the HEAD_LAYERS - 1 layers before it, their own output
read through the same norm and lm_head (the logit lens).

The result is kept only if it lowers the layer's output error below GPTQ's, over the tuned samples or, with
`tune_holdout`, over that many others held out of the steps (spread between the tuned ones). A layer the tuning does
not help keeps GPTQ's codes and scales exactly, also where the tuning started from round to nearest
(quant/signround.py: START_FROM_RTN); not before its moves halved were judged too (SHRINK). The steps overfit the
tuned samples: on Gemma 3 the error over them fell about 20% in most layers while over held-out ones it rose (layer
0: 1.40x and 1.70x; layers 1 to 4: 0.72 to 0.82x against 1.01 to 1.10x); on SmolLM2 both fall (about 25% and 6%).
Measured, W4A16 g64, 40 steps, the dithered builds: on Gemma 3 (draw 0; GPTQ alone 70.08) the plain error judged on
the tuned samples gave perplexity 84.07, judged on held-out ones 71.46; the per-channel error 72.58 and 68.64. On
SmolLM2 (four draws) judging on held-out samples cost 0.66 (31.70 against 31.04), so it is not the default.

Where SmolLM2's first token turns massive (layer 11; from there on its hidden state is 185x the median token's
norm), that one token carried 18% of the layer's error under GPTQ, and the steps made it oscillate (batch errors
0.16, 2.01, 0.20, 1.86, ...) until the layer's error was 6-7x GPTQ's and the layer kept GPTQ's bytes. Weighing each
token by 1 / its target's mean square (what the next RMSNorm does) mends the layer (29 of 30 layers kept), and so
does capping the weight of tokens over 100x the median's mean square, but neither moved the perplexity beyond the
draws' spread (per-token: 32.08 / 30.88 / 31.24 / 30.92 against 30.98 / 30.84 / 32.04 / 30.51; capped, draws 0
and 2: 31.22 / 31.93): not kept.

Measured and not kept either (dithered SmolLM2, W4A16 g64, draws 0 / 1, where the default gives 31.09 / 30.66; Intel
Xeon with AMX, torch capability AVX512): 50 steps, auto-round light's count, 31.65 / 31.30 (each layer's error over
the tuned samples 1-3% lower than after 40); each Linear's weight first corrected for the error its inputs carry
(GPTAQ's asymmetric calibration: W + W dX^T X~ (X~^T X~ + damping)^-1 from the tuned samples' float and quantized
inputs, then GPTQ) 32.88 / 33.72, a tenth damped 33.32 and 0.3 of the correction 32.33 (draw 0): GPTQ's error on
the layer's output rose from layer 3 on (layer 3: 0.075 against 0.057) even over the samples it was fitted on; and
the post-attention norm's weight tuned beside the codes (Norm Tweaking, signed steps of 0.2% of each weight) 32.43 /
32.21, the layers' errors as the default's to 0.01. Nor keeping the best of a layer's tunings after steps 10, 20,
30 and 40 (auto-round keeps its best step): draws 0 / 1 gave the default's perplexity to the last digit, each
layer's error being least after step 40 or, in layers 0, 11 and 28, above GPTQ's after every one of the four.

A MoE layer is not tuned: its routed experts are streamed apart, so its output is not at hand here. Each stack of
experts tuned on its own output instead (batched, every expert kept only where its held-out error dropped) was
measured on SmolLM2 rewritten as 8 experts (scripts/upcycle_moe.py; W4A16 g64, draw 0, GPTQ alone 33.81): towards
the float expert on the quantized inputs 34.20 (239 of 240 experts' error rose), towards the float model's path
carried through the MoE layers 48.97 (225 of 240 kept, their held-out error about 0.6x). Not kept (README).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from quantize.quant import signround
from quantize.quant.signround import Tunable

# grids tuned under plain squared error instead of the per-channel one, by measurement (dithered SmolLM2, 40 steps):
# MXFP4 draws 0 / 1 gave 31.41 / 31.41 under plain squared error and 32.04 / 33.91 under the per-channel error, where
# NVFP4 went from 30.20 to 29.95 (draw 0) and INT4 g64 moved by +0.09 +- 0.17 over four draws (Gemma 3: 84.07 to
# 72.58). Not understood: MXFP4's steps start from round to nearest and move each group's power of two
PLAIN_ERROR = ("mxfp4",)


def tuned(module: str, attention: bool | None = None) -> bool:
    """Whether a Linear of a dense layer (its name in the layer, e.g. "self_attn.q_proj") is tuned: all of them,
    but the attention's inputs (q/k/v, MLA's q_a/q_b/kv_a/kv_b, an indexer's) where `attention`, the recipe's gptq
    tune_attention, is false (tunes_attention): they then keep GPTQ's codes and scales and run quantized in the
    steps, and the steps skip attention (engine/attention_cache.py).

    Their gradient crosses attention's backward, on a CPU the steps' largest cost: in a SmolLM2 step (4 x 512
    tokens, bf16, Intel Xeon with AMX) the flash-attention backward took 22 ms against its forward's 4, and the whole
    backward 3x the forward. So INT4 left them out until issue 39: measured on the dithered SmolLM2 (W4A16 g64, 40
    steps, draws 0 / 1 / 2 / 3), the converts took 14-16% less time and the perplexity moved within the draws'
    spread (mean 31.20 against 31.09, paired +0.11 +- 0.25). With all 128 of the bench's samples tuned on, and the
    tuning judged on JUDGED of them and its outputs kept in place of the quantized pass's, tuning them is the better
    INT4 and within the time (README, issue 39). On NVFP4 leaving them out cost 0.22 and 0.35 (draws 0 / 2: 30.17 /
    31.07 against 29.95 / 30.72)."""
    attention_input = module.startswith("self_attn.") and not module.endswith("o_proj")
    return not attention_input or tunes_attention(attention)


def tunes_attention(attention: bool | None = None) -> bool:
    """Whether the attention's inputs are tuned (tuned's rule) under the recipe's gptq tune_attention: unless it is
    false. The report and the model card say which."""
    return attention is not False


# The last HEAD_LAYERS decoder layers are tuned on the logits (Head): the last through the model's final norm and
# lm_head, the ones before it through the same (the logit lens: the layers after them taken as the residual's
# identity). Measured: the docstring of Head
HEAD_LAYERS = 4
# Their rate: the grid's LR and SCALE_LR times this
HEAD_RATE = 0.2
# the grids whose last layers are so measured: INT4's and NVFP4's, where it was measured (NVFP4: the docstring of
# Head); MXFP4's keep their plain error, measured the better (the docstring of Head)
HEAD_GRIDS = ("int4", "nvfp4")
HEAD_CHUNK = 256  # tokens a pass over the vocabulary takes while the Fisher information is summed
# the Fisher information is summed over about this many of the targets' tokens (every k-th of each sample's): a pass
# over the vocabulary per token is the head's cost (SmolLM2's 49152 x 576 on 2 cores of an AMD EPYC: 4096 tokens
# took 4.2 s, and the tuning's 32 x 512 are four times as many)
HEAD_TOKENS = 4096


def on_logits(layer: int, layers: int, grid: str = "int4") -> bool:
    """Whether decoder layer `layer` of a model's `layers` has its tuning measured through the logits (Head): one of
    the last HEAD_LAYERS, on a grid of HEAD_GRIDS. The engine and the memory account both ask this."""
    return layer >= layers - HEAD_LAYERS and grid in HEAD_GRIDS


@dataclass
class Head:
    """What follows the last decoder layer: the model's final norm (a float32 module) and lm_head's weight [vocab,
    hidden] (the embedding's where they are tied). The last layer's error is measured through them, as the KL
    divergence of the quantized model's next-token distribution from the float model's, to second order: for a
    token whose float logits give p, KL(p || softmax(z + dz)) ~ 1/2 dz^T (diag p - p p^T) dz, and dz = W dn for a
    change dn of the normed hidden state. So the error is 1/2 dn^T F dn, F being W^T (diag p - p p^T) W averaged
    over the targets' tokens (`fisher`, [hidden, hidden] float32): cheap in each step, where the exact KL would
    take lm_head's forward and backward (SmolLM2: 49152 x 576 for every token), and in float32, where bf16 logits
    round by more than the layer's quantization moves them.

    Why: the last layer is where quantization costs the most. With one layer of the float dithered SmolLM2 taken at
    a time from our W4A16 g64 output (draw 0, perplexity 27.86 in bf16), the last layer alone raised it by 3.2%,
    layer 28 by 1.5, layer 9 by 1.4, no other by more than 1.2 (auto-round light's and default's last layer: 5.0%
    and 3.4%). Its output's error per channel fell only 1 to 7% in the steps, and all the model reads of it is the
    logits. Measured (W4A16 g64, dithered SmolLM2, 40 steps, two converts side by side on an Intel Xeon with AMX,
    torch capability AVX512): at the grid's rate the steps raised this error 1.3x (GPTQ's bytes kept), at
    HEAD_RATE of it they lowered it about 4%, and the perplexity over draws 0 / 1 / 2 / 3 went from 31.09 / 30.66
    / 31.72 / 31.32 to 30.68 / 30.53 / 31.17 / 31.19 (this code, converts run alone; mean 31.20 to 30.89, paired
    -0.31 +- 0.11, lower on every draw; auto-round light 31.17 / 30.91 / 30.46 / 30.98). Gemma 3 (draw 0): 78.52
    to 77.58. The rate alone is not it: the per-channel error at
    HEAD_RATE gave 31.04 / 31.01 (draws 0 / 1; its error fell 6-7%). The exact KL through bf16 logits rose under
    the steps (draws 0 / 1, 0.029 to 0.036: GPTQ's bytes kept, 30.90 / 30.79), as did the Fisher error at the
    grid's rate.

    The layers just before the last are read through the same head: their own output through the final norm and
    lm_head (the logit lens, the layers after them taken as the residual stream's identity), with p from their own
    targets. Under the per-channel error the steps made layer 28 of SmolLM2's 30 worse (draw 0: 5.40 to 8.36, GPTQ's
    bytes kept); through the head they lowered its error 8%. Measured on an AMD EPYC (torch capability AVX512, 2
    cores, two converts side by side; bf16 rounds otherwise there, so the same convert gives other perplexities than
    on the Intel Xeon above): the last layer alone gave 31.65 / 31.38 / 31.21 / 30.85 over draws 0 / 1 / 2 / 3, the
    last four (HEAD_LAYERS, the Fisher information over HEAD_TOKENS) 31.25 / 30.80 / 30.91 / 30.97 (mean 31.27 to
    30.98, paired -0.29 +- 0.15, lower on three draws of four); the last two 31.51 and the last eight 31.75 on draw
    0, the lens misleading from some depth on.

    Measured about the four and not kept (the same machine; the last four layers run again from the layer checkpoint
    entering layer 26, which gives the whole convert's perplexity to the last digit: 31.25 / 30.80 on draws 0 / 1;
    draw 0 alone where one figure is given): the stride centred, every k-th token from the k/2-th (from the first,
    as now, each sample's first token, SmolLM2's massive one, is always read and weighs k times its share), 31.22 /
    31.08; the Fisher information over every token 31.25; HEAD_RATE 0.1 31.50 and 0.4 31.49; the head's error plus
    the per-channel one, each over its value under GPTQ's bytes, 31.52; 64 tuned samples in the four 31.95; twice
    the steps at half the rate 31.15, in 1.5x the four layers' time. On the default since (its rate 0.03, 128 samples,
    SHRINK; the four run again from the checkpoint entering layer 26), the last layer's alone so, 80 steps at half
    its rate: its error 0.98x GPTQ's to 0.95x on every draw, the perplexity -0.05 +- 0.10 over draws 0-3 (lower on
    two of four; README, issue 39).

    NVFP4's last four are so measured too (HEAD_GRIDS), at HEAD_RATE of its rates, where they were measured under
    the per-channel error before. The same machine, the four run again from the checkpoint entering layer 26 (draws
    2 and 3 before: whole converts), dithered SmolLM2 NVFP4A16, draws 0 / 1 / 2 / 3: 30.08 / 30.27 / 29.98 / 30.08
    to 29.57 / 30.49 / 29.64 / 29.65 (mean 30.10 to 29.84, paired -0.27 +- 0.17, lower on three draws of four).

    MXFP4's (plain squared error, steps from round to nearest, 32 tuned samples) were measured so and are not (the
    same machine, dithered SmolLM2 MXFP4A16; the layers from 26 on run again under the change from the checkpoint
    entering layer 26 on draw 0, 22 on draws 1 / 2, against the whole converts' 31.41 / 31.41 / 31.20, which the
    unchanged code so resumed gives to the last digit): at HEAD_RATE 31.61 (draw 0; layers 27-29 kept GPTQ's bytes:
    a fifth of the rate does not carry round to nearest past GPTQ's error); at the grid's whole rate 30.91 / 32.01 /
    31.59 (+0.16 on the mean, higher on two draws of three; layer 29 kept GPTQ's bytes on each); from GPTQ's values
    at HEAD_RATE, as NVFP4 is, 31.57 (draw 0, every one of the four keeping its tuning)."""

    norm: nn.Module
    weight: torch.Tensor
    fisher: torch.Tensor

    @classmethod
    def of(cls, norm: nn.Module, weight: torch.Tensor, targets: list[torch.Tensor]) -> "Head":
        """The head whose Fisher information is averaged over `targets`' tokens (the float path's outputs of the
        layer, [1, tokens, hidden] each): every k-th token of each, k such that about HEAD_TOKENS are read."""
        w = weight.float()
        a = torch.zeros(w.shape[1], w.shape[1], device=w.device)
        mass = torch.zeros(w.shape[0], device=w.device)  # each token of the vocabulary's summed probability
        n = 0
        stride = max(1, sum(t.shape[:-1].numel() for t in targets) // HEAD_TOKENS)
        with torch.no_grad():
            for t in targets:
                x = norm(t.reshape(-1, t.shape[-1])[::stride].float())
                for k in range(0, x.shape[0], HEAD_CHUNK):
                    p = torch.softmax(x[k:k + HEAD_CHUNK] @ w.T, -1)
                    mass += p.sum(0)
                    m = p @ w
                    a -= m.T @ m
                    n += p.shape[0]
            fisher = ((w.T * mass) @ w + a) / max(n, 1)
        return cls(norm, weight, fisher)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """float32 [..., vocab]: the logits of hidden states `y` leaving the last layer."""
        return self.norm(y.float()) @ self.weight.float().T

    def error(self, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """1/2 dn^T F dn averaged over the tokens: about the mean KL divergence of y's next-token distribution from
        the target's, in nats."""
        d = self.norm(y.float()) - self.norm(target.float())
        return 0.5 * ((d @ self.fisher) * d).sum(-1).mean()


# The tuning's error before and after the steps is judged over this many of the tuned samples (spread among them)
# where none are held out: each judgement is two passes over them, and over 128 tuned samples those passes were a
# third of the tuning's time. Measured: README, issue 39
JUDGED = 32

# Where the steps did not lower the judged error, their moves are shrunk by each factor in turn (offsets and scale
# factors towards GPTQ's start), each judged once more, before the layer keeps GPTQ's bytes: one pass over the
# judged samples each, in the layers that would have kept GPTQ's bytes alone. Measured: README, issue 39
SHRINK = (0.5,)
# the grids so judged: INT4's, where it was measured. On NVFP4 (dithered SmolLM2, draw 0) the halving kept layer 0's
# tuning (0.96x its GPTQ error, 1.05x after the steps) and the perplexity rose from 29.57 to 30.42: layer 0's error
# over its tuned samples does not say what its tuning does to the model (INT4's layer 0 retried at a lower rate:
# README, issue 39)
SHRINK_GRIDS = ("int4",)

# forward(samples, weights): the layer's output for each of `samples` (a list of [1, tokens, hidden]), its modules'
# weights replaced by `weights` (module name -> weight); run with gradients when `weights` needs them
Forward = Callable[[list[int], dict[str, torch.Tensor]], list[torch.Tensor]]


def subset(n_samples: int, count: int) -> list[int]:
    """`count` sample indices spread evenly over n_samples (all of them when there are no more)."""
    if count >= n_samples:
        return list(range(n_samples))
    return [k * n_samples // count for k in range(count)]


def split(samples: list[int], holdout: int) -> tuple[list[int], list[int]]:
    """(tuned, held out): `holdout` of `samples` spread evenly among them (at most half, so that as many are tuned
    on), the midpoints of equal runs; the rest are tuned on."""
    h = min(holdout, len(samples) // 2)
    held = {k * len(samples) // h + len(samples) // (2 * h) for k in range(h)} if h else set()
    return [s for k, s in enumerate(samples) if k not in held], [s for k, s in enumerate(samples) if k in held]


def tune_layer(forward: Forward, targets: dict[int, torch.Tensor], tunables: dict[str, Tunable], iters: int,
               batch: int, dtype: torch.dtype, seed: int,
               gptq: dict[str, torch.Tensor] | None = None, held: list[int] | None = None,
               per_channel: bool = True, fixed: dict[str, torch.Tensor] | None = None,
               head: Head | None = None, final: Callable[[], dict[str, torch.Tensor]] | None = None,
               emit: Callable[[int, torch.Tensor], None] | None = None) -> tuple[float, float]:
    """Tune `tunables` (by their module names in the layer) towards `targets` (sample -> the float path's output).

    Each step takes `batch` of the samples not in `held` through one forward. gptq: GPTQ's dequantized weights by
    module name, where the tunables did not start from them (else their start is GPTQ's). Returns the output error
    (_error) over the `held` samples (else over JUDGED of the tuned ones, spread among them) under GPTQ's weights and
    after the steps, under `final()` where given (the tunables' weights as they will be stored: their scales
    rounded to the stored dtype), else under their tuned weights. Where after is not lower, the moves are shrunk
    (SHRINK) and judged again; where that does not lower it either, every tunable is reset to its start and the
    caller keeps GPTQ's codes and scales. emit: where the tuning is kept, called with each target sample and the
    layer's output under the kept weights (the judged samples' from the pass that judged them, the others' computed
    after it), which the caller may keep in place of running the layer again.
    per_channel: the error weighs each channel by channel_weights (else plain squared error). fixed: the
    dequantized weights of the layer's quantized Linears that are not tuned (module name -> weight), in every
    forward, so that the error is the quantized layer's. head: the model's end where this is its last layer: the
    error is then Head.error, and the steps take HEAD_RATE of the grid's rates."""
    held = held or []
    samples = [s for s in targets if s not in held]

    def weights(given: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        base = {f"{m}.weight": w for m, w in (fixed or {}).items()}
        if given is not None:
            return base | {f"{m}.weight": w for m, w in given.items()}
        return base | {f"{m}.weight": t.weight(dtype) for m, t in tunables.items()}

    channel = channel_weights(list(targets.values())) if per_channel and head is None else None
    measure = head.error if head is not None else lambda y, t: _error(y, t, channel)

    def loss(chunk: list[int], w: dict[str, torch.Tensor]) -> torch.Tensor:
        ys = forward(chunk, w)
        return sum(measure(y, targets[s]) for s, y in zip(chunk, ys, strict=True)) / len(chunk)

    def error(given: dict[str, torch.Tensor] | None = None, over: list[int] = (),
              outputs: dict[int, torch.Tensor] | None = None) -> float:
        total = 0.0
        with torch.no_grad():
            w = weights(given)
            for c in chunks(over, batch):
                ys = forward(c, w)
                total += sum(float(measure(y, targets[s])) for s, y in zip(c, ys, strict=True))
                if outputs is not None:
                    outputs |= {s: y.detach() for s, y in zip(c, ys, strict=True)}
        return total / len(over)

    judged = held or [samples[k] for k in subset(len(samples), JUDGED)]
    before = error(gptq, judged)
    gen = torch.Generator().manual_seed(seed)
    for it in range(iters):
        order = torch.randperm(len(samples), generator=gen)[:batch].tolist()
        with torch.enable_grad():
            loss([samples[k] for k in order], weights()).backward()
        lr = signround.schedule(it, iters) * (HEAD_RATE if head is not None else 1.0)
        for t in tunables.values():
            t.step(lr)
    for f in (1.0, *(SHRINK if all(t.grid in SHRINK_GRIDS for t in tunables.values()) else ())):
        for t in tunables.values():
            t.shrink(f)
        stored = final() if final is not None else None
        outputs: dict[int, torch.Tensor] | None = {} if emit is not None else None
        after = error(stored, judged, outputs)
        if after < before:
            break
    if after >= before:
        for t in tunables.values():
            t.reset()
    elif emit is not None:
        for s, y in outputs.items():
            emit(s, y)
        del outputs
        rest = [s for s in targets if s not in set(judged)]
        with torch.no_grad():
            w = weights(stored)
            for c in chunks(rest, batch):
                for s, y in zip(c, forward(c, w), strict=True):
                    emit(s, y.detach())
    return before, after


def chunks(xs: list[int], n: int) -> list[list[int]]:
    """xs in consecutive runs of n (the last may be shorter)."""
    return [xs[k:k + n] for k in range(0, len(xs), n)]


def channel_weights(targets: list[torch.Tensor]) -> torch.Tensor:
    """[hidden] float32: 1 / each channel's mean square over the targets' tokens (a floor of 1e-6 of the mean
    channel's keeps a silent channel finite), scaled to a mean of 1."""
    with torch.no_grad():
        ms = sum(t.float().pow(2).flatten(0, -2).mean(0) for t in targets) / len(targets)
        w = 1.0 / (ms + 1e-6 * ms.mean())
        return w / w.mean()


def _error(y: torch.Tensor, target: torch.Tensor, per_channel: torch.Tensor | None) -> torch.Tensor:
    """The mean of each element's squared error times its channel's weight (channel_weights; None: plain)."""
    if per_channel is None:
        return torch.nn.functional.mse_loss(y.float(), target.float())
    return ((y.float() - target.float()).pow(2) * per_channel).mean()
