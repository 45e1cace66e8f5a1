"""A dense Llama-style checkpoint rewritten as a Mixtral-style MoE that computes the same function: a real model's
weights in a routed-expert layout, for measuring what the engine does to routed experts (issue 39) where no real
MoE checkpoint can be downloaded.

Each layer's MLP (intermediate size I) becomes `experts` experts of I / experts each: expert j holds rows
j*I/E..(j+1)*I/E of gate_proj and up_proj (Mixtral's w1, w3) and the same columns of down_proj (w2). The router's
weight is zero, so every expert's logit is 0, and with num_experts_per_tok = experts every token goes to every
expert with weight softmax(0) = 1 / experts; w2 is multiplied by `experts` to undo it. A power of two scales a
bf16 weight exactly, so the MoE's MLP output is the dense one's sum regrouped (the same products; the sum's order
differs). Every expert sees every token: no expert is thinly routed here. Written a source shard at a time, into
DST.partial renamed to DST once whole.

    python scripts/upcycle_moe.py SRC DST --experts 8
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # transformers' Llama leaf -> Mixtral's


def upcycle(src: Path, dst: Path, experts: int) -> None:
    """Write the MoE of `src` to `dst`, a source shard at a time (memory bounded by the largest shard), into
    DST.partial renamed to DST once whole; an existing DST is refused."""
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"{src}: model_type {cfg.get('model_type')!r}; only llama checkpoints are upcycled")
    inter = cfg["intermediate_size"]
    if inter % experts or experts & (experts - 1):
        raise SystemExit(f"--experts {experts}: must be a power of two dividing intermediate_size {inter}")
    if dst.exists():
        raise SystemExit(f"{dst} exists; remove it or name another")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = sorted(src.glob("*.safetensors"))
    weight_map = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            tensors = {k: v for name in f.keys() for k, v in _rewritten(name, f.get_tensor(name), experts).items()}
        save_file(tensors, tmp / shard.name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
        del tensors
    if [x.name for x in shards] != ["model.safetensors"]:  # the shards are found by the index
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    moe = {k: v for k, v in cfg.items() if k not in ("mlp_bias", "pretraining_tp", "_model_name_or_path")}
    moe |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": inter // experts,
            "num_local_experts": experts, "num_experts_per_tok": experts, "router_aux_loss_coef": 0.0,
            "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}
    if "rope_parameters" in cfg and "rope_theta" not in moe:
        moe["rope_theta"] = cfg["rope_parameters"].get("rope_theta")
    (tmp / "config.json").write_text(json.dumps(moe, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)


def _rewritten(name: str, t: torch.Tensor, experts: int) -> dict[str, torch.Tensor]:
    """A source tensor as the MoE stores it: a Llama MLP weight split into the experts' (gate_proj also gives the
    router's zero weight), anything else as it is."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if leaf not in MIXTRAL:
        return {name: t}
    block = name[:-len(f"mlp.{leaf}.weight")] + "block_sparse_moe."
    part = (t.shape[1] if leaf == "down_proj" else t.shape[0]) // experts
    out = {}
    for j in range(experts):
        rows = slice(j * part, (j + 1) * part)
        w = (t[:, rows] * experts) if leaf == "down_proj" else t[rows]
        out[f"{block}experts.{j}.{MIXTRAL[leaf]}.weight"] = w.contiguous()
    if leaf == "gate_proj":
        out[f"{block}gate.weight"] = torch.zeros(experts, t.shape[1], dtype=t.dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--experts", type=int, default=8)
    a = ap.parse_args()
    upcycle(a.src, a.dst, a.experts)


if __name__ == "__main__":
    main()
