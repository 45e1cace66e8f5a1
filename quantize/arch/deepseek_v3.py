"""DeepSeek V3 and everything built on it: Kimi K2 / K2 Thinking (model_type kimi_k2), Kimi K2.5 / K2.6 text
models (the multimodal wrapper's text_config). MLA attention, 1 shared + N routed experts, MTP layers."""

MLA_LINEARS = frozenset({"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"})
MLP_LINEARS = frozenset({"gate_proj", "up_proj", "down_proj"})

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    linear_leaves=MLA_LINEARS | MLP_LINEARS,
    moe=True,
    awq_norms=(
        ("input_layernorm", (r"self_attn\.(q|q_a)_proj", r"self_attn\.kv_a_proj_with_mqa")),
        ("self_attn.q_a_layernorm", (r"self_attn\.q_b_proj",)),
        ("self_attn.kv_a_layernorm", (r"self_attn\.kv_b_proj",)),
        ("post_attention_layernorm", (r"mlp\.gate", r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj")),
    ),
    hf_classes={"deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM")},
)
