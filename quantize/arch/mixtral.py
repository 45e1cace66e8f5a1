"""Mixtral-style MoE checkpoints: the block is stored as `block_sparse_moe` (router `block_sparse_moe.gate`) and
each expert as `experts.E.w1` (gate), `w3` (up), `w2` (down), as Mixtral 8x7B / 8x22B ship them. GQA attention."""

from quantize.arch.qwen3_moe import GQA_LINEARS, GQA_MOE_NORMS

BLOCK = "block_sparse_moe"
EXPERT_LEAVES = ("w1", "w3", "w2")  # gate, up, down

ARCH = dict(  # an Arch's fields (quantize/arch/__init__.py): the family as data
    family="mixtral",
    model_types=("mixtral",),
    linear_leaves=GQA_LINEARS | {"gate_proj", "up_proj", "down_proj"},  # transformers' names (Model.canonical)
    moe=True,
    awq_norms=GQA_MOE_NORMS,
    hf_classes={"mixtral": ("MixtralConfig", "MixtralForCausalLM")},
    moe_block=BLOCK,
    expert_leaves=EXPERT_LEAVES,
)
