"""What vLLM 0.33 and SGLang 0.5.23 load from our outputs, pinned rule by rule. The engines cannot run here; each
test names the loader file and function whose behaviour it follows (paths inside the engines' wheels, `pip
download --no-deps vllm==0.33.0 sglang==0.5.23`), and fails if our names, ignore list or config regress."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from compressed_tensors.utils.match import match_name
from conftest import RECIPES, ROOT, config_of, read_all

from quantize import recipe, release, serving
from quantize.arch.layout import from_config
from quantize.checkpoint import Checkpoint
from quantize.cli import main
from quantize.tensor_plan import build

V, S = serving.VLLM, serving.SGLANG


def rows_by(rows, engine, variant_prefix):
    return [r for r in rows if r.engine == engine and r.variant.startswith(variant_prefix)]


def names_of(folder):
    return list(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("kind", ["glm5-bf16", "deepseek-v32-fp8"])
@pytest.mark.parametrize("scheme", [["--scheme", "fp8-block"], ["--scheme", "w4a16", "--group-size", "64"]])
def test_dsa_indexer_weights_proj_stays_bf16_and_wk_is_fp8_or_bf16(kind, scheme, fixtures_dir, tmp_path):
    """GLM-5 and DeepSeek-V3.2 alike (vLLM registry.py serves GlmMoeDsaForCausalLM and DeepseekV32ForCausalLM from
    models/deepseek_v32.py on deepseek_v2.py's Indexer; SGLang's from dsa_indexer.py). vLLM
    model_executor/models/deepseek_v2.py: Indexer.__init__ fuses wk and weights_proj into
    `wk_weights_proj`, a MergedColumnParallelLinear with quant_config=None, and `_try_load_fp8_indexer_wk`
    dequantizes only an FP8 wk into it; a weights_proj.weight_scale has no parameter to land in. SGLang
    srt/layers/attention/dsa/dsa_indexer.py: weights_proj is a bf16 ReplicatedLinear without a quant config. So
    weights_proj stays BF16 under every scheme, wk may be FP8 but never INT4, and both are in the ignore list
    exactly when kept float (compressed-tensors' own matcher decides)."""
    r = CliRunner().invoke(main, ["convert", str(fixtures_dir / kind), str(tmp_path / "o"), *scheme])
    assert r.exit_code == 0, r.output
    out, qc = read_all(tmp_path / "o"), config_of(tmp_path / "o")["quantization_config"]
    fp8 = "fp8-block" in scheme
    for i in range(2):
        idx = f"model.layers.{i}.self_attn.indexer"
        assert str(out[f"{idx}.weights_proj.weight"].dtype) == "torch.bfloat16"
        assert not any(k.startswith(f"{idx}.weights_proj.weight_") for k in out)
        assert any(match_name(f"{idx}.weights_proj", p) for p in qc["ignore"])
        if fp8:
            assert str(out[f"{idx}.wk.weight"].dtype) == "torch.float8_e4m3fn" and f"{idx}.wk.weight_scale" in out
            assert not any(match_name(f"{idx}.wk", p) for p in qc["ignore"])
        else:
            assert str(out[f"{idx}.wk.weight"].dtype) == "torch.bfloat16" and f"{idx}.wk.weight_packed" not in out
            assert any(match_name(f"{idx}.wk", p) for p in qc["ignore"])
            assert f"{idx}.wq_b.weight_packed" in out  # the rest of the indexer is still quantized
    rows = serving.matrix_of(tmp_path / "o")
    assert all(r.loads for r in rows)
    # what an output that quantized weights_proj would get from the matrix (the code before this rule)
    names = names_of(tmp_path / "o") + ["model.layers.0.self_attn.indexer.weights_proj.weight_scale"]
    before = serving.matrix(config_of(tmp_path / "o"), names)
    assert not any(r.loads for r in before if r.variant.startswith(("FP8", "W4A16")))


def test_plan_bytes_follow_the_indexer_rule(fixtures_dir):
    """`plan`'s arithmetic from a bare config equals what convert writes, weights_proj kept BF16 included."""
    from quantize import plan

    src = fixtures_dir / "glm5-bf16"
    built = build(Checkpoint(src), recipe.preset("w4a16", 64), 2**30)
    model, layout = from_config(json.loads((src / "config.json").read_text()))
    arithmetic = plan.weights_of(plan.roles_of(model, layout), plan.recipe_bytes(recipe.preset("w4a16", 64), model.arch.family))
    assert sum(w.nbytes for w in arithmetic) == built.out_bytes


@pytest.mark.parametrize("kind", ["kimi-k2-fp8", "glm4-moe-bf16"])
def test_the_mtp_layer_is_ignored_under_both_engines_draft_names(kind, converted):
    """SGLang srt/models/deepseek_nextn.py DeepseekModelNextN.__init__ and glm4_moe_nextn.py
    Glm4MoeModelNextN.__init__ build the draft layer as `model.decoder` (prefix add_prefix("decoder", "model")), so
    an ignore entry for `model.layers.{N}` alone leaves the draft's experts built INT4 and our BF16 weights for
    them skipped. vLLM (model_executor/models/deepseek_mtp.py, glm4_moe_mtp.py) keeps `model.layers.{N}`."""
    out = converted[kind]
    cfg = config_of(out)
    n, ignore = cfg["num_hidden_layers"], cfg["quantization_config"]["ignore"]
    for module in ("model.decoder.mlp.experts.0.gate_proj", "model.decoder.mlp.shared_experts.down_proj",
                   f"model.layers.{n}.mlp.experts.0.gate_proj", f"model.layers.{n}.eh_proj"):
        assert any(match_name(module, p) for p in ignore), module
    assert not any(match_name(f"model.layers.{n - 1}.mlp.experts.0.gate_proj", p) for p in ignore)  # decoder stays INT4
    for engine in (V, S):
        (draft,) = rows_by(serving.matrix_of(out), engine, "MTP")
        assert draft.loads and draft.flags == (serving.MTP_FLAG[engine],)
    without = dict(cfg, quantization_config={**cfg["quantization_config"],
                                             "ignore": [p for p in ignore if "decoder" not in p]})
    (sglang_draft,) = rows_by(serving.matrix(without, names_of(out)), S, "MTP")
    assert not sglang_draft.loads and "model.decoder" in sglang_draft.notes[0]


def test_glm45_int4_needs_sglangs_shared_expert_fusion_off_and_kimi_does_not(converted):
    """SGLang srt/models/glm4_moe.py Glm4MoeForCausalLM.shared_experts_fusion_disable_reason has no guard for
    shared experts kept at a higher precision than INT4 routed experts (only w4afp8), so the shared expert is
    fused as an extra routed slot and its BF16 weights find no parameter. deepseek_v2.py
    DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason refuses fusion itself
    (quant_blocks_shared_experts_fusion), so Kimi needs no flag. The card's SGLang command carries the flag."""
    glm, kimi = serving.matrix_of(converted["glm4-moe-bf16"]), serving.matrix_of(converted["kimi-k2-fp8"])
    (glm_sglang,) = rows_by(glm, S, "W4A16")
    assert glm_sglang.loads and serving.NO_SHARED_FUSION in glm_sglang.flags
    assert serving.NO_SHARED_FUSION not in serving.launch_flags(kimi, S)
    assert serving.NO_SHARED_FUSION not in serving.launch_flags(glm, V)  # vLLM has no such fusion
    commands = release.serving_commands("me/glm-int4", 8, [1, 2, 4, 8], glm, remote_code=False)
    sglang_line = next(line for line in commands.splitlines() if "sglang.launch_server" in line)
    assert serving.NO_SHARED_FUSION in sglang_line and serving.MTP_FLAG[S] in sglang_line
    assert serving.NO_SHARED_FUSION not in next(line for line in commands.splitlines() if "vllm serve" in line)


def with_kv(folder, mla: bool, names_as: str):
    """An output's config and names plus FP8 KV scales named `names_as` (ours, or the name we wrote before)."""
    cfg, names = config_of(folder), names_of(folder)
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    for i in range(cfg.get("num_hidden_layers") or cfg["text_config"]["num_hidden_layers"]):
        ours = serving.kv_scale_names("", i, mla)
        names += list(ours) if names_as == "ours" else [f"model.layers.{i}.self_attn.k_scale",
                                                        f"model.layers.{i}.self_attn.v_scale"]
    return cfg, names


def test_mla_kv_scales_carry_sglangs_names_and_vllm_is_told_to_use_fp8(converted):
    """SGLang srt/models/deepseek_common/deepseek_weight_loader.py (do_load_weights): a k_scale / v_scale that is
    not a parameter is looked up again with `k_proj` / `v_proj` replaced by `attn_mqa`; `self_attn.k_scale` has
    no k_proj to replace and is dropped with "not found in params_dict". vLLM
    model_executor/layers/quantization/compressed_tensors/compressed_tensors.py get_quant_method gives
    CompressedTensorsKVCacheMethod only to `Attention`, not MLAAttention (layers/attention/mla_attention.py), so
    MLA scales are skipped by maybe_remap_kv_scale_name: the cache runs at 1.0, and FP8 only with the flag."""
    assert serving.kv_scale_names("", 3, mla=True) == ("model.layers.3.self_attn.k_proj.k_scale",
                                                        "model.layers.3.self_attn.v_proj.v_scale")
    kimi = converted["kimi-k2-fp8"]
    rows = serving.matrix(*with_kv(kimi, True, "ours"))
    (vllm_kv,), (sglang_kv,) = rows_by(rows, V, "FP8 KV"), rows_by(rows, S, "FP8 KV")
    assert sglang_kv.loads and not sglang_kv.notes and sglang_kv.flags == ("--kv-cache-dtype fp8_e4m3",)
    assert vllm_kv.flags == ("--kv-cache-dtype fp8",) and "scale 1.0" in vllm_kv.notes[0]
    (before,) = rows_by(serving.matrix(*with_kv(kimi, True, "old")), S, "FP8 KV")
    assert not before.loads and "k_proj.k_scale" in before.notes[0]
    commands = release.serving_commands("me/k2", 8, [8], rows, remote_code=True)
    assert "--kv-cache-dtype fp8 " in commands and "--kv-cache-dtype fp8_e4m3" in commands


def test_glm45_kv_scales_are_read_by_vllm_and_dropped_by_sglang_which_the_matrix_says(converted):
    """GQA scales `self_attn.k_scale`: vLLM maps them onto Attention's k_scale (compressed_tensors.py
    get_quant_method -> CompressedTensorsKVCacheMethod). SGLang srt/models/glm4_moe.py Glm4MoeAttention builds
    RadixAttention without quant_config, so no k_scale parameter exists and the scales are dropped without a
    warning; llama.py and qwen2.py pass quant_config and read them."""
    assert serving.kv_scale_names("", 0, mla=False) == ("model.layers.0.self_attn.k_scale",
                                                         "model.layers.0.self_attn.v_scale")
    rows = serving.matrix(*with_kv(converted["glm4-moe-bf16"], False, "ours"))
    (vllm_kv,), (sglang_kv,) = rows_by(rows, V, "FP8 KV"), rows_by(rows, S, "FP8 KV")
    assert vllm_kv.loads and not vllm_kv.notes
    assert "without the quant config" in sglang_kv.notes[0] and "--kv-cache-dtype fp8_e4m3" in sglang_kv.flags
    (llama_kv,) = rows_by(serving.matrix(*with_kv(converted["llama-bf16"], False, "ours")), S, "FP8 KV")
    assert llama_kv.loads and not llama_kv.notes


@pytest.mark.parametrize("kind,sglang_reads", [("mixtral-bf16", True), ("minimax-m2-fp8", True),
                                               ("qwen3-moe-fp8", False), ("mistral-bf16", True), ("phi3-bf16", True),
                                               ("gemma3-bf16", True)])
def test_sglang_reads_gqa_kv_scales_in_mixtral_and_minimax_m2_not_qwen3_moe(kind, sglang_reads, converted):
    """SGLang srt/models/mixtral.py MixtralAttention and minimax_m2.py MiniMaxM2Attention build RadixAttention
    with quant_config=quant_config (k_scale / v_scale parameters exist and load); qwen3_moe.py Qwen3MoeAttention
    builds it without (dropped, FP8 cache at 1.0). Mistral and Phi-3 are llama.py's LlamaForCausalLM subclasses
    (mistral.py, llama.py Phi3ForCausalLM), Gemma 3's text model is gemma3_causal.py: all pass it. vLLM reads
    `self_attn.k_scale` for all (GQA)."""
    rows = serving.matrix(*with_kv(converted[kind], False, "ours"))
    (vllm_kv,), (sglang_kv,) = rows_by(rows, V, "FP8 KV"), rows_by(rows, S, "FP8 KV")
    assert vllm_kv.loads and not vllm_kv.notes
    assert (sglang_kv.loads and not sglang_kv.notes) == sglang_reads
    if not sglang_reads:
        assert "without the quant config" in sglang_kv.notes[0]


def test_tp_sizes_follow_the_attention_heads_and_phi3s_fused_parts():
    """vLLM (attention.py / linear.py QKVParallelLinear) and SGLang split attention by heads: num_attention_heads
    % tp == 0, KV heads split evenly or replicated (tp % kv_heads == 0). A fused qkv_proj stored whole
    (Phi-3) is split part by part by QKVParallelLinear.weight_loader with no shard id, so its rank holds
    heads / tp query and max(1, kv / tp) key and value heads, whose width Marlin needs a multiple of 64."""
    from types import SimpleNamespace

    from quantize.arch import Role
    from quantize.tensor_plan import attention_tp_ok, dense_tp_ok

    def model(heads, kv, **extra):
        return SimpleNamespace(text_config={"num_attention_heads": heads, "num_key_value_heads": kv, **extra})

    assert [tp for tp in (1, 2, 4, 8, 16) if attention_tp_ok(model(32, 8), tp)] == [1, 2, 4, 8, 16]
    assert [tp for tp in (1, 2, 4, 8) if attention_tp_ok(model(40, 8), tp)] == [1, 2, 4, 8]
    assert [tp for tp in (1, 2, 3, 4, 8) if attention_tp_ok(model(24, 8), tp)] == [1, 2, 4, 8]
    assert not attention_tp_ok(model(24, 6), 4)  # 6 KV heads neither split by 4 nor replicate to it
    assert attention_tp_ok(model(128, 128, kv_lora_rank=512), 8)  # MLA: the latent is replicated
    # Phi-3-mini: 32 heads of 96, qkv_proj [9216, 3072]
    qkv = SimpleNamespace(action="quantize", tensor=SimpleNamespace(shape=(9216, 3072)),
                          role=Role("attention", "model.layers.0.self_attn.qkv_proj"))
    phi = model(32, 32)
    assert [tp for tp in (1, 2, 4, 8) if dense_tp_ok([qkv], 128, tp, phi)] == [1, 2, 4, 8]
    # 16 heads of 64, 4 KV heads: at tp 8 a rank holds 2 query + 2 x 1 replicated KV heads, 256 wide
    qkv.tensor.shape = ((16 + 8) * 64, 1024)
    assert [tp for tp in (1, 2, 4, 8) if dense_tp_ok([qkv], 128, tp, model(16, 4))] == [1, 2, 4, 8]
    # heads of 40: a rank's 2 x (8 + 2 x 2) x 40 = 480 columns at tp 2 are no multiple of 64 (960 at tp 1 are)
    qkv.tensor.shape = ((16 + 8) * 40, 1024)
    assert [tp for tp in (1, 2, 4, 8) if dense_tp_ok([qkv], 128, tp, model(16, 4))] == [1]


def test_mixtral_style_experts_keep_the_release_names_both_engines_load_natively(converted):
    """vLLM model_executor/models/mixtral.py and minimax_m2.py build FusedMoE with ckpt_names=("w1", "w2", "w3");
    MixtralModel.hf_to_vllm_mapper also maps gate_proj/up_proj/down_proj onto them, MiniMaxM2Model's does not (so
    an output that renamed MiniMax-M2's experts, as llm-compressor 0.14's does, would leave them unloaded). SGLang
    srt/models/mixtral.py and minimax_m2.py read w1/w2/w3. Our outputs keep the release's w1/w3/w2."""
    for kind in ("mixtral-bf16", "minimax-m2-fp8"):
        names = names_of(converted[kind])
        experts = [n for n in names if ".experts." in n and n.endswith(".weight_packed")]
        assert experts and all(n.split(".experts.")[0].endswith("block_sparse_moe") for n in experts)
        assert {n.rsplit(".", 2)[1] for n in experts} == {"w1", "w2", "w3"}
        assert all(r.loads for r in serving.matrix_of(converted[kind]))


ENGINE_COMPRESSED_TENSORS = {"0.17.0": "vLLM 0.33.0", "0.18.0": "SGLang 0.5.23"}
PARSE = """
import json, sys
import compressed_tensors
from compressed_tensors.quantization import QuantizationConfig
assert compressed_tensors.__version__.startswith(sys.argv[1]), compressed_tensors.__file__
for name, qc in json.load(open(sys.argv[2])).items():
    QuantizationConfig.model_validate(qc)
print("parsed", len(json.load(open(sys.argv[2]))))
"""


def test_every_output_config_parses_with_the_compressed_tensors_the_engines_pin(fixtures_dir, tmp_path):
    """vLLM 0.33.0 pins compressed-tensors 0.17.0 and SGLang 0.5.23 pins 0.18.0 (their wheels' METADATA). Both parse
    configs with QuantizationArgs.model_validate, which forbids unknown keys: a field that our 0.19 writes and
    theirs lacks would stop the engine at parse time. Every fixture under every variant we write (release
    recipes, FP8 blocks, FP8 KV cache) is parsed by exactly those versions, installed beside ours."""
    import dataclasses

    configs = {}
    for kind, rec in (("kimi-k2-fp8", "kimi-k2-w4a16"), ("kimi-k25-int4", "kimi-k2-w4a16"), ("glm4-moe-bf16", "glm-w4a16"),
                      ("glm5-bf16", "glm-w4a16"), ("llama-bf16", "dense-w4a16"), ("deepseek-v32-fp8", "moe-w4a16"),
                      ("qwen3-moe-fp8", "moe-w4a16"), ("minimax-m2-fp8", "moe-w4a16"), ("mixtral-bf16", "moe-w4a16"),
                      ("phi3-bf16", "dense-w4a16"), ("gemma3-bf16", "dense-w4a16")):
        base = recipe.load(RECIPES / f"{rec}.yaml")
        kv = dataclasses.replace(base, method="gptq", kv_cache="fp8")
        for variant, r in (("int4", base), ("int4+kv", kv), ("fp8-block", base.fp8_block_variant())):
            configs[f"{kind} {variant}"] = build(Checkpoint(fixtures_dir / kind), r, 2**30).quantization_config()
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(configs))
    for version, engine in ENGINE_COMPRESSED_TENSORS.items():
        target = ROOT / ".cache" / "compressed-tensors" / version
        if not (target / "compressed_tensors").is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                            f"compressed-tensors=={version}"], check=True, capture_output=True, timeout=600)
        p = subprocess.run([sys.executable, "-c", PARSE, version, str(path)], capture_output=True, text=True,
                           env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=300)
        assert p.returncode == 0, f"{engine}'s compressed-tensors {version} refuses a config: {p.stderr[-1500:]}"
        assert p.stdout.split() == ["parsed", str(len(configs))]
