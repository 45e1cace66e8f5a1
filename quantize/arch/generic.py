"""Any dense decoder that transformers builds (Mistral, Gemma 2 / 3, Phi-3, Qwen2 / 3, Llama and their relatives)
as a family, read from its own model class instead of declared: a one-layer copy built on the meta device (no
memory) gives the Linear leaves, and one traced forward through it gives AWQ's mappings, the norms whose output
goes straight into Linears and nowhere else.

AWQ folds its scales into a norm's weight: exact for a norm that scales by (c + weight), c read from the norm
itself (0, or Gemma's 1: `norm_offset`). Where a norm's output also goes elsewhere (a residual, a non-Linear op),
or the norm is of another form, the mapping is ambiguous: AWQ is refused for the family with the reason
(`no_awq`); GPTQ and RTN still run.

The result is an Arch's fields (quantize/arch/__init__.py), as the declared families' files hold them."""

import copy
import functools
import json

from quantize import hf
from quantize.errors import QuantizeError


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
    try:
        config = getattr(transformers, config_cls)(**raw)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = getattr(transformers, lm_cls)._from_config(config, dtype=torch.float32)
    except Exception as e:  # transformers' own checks of the config
        raise QuantizeError(f"config.json: transformers cannot build {lm_cls} from it ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); the config is broken") from e
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise QuantizeError(f"unknown architecture: model_type {model_type!r} ({lm_cls}) keeps its decoder layers "
                            "elsewhere than model.layers.N, the layout this tool reads")
    layer = layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    norms, why, offset = _awq_norms(model, layer, linears)
    return dict(family="dense", model_types=(model_type,), linear_leaves=frozenset(n.rpartition(".")[2] for n in linears),
                moe=False, hf_classes={model_type: (config_cls, lm_cls)}, awq_norms=norms, no_awq=why,
                norm_offset=offset)


def _awq_norms(model, layer, linears: dict) -> tuple[tuple, str | None, float]:
    """(norm, consumers) pairs traced from one forward on the meta device (each norm's output followed to the
    Linears that take it as their input; one used by anything else makes AWQ ambiguous), why AWQ cannot run (or
    None), and the norms' weight offset."""
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
        return (), f"its forward could not be traced ({type(e).__name__}), so AWQ's mappings are unknown", 0.0
    finally:
        for h in hooks:
            h.remove()
    for n in norm_names:
        if n in fed and n in other:
            return (), f"its {n} feeds {', '.join(sorted(fed[n]))} and also {', '.join(sorted(other[n]))}", 0.0
    offsets = {_offset(modules[n]) for n in fed}
    if None in offsets or len(offsets) > 1:
        return (), (f"its norms ({', '.join(sorted(type(modules[n]).__name__ for n in fed))}) do not scale by "
                    "(a constant + weight), so AWQ's scales cannot fold into them"), 0.0
    import re

    return tuple((n, tuple(re.escape(x) for x in fed[n])) for n in norm_names if n in fed), None, \
        next(iter(offsets), 0.0)


def _offset(norm) -> float | None:
    """c where the norm's output is (c + weight) * f(x): 0 for a norm that multiplies by its weight, 1 for Gemma's
    1 + weight; None for a norm that is neither (AWQ cannot fold into it). Read from the outputs at weight 0
    and weight 1 (c f(x) and (c + 1) f(x)), a bias held at 0."""
    import torch

    probe = copy.deepcopy(norm).to_empty(device="cpu")
    params = dict(probe.named_parameters())
    if "weight" not in params or params["weight"].ndim != 1:
        return None
    x = torch.randn(3, params["weight"].shape[0], generator=torch.Generator().manual_seed(0))
    outs = []
    with torch.no_grad():
        for value in (0.0, 1.0):
            for name, p in params.items():
                p.fill_(value if name == "weight" else 0.0)
            outs.append(probe(x).float())
    y0, y1 = outs
    step = y1 - y0  # f(x)
    if not torch.all(step.abs() > 1e-6):
        return None
    c = y0 / step
    return round(float(c.mean()), 6) if torch.allclose(c, c.mean(), atol=1e-4) else None
