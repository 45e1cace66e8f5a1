"""MiniMax-M2 / M2.1 (230B, an FP8-block release): Mixtral's names (`block_sparse_moe.experts.E.w1/w3/w2`),
GQA attention with q/k norms over all heads, a sigmoid router whose correction bias sits on the block
(`block_sparse_moe.e_score_correction_bias`), and MTP modules after the decoder layers (`num_mtp_modules`),
which transformers does not build and both engines drop: they are carried as they are."""

from quantize.arch.mixtral import BLOCK, EXPERT_LEAVES
from quantize.arch.qwen3_moe import GQA_LINEARS, GQA_MOE_NORMS

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="minimax_m2",
    model_types=("minimax_m2",),
    linear_leaves=GQA_LINEARS | {"gate_proj", "up_proj", "down_proj"},
    moe=True,
    awq_norms=GQA_MOE_NORMS,
    hf_classes={"minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM")},
    moe_block=BLOCK,
    expert_leaves=EXPERT_LEAVES,
)
