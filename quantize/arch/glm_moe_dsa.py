"""GLM-5.x (GlmMoeDsa): DeepSeek-style MLA plus the DSA indexer (`self_attn.indexer.{wq_b,wk,weights_proj}`)."""

from quantize.arch import Arch
from quantize.arch.deepseek_v3 import MLA_LINEARS, MLP_LINEARS

ARCH = Arch(
    family="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    linear_leaves=MLA_LINEARS | MLP_LINEARS | {"wq_b", "wk", "weights_proj"},
    moe=True,
    hf_classes={"glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")},
)
