"""The attention's context (its output projection's input) of each tuned sample, kept from the sample's first forward
of the quantized path, so that the tuning's later forwards skip attention (engine/tune.py).

Where a recipe keeps the attention's inputs (q/k/v, MLA's projections, an indexer's) as GPTQ solved them (gptq
tune_attention false: tune.tuned), a sample's input to the layer is the same in every step: so what reaches o_proj
is the same in every step. On a SmolLM2 layer (4 x 512 tokens, bf16, Intel Xeon with AMX) the attention took 12
of a forward's 27 ms, and 10 of a tuning step's 67 with its backward. Every transformers attention this engine
builds ends in `o_proj` and returns its output first (the decoder layer unpacks `hidden, _ =
self.self_attn(...)`), which is all this relies on; the cached forward returns the same tuple shape with the rest
None (the attention weights, which the layers drop).
"""

from contextlib import contextmanager

import torch
from torch import nn


class AttentionCache:
    """o_proj's input [1, tokens, width] per sample, for one layer's tuning, with the attention weights it was
    computed under."""

    def __init__(self, attention: nn.Module):
        self.attention = attention
        self.context: dict[int, tuple[list, torch.Tensor]] = {}  # sample -> (the weights' key, its context)
        self._arity = 0  # the length of the attention's output tuple (0: not a tuple)
        # whether the attention's other outputs were all None when recorded: where one is not (eager attention's
        # weights, an indexer's top-k the layer carries on), nothing is served and attention always runs
        self._servable = True

    @classmethod
    def of(cls, layer: nn.Module, tuned: list[str]) -> "AttentionCache | None":
        """The cache for `layer` when what it tunes (module names in the layer) leaves attention's inputs fixed: no
        tuned module in self_attn but its o_proj; None where the layer has no self_attn.o_proj Linear."""
        attention = getattr(layer, "self_attn", None)
        if not isinstance(getattr(attention, "o_proj", None), nn.Linear):
            return None
        if any(m.startswith("self_attn.") and m != "self_attn.o_proj" for m in tuned):
            return None
        return cls(attention)

    @contextmanager
    def serving(self, samples: list[int], weights: dict[str, torch.Tensor]):
        """Within: the layer's forward of `samples` (as one batch, in this order) under `weights` (the
        functional call's, by parameter name in the layer) through the attention, which either records their
        contexts or is replaced by o_proj of the ones recorded under the same attention weights (the same tensors:
        a forward under other ones, e.g. the float weights, records anew)."""
        key = [(n, w) for n, w in sorted(weights.items(), key=lambda kv: kv[0])
               if n.startswith("self_attn.") and not n.startswith("self_attn.o_proj.")]
        if self._servable and all(s in self.context and _same(self.context[s][0], key) for s in samples):
            context = torch.cat([self.context[s][1] for s in samples])
            o_proj = self.attention.o_proj

            def cached(*_args, **_kwargs):
                out = o_proj(context)
                return (out, *([None] * (self._arity - 1))) if self._arity else out

            self.attention.forward = cached  # an instance attribute shadows the class's forward
            try:
                yield
            finally:
                del self.attention.forward
            return

        def record(_module, args):
            x = args[0].detach()
            for j, s in enumerate(samples):
                self.context[s] = (key, x[j:j + 1])

        def arity(_module, _args, out):
            self._arity = len(out) if isinstance(out, tuple) else 0
            self._servable = self._servable and all(x is None for x in (out[1:] if self._arity else ()))

        hooks = [self.attention.o_proj.register_forward_pre_hook(record), self.attention.register_forward_hook(arity)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def _same(a: list, b: list) -> bool:
    """Whether two (name, tensor) lists hold the same tensors (the objects, kept alive by the cache)."""
    return len(a) == len(b) and all(n == m and v is w for (n, v), (m, w) in zip(a, b, strict=True))
