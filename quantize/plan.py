"""The serving capacity planner: KV bytes per token, weights per GPU, and the tokens and requests that fit.

Arithmetic only, from a config and a list of weight tensors (read from a checkpoint's headers, or laid out
from the config by transformers' model class on the meta device). KV bytes follow SGLang's memory pools:
- MLA (DeepSeek V3, Kimi K2, GLM-5): the cache holds the compressed latent and the rope key,
  (kv_lora_rank + qk_rope_head_dim) per layer, replicated on every TP rank.
- DSA (GLM-5.x, DeepSeek V3.2): the MLA latent plus the indexer's key cache, index_head_dim FP8 bytes and
  one float32 scale per 128 of them per layer (SGLang's NSATokenToKVPool; it is FP8 whatever the KV dtype).
- GQA: max(1, kv_heads / tp) heads of head_dim (K) + v_head_dim (V) per layer and rank.
Weights per GPU follow how SGLang and vLLM shard: Linears split over TP ranks, except what they replicate
(the MLA down-projections q_a_proj and kv_a_proj_with_mqa, the DSA indexer, the router, MTP's eh_proj,
norms, and K/V projections when there are fewer KV heads than ranks).
"""

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field

from quantize import arch
from quantize.arch import Role
from quantize.arch.layout import from_config
from quantize.serving import REPLICATED

GIB = 2**30


def size_label(n: int) -> str:
    """Bytes as GiB, or MiB below a quarter GiB (tiny test checkpoints)."""
    return f"{n / GIB:,.2f} GiB" if n >= 2**28 else f"{n / 2**20:,.1f} MiB"

# total memory of one GPU as nvidia-smi reports it (MiB / 1024)
GPUS = {"h100": 81559 / 1024, "h200": 143771 / 1024, "b200": 183359 / 1024}

INDEXER_SCALE_BLOCK = 128  # one float32 scale per 128 index-key values


@dataclass(frozen=True)
class Weight:
    name: str
    shape: tuple[int, ...]
    role: Role
    nbytes: int  # under the format in question, scales included


@dataclass(frozen=True)
class KV:
    kind: str  # mla | dsa | gqa
    layers: int
    bytes_per_token: int  # on one TP rank
    detail: str


def kv_per_token(cfg: dict, kv_bytes: int, tp: int = 1, mtp_layers: int = 0) -> KV:
    """KV cache bytes per token on one TP rank, with `kv_bytes` per element (2 for BF16, 1 for FP8)."""
    layers = int(cfg["num_hidden_layers"]) + mtp_layers
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        per_layer = latent * kv_bytes
        detail = f"({cfg['kv_lora_rank']} + {cfg['qk_rope_head_dim']}) x {layers} layers x {kv_bytes} B"
        if cfg.get("index_head_dim"):
            d = int(cfg["index_head_dim"])
            index = d + d // INDEXER_SCALE_BLOCK * 4
            detail += f" + indexer ({d} FP8 + {d // INDEXER_SCALE_BLOCK * 4} B scale) x {layers}"
            return KV("dsa", layers, (per_layer + index) * layers, detail)
        return KV("mla", layers, per_layer * layers, detail)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    v_head_dim = int(cfg.get("v_head_dim") or head_dim)
    per_rank = max(1, kv_heads // tp)
    detail = f"{per_rank} KV heads/rank x ({head_dim} + {v_head_dim}) x {layers} layers x {kv_bytes} B"
    return KV("gqa", layers, per_rank * (head_dim + v_head_dim) * layers * kv_bytes, detail)


def rank_divisor(w: Weight, cfg: dict, tp: int) -> int:
    """How many ways TP splits this tensor (1: every rank holds all of it)."""
    split = _split(w.name, w.role.kind, len(w.shape))
    if split == "kv_heads":
        kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        return min(tp, kv_heads)
    return tp if split == "tp" else 1


_KV_PROJ = re.compile(r"self_attn\.(k|v)_proj")


@functools.lru_cache(maxsize=1 << 17)
def _split(name: str, kind: str, ndim: int) -> str:
    """replicated | kv_heads | tp (plan asks this of each tensor once per scenario)."""
    if ndim < 2 or REPLICATED.search(name) or kind in ("norm", "router"):
        return "replicated"
    return "kv_heads" if _KV_PROJ.search(name) else "tp"


def per_gpu_bytes(weights: list[Weight], cfg: dict, tp: int) -> float:
    return sum(w.nbytes / rank_divisor(w, cfg, tp) for w in weights)


# ---- weight lists ----------------------------------------------------------------------------------------


def _int4_bytes(shape: tuple[int, ...], num_bits: int, group_size: int, symmetric: bool = True) -> int:
    out_f, in_f = shape
    n = out_f * in_f * num_bits // 8 + out_f * (in_f // group_size) * 2 + 16  # packed, BF16 scales, weight_shape
    if not symmetric:
        n += math.ceil(out_f / 8) * (in_f // group_size) * 4
    return n


def _fp8_block_bytes(shape: tuple[int, ...], block: tuple[int, int], scale_bytes: int = 2) -> int:
    """e4m3 weight plus one scale per block: BF16 in compressed-tensors FP8_BLOCK (the model dtype), float32
    in DeepSeek's own format."""
    return math.prod(shape) + math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1]) * scale_bytes


def source_format_bytes(cfg: dict):
    """bytes(name, shape, role) of a tensor under the checkpoint's own format, from its quantization_config."""
    qc = cfg.get("quantization_config") or {}
    block = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
    skip = qc.get("modules_to_not_convert") or []
    groups = (qc.get("config_groups") or {}).values() if qc.get("quant_method") == "compressed-tensors" else []
    weights = [g.get("weights") or {} for g in groups]
    ct_ignore = qc.get("ignore") or []

    def nbytes(name: str, shape: tuple[int, ...], role: Role) -> int:
        numel = math.prod(shape)
        module = name.rpartition(".")[0]
        if role.linear and block and not any(s in module for s in skip):
            return _fp8_block_bytes(shape, block, scale_bytes=4)
        if role.linear and weights and weights[0].get("block_structure") and not _ignored(ct_ignore, module):
            return _fp8_block_bytes(shape, tuple(weights[0]["block_structure"]))
        if role.linear and weights and weights[0].get("num_bits") == 4 and not _ignored(ct_ignore, module):
            w = weights[0]
            return _int4_bytes(shape, 4, int(w["group_size"]), bool(w.get("symmetric", True)))
        return numel * _float_bytes(name)

    return nbytes


def recipe_bytes(recipe, family: str, include_mtp: bool = False):
    """bytes(name, shape, role) of a tensor after `quantize convert` with `recipe` on a model of `family`:
    targeted Linears INT4 with their group scales (or FP8 blocks, for an fp8-block recipe) unless the engines
    need them float (serving.keep_float), everything else BF16 (FP8 sources are dequantized), MTP layers BF16 as
    in convert (unless `include_mtp`, which quantizes them like the decoder layers, for comparison)."""
    from quantize import serving

    def nbytes(name: str, shape: tuple[int, ...], role: Role) -> int:
        if ((include_mtp or role.kind != "mtp") and recipe.targets_module(role.module, role.linear)
                and not serving.keep_float(family, role.module, recipe.scheme.fp8_block)):
            s = recipe.scheme
            if s.fp8_block:
                return _fp8_block_bytes(shape, tuple(s.block_structure))
            if s.fp4:  # half a byte a weight, a one-byte scale a group, NVFP4's float32 global scale
                # (and with NVFP4 activations, the float32 input_global_scale)
                return math.prod(shape) // 2 + math.prod(shape) // s.group_size + (4 if s.fp4 == "nvfp4" else 0) \
                    + (4 if s.w4a4 else 0)
            return _int4_bytes(shape, s.num_bits, s.group_size, s.symmetric)
        return math.prod(shape) * _float_bytes(name)

    return nbytes


def _float_bytes(name: str) -> int:
    """BF16, except the router's score-correction bias, which DeepSeek-style checkpoints keep in float32."""
    return 4 if name.endswith("e_score_correction_bias") else 2


def _ignored(patterns: list[str], module: str) -> bool:
    from quantize.recipe import any_matches

    return any_matches(tuple(patterns), module)


def roles_of(model: arch.Model, layout: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...], Role]]:
    """The layout's tensors with their roles, worked out once for every weights_of of one plan; an MTP layer's
    Linears are marked Linear too (the role leaves them out of recipes, but the source format stores them like
    any decoder layer's)."""
    out = []
    for name, shape in layout:
        role = model.role(name, len(shape))
        if role.kind == "mtp" and len(shape) == 2 and name.endswith(".weight"):
            leaf = role.module.rpartition(".")[2]
            role = dataclasses.replace(role, linear=leaf in model.arch.linear_leaves or leaf == "eh_proj")
        out.append((name, shape, role))
    return out


def weights_of(typed: list[tuple[str, tuple[int, ...], Role]], nbytes) -> list[Weight]:
    """The tensors of roles_of with their bytes under `nbytes`."""
    return [Weight(name, shape, role, nbytes(name, shape, role)) for name, shape, role in typed]


# ---- scenarios -------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    weights: str  # label of the weight format
    kv_dtype: str
    weights_total: float  # bytes, the whole model
    weights_per_gpu: float
    kv: KV
    kv_budget_per_gpu: float  # bytes
    tokens: int  # that fit in one replica's KV cache
    replicas: int
    context_len: int

    @property
    def total_tokens(self) -> int:
        return self.tokens * self.replicas

    @property
    def max_requests(self) -> int:
        return self.total_tokens // self.context_len if self.context_len else 0

    def to_dict(self) -> dict:
        return {
            "weights": self.weights, "kv_dtype": self.kv_dtype,
            "weights_total_gib": round(self.weights_total / GIB, 2),
            "weights_per_gpu_gib": round(self.weights_per_gpu / GIB, 2),
            "kv_kind": self.kv.kind, "kv_bytes_per_token": self.kv.bytes_per_token, "kv_formula": self.kv.detail,
            "kv_budget_per_gpu_gib": round(self.kv_budget_per_gpu / GIB, 2),
            "tokens_per_replica": self.tokens, "replicas": self.replicas, "total_tokens": self.total_tokens,
            "context_len": self.context_len, "max_concurrent_requests": self.max_requests,
        }


@dataclass
class Setup:
    gpus: int = 8
    tp: int = 8
    dp: int = 1
    gpu_mem_gib: float = GPUS["h200"]
    mem_fraction: float = 0.9
    overhead_gib: float = 0.0
    kv_budget_gib: float | None = None  # fixes the KV budget per GPU instead of deriving it
    context_len: int = 131072
    mtp: bool = False
    notes: list[str] = field(default_factory=list)


def scenario(label: str, weights: list[Weight], cfg: dict, kv_dtype: str, setup: Setup, mtp_layers: int) -> Scenario:
    kv = kv_per_token(cfg, 1 if kv_dtype == "fp8" else 2, setup.tp, mtp_layers if setup.mtp else 0)
    per_gpu = per_gpu_bytes(weights, cfg, setup.tp)
    if setup.kv_budget_gib is not None:
        budget = setup.kv_budget_gib * GIB
    else:
        budget = setup.gpu_mem_gib * GIB * setup.mem_fraction - per_gpu - setup.overhead_gib * GIB
    tokens = max(0, int(budget // kv.bytes_per_token))
    return Scenario(label, kv_dtype, sum(w.nbytes for w in weights), per_gpu, kv, budget, tokens, setup.dp,
                    setup.context_len)


# ---- published figures -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    what: str
    published: float
    computed: float
    unit: str
    tolerance: float = 0.01  # relative
    why: str = ""

    @property
    def holds(self) -> bool:
        return abs(self.computed - self.published) <= self.tolerance * abs(self.published)

    def to_dict(self) -> dict:
        return {"what": self.what, "published": self.published, "computed": round(self.computed, 3),
                "unit": self.unit, "holds": self.holds, "why": self.why}


def is_kimi_k2(cfg: dict) -> bool:
    return cfg.get("n_routed_experts") == 384 and cfg.get("num_hidden_layers") == 61 and cfg.get("kv_lora_rank") == 512


def is_glm5(cfg: dict) -> bool:
    return cfg.get("model_type") == "glm_moe_dsa" and cfg.get("num_hidden_layers") == 78 and cfg.get("hidden_size") == 6144


# Parameter counts the model cards state, matched by the config fields that identify the release:
# (what, identifying fields, total, activated per token, where it is stated, how the card counts)
CARDS = (
    ("Qwen3-235B-A22B", {"model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096}, 235e9, 22e9,
     "huggingface.co/Qwen/Qwen3-235B-A22B: 235B in total, 22B activated", "embeddings counted"),
    ("Qwen3-30B-A3B", {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048}, 30.5e9, 3.3e9,
     "huggingface.co/Qwen/Qwen3-30B-A3B: 30.5B in total, 3.3B activated", "embeddings counted"),
    ("MiniMax-M2", {"model_type": "minimax_m2", "num_hidden_layers": 62, "hidden_size": 3072}, 230e9, 10e9,
     "huggingface.co/MiniMaxAI/MiniMax-M2: 230 billion total parameters with 10 billion active", "no embeddings"),
    ("Mixtral-8x7B", {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096}, 46.7e9, 12.9e9,
     "Jiang et al., Mixtral of Experts (arXiv:2401.04088): 47B parameters, 13B active (46.7B / 12.9B on "
     "mistral.ai)", "embeddings counted"),
    ("DeepSeek-V3.2", {"model_type": "deepseek_v32", "num_hidden_layers": 61, "hidden_size": 7168}, 685e9, 37e9,
     "huggingface.co/deepseek-ai/DeepSeek-V3.2: 685B (DeepSeek-V3's card: 671B main model + 14B MTP module), "
     "37B activated", "no embeddings"),
)


def parameter_claims(cfg: dict, source: list[Weight]) -> list[Claim]:
    """The card's total and activated parameters against this config's tensors: every weight for the total, and per
    token the routed experts' top_k / n share of theirs (the MTP layers aside; embeddings as the card counts)."""
    out = []
    for what, fields, total, active, where, counting in CARDS:
        if any(cfg.get(k) != v for k, v in fields.items()):
            continue
        n_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 1
        share = int(cfg.get("num_experts_per_tok") or 1) / int(n_experts)
        numel = {w.name: math.prod(w.shape) for w in source}
        count = {w.name: numel[w.name] * (share if w.role.kind == "expert" else 1) for w in source
                 if w.role.kind != "mtp" and (w.role.kind not in ("embedding", "lm_head") or counting != "no embeddings")}
        out += [Claim(f"{what} parameters", total / 1e9, sum(numel.values()) / 1e9, "B", 0.02, where),
                Claim(f"{what} activated parameters per token", active / 1e9, sum(count.values()) / 1e9, "B", 0.03,
                      f"{where} ({counting})")]
    return out


def published_claims(cfg: dict, source: list[Weight], int4_experts_all: list[Weight] | None,
                     int4_recipe: list[Weight] | None) -> list[Claim]:
    """The figures published for these models, recomputed from this config."""
    claims = parameter_claims(cfg, source)
    if is_kimi_k2(cfg):
        budget = 44.9 * GIB
        bf16, fp8 = kv_per_token(cfg, 2).bytes_per_token, kv_per_token(cfg, 1).bytes_per_token
        claims += [
            Claim("KV bytes per token, BF16 (MLA latent)", 70272, bf16, "B", 0),
            Claim("KV bytes per token, FP8", 35136, fp8, "B", 0),
            Claim("tokens in a 44.9 GiB KV budget, BF16", 686e3, budget // bf16, "tokens"),
            Claim("tokens in a 44.9 GiB KV budget, FP8", 1.37e6, budget // fp8, "tokens"),
        ]
    if is_glm5(cfg):
        src = sum(w.nbytes for w in source) / GIB
        fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
        claims.append(Claim("FP8 checkpoint size", 704, src, "GiB", 0.01,
                            "" if fp8 else "this config is not the FP8 checkpoint's"))
        if int4_experts_all is not None:
            claims.append(Claim("INT4 g32 routed experts, the rest BF16", 420, sum(w.nbytes for w in int4_experts_all) / GIB,
                                "GiB", 0.01, "every routed expert INT4, the MTP layer's included"))
        replicated = "SGLang replicates the MLA down-projections (q_a_proj, kv_a_proj_with_mqa) and the DSA indexer " \
                     "on every rank; the published figure divides the checkpoint by 8"
        claims.append(Claim("FP8 weights per GPU at TP 8", 88, per_gpu_bytes(source, cfg, 8) / GIB, "GiB", 0.01,
                            replicated))
        if int4_experts_all is not None:
            claims.append(Claim("INT4 weights per GPU at TP 8", 52, per_gpu_bytes(int4_experts_all, cfg, 8) / GIB,
                                "GiB", 0.02, replicated))
        if int4_recipe is not None:
            claims.append(Claim("INT4 g32 routed experts, the rest BF16", 420, sum(w.nbytes for w in int4_recipe) / GIB,
                                "GiB", 0.01, "as `quantize convert` writes it: the MTP layer stays BF16, which vLLM's "
                                "and SGLang's MTP modules load unquantized"))
    return claims


# ---- the whole report ------------------------------------------------------------------------------------

# the GLM release scheme the published INT4 figure describes: routed experts INT4 g32, the rest BF16
GLM_EXPERTS_G32 = {"name": "glm-experts-g32", "scheme": {"num_bits": 4, "group_size": 32, "symmetric": True},
                   "targets": ["Linear"],
                   "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]}


@dataclass
class Report:
    model: str
    source: str
    config: dict
    scenarios: list[Scenario]
    claims: list[Claim]
    notes: list[str]

    def to_dict(self, setup: Setup) -> dict:
        return {"model": self.model, "source": self.source,
                "setup": {k: v for k, v in vars(setup).items() if k != "notes"},
                "scenarios": [s.to_dict() for s in self.scenarios], "claims": [c.to_dict() for c in self.claims],
                "notes": self.notes}


def _from_folder(folder):
    from quantize import tensor_plan
    from quantize.checkpoint import Checkpoint

    ckpt = Checkpoint(folder)
    model = arch.resolve(ckpt.config, list(ckpt.tensors))
    source = [Weight(n, t.shape, model.role(n, len(t.shape)), t.stored_bytes) for n, t in ckpt.tensors.items()]

    def under(recipe) -> list[Weight]:
        built = tensor_plan.build(ckpt, recipe, 1 << 62)
        return [Weight(e.tensor.name, e.tensor.shape, e.role, e.out_bytes) for e in built.entries]

    return model, source, under, f"{ckpt.format.kind} checkpoint"


def _label(recipe) -> str:
    s = recipe.scheme
    if s.fp8_block:
        kind = "FP8 blocks"
    elif s.w4afp8:
        kind = f"INT4 g{s.group_size} + FP8 activations"
    elif s.w4a4:
        kind = "NVFP4 (W4A4)"
    elif s.fp4:
        kind = f"{s.fp4.upper()}A16"
    else:
        kind = f"INT4 g{s.group_size}"
    return f"{recipe.name} ({kind})"


def w4afp8_variant(recipe):
    """The single-checkpoint alternative to a prefill / decode pair: the recipe's targets as W4AFP8 (INT4 g128
    weights, FP8 activations), or every Linear but lm_head without a recipe."""
    import dataclasses

    from quantize import recipe as recipes

    if recipe is None:
        return recipes.preset("w4afp8", 128)
    scheme = recipes.Scheme(num_bits=4, group_size=128, symmetric=True, activations="fp8")
    return dataclasses.replace(recipe, name=f"{recipe.name}-w4afp8", scheme=scheme, kv_cache=None)


def capacity(path, setup: Setup, kv_dtypes: list[str], recipe=None, disaggregated: bool = False) -> Report:
    """The scenarios (source or recipe weights x KV dtypes) for a checkpoint folder or a config.json.

    `disaggregated`: the prefill / decode pair, prefill on FP8 blocks of every Linear but lm_head
    (Recipe.fp8_block_variant) and decode on the recipe's weights (or the source's), each pool sized with the
    same setup."""
    import json
    from pathlib import Path

    from quantize import recipe as recipes
    from quantize.errors import UsageError

    path = Path(path)
    if setup.gpus != setup.tp * setup.dp:
        raise UsageError(f"--gpus {setup.gpus} is not --tp {setup.tp} x --dp {setup.dp}")
    if path.is_dir() and any(path.glob("*.safetensors")):
        model, source, under, what = _from_folder(path)
        cfg = model.text_config
        layout = None
    else:
        cfg_path = path / "config.json" if path.is_dir() else path
        if not cfg_path.is_file():
            raise UsageError(f"{path} is neither a checkpoint folder nor a config.json")
        full = json.loads(cfg_path.read_text())
        model, layout = from_config(full)
        cfg = model.text_config
        layout = roles_of(model, layout)
        source = weights_of(layout, source_format_bytes(cfg))

        def under(r) -> list[Weight]:
            return weights_of(layout, recipe_bytes(r, model.arch.family))

        what = "config only: shapes from transformers' model class, " + (
            "FP8 blocks" if (cfg.get("quantization_config") or {}).get("quant_method") == "fp8" else "as the config says")
    notes = []
    rows = [("source (" + _format_label(cfg) + ")", source)]
    if disaggregated:
        prefill = recipe.fp8_block_variant() if recipe is not None else recipes.preset("fp8-block", 128)
        rows.append(("prefill: " + _label(prefill), under(prefill)))
        if recipe is not None:
            rows.append(("decode: " + _label(recipe), under(recipe)))
        notes.append("disaggregated serving: a prefill pool on FP8 block weights (W8A8 block GEMMs, compute-bound "
                     "prompts) and a decode pool on " + ("the recipe's INT4 weights (less weight traffic per token)"
                                                         if recipe is not None else "the source weights")
                     + "; each row is one pool with this --gpus/--tp; `quantize convert --prefill-out` writes both")
        single = w4afp8_variant(recipe)
        rows.append(("or one checkpoint for both: " + _label(single), under(single)))
        notes.append("or one checkpoint for both phases: W4AFP8 (`--scheme w4afp8`) keeps INT4's memory and runs FP8 "
                     "GEMMs on Hopper (SM 9.0 in vLLM), so prefill does not widen INT4 to BF16")
    elif recipe is not None:  # one recipe, or several side by side (plan --weights schemes)
        rows += [(_label(r), under(r)) for r in (recipe if isinstance(recipe, list) else [recipe])]
    # the MTP layers that hold weights (MiniMax-M2's config names 3 MTP modules that its release does not hold)
    mtp_layers = len({w.role.layer for w in source if w.role.kind == "mtp"})
    scenarios = [scenario(label, w, cfg, kv, setup, mtp_layers) for kv in kv_dtypes for label, w in rows]
    if layout is None and (is_glm5(cfg) or is_kimi_k2(cfg)):
        layout = roles_of(model, from_config(cfg)[1])
    all_int4 = rec_int4 = None
    if is_glm5(cfg) and layout is not None:
        glm = recipes.from_dict(GLM_EXPERTS_G32, "built-in GLM release scheme")
        rec_int4 = weights_of(layout, recipe_bytes(glm, model.arch.family))
        all_int4 = weights_of(layout, recipe_bytes(glm, model.arch.family, include_mtp=True))
    claims = published_claims(cfg, source, all_int4, rec_int4)
    for c in claims:
        if not c.holds:
            notes.append(f"published {c.what} {c.published:g} {c.unit} does not follow from this config: "
                         f"{c.computed:,.1f} {c.unit}" + (f" ({c.why})" if c.why else ""))
    if mtp_layers and not setup.mtp:
        notes.append(f"{mtp_layers} MTP layer(s) hold weights but no KV here; pass --mtp to serve with "
                     "speculative decoding (their KV is added)")
    return Report(f"{model.model_type} ({model.arch.family})", f"{path} [{what}]", cfg, scenarios, claims, notes)


def _format_label(cfg: dict) -> str:
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        return "FP8 blocks"
    if qc.get("quant_method") == "compressed-tensors":
        return "compressed-tensors"
    return "BF16"
