"""Dense decoders with Llama's module names: Llama, Qwen2, Qwen3."""

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="llama",
    model_types=("llama", "qwen2", "qwen3"),
    linear_leaves=frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    moe=False,
    awq_norms=(
        ("input_layernorm", (r"self_attn\.(q|k|v)_proj",)),
        ("post_attention_layernorm", (r"mlp\.gate", r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj")),
    ),
    hf_classes={
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    },
)
