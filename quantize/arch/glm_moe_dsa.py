"""GLM-5.x (GlmMoeDsa): DeepSeek-style MLA plus the DSA indexer (`self_attn.indexer.{wq_b,wk,weights_proj}`)."""

from quantize.arch.deepseek_v3 import MLA_LINEARS, MLP_LINEARS

# the DSA indexer reads the normed hidden states (wk, weights_proj) and the q latent (wq_b): they balance too
DSA_NORMS = (
    ("input_layernorm", (r"self_attn\.(q|q_a)_proj", r"self_attn\.kv_a_proj_with_mqa",
                         r"self_attn\.indexer\.(wk|weights_proj)")),
    ("self_attn.q_a_layernorm", (r"self_attn\.q_b_proj", r"self_attn\.indexer\.wq_b")),
    ("self_attn.kv_a_layernorm", (r"self_attn\.kv_b_proj",)),
    ("post_attention_layernorm", (r"mlp\.gate", r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up)_proj")),
)

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    linear_leaves=MLA_LINEARS | MLP_LINEARS | {"wq_b", "wk", "weights_proj"},
    moe=True,
    awq_norms=DSA_NORMS,
    hf_classes={"glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")},
    dsa=True,
    carries_topk=True,
    mtp_own_head=False,  # GLM-5's MTP layer shares the model's embedding and head
)
