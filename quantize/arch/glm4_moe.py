"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe): GQA attention with q/k/v biases, shared + routed experts, MTP layers."""

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="glm4_moe",
    model_types=("glm4_moe",),
    linear_leaves=frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    moe=True,
    awq_norms=(
        ("input_layernorm", (r"self_attn\.(q|k|v)_proj",)),
        ("post_attention_layernorm", (r"mlp\.gate", r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj")),
    ),
    hf_classes={"glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM")},
)
