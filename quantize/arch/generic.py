"""Any dense decoder that transformers builds (Mistral, Gemma 2 / 3, Phi-3, Qwen2 / 3, Llama and their relatives)
as a family, read from its own model class instead of declared: a one-layer copy built on the meta device (no
memory) gives the Linear leaves, and one traced forward through it gives AWQ's mappings, the norms whose output
goes straight into Linears and nowhere else.

AWQ folds its scales into a norm's weight, which is exact only for a norm that multiplies by its weight. Where a
norm's output also goes elsewhere (a residual, a non-Linear op), or the norm computes x * (1 + weight) (Gemma),
the mapping is ambiguous: AWQ is refused for the family with the reason (`no_awq`); GPTQ and RTN still run.

The result is an Arch's fields (quantize/arch/__init__.py), as the declared families' files hold them."""

import copy
import functools
import json

from quantize import hf


def classes(model_type: str) -> tuple[str, str] | None:
    """transformers' (config class, causal LM class) for a model_type it builds itself, or None."""
    hf.transformers()
    from transformers.models.auto import configuration_auto, modeling_auto

    config_cls = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
    lm_cls = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return (config_cls, lm_cls) if config_cls and lm_cls else None


def fields(model_type: str, text_config: dict) -> dict:
    """The Arch fields of a dense decoder of this model_type and config (cached per config)."""
    return _fields(model_type, json.dumps(text_config, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _fields(model_type: str, config_json: str) -> dict:
    import torch
    from torch import nn

    transformers = hf.transformers()
    config_cls, lm_cls = classes(model_type)
    raw = {k: v for k, v in json.loads(config_json).items() if k not in ("model_type", "auto_map", "quantization_config")}
    raw["num_hidden_layers"] = 1
    for k in ("layer_types", "mlp_layer_types"):
        if isinstance(raw.get(k), list):
            raw[k] = raw[k][:1]
    config = getattr(transformers, config_cls)(**raw)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = getattr(transformers, lm_cls)._from_config(config, dtype=torch.float32)
    layer = model.model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    norms, why = _awq_norms(model, layer, linears)
    return dict(family="dense", model_types=(model_type,), linear_leaves=frozenset(n.rpartition(".")[2] for n in linears),
                moe=False, hf_classes={model_type: (config_cls, lm_cls)}, awq_norms=norms, no_awq=why)


def _awq_norms(model, layer, linears: dict) -> tuple[tuple, str | None]:
    """(norm, consumers) pairs traced from one forward on the meta device: each module's output is followed to
    the Linears that take it as their input; a norm's output used by anything else makes AWQ ambiguous."""
    import torch
    from torch.overrides import TorchFunctionMode

    produced: dict[int, str] = {}  # id of a norm's output -> the norm's name
    kept: list = []  # the outputs themselves, so that no id is reused while the forward runs
    fed: dict[str, list[str]] = {}  # norm -> Linears it feeds
    other: dict[str, set[str]] = {}  # norm -> the other ops that read its output
    inside: list[str] = []  # the Linear whose forward is running

    modules = dict(layer.named_modules())
    norm_names = [n for n, m in modules.items() if n and "norm" in type(m).__name__.lower() and n not in linears]

    class Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name != "__get__":  # .shape, .dtype, .device: reading metadata is no use of the values
                for a in [*args, *(kwargs or {}).values()]:
                    if id(a) in produced and not (name == "linear" and inside):
                        other.setdefault(produced[id(a)], set()).add(name)
            return func(*args, **(kwargs or {}))

    hooks = []
    for n in norm_names:
        def post(_m, _a, out, n=n):
            produced[id(out)] = n
            kept.append(out)

        hooks.append(modules[n].register_forward_hook(post))
    for n, lin in linears.items():
        def pre(_m, args, n=n):
            src = produced.get(id(args[0]))
            if src is not None:
                fed.setdefault(src, []).append(n)
            inside.append(n)

        def done(*_):
            inside.pop()  # returns None: a forward hook's return value would replace the output

        hooks.append(lin.register_forward_pre_hook(pre))
        hooks.append(lin.register_forward_hook(done))
    try:
        with torch.no_grad(), Uses():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))
    except Exception as e:  # a class whose forward the meta device cannot run: no mapping is traced
        return (), f"its forward could not be traced ({type(e).__name__}), so AWQ's mappings are unknown"
    finally:
        for h in hooks:
            h.remove()
    for n in norm_names:
        if n in fed and n in other:
            return (), f"its {n} feeds {', '.join(sorted(fed[n]))} and also {', '.join(sorted(other[n]))}"
    if fed and not _multiplies(modules[next(iter(fed))]):
        return (), (f"its norms compute x * (1 + weight) ({type(modules[next(iter(fed))]).__name__}), so AWQ's "
                    "scales cannot fold into them")
    import re

    return tuple((n, tuple(re.escape(x) for x in fed[n])) for n in norm_names if n in fed), None


def _multiplies(norm) -> bool:
    """Whether the norm's output is its weight times something: a zero weight gives a zero output."""
    import torch

    probe = copy.deepcopy(norm).to_empty(device="cpu")
    with torch.no_grad():
        for p in probe.parameters():
            p.zero_()
        for b in probe.buffers():
            b.zero_()
        dim = next(probe.parameters()).shape[-1]
        x = torch.randn(3, dim, generator=torch.Generator().manual_seed(0))
        return bool(probe(x).abs().max() == 0)
