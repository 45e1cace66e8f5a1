"""DeepSeek-V3.1 / V3.2 with DeepSeek Sparse Attention (`deepseek_v32`): V3's MLA, experts and MTP layer, plus
a DSA indexer in every layer (`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`), GLM-5's sibling. Unlike GLM-5,
each layer scores its own top-k (nothing carried between layers) and the MTP layer stores its own head."""

from quantize.arch.deepseek_v3 import MLA_LINEARS, MLP_LINEARS
from quantize.arch.glm_moe_dsa import DSA_NORMS

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="deepseek_v32",
    model_types=("deepseek_v32",),
    linear_leaves=MLA_LINEARS | MLP_LINEARS | {"wq_b", "wk", "weights_proj"},
    moe=True,
    awq_norms=DSA_NORMS,
    hf_classes={"deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM")},
    dsa=True,
)
