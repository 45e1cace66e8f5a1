"""Sign-gradient rounding seeded from GPTQ (SignRound: Cheng et al., 2023, arXiv:2309.05516), for symmetric INT4
and FP4 (NVFP4, MXFP4).

GPTQ chooses each code against its own Linear's inputs, one column at a time. What serving sees is the decoder
layer's output, through attention's softmax and the MLP's gate. SignRound tunes, per layer, an offset V in
[-0.5, 0.5] added to each weight's value before rounding and a factor on each group's scale, by signed gradient
steps on the layer's output error (a straight-through estimate of the rounding's gradient). Here the values are
not w / scale but GPTQ's own: the updated weight over its step at the moment GPTQ rounded it, so V = 0 gives GPTQ's
codes exactly and the steps start from them, where SignRound starts from round to nearest. The stored format is
unchanged: int codes in [q_min, q_max] and one positive scale per group, in the model's dtype; or e2m1 codes under
NVFP4's e4m3 scales (the tuned scale is rounded to e4m3 in every forward, straight through, so what is tuned is
what is stored) or MXFP4's powers of two, whose exponent is tuned instead: a continuous shift per group, rounded
to -1, 0 or +1 in every forward (straight through), so a group may halve or double its step after the scale
search chose it by weight error alone (auto-round tunes the same exponent, as floor(log2(max * ms)) with ms in
(0, 1]). Under a shifted step the values are divided by 2^shift, exactly in float32, and the shift's gradient is
the rounding residual of each value (its clipped ones pushing the step up), as a learned step size's is. From
GPTQ's start, on the dithered SmolLM2 (draw 0), tuning the exponent took MXFP4 from perplexity 33.00 to 32.74.

e2m1 is no uniform grid: its spacing is 0.5 below 2, 1 below 4 and 2 up to 6. NVFP4 adds the offset in units of 1,
as auto-round does: below 2 V = +-0.5 reaches a whole code away, between 4 and 6 only values within 0.5 of the
boundary at 5 can move. MXFP4 counts it in the spacing where each value lies (SPACING_OFFSET), so that V = +-0.5
reaches the next rounding boundary anywhere on the grid. On NVFP4 units of 1 were measured the better (dithered
SmolLM2, draw 3: 30.26 against 30.73 over 32 tuned samples, 29.55 against 30.00 over 128): most of a group's
values lie below 2 under a scale set by its largest, and there the steps may move them twice as far. On MXFP4
units of 1 were measured since (AMD EPYC, torch capability AVX512, 2 cores; whole converts of dithered SmolLM2,
draws 0 / 1 / 2 / 3): 31.00 / 30.79 / 32.14 / 31.26 against the spacing's 31.41 / 31.41 / 31.20 / 31.44 (mean 31.30
against 31.36, paired -0.07 +- 0.35: within the draws' spread), and over all 128 samples (NVFP4's pair of changes)
32.71 on draw 0. Not kept: one rule would be the simpler code, but not a measured gain.

MXFP4 starts from round to nearest under the searched exponents instead (START_FROM_RTN), as auto-round does: on
the dithered SmolLM2 (draw 0, 40 steps) GPTQ's values tuned gave perplexity 32.74 and round to nearest's 31.63,
where GPTQ's start was the better on NVFP4 (30.20 against 31.08) and on INT4 g64 (30.36 against 31.48). The layer
still keeps GPTQ's bytes where its output error is the lower (engine/tune.py).

Pure tensor functions: the layer's forward and the loss are the engine's (engine/tune.py).
"""

from dataclasses import dataclass

import torch

from quantize.quant import codec, fp4
from quantize.quant.rtn import int_range

# Steps: V moves by LR (scaled by the schedule) per iteration, the scale factor by SCALE_LR. SignRound's default is
# 1 / iters for both. Measured on the dithered SmolLM2 (W4A16 g64, one draw, 20 iterations, the first target: the
# float layer on the quantized inputs): LR 0.005 and SCALE_LR 0.00025 gave perplexity 32.54, these 31.82 (GPTQ alone
# 33.74, auto-round's 50 iterations 31.07). LR is per grid. INT4's was tried higher, at 40 steps under the
# per-channel error (Intel Xeon with AMX, torch capability AVX512; dithered builds, W4A16 g64), when 32 samples were
# tuned on and the attention's inputs kept. On SmolLM2 (draws 0 / 1 / 2 / 3) 0.01 gave 31.65 on draw 0; 0.02 30.98
# / 30.84 / 32.04 / 30.51; 0.03 30.71 / 30.88 / 30.28 / 30.99; 0.05 30.42 / 30.60 / 32.84 (draws 0-2). On Gemma 3
# (draws 0 / 1) 0.02 gave 74.41 / 72.82; 0.025 78.27 / 72.42; 0.03 79.91 / 77.76, and 0.03 over 64 tuned samples
# 81.74 / 73.63: the larger steps fit Gemma's 32 tuned samples the more (engine/tune.py), so 0.02 stayed. Over 128
# tuned samples with the attention's inputs tuned (INT4's default since issue 39) 0.03 is the better on both
# families (AMD EPYC, torch capability AVX512, converts two at a time): SmolLM2 30.09 / 30.38 / 30.43 / 31.45 against
# 30.58 / 30.92 / 30.78 / 30.76 (mean 30.59 against 30.76, paired -0.17 +- 0.29, lower on three draws of four: draw
# 3, as before, the one it loses), Gemma 3 draws 0 / 1 69.74 / 71.82 against 72.17 / 75.22 (where 7 and 8 of its
# 18 layers keep GPTQ's bytes against 3 and 1: less tuning kept). auto-round's default (iters 200) gives 30.82 /
# 30.74 / 30.30 / 29.90 on those SmolLM2 draws (mean 30.44): ahead, until the layers that would keep GPTQ's bytes
# judged their moves halved too (engine/tune.py: SHRINK; 30.41, level). NVFP4 (also 128 samples) is not measured
# at 0.03 and stays at 0.02.
LR = {"int4": 0.03, "nvfp4": 0.02, "mxfp4": 0.02}
# SCALE_LR 0.01 on NVFP4, nearer auto-round's minmax rate (1 / iters, linearly decayed), cost 0.02 and 0.69 (dithered
# SmolLM2 draws 2 / 3, 32 samples, offsets in the spacing: 30.74 / 31.42 against 30.72 / 30.73)
SCALE_LR = 0.002
SCALE_RANGE = 0.3  # the factor on a group's scale stays in [1 - 0.3, 1 + 0.3]
# MXFP4's exponent shift moves by EXP_LR a step (times the schedule) in [-1, 1]: a run of 5 steps of one sign at
# the schedule's start, or 10 at its mean, carries it past +-0.5 to a halved or doubled step
EXP_LR = 0.05


def offset_rate(grid: str, rate: float | None = None) -> float:
    """The offsets' step on `grid`: a recipe's tune_rate where it sets one, else the grid's LR (the one rule that
    the steps, `--json` and the model card all give)."""
    return LR[grid] if rate is None else rate


# grids whose tuning starts from round to nearest (the weight over its searched step), not from GPTQ's values: chosen
# by measurement (the module's docstring). A likely reason, not shown: MXFP4's steps are powers of two, so its
# groups' errors, and the updates GPTQ carries along a row from them, are larger than NVFP4's, and GPTQ's values sit
# where half a spacing of offset does not reach what the layer's output wants
START_FROM_RTN = ("mxfp4",)
# grids whose offset is counted in e2m1's spacing where each value lies, not in units of 1 (the module's docstring)
SPACING_OFFSET = ("mxfp4",)

E4M3_MAX = 448.0
E4M3_TINY = 2.0 ** -9  # e4m3's least positive value: a group's scale, once nonzero, never tunes to 0


@dataclass
class Tunable:
    """One Linear's rounding under tuning: values [out, in] float32 (GPTQ's w / step before rounding), scale
    [out, groups] float32 (INT4 and MXFP4: each group's step; NVFP4: its e4m3 scale, the step being scale /
    gscale), and the tuned offset [out, in] and scale factor - 1 [out, groups] (MXFP4: the exponent's shift; both
    start at 0). grid: "int4", "nvfp4" or "mxfp4"."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    factor: torch.Tensor
    num_bits: int = 4
    grid: str = "int4"
    gscale: torch.Tensor | None = None  # NVFP4's global scale
    rate: float | None = None  # the offsets' step (a recipe's tune_rate); None: the grid's LR

    @classmethod
    def start(cls, values: torch.Tensor, scale: torch.Tensor, num_bits: int = 4, grid: str = "int4",
              gscale: torch.Tensor | None = None) -> "Tunable":
        assert values.shape[0] == scale.shape[0] and values.shape[1] % scale.shape[1] == 0, \
            f"values {tuple(values.shape)} for scale {tuple(scale.shape)}"
        assert (grid == "nvfp4") == (gscale is not None), "NVFP4, and only NVFP4, has a global scale"
        offset = torch.zeros_like(values, dtype=torch.float32, requires_grad=True)
        factor = torch.zeros_like(scale, dtype=torch.float32, requires_grad=True)
        return cls(values.float(), scale.float(), offset, factor, num_bits, grid,
                   None if gscale is None else gscale.float())

    @classmethod
    def of(cls, scheme, values: torch.Tensor, params: "codec.Params", w: torch.Tensor | None = None,
           rate: float | None = None) -> "Tunable":
        """A Linear's GPTQ result (its values and codec.Params) under `scheme` made tunable; w: the Linear's
        weight [out, in], whose values over the steps replace GPTQ's on the grids of START_FROM_RTN; rate: the
        offsets' step where a recipe sets it (else the grid's LR)."""
        if scheme.fp4 == "nvfp4":
            t = cls.start(values, params.stored[0].float(), grid="nvfp4", gscale=params.stored[1])
        else:
            step = params.step.float()
            if w is not None and scheme.fp4 in START_FROM_RTN:
                values = (w.float().unflatten(-1, (step.shape[1], -1)) / step[..., None]).flatten(-2)
            t = cls.start(values, step, scheme.num_bits, scheme.grid)
        t.rate = rate
        return t

    @staticmethod
    def _shift(factor: torch.Tensor) -> torch.Tensor:
        """MXFP4: 2 ** each group's exponent shift [out, groups], the shift rounded to an integer (its gradient
        straight through). The other grids' factor scales the step itself (_scale)."""
        return torch.exp2(factor + (torch.round(factor) - factor).detach())

    def _moved(self, offset: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """The values moved by `offset`, before rounding; on e2m1 clamped to its range +-6, on the grids of
        SPACING_OFFSET in units of the grid's spacing where each value lies, MXFP4's first divided by their group's
        2 ** shift."""
        if self.grid == "int4":
            return self.values + offset
        x = self.values
        if self.grid == "mxfp4":
            out, groups = self.scale.shape
            x = (x.reshape(out, groups, -1) / self._shift(factor)[..., None]).reshape(x.shape)
        if self.grid in SPACING_OFFSET:
            offset = offset * fp4.spacing(x.detach())
        return torch.clamp(x + offset, -6.0, 6.0)

    def codes(self) -> torch.Tensor:
        """int8 [out, in]: INT4's round(values + offset), clamped to the scheme's range; or FP4's 4-bit codes."""
        x = self._moved(self.offset.detach(), self.factor.detach())
        if self.grid != "int4":
            return fp4.value_codes(fp4.round_e2m1_(x)).to(torch.int8)
        q_min, q_max = int_range(self.num_bits)
        return torch.clamp(torch.round(x), q_min, q_max).to(torch.int8)

    def _scale(self, factor: torch.Tensor) -> torch.Tensor:
        """Each group's scale under `factor`, as stored: NVFP4's rounded to e4m3 (the gradient straight through);
        MXFP4's a power of two times 2 ** its shift."""
        if self.grid == "mxfp4":
            return self.scale * self._shift(factor)
        s = self.scale * (1 + factor)
        if self.grid == "nvfp4":
            s = torch.where(self.scale > 0, s.clamp(E4M3_TINY, E4M3_MAX), 0.0)
            s = s + (s.detach().to(torch.float8_e4m3fn).float() - s.detach())
        return s

    def steps(self) -> torch.Tensor:
        """float32 [out, groups]: each group's tuned step (NVFP4: its tuned e4m3 scale over the global scale)."""
        s = self._scale(self.factor.detach())
        return s / self.gscale if self.grid == "nvfp4" else s

    def params(self, solved: "codec.Params") -> "codec.Params":
        """GPTQ's codec.Params `solved` with the tuned steps, the scale tensors in the dtypes it stores them."""
        if self.grid == "nvfp4":
            scale = self._scale(self.factor.detach())
            return codec.Params(scale / self.gscale, None, (scale.to(solved.stored[0].dtype), solved.stored[1]))
        if self.grid == "mxfp4":
            step = self.steps()
            return codec.Params(step.to(solved.step.dtype), None, (fp4.mx_bytes(step),))
        step = self.steps().to(solved.step.dtype)
        return codec.Params(step, None, (step,))

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in] in `dtype`, differentiable in offset and factor: the rounding passes
        its gradient straight through (SignRound's estimate)."""
        if self.grid == "int4":
            return _Int4Weight.apply(self.values, self.offset, self.scale, self.factor, self.num_bits, dtype)
        x = self._moved(self.offset, self.factor)
        q = x + (fp4.round_e2m1_(x.detach().clone()) - x.detach())
        out, groups = self.scale.shape
        s = self._scale(self.factor)
        if self.grid == "nvfp4":
            s = s / self.gscale
        return (q.reshape(out, groups, -1) * s[..., None]).reshape(q.shape).to(dtype)

    def step(self, lr: float) -> None:
        """One signed step against the gradients (then cleared); lr: the schedule's factor on LR (this grid's) and
        SCALE_LR."""
        with torch.no_grad():
            if self.offset.grad is not None:
                self.offset.sub_(offset_rate(self.grid, self.rate) * lr * self.offset.grad.sign()).clamp_(-0.5, 0.5)
            if self.factor.grad is not None and self.grid == "mxfp4":
                self.factor.sub_(EXP_LR * lr * self.factor.grad.sign()).clamp_(-1.0, 1.0)
            elif self.factor.grad is not None:
                self.factor.sub_(SCALE_LR * lr * self.factor.grad.sign()).clamp_(-SCALE_RANGE, SCALE_RANGE)
        self.offset.grad = self.factor.grad = None

    def shrink(self, f: float) -> None:
        """The tuned moves times f (0: back to GPTQ's codes and scales)."""
        with torch.no_grad():
            self.offset.mul_(f)
            self.factor.mul_(f)

    def reset(self) -> None:
        """Back to GPTQ's codes and scales: no move left (a -0.0 rounds and scales as 0.0 does)."""
        self.shrink(0.0)


class _Int4Weight(torch.autograd.Function):
    """Tunable.weight on the INT4 grid as one node: (values + offset) rounded straight through, clamped to the
    range, times each group's step scale * (1 + factor), in `dtype`. The same numbers, forward and backward, as the
    composite of torch ops it replaces, every bit (tests/test_signround.py), in fewer passes over the weights: the
    seven weights of a SmolLM2 layer and their gradients took 18.4 ms of each tuning step's ~110 as the composite
    and take 12.1 (Intel Xeon with AMX, torch capability AVX512, 2 cores). Memory bound: 3.5M float32 values a
    pass."""

    @staticmethod
    def forward(ctx, values, offset, scale, factor, num_bits, dtype):
        q_min, q_max = int_range(num_bits)
        # round(x) is x + (round(x) - x) exactly: every float32 difference here is exact
        q = torch.add(values, offset).round_()
        inside = (q >= q_min).logical_and_(q <= q_max)  # clamp's gradient passes where the value is not clamped
        q = q.clamp_(q_min, q_max).reshape(*scale.shape, -1)
        s = scale * (1 + factor)
        ctx.save_for_backward(q, s, scale, inside)
        w = torch.empty(q.shape, dtype=dtype, device=q.device)
        return torch.mul(q, s[..., None], out=w).reshape(values.shape)

    @staticmethod
    def backward(ctx, grad):
        q, s, scale, inside = ctx.saved_tensors
        g = grad.reshape(q.shape)
        d_offset = (g * s[..., None]).reshape(inside.shape).masked_fill_(inside.logical_not(), 0.0)
        d_factor = (g.float() * q).sum(-1) * scale
        return None, d_offset, None, d_factor, None, None


def schedule(iteration: int, iters: int) -> float:
    """SignRound's linear decay, from 2 to 0 (a mean of 1 over the iterations)."""
    return 2.0 * (1 - iteration / iters)
