#!/usr/bin/env python
"""Build tiny checkpoints with real architectures and real on-disk formats (tests cannot download models).

    python scripts/make_fixture.py OUT_DIR [--kind kimi-k2-fp8|kimi-k25-int4|glm4-moe-bf16|glm4-moe-fp8|glm5-bf16|llama-bf16|all]

Without --kind, a folder named after a kind (fixtures/llama-bf16) gets that kind; any other name is an error.

Weights come from the real transformers classes (random init, fixed seed), saved by transformers in the
checkpoint layout (experts unfused), then re-encoded the way the real releases are:
  kimi-k2-fp8    Kimi K2 Instruct: model_type kimi_k2 + auto_map (remote code that must never run), DeepSeek
                 FP8 128x128 blocks with weight_scale_inv, an MTP layer, 3 shards with a weight and its
                 scale in different shards
  kimi-k25-int4  Kimi K2.5: multimodal wrapper (text_config, language_model. prefix, a vision tower), routed
                 experts compressed-tensors pack-quantized INT4 g32 (made by the compressed-tensors library)
  glm4-moe-bf16  GLM-4.5 (Glm4Moe) BF16 with an MTP layer
  glm4-moe-fp8   the same as compressed-tensors float-quantized FP8 (per-channel), as GLM FP8 releases
  glm5-bf16      GLM-5 (GlmMoeDsa) BF16 with the DSA indexer
  llama-bf16     a dense Llama
  deepseek-v32-fp8  DeepSeek-V3.2 (deepseek_v32): V3's FP8 blocks and MTP layer plus the DSA indexer, whose
                 weights_proj is stored BF16 (wq_b and wk FP8), as the release stores it
  qwen3-moe-fp8  Qwen3-235B-A22B-FP8 style: q/k norms, no shared expert, a dense layer (mlp_only_layers), FP8
                 128x128 blocks with weight_scale_inv, the router (mlp.gate) BF16
  minimax-m2-fp8 MiniMax-M2: block_sparse_moe.experts.E.w1/w2/w3, the router's correction bias on the block
                 (float32), q/k norms over all heads, partial rotary (rotary_dim), FP8 blocks
  mixtral-bf16   Mixtral-style experts (block_sparse_moe.experts.E.w1/w2/w3), BF16
  gemma3-bf16, phi3-bf16, mistral-bf16
                 dense decoders no family file declares: Gemma 3's text model (sliding and full attention
                 layers, (1 + weight) norms, a scaled embedding), Phi-3 (fused qkv_proj and gate_up_proj), Mistral
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB = 1024
REMOTE_CODE = 'raise RuntimeError("remote code was executed; quantize must never import this file")\n'
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out: Path) -> None:
    """A real BPE tokenizer trained here on text that ships with Python."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 24, special_tokens=special, show_progress=False)
    tok.train_from_iterator(list(pydoc_data.topics.topics.values()), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


MOE = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    num_attention_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MLA = dict(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_key_value_heads=4,
           n_group=1, topk_group=1)


# dense decoders that no family file declares, built from transformers' own classes by quantize/arch/generic.py
DENSE = {"gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
         "mistral": ("MistralConfig", "MistralForCausalLM")}

# GQA MoE families (Qwen3-MoE, MiniMax-M2, Mixtral): 8 experts of 128, top 2, head_dim 64
GQA_MOE = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)


def _hf_checkpoint(kind: str, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A random-init model of the family, saved by transformers (checkpoint layout), read back as tensors."""
    import transformers

    torch.manual_seed(seed)
    if kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**MOE, **MLA)
        model = transformers.DeepseekV3ForCausalLM(cfg)
    elif kind == "glm4_moe":
        cfg = transformers.Glm4MoeConfig(**MOE, num_key_value_heads=2, head_dim=64, n_group=1, topk_group=1,
                                         partial_rotary_factor=0.5, attention_bias=True)
        model = transformers.Glm4MoeForCausalLM(cfg)
    elif kind == "glm_moe_dsa":
        cfg = transformers.GlmMoeDsaConfig(
            **{k: v for k, v in MOE.items() if k != "first_k_dense_replace"}, **MLA, index_head_dim=64, index_n_heads=2,
            index_topk=8, mlp_layer_types=["dense", "sparse", "sparse"],
        )
        model = transformers.GlmMoeDsaForCausalLM(cfg)
    elif kind == "deepseek_v32":
        cfg = transformers.DeepseekV32Config(**MOE, **MLA, index_head_dim=64, index_n_heads=2, index_topk=8)
        model = transformers.DeepseekV32ForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**GQA_MOE, num_experts=8, moe_intermediate_size=128, intermediate_size=512,
                                          mlp_only_layers=[0], norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "minimax_m2":
        cfg = transformers.MiniMaxM2Config(**GQA_MOE, num_local_experts=8, intermediate_size=128,
                                           rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                            "partial_rotary_factor": 0.5})
        model = transformers.MiniMaxM2ForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**{**GQA_MOE, "num_hidden_layers": 2}, num_local_experts=8,
                                         intermediate_size=128)
        model = transformers.MixtralForCausalLM(cfg)
    elif kind in DENSE:  # dense decoders of no declared family (quantize/arch/generic.py)
        config_cls, lm_cls = DENSE[kind]
        extra = {"gemma3_text": dict(head_dim=64, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                     query_pre_attn_scalar=64),
                 "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                 "mistral": dict(head_dim=64, sliding_window=4096)}[kind]
        cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=512, tie_word_embeddings=False, **extra)
        model = getattr(transformers, lm_cls)(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1 and p.dtype.is_floating_point and p.abs().sum() == 0:
                p.normal_(0, 0.02)  # zero biases would hide bias-handling bugs
    model = model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(f))
        config = json.loads((Path(tmp) / "config.json").read_text())
        gen = Path(tmp) / "generation_config.json"
        config["_generation_config"] = json.loads(gen.read_text()) if gen.exists() else None
    if "e_score_correction_bias" in " ".join(tensors):
        for k in tensors:
            if k.endswith("e_score_correction_bias"):
                tensors[k] = tensors[k].float()  # kept float32, as the real checkpoints store it
    return tensors, config


def _add_mtp(tensors: dict[str, torch.Tensor], n_layers: int, seed: int) -> None:
    """A DeepSeek-style MTP layer at index num_hidden_layers: a copy of the last decoder layer plus its heads."""
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n_layers - 1}."
    mtp = f"model.layers.{n_layers}."
    for k in [k for k in tensors if k.startswith(last)]:
        t = tensors[k]
        noise = (torch.randn(t.shape, generator=g) * 0.01).to(t.dtype) if t.dtype.is_floating_point else 0
        tensors[mtp + k[len(last):]] = t + noise
    h = tensors["model.norm.weight"].shape[0]
    for name, shape in [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("shared_head.norm.weight", (h,)),
                        ("eh_proj.weight", (h, 2 * h)), ("embed_tokens.weight", (VOCAB, h)),
                        ("shared_head.head.weight", (VOCAB, h))]:
        tensors[mtp + name] = (torch.randn(shape, generator=g) * 0.02 + (1 if "norm" in name else 0)).to(torch.bfloat16)


def _is_linear_weight(name: str, t: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return t.ndim == 2 and (leaf.endswith("_proj") or leaf in ("kv_a_proj_with_mqa", "wq_b", "wk", "weights_proj",
                                                               "w1", "w2", "w3"))


def fp8_blocks(family: str, seed: int, mtp: bool, bf16: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """A family's checkpoint as DeepSeek-style FP8 releases store it: every Linear weight (but lm_head, the router
    and the names ending in `bf16`) as e4m3 128x128 blocks with a float32 weight_scale_inv."""
    from quantize.quant.fp8 import quantize_block

    tensors, config = _hf_checkpoint(family, seed)
    if mtp:
        _add_mtp(tensors, config["num_hidden_layers"], seed + 1)
        config["num_nextn_predict_layers"] = 1
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_linear_weight(name, t) and not name.endswith(bf16):
            stored[name], stored[name + "_scale_inv"] = quantize_block(t.float())
        else:
            stored[name] = t
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    return stored, config


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], n_shards: int, move: dict[str, int] | None = None) -> None:
    names = sorted(tensors)
    assign = {n: i * n_shards // len(names) for i, n in enumerate(names)}
    assign.update(move or {})
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    for i, f in enumerate(files):
        save_file({n: tensors[n].contiguous() for n in names if assign[n] == i}, out / f, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: files[assign[n]] for n in names}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_config(out: Path, config: dict) -> None:
    gen = config.pop("_generation_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if gen:
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    build_tokenizer(out)


def kimi_k2_fp8(out: Path, seed: int = 0) -> Path:
    from quantize.quant.fp8 import quantize_block

    tensors, config = _hf_checkpoint("deepseek_v3", seed)
    _add_mtp(tensors, config["num_hidden_layers"], seed + 1)
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_linear_weight(name, t):
            stored[name], stored[name + "_scale_inv"] = quantize_block(t.float())
        else:
            stored[name] = t
    out.mkdir(parents=True, exist_ok=True)
    split_weight = "model.layers.1.mlp.experts.0.down_proj.weight"
    _write_shards(out, stored, 3, move={split_weight: 0, split_weight + "_scale_inv": 2})
    config.update(
        model_type="kimi_k2",
        architectures=["DeepseekV3ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        num_nextn_predict_layers=1,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]},
    )
    _write_config(out, config)
    for f in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (out / f).write_text(REMOTE_CODE)
    return out


def kimi_k25_int4(out: Path, seed: int = 0) -> Path:
    """Routed experts INT4 g32 packed by compressed-tensors itself, the rest BF16, under language_model."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    tensors, text_config = _hf_checkpoint("deepseek_v3", seed)
    args = QuantizationArgs(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    stored: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            scale, zp = compute_dynamic_scales_and_zp(t, args, module=None)
            packed = PackedQuantizationCompressor.compress({"weight": t, "weight_scale": scale, "weight_zero_point": zp}, scheme)
            for part, v in packed.items():
                stored[f"language_model.{name[: -len('.weight')]}.{part}"] = v
        else:
            stored[f"language_model.{name}"] = t
    g = torch.Generator().manual_seed(seed)
    for name, shape in [("vision_tower.blocks.0.attn.qkv.weight", (384, 128)),
                        ("vision_tower.blocks.0.mlp.fc0.weight", (256, 128)),
                        ("mm_projector.proj.0.weight", (256, 128)), ("mm_projector.pre_norm.weight", (128,))]:
        stored[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, stored, 2)
    text_config.pop("_generation_config", None)
    text_config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": text_config,
        "vision_config": {"hidden_size": 128, "num_hidden_layers": 1},
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                          "weights": {"num_bits": 4, "group_size": 32, "symmetric": True,
                                                      "strategy": "group", "type": "int"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*",
                       "re:vision_tower.*", "re:mm_projector.*"],
        },
    }
    _write_config(out, config)
    for f in ("configuration_kimi_k25.py", "modeling_kimi_k25.py"):
        (out / f).write_text(REMOTE_CODE)
    return out


def glm4_moe(out: Path, fp8: bool = False, seed: int = 0) -> Path:
    tensors, config = _hf_checkpoint("glm4_moe", seed)
    _add_mtp(tensors, config["num_hidden_layers"], seed + 1)
    config["num_nextn_predict_layers"] = 1
    stored = dict(tensors)
    if fp8:
        fp8_max = torch.finfo(torch.float8_e4m3fn).max
        for name, t in tensors.items():
            if _is_linear_weight(name, t) and not name.startswith(f"model.layers.{config['num_hidden_layers']}."):
                scale = (t.float().abs().amax(dim=1, keepdim=True) / fp8_max).clamp(min=1e-12)
                stored[name] = (t.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
                stored[name[: -len("weight")] + "weight_scale"] = scale.to(torch.bfloat16)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "symmetric": True, "dynamic": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:model.layers.3.*"],
        }
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, stored, 2)
    _write_config(out, config)
    return out


def deepseek_v32_fp8(out: Path, seed: int = 0) -> Path:
    stored, config = fp8_blocks("deepseek_v32", seed, mtp=True, bf16=("indexer.weights_proj.weight",))
    config.update(architectures=["DeepseekV32ForCausalLM"])
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, stored, 3)
    _write_config(out, config)
    return out


def qwen3_moe_fp8(out: Path, seed: int = 0) -> Path:
    stored, config = fp8_blocks("qwen3_moe", seed, mtp=False)
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, stored, 2)
    _write_config(out, config)
    return out


def minimax_m2_fp8(out: Path, seed: int = 0) -> Path:
    """As MiniMaxAI/MiniMax-M2 ships: the release's config spells partial rotary as rotary_dim (64 of head_dim
    128) and names 3 MTP modules whose weights the release does not hold."""
    stored, config = fp8_blocks("minimax_m2", seed, mtp=False)
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rotary_dim=config["head_dim"] // 2, use_routing_bias=True,
                  scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer", num_mtp_modules=3,
                  mtp_transformer_layers=1, bos_token_id=1, eos_token_id=2)
    config["quantization_config"]["modules_to_not_convert"] = ["gate", "e_score_correction_bias", "lm_head"]
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, stored, 2)
    _write_config(out, config)
    return out


def plain(out: Path, kind: str, n_shards: int, seed: int = 0) -> Path:
    """The checkpoint as transformers saves it (BF16), in `n_shards` shards."""
    tensors, config = _hf_checkpoint(kind, seed)
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, tensors, n_shards)
    _write_config(out, config)
    return out


BUILDERS = {
    "kimi-k2-fp8": kimi_k2_fp8,
    "kimi-k25-int4": kimi_k25_int4,
    "glm4-moe-bf16": glm4_moe,
    "glm4-moe-fp8": lambda out: glm4_moe(out, fp8=True),
    "glm5-bf16": lambda out: plain(out, "glm_moe_dsa", 2),
    "llama-bf16": lambda out: plain(out, "llama", 1),
    "deepseek-v32-fp8": deepseek_v32_fp8,
    "qwen3-moe-fp8": qwen3_moe_fp8,
    "minimax-m2-fp8": minimax_m2_fp8,
    "mixtral-bf16": lambda out: plain(out, "mixtral", 2),
    "gemma3-bf16": lambda out: plain(out, "gemma3_text", 1),
    "phi3-bf16": lambda out: plain(out, "phi3", 1),
    "mistral-bf16": lambda out: plain(out, "mistral", 1),
}


def build(kind: str, out: Path) -> Path:
    """Build one fixture into `out` (replaced if present)."""
    if out.exists():
        shutil.rmtree(out)
    return BUILDERS[kind](out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--kind", choices=[*BUILDERS, "all"], help="[the folder's name, when it is a kind]")
    a = p.parse_args()
    kind = a.kind or (a.out_dir.name if a.out_dir.name in BUILDERS else None)
    if kind is None:
        p.error(f"{a.out_dir.name!r} is not a fixture kind: name the folder after one or pass --kind "
                f"({', '.join(BUILDERS)}, all)")
    kinds = list(BUILDERS) if kind == "all" else [kind]
    for kind in kinds:
        target = a.out_dir / kind if len(kinds) > 1 else a.out_dir
        build(kind, target)
        print(target)


if __name__ == "__main__":
    main()
