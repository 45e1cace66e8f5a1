"""What we know about each architecture, and how a tensor name maps to its role.

Each family file declares an `Arch`: the model_types it serves, the leaf names of its Linear modules and how its
checkpoints name the MoE block and the experts. `resolve` picks the family from config.json (reading a multimodal
wrapper's `text_config`); a dense decoder of no declared family gets one built from transformers' own classes
(`generic`). `Model.role` says of any tensor name what it is: layer, expert, kind, whether it is a quantizable
Linear weight, and its module's name as transformers' model calls it (`canonical`).

Names: the engine builds layers from transformers' classes, whose MoE block is always `mlp` with fused
`experts` (split here per expert as `mlp.experts.E.{gate,up,down}_proj`) and a router `mlp.gate`. A checkpoint may
store them otherwise (Mixtral, MiniMax-M2: `block_sparse_moe.experts.E.w1/w3/w2`); `Model.canonical` and
`Model.stored` translate a layer's names both ways, and outputs keep the checkpoint's own names (the engines'
loaders read those).
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
    # the checkpoint's name of the MoE block and of an expert's gate, up and down Linears (transformers' are mlp and
    # gate_proj, up_proj, down_proj); the router is `{moe_block}.gate`
    moe_block: str = "mlp"
    expert_leaves: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # DeepSeek Sparse Attention: the indexer scores per head against a materialized causal mask
    dsa: bool = False
    carries_topk: bool = False  # GLM-5: a layer's top-k indices go on to the next layers
    # whether an MTP layer stores its own embedding and output head (DeepSeek-V3, GLM-4.5; GLM-5 shares the model's)
    mtp_own_head: bool = True
    # why AWQ cannot run on this family (its smoothing mappings are ambiguous), or None
    no_awq: str | None = None
    # a norm that scales by (norm_offset + weight): Gemma's 1 + weight; AWQ folds its scales in accordingly
    norm_offset: float = 0.0


@dataclass(frozen=True)
class Role:
    # embedding | lm_head | norm | attention | indexer | router | dense_mlp | shared_expert | expert | mtp | vision | other
    kind: str
    module: str  # the module name (tensor name without its last component)
    layer: int | None = None
    expert: int | None = None
    linear: bool = False  # a Linear weight that a recipe may quantize
    canonical: str = ""  # the module's name in transformers' model (Model.canonical), "" where it is `module`

    @property
    def leaf(self) -> str:
        """The module's last name as transformers calls it: `down_proj` for Mixtral's `w2`."""
        return (self.canonical or self.module).rpartition(".")[2]


_LAYER = re.compile(r"^(?P<prefix>.*?)model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")
_EXPERT_LEAF = re.compile(r"^(mlp\.experts\.\d+\.)([^.]+)(.*)$")
LEAVES = ("gate_proj", "up_proj", "down_proj")  # an expert's Linears as transformers' models name them


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
        # DeepSeek / GLM: num_nextn_predict_layers; MiniMax-M2: num_mtp_modules
        cfg = self.text_config
        return int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_modules") or 0)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def moe_intermediate_size(self) -> int | None:
        v = self.text_config.get("moe_intermediate_size")
        if not v and self.arch.moe and self.text_config.get("num_local_experts"):
            v = self.text_config.get("intermediate_size")  # Mixtral, MiniMax-M2: every MLP is the experts'
        return int(v) if v else None

    @property
    def experts_field(self) -> str:
        """The config field that counts the routed experts, as this family spells it."""
        return next((f for f in ("n_routed_experts", "num_experts", "num_local_experts") if self.text_config.get(f)),
                    "n_routed_experts")

    @property
    def n_routed_experts(self) -> int | None:
        cfg = self.text_config
        v = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
        return int(v) if v else None

    def transformers_config(self, dtype):
        """The text model's transformers config, built from the dict (never from remote code)."""
        transformers = hf.transformers()

        config_cls, _ = self.arch.hf_classes[self.model_type]
        raw = {k: v for k, v in self.text_config.items() if k not in ("model_type", "auto_map", "quantization_config")}
        rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
        if raw.get("rotary_dim") and raw.get("head_dim") and "partial_rotary_factor" not in {**raw, **rope}:
            # MiniMax-M2's release spells partial rotary as rotary_dim (64 of head_dim 128); transformers reads the
            # fraction from rope_parameters
            raw["partial_rotary_factor"] = raw["rotary_dim"] / raw["head_dim"]
        config = getattr(transformers, config_cls)(**raw)
        config._attn_implementation = "sdpa"
        config.dtype = dtype
        return config

    def causal_lm_class(self):
        transformers = hf.transformers()
        return getattr(transformers, self.arch.hf_classes[self.model_type][1])

    def canonical(self, rel: str) -> str:
        """A layer's tensor or module name as the checkpoint stores it -> as transformers' layer calls it."""
        a = self.arch
        if a.moe_block != "mlp" and (rel == a.moe_block or rel.startswith(a.moe_block + ".")):
            rel = "mlp" + rel[len(a.moe_block):]
        if a.expert_leaves != LEAVES and (m := _EXPERT_LEAF.match(rel)) is not None:
            rel = m[1] + dict(zip(a.expert_leaves, LEAVES, strict=True)).get(m[2], m[2]) + m[3]
        return rel

    def stored(self, rel: str) -> str:
        """The inverse of `canonical`: a layer's name in transformers' layer -> as the checkpoint stores it."""
        a = self.arch
        if a.expert_leaves != LEAVES and (m := _EXPERT_LEAF.match(rel)) is not None:
            rel = m[1] + dict(zip(LEAVES, a.expert_leaves, strict=True)).get(m[2], m[2]) + m[3]
        if a.moe_block != "mlp" and (rel == "mlp" or rel.startswith("mlp.")):
            rel = a.moe_block + rel[len("mlp"):]
        return rel

    def stored_name(self, layer: int, rel: str) -> str:
        """The checkpoint's full name of `rel` (transformers' name inside decoder layer `layer`)."""
        return f"{self.prefix}model.layers.{layer}.{self.stored(rel)}"

    def stored_of(self, name: str) -> str:
        """Any of transformers' names (no prefix) -> the checkpoint's: a decoder layer's own names translated."""
        m = _LAYER.match(name)
        return name if m is None or m["prefix"] else f"model.layers.{m['layer']}.{self.stored(m['rest'])}"

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
        layer, rest = int(m["layer"]), self.canonical(m["rest"])
        canonical = f"{self.prefix}model.layers.{layer}.{rest.rpartition('.')[0]}"
        canonical = "" if canonical == module else canonical
        if layer >= self.num_hidden_layers:
            return Role("mtp", module, layer, canonical=canonical)
        expert = None
        if rest.startswith("self_attn.indexer."):
            kind = "indexer"
        elif rest.startswith("self_attn."):
            kind = "attention"
        elif (e := _EXPERT.match(rest)) is not None:
            kind, expert = "expert", int(e[1])
        elif rest.startswith("mlp.shared_experts."):
            kind = "shared_expert"
        elif (rest.startswith("mlp.gate.") and "mlp.gate." + leaf == rest) or rest == "mlp.e_score_correction_bias":
            kind = "router"  # MiniMax-M2 keeps the router's correction bias on the block
        elif rest.startswith("mlp."):
            kind = "dense_mlp"
        elif "norm" in rest:
            kind = "norm"
        else:
            kind = "other"
        linear = leaf == "weight" and ndim == 2 and rest.rpartition(".")[0].rpartition(".")[2] in self.arch.linear_leaves
        return Role(kind, module, layer, expert, linear, canonical)


@functools.cache
def families() -> tuple[Arch, ...]:
    """Every family: each file of quantize/arch/ holds one as data (an Arch's fields), importing nothing back."""
    from quantize.arch import deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, llama, minimax_m2, mixtral, qwen3_moe

    return tuple(Arch(**m.ARCH) for m in (deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, llama, minimax_m2, mixtral,
                                          qwen3_moe))


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
    if text_config.get("num_hidden_layers") is None or text_config.get("hidden_size") is None:
        if model_type in by_type:
            raise QuantizeError("config.json lacks num_hidden_layers or hidden_size; the checkpoint is incomplete")
    arch = by_type.get(model_type) or _undeclared(config, text_config, model_type, tensor_names)
    return Model(arch, model_type, text_config, _prefix(tensor_names))


def _undeclared(config: dict, text_config: dict, model_type, tensor_names: list[str]) -> Arch:
    """A family no file declares: a dense decoder that transformers builds gets one from its own classes
    (arch/generic.py); a MoE is refused, naming what a family file must say; anything else is unknown."""
    from quantize.arch import generic

    what = f"model_type {config.get('model_type')!r} (architectures {config.get('architectures')})"
    experts = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if text_config.get(k)), None)
    if experts or any(".experts." in n for n in tensor_names):
        fused = next((n for n in tensor_names if n.endswith(".experts.gate_up_proj")), None)
        raise QuantizeError(
            f"unknown MoE architecture: {what}: its expert naming, router and AWQ norm mappings are not declared "
            f"(add a family to quantize/arch/)"
            + (f", and its routed experts are stored fused ({fused}, as Qwen3-VL-MoE ships them), where quantize "
               "streams experts stored one by one" if fused else "")
            + f"; supported MoE: {', '.join(sorted(t for a in families() if a.moe for t in a.model_types))}")
    if isinstance(model_type, str) and generic.classes(model_type) is not None \
            and text_config.get("num_hidden_layers") is not None and text_config.get("hidden_size") is not None \
            and any(_LAYER.match(n) for n in tensor_names):
        return Arch(**generic.fields(model_type, text_config))
    raise QuantizeError(
        f"unknown architecture: {what}; supported: {', '.join(supported_model_types())}, and any dense decoder "
        "transformers builds with model.layers.N names")
