"""Sign-gradient rounding seeded from GPTQ (SignRound: Cheng et al., 2023, arXiv:2309.05516), for symmetric INT4.

GPTQ chooses each code against its own Linear's inputs, one column at a time. What serving sees is the decoder
layer's output, through attention's softmax and the MLP's gate. SignRound tunes, per layer, an offset V in
[-0.5, 0.5] added to each weight's value before rounding and a factor on each group's scale, by signed gradient
steps on the layer's output error (a straight-through estimate of the rounding's gradient). Here the values are
not w / scale but GPTQ's own: the updated weight over its step at the moment GPTQ rounded it, so V = 0 gives GPTQ's
codes exactly and the steps start from them, where SignRound starts from round to nearest. The stored format is
unchanged: int codes in [q_min, q_max] and one positive scale per group, in the model's dtype.

Pure tensor functions: the layer's forward and the loss are the engine's (engine/tune.py).
"""

from dataclasses import dataclass

import torch

from quantize.quant.rtn import int_range

# Steps: V moves by LR (scaled by the schedule) per iteration, the scale factor by SCALE_LR. SignRound's default is
# 1 / iters for both. Measured on the dithered SmolLM2 (W4A16 g64, one draw, 20 iterations, the first target: the
# float layer on the quantized inputs): LR 0.005 and SCALE_LR 0.00025 gave perplexity 32.54, these 31.82 (GPTQ alone
# 33.74, auto-round's 50 iterations 31.07).
LR = 0.02
SCALE_LR = 0.002
SCALE_RANGE = 0.3  # the factor on a group's scale stays in [1 - 0.3, 1 + 0.3]


@dataclass
class Tunable:
    """One Linear's rounding under tuning: values [out, in] float32 (GPTQ's w / step before rounding), scale
    [out, groups] float32, and the tuned offset [out, in] and scale factor - 1 [out, groups] (both start at 0)."""

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    factor: torch.Tensor
    num_bits: int = 4

    @classmethod
    def start(cls, values: torch.Tensor, scale: torch.Tensor, num_bits: int = 4) -> "Tunable":
        assert values.shape[0] == scale.shape[0] and values.shape[1] % scale.shape[1] == 0, \
            f"values {tuple(values.shape)} for scale {tuple(scale.shape)}"
        offset = torch.zeros_like(values, dtype=torch.float32, requires_grad=True)
        factor = torch.zeros_like(scale, dtype=torch.float32, requires_grad=True)
        return cls(values.float(), scale.float(), offset, factor, num_bits)

    def codes(self) -> torch.Tensor:
        """int8 [out, in]: round(values + offset), clamped to the scheme's range."""
        q_min, q_max = int_range(self.num_bits)
        return torch.clamp(torch.round(self.values + self.offset.detach()), q_min, q_max).to(torch.int8)

    def steps(self) -> torch.Tensor:
        """float32 [out, groups]: each group's tuned scale."""
        return self.scale * (1 + self.factor.detach())

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in] in `dtype`, differentiable in offset and factor: the rounding passes
        its gradient straight through (SignRound's estimate)."""
        q_min, q_max = int_range(self.num_bits)
        x = self.values + self.offset
        q = torch.clamp(x + (torch.round(x) - x).detach(), q_min, q_max)
        out, groups = self.scale.shape
        s = self.scale * (1 + self.factor)
        return (q.reshape(out, groups, -1) * s[..., None]).reshape(q.shape).to(dtype)

    def step(self, lr: float) -> None:
        """One signed step against the gradients (then cleared); lr: the schedule's factor on LR and SCALE_LR."""
        with torch.no_grad():
            if self.offset.grad is not None:
                self.offset.sub_(LR * lr * self.offset.grad.sign()).clamp_(-0.5, 0.5)
            if self.factor.grad is not None:
                self.factor.sub_(SCALE_LR * lr * self.factor.grad.sign()).clamp_(-SCALE_RANGE, SCALE_RANGE)
        self.offset.grad = self.factor.grad = None

    def reset(self) -> None:
        """Back to GPTQ's codes and scales."""
        with torch.no_grad():
            self.offset.zero_()
            self.factor.zero_()


def schedule(iteration: int, iters: int) -> float:
    """SignRound's linear decay, from 2 to 0 (a mean of 1 over the iterations)."""
    return 2.0 * (1 - iteration / iters)
