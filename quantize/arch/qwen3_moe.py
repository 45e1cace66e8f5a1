"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B and their -FP8 block releases): GQA attention
with per-head q/k norms, routed experts only (no shared expert), dense MLP layers where `mlp_only_layers` says."""

GQA_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP_LINEARS = frozenset({"gate_proj", "up_proj", "down_proj"})
# the norms before attention and before the MoE block, and everything that reads them (router included)
GQA_MOE_NORMS = (
    ("input_layernorm", (r"self_attn\.(q|k|v)_proj",)),
    ("post_attention_layernorm", (r"mlp\.gate", r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj")),
)

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="qwen3_moe",
    model_types=("qwen3_moe",),
    linear_leaves=GQA_LINEARS | MLP_LINEARS,
    moe=True,
    awq_norms=GQA_MOE_NORMS,
    hf_classes={"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")},
)
