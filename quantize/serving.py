"""What vLLM 0.33 and SGLang 0.5.23 load from an output, and the flags they need: read from their loaders, not
run. The names we write for them, what must stay float for them, and the serving matrix that `inspect OUT`,
`convert`'s summary and the model card show. Each rule is pinned by a test in tests/test_serving.py whose
docstring names the engine file and function it follows."""

import re
from dataclasses import dataclass

VLLM, SGLANG = "vLLM 0.33", "SGLang 0.5.23"
# the engines' launch-flag spellings (vllm/engine/arg_utils.py; sglang/srt/arg_groups/fields/{model,spec,exec_}.py)
KV_FLAG = {VLLM: "--kv-cache-dtype fp8", SGLANG: "--kv-cache-dtype fp8_e4m3"}
MTP_FLAG = {VLLM: "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'",
            SGLANG: "--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
                    "--speculative-num-draft-tokens 4"}
NO_SHARED_FUSION = "--disable-shared-experts-fusion"
# tensors SGLang and vLLM keep whole on every TP rank: MLA down-projections, the DSA indexer, MTP's eh_proj, router
REPLICATED = re.compile(r"(q_a_proj|kv_a_proj_with_mqa|\.indexer\.|eh_proj|mlp\.gate\.)")
# SGLang builds RadixAttention with the quant config (so it loads KV scales) in these GQA models only: llama.py
# (Llama, and Mistral and Phi-3 through it), qwen2.py, mixtral.py, minimax_m2.py, gemma2.py, gemma3_causal.py; not
# glm4_moe.py, qwen3.py, qwen3_moe.py
SGLANG_GQA_KV_SCALES = ("llama", "qwen2", "mistral", "phi3", "mixtral", "minimax_m2", "gemma2", "gemma3_text")


def kv_scale_names(prefix: str, layer: int, mla: bool) -> tuple[str, str]:
    """The K and V scale tensors of one layer, as the engines read them. GQA: `self_attn.k_scale`, which vLLM and
    SGLang remap to `self_attn.attn.k_scale`. MLA: SGLang's DeepSeek loader finds them only as
    `self_attn.k_proj.k_scale` / `v_proj.v_scale` (renamed to `attn_mqa`); vLLM reads none for MLA."""
    base = f"{prefix}model.layers.{layer}.self_attn."
    return (base + "k_proj.k_scale", base + "v_proj.v_scale") if mla else (base + "k_scale", base + "v_scale")


# the families with DeepSeek Sparse Attention: both engines build their indexer with one module (vLLM
# model_executor/models/deepseek_v2.py Indexer, for DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM alike; SGLang
# srt/layers/attention/dsa/dsa_indexer.py)
DSA = ("glm_moe_dsa", "deepseek_v32")


def keep_float(family: str, module: str, fp8: bool) -> str | None:
    """Why both engines need this Linear in the model's dtype under the scheme (FP8 blocks or INT4), or None.

    The DSA indexer (GLM-5, DeepSeek-V3.2): vLLM fuses `wk` and `weights_proj` into one Linear built without a
    quant config and dequantizes only an FP8 `wk` into it; SGLang builds `weights_proj` in bf16 without a quant
    config."""
    if family not in DSA:
        return None
    if module.endswith("self_attn.indexer.weights_proj"):
        return "the engines build the DSA indexer's weights_proj unquantized (vLLM fuses it with wk)"
    if module.endswith("self_attn.indexer.wk") and not fp8:
        return "vLLM fuses the DSA indexer's wk into an unquantized Linear, dequantizing only an FP8 wk"
    return None


def engine_ignore(family: str, fp8: bool) -> tuple[str, ...]:
    """compressed-tensors ignore patterns for what keep_float leaves in the model's dtype."""
    if family not in DSA:
        return ()
    return (r"re:.*self_attn\.indexer\.weights_proj$",) + (() if fp8 else (r"re:.*self_attn\.indexer\.wk$",))


def mtp_ignore(prefix: str, layer: int) -> tuple[str, ...]:
    """An MTP layer under both engines' names: vLLM's draft keeps `model.layers.{N}`, SGLang's is `model.decoder`."""
    return (f"re:{re.escape(prefix)}model\\.layers\\.{layer}\\..*", f"re:{re.escape(prefix)}model\\.decoder\\..*")


@dataclass(frozen=True)
class Row:
    engine: str
    variant: str  # the weights' scheme, "FP8 KV cache", "MTP draft"
    loads: bool
    flags: tuple[str, ...]
    notes: tuple[str, ...]  # what the engine ignores or does differently, and why

    def to_dict(self) -> dict:
        return {"engine": self.engine, "variant": self.variant, "loads": self.loads, "flags": list(self.flags),
                "notes": list(self.notes)}


def matrix(config: dict, names: list[str]) -> list[Row]:
    """The serving matrix of an output: its config.json and tensor names (the index's weight_map)."""
    from quantize import arch

    model = arch.resolve(config, names)
    cfg, family, prefix = model.text_config, model.arch.family, model.prefix
    qc = config.get("quantization_config") or cfg.get("quantization_config") or {}
    ignore = list(qc.get("ignore") or [])
    int4 = {n[: -len(".weight_packed")] for n in names if n.endswith(".weight_packed")}
    fp8 = {n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")} - int4
    scheme = _scheme_label(qc)
    mla = bool(cfg.get("kv_lora_rank"))
    rows = []
    for engine in (VLLM, SGLANG):
        flags, notes, loads = [], [], True
        for m in sorted(int4 | fp8):
            why = keep_float(family, m, fp8=m in fp8)
            if why:
                loads = False
                notes.append(f"{m} is {'FP8' if m in fp8 else 'INT4'}, but {why}: its weights would load wrong")
                break
        fmt = qc.get("format")
        if scheme.startswith("W4AFP8"):
            notes.append(W4AFP8_GPUS[engine])
        if scheme.startswith("NVFP4 (W4A4"):
            notes.append(NVFP4_W4A4_GPUS[engine])
        elif fmt in FP4_GPUS:
            if engine == SGLANG and fmt == "mxfp4-pack-quantized" and any(".experts." not in m for m in int4):
                loads = False
                notes.append("SGLang takes a dense MXFP4 Linear for an INT W4A16 one (_is_wNa16_group_channel checks "
                             "no type) and refuses the mxfp4-pack-quantized format there: serve it with vLLM")
            else:
                notes.append(FP4_GPUS[fmt])
        if engine == SGLANG and family == "glm4_moe" and _routed_int4_shared_float(int4, names):
            flags.append(NO_SHARED_FUSION)
            notes.append("GLM-4.x fuses the shared expert into the INT4 routed-expert module unless told not to "
                         "(glm4_moe.py has no precision guard), which drops the BF16 shared-expert weights")
        rows.append(Row(engine, scheme, loads, tuple(flags), tuple(notes)))
    if qc.get("kv_cache_scheme"):
        rows += [_kv_row(engine, model, names, mla) for engine in (VLLM, SGLANG)]
    mtp = sorted({r.layer for r in (model.role(n) for n in names) if r.kind == "mtp"})
    if mtp:
        rows += [_mtp_row(engine, prefix, mtp[0], ignore, names) for engine in (VLLM, SGLANG)]
    return rows


def launch_flags(rows: list[Row], engine: str) -> list[str]:
    """Every flag the rows of `engine` that load need, in order, once each."""
    out: list[str] = []
    for r in rows:
        if r.engine == engine and r.loads:
            out += [f for f in r.flags if f not in out]
    return out


# Which GPUs run an FP4 output, and how (vLLM 0.33: CompressedTensorsW4A4Fp4(use_a16=True), min capability 7.5,
# and CompressedTensorsW4A4Mxfp4, 8.0; SGLang 0.5.23: CompressedTensorsW4A16Fp4, FP4 Marlin, 8.0)
FP4_GPUS = {
    "nvfp4-pack-quantized": "weight-only on every GPU (BF16 activations): Blackwell W4A16 kernels on SM 10.x/12.x "
                            "(vLLM: FlashInfer CuteDSL, B12x), FP4 Marlin on Ampere and Hopper (SM 8.0-9.0); "
                            "FP4 tensor-core GEMMs need NVFP4 activations too (W4A4)",
    "mxfp4-pack-quantized": "MXFP4 weights with BF16 activations, on SM 8.0 and up",
}


# NVFP4 W4A4 (vLLM 0.33: CompressedTensorsConfig._get_scheme_from_parts -> CompressedTensorsW4A4Fp4() when the
# activations are NVFP4 too, init_nvfp4_linear_kernel(use_a16=False) choosing a Blackwell FP4 GEMM where one is
# supported, and CompressedTensorsW4A4Nvfp4MoEMethod, which folds 1 / w13_input_global_scale into the kernels (the
# max over experts for FlashInfer's shared-scale backends); SGLang 0.5.23: _is_fp4a4_nvfp4 ->
# CompressedTensorsW4A4Fp4 / CompressedTensorsW4A4Nvfp4MoE, min capability 10.0, else
# CompressedTensorsW4A16Fp4(has_input_global_scale=True): FP4 Marlin, the activation scales dropped)
NVFP4_W4A4_GPUS = {
    VLLM: "NVFP4 activations into FP4 tensor-core GEMMs on Blackwell (SM 10.x/12.x: CUTLASS, FlashInfer); "
          "where no W4A4 kernel is supported, weight-only FP4 Marlin",
    SGLANG: "W4A4 on compute capability >= 10.0 (CompressedTensorsW4A4Fp4, W4A4 MoE); below it weight-only FP4 "
            "Marlin, input_global_scale dropped (activations stay BF16)",
}


# W4AFP8 (vLLM 0.33: _is_fp8_w4a8_sm90 matches SM 9.0 exactly, CompressedTensorsW4A8Fp8; SGLang 0.5.23:
# _is_wint4afp8 -> CompressedTensorsW4AFP8MoE for experts, _is_wNa16_group_channel -> CompressedTensorsWNA16 for
# dense Linears, which ignores the activation scheme)
W4AFP8_GPUS = {
    VLLM: "Hopper (SM 9.0) only: FP8 activations into CUTLASS W4A8 GEMMs; on other GPUs no scheme matches",
    SGLANG: "routed experts in CUTLASS W4A8 MoE (SM 9.0); dense Linears as INT4 W4A16 Marlin (their FP8 "
                     "activation scheme is not used)",
}


def _scheme_label(qc: dict) -> str:
    groups = list((qc.get("config_groups") or {}).values())
    w = (groups[0].get("weights") or {}) if groups else {}
    fmt = qc.get("format") or (groups[0].get("format") if groups else None)
    if fmt == "nvfp4-pack-quantized" and groups and (groups[0].get("input_activations") or {}).get("num_bits") == 4:
        return "NVFP4 (W4A4, FP4 g16)"
    if fmt == "nvfp4-pack-quantized":
        return "NVFP4A16 (FP4 g16)"
    if fmt == "mxfp4-pack-quantized":
        return "MXFP4A16 (FP4 g32)"
    if fmt == "pack-quantized" and groups and (groups[0].get("input_activations") or {}).get("type") == "float":
        return f"W4AFP8 (INT4 g{w.get('group_size')}, FP8 activations)"
    if fmt == "pack-quantized":
        return f"W4A16 INT4 g{w.get('group_size')}"
    if fmt == "float-quantized":
        return "FP8_BLOCK" if w.get("strategy") == "block" else "FP8"
    return "as the source"


def _routed_int4_shared_float(int4: set[str], names: list[str]) -> bool:
    shared = {n.rsplit(".", 1)[0] for n in names if ".mlp.shared_experts." in n and n.endswith(".weight")}
    return any(".mlp.experts." in m for m in int4) and bool(shared - int4)


def _kv_row(engine: str, model, names: list[str], mla: bool) -> Row:
    k_written = [n for n in names if n.endswith("k_scale")]
    wants = kv_scale_names(model.prefix, 0, mla)[0].split("model.layers.0.", 1)[1]
    named = bool(k_written) and all(n.endswith(wants) for n in k_written)
    if engine == VLLM:
        if mla:
            return Row(engine, "FP8 KV cache", True, (KV_FLAG[engine],), (
                "vLLM gives compressed-tensors KV scales only to Attention layers, not MLAAttention: the FP8 MLA cache "
                "runs at scale 1.0; the flag turns it on",))
        return Row(engine, "FP8 KV cache", named, (KV_FLAG[engine],), () if named else (
            f"KV scales are not named {wants}: vLLM drops them",))
    if mla:
        return Row(engine, "FP8 KV cache", named, (KV_FLAG[engine],), () if named else (
            f"SGLang's DeepSeek loader reads MLA scales only as {wants}: these are dropped (scale 1.0)",))
    if model.model_type not in SGLANG_GQA_KV_SCALES:
        return Row(engine, "FP8 KV cache", True, (KV_FLAG[engine],), (
            f"SGLang builds {model.model_type}'s RadixAttention without the quant config: the KV scales are dropped "
            "without a warning and the FP8 cache runs at scale 1.0; the flag turns it on",))
    return Row(engine, "FP8 KV cache", named, (KV_FLAG[engine],), ())


def _mtp_row(engine: str, prefix: str, layer: int, ignore: list[str], names: list[str]) -> Row:
    here = f"{prefix}model.layers.{layer}."
    quantized = any(n.startswith(here) and n.endswith((".weight_packed", ".weight_scale")) for n in names)
    probe = (f"{prefix}model.layers.{layer}.mlp.experts.0.gate_proj" if engine == VLLM
             else f"{prefix}model.decoder.mlp.experts.0.gate_proj")
    from quantize.recipe import matches

    if quantized or any(matches(p, probe) for p in ignore):
        return Row(engine, "MTP draft", True, (MTP_FLAG[engine],), ())
    return Row(engine, "MTP draft", False, (), (
        f"the draft layer is {probe.rsplit('.mlp', 1)[0]} there and no ignore entry matches it: its Linears are "
        "built quantized, our BF16 weights for them are skipped",))


def matrix_of(folder) -> list[Row]:
    """The serving matrix of an output folder, from its config.json and its index's tensor names."""
    import json
    from pathlib import Path

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    else:
        from quantize.safetensors_file import read_header

        names = [n for f in sorted(folder.glob("*.safetensors")) for n in read_header(f)]
    return matrix(config, names)


def markdown(rows: list[Row]) -> str:
    """The matrix as a Markdown table, for the model card."""
    lines = ["| engine | variant | loads | flags | notes |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.engine} | {r.variant} | {'yes' if r.loads else '**no**'} | "
                     f"{' '.join(f'`{f}`' for f in r.flags) or '-'} | {'; '.join(r.notes) or '-'} |")
    return "\n".join(lines)
