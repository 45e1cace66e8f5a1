"""What we know about each architecture, and how a tensor name maps to its role.

Each family file declares an `Arch`: the model_types it serves and the leaf names of its Linear modules.
`resolve` picks the family from config.json (reading a multimodal wrapper's `text_config`), and `Model.role`
says of any tensor name what it is: layer, expert, kind, and whether it is a quantizable Linear weight.
"""

import functools
import re
from dataclasses import dataclass

from quantize import hf
from quantize.errors import QuantizeError


@dataclass(frozen=True)
class Arch:
    family: str
    model_types: tuple[str, ...]
    linear_leaves: frozenset[str]
    moe: bool
    # model_type -> (transformers config class, causal LM class), for the layerwise engine's forwards
    hf_classes: dict[str, tuple[str, str]]
    # AWQ: (norm module, regexes of every module that consumes its output), names relative to a decoder layer;
    # every consumer is listed, quantized or not (a router or indexer left out would see rescaled inputs).
    # Each MLP's up_proj -> down_proj and, where shapes allow, v_proj -> o_proj are added by the engine.
    awq_norms: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class Role:
    # embedding | lm_head | norm | attention | indexer | router | dense_mlp | shared_expert | expert | mtp | vision | other
    kind: str
    module: str  # the module name (tensor name without its last component)
    layer: int | None = None
    expert: int | None = None
    linear: bool = False  # a Linear weight that a recipe may quantize


_LAYER = re.compile(r"^(?P<prefix>.*?)model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Model:
    """An architecture resolved against one checkpoint's config and tensor names."""

    arch: Arch
    model_type: str
    text_config: dict
    prefix: str  # "" or e.g. "language_model." for multimodal wrappers

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def num_mtp_layers(self) -> int:
        return int(self.text_config.get("num_nextn_predict_layers") or 0)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def moe_intermediate_size(self) -> int | None:
        v = self.text_config.get("moe_intermediate_size")
        return int(v) if v else None

    @property
    def n_routed_experts(self) -> int | None:
        v = self.text_config.get("n_routed_experts") or self.text_config.get("num_experts")
        return int(v) if v else None

    def transformers_config(self, dtype):
        """The text model's transformers config, built from the dict (never from remote code)."""
        transformers = hf.transformers()

        config_cls, _ = self.arch.hf_classes[self.model_type]
        raw = {k: v for k, v in self.text_config.items() if k not in ("model_type", "auto_map", "quantization_config")}
        config = getattr(transformers, config_cls)(**raw)
        config._attn_implementation = "sdpa"
        config.dtype = dtype
        return config

    def causal_lm_class(self):
        transformers = hf.transformers()
        return getattr(transformers, self.arch.hf_classes[self.model_type][1])

    def role(self, name: str, ndim: int = 2) -> Role:
        module, _, leaf = name.rpartition(".")
        m = _LAYER.match(name)
        if m is None or m["prefix"] != self.prefix:
            if name.startswith(self.prefix):
                rest = name[len(self.prefix):]
                if rest.startswith("model.embed_tokens."):
                    return Role("embedding", module)
                if rest.startswith("lm_head."):
                    return Role("lm_head", module)
                if rest.startswith("model.norm."):
                    return Role("norm", module)
            return Role("vision" if self.prefix else "other", module)
        layer, rest = int(m["layer"]), m["rest"]
        if layer >= self.num_hidden_layers:
            return Role("mtp", module, layer)
        expert = None
        if rest.startswith("self_attn.indexer."):
            kind = "indexer"
        elif rest.startswith("self_attn."):
            kind = "attention"
        elif (e := _EXPERT.match(rest)) is not None:
            kind, expert = "expert", int(e[1])
        elif rest.startswith("mlp.shared_experts."):
            kind = "shared_expert"
        elif rest.startswith("mlp.gate.") and "mlp.gate." + leaf == rest:
            kind = "router"
        elif rest.startswith("mlp."):
            kind = "dense_mlp"
        elif "norm" in rest:
            kind = "norm"
        else:
            kind = "other"
        linear = leaf == "weight" and ndim == 2 and module.rpartition(".")[2] in self.arch.linear_leaves
        return Role(kind, module, layer, expert, linear)


@functools.cache
def families() -> tuple[Arch, ...]:
    """Every family: each file of quantize/arch/ holds one as data (an Arch's fields), importing nothing back."""
    from quantize.arch import deepseek_v3, glm4_moe, glm_moe_dsa, llama

    return tuple(Arch(**m.ARCH) for m in (deepseek_v3, glm4_moe, glm_moe_dsa, llama))


def supported_model_types() -> list[str]:
    return sorted(t for a in families() for t in a.model_types)


def _prefix(tensor_names: list[str]) -> str:
    for name in tensor_names:
        if (m := _LAYER.match(name)) is not None:
            return m["prefix"]
    return ""


def resolve(config: dict, tensor_names: list[str]) -> Model:
    """The Model for a config.json dict; a multimodal wrapper resolves to its text model.

    Raises QuantizeError listing the supported model types when the architecture is unknown.
    """
    text_config = config
    model_type = config.get("model_type")
    by_type = {t: a for a in families() for t in a.model_types}
    if model_type not in by_type and isinstance(config.get("text_config"), dict):
        text_config = config["text_config"]
        model_type = text_config.get("model_type")
    arch = by_type.get(model_type)
    if arch is None:
        raise QuantizeError(
            f"unknown architecture: model_type {config.get('model_type')!r} "
            f"(architectures {config.get('architectures')}); supported: {', '.join(supported_model_types())}"
        )
    if text_config.get("num_hidden_layers") is None or text_config.get("hidden_size") is None:
        raise QuantizeError("config.json lacks num_hidden_layers or hidden_size; the checkpoint is incomplete")
    return Model(arch, model_type, text_config, _prefix(tensor_names))
