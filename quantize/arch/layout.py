"""Every weight a config implies, and a source checked against it before anything is written.

A config that lies (a negative size, an expert count the shards do not hold, a shape that contradicts a tensor)
must fail here, in one line that names the field or the tensor, and never reach an engine as a traceback or an
output whose config.json no engine can load. `from_config` is also what `plan` sizes a bare config.json with.
"""

import math

from quantize import arch
from quantize.errors import QuantizeError

# config fields that size tensors or loops: whole numbers, at least 1 (SIZES) or 0 (COUNTS); None where optional
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts", "num_experts",
         "num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
         "n_group", "topk_group", "index_head_dim", "index_n_heads", "index_topk", "max_position_embeddings",
         "moe_layer_freq")
COUNTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
MAX_SIZE = 2**31 - 1
MODEL_DTYPES = ("bfloat16", "float16", "float32")


def _bad(field: str, value, want: str) -> QuantizeError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return QuantizeError(f"config.json: {field} is {shown}, expected {want}; the config is broken")


def check_config(config) -> None:
    """Types, signs and sizes of the fields that shape the model, and its dtype (a multimodal wrapper's
    text_config too). Raises QuantizeError naming the field."""
    if not isinstance(config, dict):
        raise QuantizeError(f"config.json: expected a JSON object, found {type(config).__name__}; the config is broken")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise _bad("text_config", text, "an object")
    for where, cfg in (("", config), ("text_config.", text or {})):
        for k in SIZES + COUNTS:
            v = cfg.get(k)
            low = 1 if k in SIZES else 0
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_SIZE):
                raise _bad(where + k, v, f"a whole number from {low} to {MAX_SIZE}")
        for k in POSITIVE_FLOATS:
            v = cfg.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0):
                raise _bad(where + k, v, "a positive number")
        for k in ("torch_dtype", "dtype"):
            v = cfg.get(k)
            if v is not None and v not in MODEL_DTYPES:
                raise _bad(where + k, v, f"one of {', '.join(MODEL_DTYPES)}")
        if not isinstance(cfg.get("model_type", ""), str):
            raise _bad(where + "model_type", cfg["model_type"], "a string")
        heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if heads and kv and heads % kv:
            raise QuantizeError(f"config.json: {where}num_attention_heads {heads} is not a multiple of "
                                f"num_key_value_heads {kv}; the config is broken")
        experts = cfg.get("n_routed_experts") or cfg.get("num_experts")
        if experts and (cfg.get("num_experts_per_tok") or 0) > experts:
            raise QuantizeError(f"config.json: {where}num_experts_per_tok {cfg['num_experts_per_tok']} is more than "
                                f"the {experts} routed experts; the config is broken")


def shapes(model: arch.Model) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every weight a checkpoint of this model stores, as checkpoints name them: transformers'
    model class built on the meta device (no memory), fused experts split per expert, MTP layers (a decoder layer
    plus eh_proj and its norms, and its own embedding and head where the family stores them) added as
    DeepSeek-style checkpoints store them."""
    import torch

    try:
        hf_config = model.transformers_config(torch.bfloat16)
        with torch.device("meta"):
            skeleton = model.causal_lm_class()._from_config(hf_config, dtype=torch.bfloat16)
    except Exception as e:  # transformers' own checks, or its arithmetic failing on a value they do not check
        raise QuantizeError(f"config.json: transformers cannot build {model.arch.hf_classes[model.model_type][1]} from "
                            f"it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the config is "
                            "broken") from e
    out: list[tuple[str, tuple[int, ...]]] = []
    persistent = [(f"{m}.{b}" if m else b, t) for m, mod in skeleton.named_modules() for b, t in mod._buffers.items()
                  if t is not None and b not in mod._non_persistent_buffers_set]  # e.g. the router's score bias
    for name, p in [*skeleton.named_parameters(), *persistent]:
        shape = tuple(p.shape)
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(shape[0]):
                half = (shape[1] // 2, shape[2])
                out += [(f"{base}{e}.gate_proj.weight", half), (f"{base}{e}.up_proj.weight", half)]
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", shape[1:]) for e in range(shape[0])]
        else:
            out.append((name, shape))
    out = [(model.stored_of(name), shape) for name, shape in out]  # Mixtral's block_sparse_moe.experts.E.w1
    n, hidden = model.num_hidden_layers, model.hidden_size
    last = f"model.layers.{n - 1}."
    # DeepSeek-style MTP layers (num_nextn_predict_layers); MiniMax-M2's MTP modules are not transformers' and are
    # carried as stored
    for k in range(int(model.text_config.get("num_nextn_predict_layers") or 0)):
        mtp = f"model.layers.{n + k}."
        out += [(mtp + name[len(last):], shape) for name, shape in out if name.startswith(last)]
        out += [(mtp + "eh_proj.weight", (hidden, 2 * hidden)), (mtp + "enorm.weight", (hidden,)),
                (mtp + "hnorm.weight", (hidden,)), (mtp + "shared_head.norm.weight", (hidden,))]
        if model.arch.mtp_own_head:
            # DeepSeek-V3 (model.layers.61: 1.73 GB of head alone) and GLM-4.5 store the MTP layer's own copies of
            # the embedding and the output head; GLM-5's MTP layer shares the model's
            vocab = int(hf_config.vocab_size)  # transformers' default where the config has none
            out += [(mtp + "embed_tokens.weight", (vocab, hidden)), (mtp + "shared_head.head.weight", (vocab, hidden))]
    return dict(out)


def from_config(cfg: dict) -> tuple[arch.Model, list[tuple[str, tuple[int, ...]]]]:
    """The model of a bare config.json and every weight (name, shape) a checkpoint of it holds (`shapes`)."""
    check_config(cfg)
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg \
        else cfg
    model = arch.resolve(cfg, ["model.layers.0.x"])
    model = arch.Model(model.arch, model.model_type, text_cfg, "")
    return model, list(shapes(model).items())


def _counts(model: arch.Model, stored: dict[str, tuple[int, ...]]) -> None:
    """Layer and expert counts from the names alone, before anything is built from the config: a config that
    claims a million experts is refused here, not by laying them out."""
    layers, experts = set(), set()
    for name, shape in stored.items():
        r = model.role(name, len(shape))
        if r.layer is not None:
            layers.add(r.layer)
        if r.expert is not None and r.kind == "expert":
            experts.add(r.expert)
    n, mtp = model.num_hidden_layers, model.num_mtp_layers
    decoder = {i for i in layers if i < n}
    if decoder != set(range(n)):
        missing = sorted(set(range(n)) - decoder)
        raise QuantizeError(
            f"config.json says num_hidden_layers={n} but the weights hold layers "
            f"{min(layers, default=None)}..{max(layers, default=None)}"
            + (f" with {missing[:5]} missing" if missing else "")
        )
    extra = sorted(i for i in layers if i >= n)
    if extra and max(extra) >= n + max(mtp, 1):
        raise QuantizeError(f"the weights hold layer {max(extra)} beyond num_hidden_layers={n} + {mtp} MTP layers")
    n_exp = model.n_routed_experts
    if experts and n_exp is not None and max(experts) >= n_exp:
        raise QuantizeError(f"config.json says {n_exp} routed experts but the weights hold expert {max(experts)}")
    if model.arch.moe and n_exp and len(experts) != n_exp:
        raise QuantizeError(f"config.json says {model.experts_field}={n_exp} but the weights hold {len(experts)} experts")


def check(model: arch.Model, stored: dict[str, tuple[int, ...]], files: dict[str, str]) -> None:
    """Refuse a source whose config contradicts its tensors: counts first, then every shape the config implies
    against the shard headers (`files` names the shard of each tensor). An MTP layer may be missing (releases
    strip it), a tensor the config does not imply is carried as it is (a vision tower, a buffer)."""
    _counts(model, stored)
    for name, want in shapes(model).items():
        name = model.prefix + name
        have = stored.get(name)
        if have is None:
            if model.role(name, len(want)).kind == "mtp":
                continue
            raise QuantizeError(f"config.json implies {name} {list(want)}, which no shard holds; the config "
                                "contradicts the weights (or the checkpoint is incomplete)")
        if tuple(have) != tuple(want):
            differ = {w for w, h in zip(want, have, strict=False) if w != h} if len(want) == len(have) else set(want)
            fields = sorted(k for k, v in model.text_config.items()
                            if isinstance(v, int) and not isinstance(v, bool) and v in differ)
            hint = f" (check {', '.join(fields[:4])})" if fields else ""
            raise QuantizeError(f"{files.get(name, 'a shard')}: {name} is {list(have)} but config.json implies "
                                f"{list(want)}{hint}; the config contradicts the weights")
