"""scripts/upcycle_moe.py: a dense Llama rewritten as a Mixtral-style MoE of the same function, the bench's real
weights in a routed-expert layout (its docstring)."""

import json

import pytest
import torch
import upcycle_moe
from safetensors import safe_open


def test_the_upcycled_moe_computes_the_dense_models_function(fixtures_dir, tmp_path):
    """Every token goes to every expert at weight 1 / experts, which w2's factor undoes: transformers' Mixtral gives
    the dense Llama's logits, to float32's rounding of the regrouped sums."""
    from transformers import AutoModelForCausalLM

    src, dst = fixtures_dir / "llama-bf16", tmp_path / "moe"
    upcycle_moe.upcycle(src, dst, experts=4)
    cfg = json.loads((dst / "config.json").read_text())
    dense_cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == cfg["num_experts_per_tok"] == 4
    assert cfg["intermediate_size"] * 4 == dense_cfg["intermediate_size"]
    assert not (tmp_path / "moe.partial").exists()  # written under a temporary name, renamed once whole
    with pytest.raises(SystemExit, match="exists"):  # and never over what is there
        upcycle_moe.upcycle(src, dst, experts=4)
    names = set()
    for shard in dst.glob("*.safetensors"):  # one per source shard, under its name
        with safe_open(shard, "pt") as f:
            names |= set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not any(".mlp." in n for n in names)
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    moe = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    ids = torch.tensor([[1, 17, 230, 5, 99, 3, 41, 8]])
    with torch.no_grad():
        a, b = dense(ids).logits, moe(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), float((a - b).abs().max())


def test_experts_that_do_not_split_the_mlp_evenly_are_refused(fixtures_dir, tmp_path):
    with pytest.raises(SystemExit, match="power of two dividing"):
        upcycle_moe.upcycle(fixtures_dir / "llama-bf16", tmp_path / "moe", experts=3)
