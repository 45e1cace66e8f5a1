"""AWQ (Lin et al., 2023, arXiv:2306.00978) of one decoder layer in the layerwise engine, on rank 0: record what
each smoothing mapping's balance layers see, search per-channel scales against the loss at the block's output
(quant/awq.py), fold them into the norm (or the Linear) before, then RTN. A MoE layer's routed experts are not in
the layer (Deferred): the norm that feeds them is searched with every rank (engine/awq_experts.py), which then
smooth and round their own experts.

`q` is the engine's LayerwiseQuantizer: its passes (`_run`), its layer inputs and its results.
"""

import re
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from quantize.quant import awq
from quantize.tensor_plan import Entry


def _mappings(q, modules: dict[str, nn.Module], targets: dict[str, Entry],
              routed: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """(smooth, balance) pairs present in this layer whose balance layers include something quantized. `routed`:
    the names of the routed experts' Linears (`mlp.experts.E.gate_proj`) when they are streamed, not modules."""
    pairs = []
    for smooth, patterns in q.model.arch.awq_norms:
        if smooth in modules:
            balance = [n for n in [*routed, *modules] if any(re.fullmatch(p, n) for p in patterns)
                       and (n in routed or getattr(modules[n], "weight", None) is not None)]
            pairs.append((smooth, balance))
    for n, mod in modules.items():
        if n.endswith("up_proj") and (down := n[: -len("up_proj")] + "down_proj") in modules:
            pairs.append((n, [down]))
        if n.endswith("self_attn.v_proj") and (o := n[: -len("v_proj")] + "o_proj") in modules:
            if mod.out_features == modules[o].in_features:
                pairs.append((n, [o]))
    return [(sm, bal) for sm, bal in pairs if bal and any(b in targets for b in bal)]

def _attention_loss(q, layer: nn.Module, i: int, quantized: list[nn.Module], inputs: list[torch.Tensor]):
    """AWQ loss at the attention block's output, over whole calibration batches."""
    topk = takes_topk(layer.self_attn)

    def run() -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for b, x in enumerate(inputs):
                pos = q.positions[b]
                mask, rotary = q._inputs(x, pos, q.layer_type(i))  # a sliding-window layer's own mask
                kwargs = {"prev_topk_indices": q.carry[b]} if topk else {}
                y = layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=pos,
                                    position_embeddings=rotary, **kwargs)
                outs.append(y[0] if isinstance(y, tuple) else y)
        return outs

    return _swapped_loss(run, quantized, q.recipe.scheme.group_size, q.recipe.scheme.symmetric)

def awq_layer(q, layer: nn.Module, i: int, targets: dict[str, Entry], report, moe=None) -> None:
    """Record the inputs each mapping's balance layers see, search and apply the scales, then RTN. `moe`: the
    layer's routed experts (awq_experts.AWQExperts), whose norm is searched first, with the other ranks."""
    modules = dict(layer.named_modules())
    routed = tuple(moe.linear_names()) if moe is not None else ()
    mappings = _mappings(q, modules, targets, routed)
    rec = _AWQRecorder(q.awq_rows, len(q.hidden))
    hooks = []
    for smooth, balance in mappings:
        if isinstance(modules[smooth], nn.Linear):  # up -> down, v -> o: record what the balance layer receives
            hooks.append(modules[balance[0]].register_forward_pre_hook(partial(rec.pre_hook, smooth)))
        else:
            hooks.append(modules[smooth].register_forward_hook(partial(rec.hook, smooth)))
    if moe is not None:
        q._deferred(layer).record = moe.record_calibration
    q._run(layer, i, advance=False)
    for h in hooks:
        h.remove()
    if moe is not None:
        q._deferred(layer).record = None
        moe.share_calibration()
        if any(b in routed for _, bal in mappings for b in bal) != moe.norm_applies:
            # the other ranks join the norm's search by the plan's rule: a disagreement would leave them waiting
            raise AssertionError(f"layer {i}: rank 0's AWQ mappings and the plan disagree on the experts' norm")
        # the norm before the experts first: the other ranks wait for its scales (it shares no module with the
        # attention's mappings, and came before the MLP's own up -> down in any case)
        mappings.sort(key=lambda m: not any(b in routed for b in m[1]))

    s, g = q.recipe.scheme, q.recipe.scheme.group_size
    modified: set[str] = set()
    for smooth, balance in mappings:
        x_mean, X = rec.stats(smooth)
        here = [b for b in balance if b in modules]
        quantized = [b for b in here if b in targets]
        if any(b in routed for b in balance):
            scales, ratio, initial, best = _search_with_experts(q, layer, moe, x_mean, X, quantized, modules)
        elif X is None:
            continue
        else:
            parent = _parent(smooth, balance, modules)
            if parent == "self_attn":
                loss = _attention_loss(q, layer, i, [modules[b] for b in quantized], rec.attention_inputs)
            elif parent == "mlp":
                loss = _module_loss(layer.mlp, [modules[b] for b in quantized], [X.to(q.device, q.compute)[None]], g,
                                    s.symmetric)
            else:
                loss = awq.linear_loss([(modules[b].weight.data, X.to(q.device)) for b in quantized], g, s.symmetric)
            scales, ratio, initial, best = awq.search(x_mean.to(q.device), [modules[b].weight.data for b in quantized],
                                                     loss, g, q.recipe.awq.n_grid)
        q.stats.awq.append({"layer": i, "smooth": smooth, "ratio": ratio, "loss_identity": initial,
                            "loss_best": best})
        _apply_scales(modules[smooth], [modules[b] for b in here], scales.to(q.device),
                      q.model.arch.norm_offset if modules[smooth].weight.ndim == 1 else 0.0)
        modified.update([smooth, *here])
        if smooth == "input_layernorm":  # later attention losses must see the rescaled norm's output
            rec.attention_inputs = [(x.float() / scales.to(x.device)).to(x.dtype) for x in rec.attention_inputs]
    rec.attention_inputs.clear()
    for m, e in targets.items():
        if m in modules:
            q._quantize_module(modules[m], e, report)
    for m in sorted(modified - set(targets)):
        for leaf in ("weight", "bias"):
            name = q.model.stored_name(i, f"{m}.{leaf}")
            t = getattr(modules[m], leaf, None)
            if t is not None and name in q.entries:
                q._store_result(name, [t.detach().to("cpu", _dtype(q.entries[name].outputs[0].dtype))])


def _search_with_experts(q, layer: nn.Module, moe, x_mean, X, quantized: list[str], modules: dict[str, nn.Module]):
    """The norm before a MoE block, searched with every rank: the shared experts' error here (the block run with
    its routed experts Deferred, so its output is theirs), the routed experts' on their ranks."""
    s, g = q.recipe.scheme, q.recipe.scheme.group_size
    total, rows = awq.weight_sums([modules[b].weight.data for b in quantized], g)
    shared_loss, elements = None, 0
    if X is not None:
        elements = X.shape[0] * X.shape[1]
        if quantized:
            shared_loss = _module_loss(layer.mlp, [modules[b] for b in quantized], [X.to(q.device, q.compute)[None]],
                                       g, s.symmetric)
    return moe.search_norm(x_mean, (total, rows, shared_loss, elements))


def _parent(smooth: str, balance: list[str], modules: dict[str, nn.Module]) -> str | None:
    """Where AWQ measures its loss: the attention or MLP block holding every balance layer of a norm mapping
    (as llm-compressor does), else at the balance layers themselves (up -> down, v -> o)."""
    if isinstance(modules[smooth], nn.Linear):
        return None
    for parent in ("self_attn", "mlp"):
        if all(b.startswith(parent + ".") for b in balance):
            return parent
    return None


def _swapped_loss(run: Callable[[], list[torch.Tensor]], quantized: list[nn.Module], group_size: int, symmetric: bool):
    """Loss over scales: squared error of `run()` with each quantized module computing Q(W * s) / s."""
    refs = [r.float() for r in run()]

    def loss(s: torch.Tensor) -> float:
        originals = [m.weight.data for m in quantized]
        try:
            for m, w in zip(quantized, originals, strict=True):
                m.weight.data = awq.scaled_fake_quant(w, s, group_size, symmetric)
            outs = run()
        finally:
            for m, w in zip(quantized, originals, strict=True):
                m.weight.data = w
        err = sum(float((o.float() - r).pow(2).sum()) for o, r in zip(outs, refs, strict=True))
        return err / max(sum(r.numel() for r in refs), 1)

    return loss


def _module_loss(module: nn.Module, quantized: list[nn.Module], inputs: list[torch.Tensor], group_size: int,
                 symmetric: bool):
    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [module(x) for x in inputs]

    return _swapped_loss(run, quantized, group_size, symmetric)


def _dtype(name: str) -> torch.dtype:
    from quantize.safetensors_file import DTYPES

    return DTYPES[name]


@torch.no_grad()
def _apply_scales(smooth: nn.Module, balance: list[nn.Module], s: torch.Tensor, offset: float = 0.0) -> None:
    """smooth's output / s, every balance layer's input columns * s: the float model is unchanged. `offset`: a
    norm that scales by (offset + weight) (Gemma's 1 + weight) takes (offset + weight) / s - offset."""
    w = smooth.weight
    if w.ndim == 1:
        w.copy_(((offset + w.float()) / s - offset).to(w.dtype))
    else:
        w[-s.numel():].copy_((w[-s.numel():].float() / s.view(-1, 1)).to(w.dtype))
    if getattr(smooth, "bias", None) is not None:
        smooth.bias[-s.numel():].copy_((smooth.bias[-s.numel():].float() / s).to(smooth.bias.dtype))
    for b in balance:
        b.weight.copy_((b.weight.float() * s.view(1, -1)).to(b.weight.dtype))


class _AWQRecorder:
    """What AWQ needs of one calibration pass: mean |x| per channel of every mapping's input over all tokens,
    and the inputs themselves at a fixed, evenly spread subset of token positions (the grid search's data)."""

    def __init__(self, max_rows: int, n_samples: int):
        self.max_rows, self.n_samples = max_rows, n_samples
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.attention_inputs: list[torch.Tensor] = []  # whole batches: attention needs whole sequences

    def _keep(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        a = x.abs().sum(0, dtype=torch.float64)
        self.sums[name] = self.sums[name] + a if name in self.sums else a
        self.counts[name] += x.shape[0]
        per_sample = max(1, self.max_rows // self.n_samples)
        stride = max(1, x.shape[0] // per_sample)
        self.rows[name].append(x[::stride][:per_sample].to("cpu", copy=True))  # the compute dtype, as the layer sees it

    def hook(self, name: str, _module, _args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if name == "input_layernorm":
            self.attention_inputs.append(out)
        self._keep(name, out)

    def pre_hook(self, name: str, _module, args) -> None:
        self._keep(name, args[0])

    def stats(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.counts.get(name):
            return None, None
        return (self.sums[name] / self.counts[name]).float(), torch.cat(self.rows[name])


def takes_topk(module: nn.Module) -> bool:
    """Whether the module is one of GLM-5's DSA blocks, which pass their indexer's top-k on."""
    import inspect

    return "prev_topk_indices" in inspect.signature(module.forward).parameters
