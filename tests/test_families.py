"""The families beyond Kimi and GLM: DeepSeek-V3.2 (DSA), Qwen3-MoE, MiniMax-M2 and Mixtral-style experts, each
from a fixture in its release's on-disk names and format (scripts/make_fixture.py), through everything the tool
does: names and roles, streaming RTN against llm-compressor's model_free_ptq, GPTQ and AWQ with streamed experts
(and GPTQ against llm-compressor's oneshot), the FP8 KV cache, the prefill pair, verify, and the source check."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import config_of, read_all
from test_gptq import calibration_samples

from quantize import arch, calib, recipe, serving, verify
from quantize.checkpoint import Checkpoint
from quantize.cli import main
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.errors import QuantizeError
from quantize.tensor_plan import build

FAMILIES = ["deepseek-v32-fp8", "qwen3-moe-fp8", "minimax-m2-fp8", "mixtral-bf16"]
# the checkpoint's name of expert 0's gate Linear in layer 1, per fixture: the family's own naming
GATE = {"deepseek-v32-fp8": "model.layers.1.mlp.experts.0.gate_proj",
        "qwen3-moe-fp8": "model.layers.1.mlp.experts.0.gate_proj",
        "minimax-m2-fp8": "model.layers.1.block_sparse_moe.experts.0.w1",
        "mixtral-bf16": "model.layers.1.block_sparse_moe.experts.0.w1"}
ROUTER = {"deepseek-v32-fp8": "model.layers.1.mlp.gate.weight", "qwen3-moe-fp8": "model.layers.1.mlp.gate.weight",
          "minimax-m2-fp8": "model.layers.1.block_sparse_moe.gate.weight",
          "mixtral-bf16": "model.layers.1.block_sparse_moe.gate.weight"}


def bf16_twin(src: Path, out: Path) -> Path:
    """The source with every weight decoded to the model's dtype (FP8 blocks dequantized): what a tool that cannot
    read FP8 blocks (llm-compressor's model_free_ptq, transformers without a quantizer) gets to start from."""
    from safetensors.torch import save_file

    if out.exists():
        return out
    out.mkdir(parents=True)
    ckpt = Checkpoint(src)
    save_file({n: (ckpt.decode(t) if t.encoding == "float" else ckpt.decode(t).to(ckpt.dtype)).contiguous()
               for n, t in ckpt.tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    cfg = config_of(src)
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_family_names_its_experts_router_and_layers_as_its_release(kind, fixtures_dir):
    """Every tensor gets its role from the family's own naming; a layer's names translate to transformers' module
    names and back without loss (Model.canonical / stored), and the config's implied shapes are the stored ones."""
    from quantize.arch import layout

    ckpt = Checkpoint(fixtures_dir / kind)
    model = arch.resolve(ckpt.config, list(ckpt.tensors))
    roles = {n: model.role(n, len(t.shape)) for n, t in ckpt.tensors.items()}
    experts = [n for n, r in roles.items() if r.kind == "expert"]
    moe_layers = {r.layer for r in roles.values() if r.kind == "expert"}
    assert len(experts) == 3 * model.n_routed_experts * len(moe_layers) > 0
    assert all(roles[n].linear for n in experts if n.endswith(".weight"))
    assert roles[GATE[kind] + ".weight"].kind == "expert" and roles[GATE[kind] + ".weight"].leaf == "gate_proj"
    assert roles[ROUTER[kind]].kind == "router" and not roles[ROUTER[kind]].linear
    for n in ckpt.tensors:
        if (m := arch._LAYER.match(n)) is not None:
            assert model.stored(model.canonical(m["rest"])) == m["rest"], n
    layout.check(model, {n: t.shape for n, t in ckpt.tensors.items()}, {})
    if kind == "minimax-m2-fp8":
        bias = "model.layers.1.block_sparse_moe.e_score_correction_bias"
        assert roles[bias].kind == "router" and ckpt.tensors[bias].stored_dtype == "F32"
        assert model.num_mtp_layers == 3  # named by the config, not stored: the check lets them be missing
    if kind == "deepseek-v32-fp8":
        assert roles["model.layers.0.self_attn.indexer.wk.weight"].kind == "indexer"
        assert model.arch.dsa and not model.arch.carries_topk


@pytest.mark.parametrize("kind", FAMILIES)
def test_rtn_bytes_are_model_free_ptqs(kind, fixtures_dir, tmp_path, model_free_ptq):
    """`--scheme w4a16` streamed, against llm-compressor's model_free_ptq with the same scheme and our ignore list
    (plus the routers and embeddings its every-2-D-weight target would take). model_free_ptq cannot read an FP8
    block source (it tries to initialise float8 weights), so an FP8 release's reference runs on its BF16 twin:
    the blocks decoded by us, which is also what our RTN quantizes. Every tensor, byte for byte."""
    src = fixtures_dir / kind
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "ours"), "--scheme", "w4a16", "--group-size",
                                  "128", "--json"])  # the library's W4A16 preset: group 128
    assert r.exit_code == 0, r.output
    block = "block_sparse_moe" if "w1" in GATE[kind] else "mlp"
    ignore = config_of(tmp_path / "ours")["quantization_config"]["ignore"] + [rf"re:.*{block}\.gate$",
                                                                             r"re:.*embed_tokens$"]
    twin = bf16_twin(src, tmp_path / "twin") if kind.endswith("-fp8") else src
    model_free_ptq(twin, tmp_path / "ref", "W4A16", ignore)
    ours, ref = read_all(tmp_path / "ours"), read_all(tmp_path / "ref")
    assert ours.keys() == ref.keys()
    assert f"{GATE[kind]}.weight_packed" in ours  # the release's own expert names
    for k in ours:
        a, b = ours[k], ref[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b), k


def _calibrated(src: Path, tmp_path: Path, method: str, **gptq) -> tuple[Path, object]:
    r = recipe.preset("w4a16", 32, method=method)
    r = dataclasses.replace(r, gptq=dataclasses.replace(r.gptq, **gptq),
                            calibration=dataclasses.replace(r.calibration, data=str(calibration_samples(tmp_path)),
                                                            num_samples=8, seq_len=64, min_expert_tokens=1))
    plan = build(Checkpoint(src), r, 2**20)
    samples = calib.load_samples(r.calibration.data, calib.load_tokenizer(src), 8, 64)
    out = tmp_path / f"{method}"
    hook = Calibrated(plan, samples, torch.device("cpu"))
    try:
        stream.run(plan, out, calibrated=hook)
    finally:
        hook.close()
    return out, hook.quantizer.stats


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_gptq_and_awq_stream_each_familys_experts_and_the_output_loads(kind, method, fixtures_dir, tmp_path):
    """The layerwise engine builds each layer from the family's transformers class with the release's names
    (Mixtral's block_sparse_moe.experts.E.w1 as the layer's mlp.experts), streams the routed experts, and writes
    them under the release's names; the output verifies against the source and loads in transformers with every
    key. AWQ smooths the norm before the MoE block into every consumer, the router too (its weight is rescaled
    and written back float)."""
    from transformers import AutoModelForCausalLM

    src = fixtures_dir / kind
    out, stats = _calibrated(src, tmp_path, method)
    assert stats.layers and sum(x.experts_calibrated for x in stats.layers) > 0
    assert any(x.tokens_per_expert for x in stats.layers)
    written = read_all(out)
    assert f"{GATE[kind]}.weight_packed" in written
    assert verify.verify(out, source=src, deep=True).clean
    if method == "awq":
        source = Checkpoint(src)
        router = source.decode(source.tensors[ROUTER[kind]]).to(written[ROUTER[kind]].dtype)
        assert not torch.equal(written[ROUTER[kind]], router)  # rescaled with the experts it routes to
        assert any(s["smooth"] == "post_attention_layernorm" and s["layer"] == 1 for s in stats.awq)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    n = config_of(out)["num_hidden_layers"]
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])  # MTP: transformers drops it
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 17, 230, 5, 99]])).logits).all()


ONESHOT_ALL = r"""
import json, sys, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
ids = json.loads(sys.argv[1])
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
for src, out in zip(sys.argv[2::2], sys.argv[3::2]):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    args = QuantizationArgs(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int")
    recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                          ignore=["lm_head"], dampening_frac=0.01, block_size=128, actorder="static")
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=max(map(len, ids)), shuffle_calibration_samples=False, output_dir=out)
"""


def _with_release_names(folder: Path, out: Path) -> Path:
    """A copy of llm-compressor's Mixtral-style output with the experts under w1/w3/w2 (what vLLM's mapper does)."""
    from safetensors.torch import save_file

    out.mkdir()
    back = {".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}
    tensors = {}
    for name, t in read_all(folder).items():
        for a, b in back.items():
            name = name.replace(a, b) if ".experts." in name else name
        tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", out / "config.json")
    return out


def _logit_error(folder: Path, source: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    def logits(f):
        with torch.no_grad():
            return AutoModelForCausalLM.from_pretrained(f, dtype=torch.bfloat16)(ids).logits.float()

    ref = logits(source)
    return float((logits(folder) - ref).norm() / ref.norm())


def test_gptq_is_llm_compressors_layout_and_scales_on_every_family(fixtures_dir, tmp_path):
    """llm-compressor 0.14's oneshot + GPTQModifier runs all four families on their BF16 twins (it reads no FP8
    blocks). Under min/max scales and fixed damping (its rules) our every weight_scale is its byte for byte and
    the tensors are the same but for two departures, both on purpose: Mixtral-style experts keep the release's
    w1/w3/w2 (llm-compressor writes gate_proj/up_proj/down_proj under block_sparse_moe, which vLLM's
    MixtralModel.hf_to_vllm_mapper maps back to w1/w3/w2), and DeepSeek-V3.2's indexer keeps weights_proj (and
    INT4 wk) BF16, which llm-compressor quantizes and neither engine can load (serving.keep_float); and our
    output carries the MTP layer, which transformers drops on load (so llm-compressor never sees it). The codes
    are not byte-equal (the Hessians sum in another order and GPTQ's rounding chain amplifies it: 10-40% of codes
    differ from the first layer on); the output error at the logits is within 1.3x of llm-compressor's."""
    ids = calib.load_samples(str(calibration_samples(tmp_path)), calib.load_tokenizer(fixtures_dir / "mixtral-bf16"),
                             8, 64)
    twins = {k: bf16_twin(fixtures_dir / k, tmp_path / f"{k}-twin") if k.endswith("-fp8") else fixtures_dir / k
             for k in FAMILIES}
    args = [json.dumps([x[0].tolist() for x in ids])]
    for k in FAMILIES:
        args += [str(twins[k]), str(tmp_path / f"{k}-llmc")]
    p = subprocess.run([sys.executable, "-c", ONESHOT_ALL, *args], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    probe = torch.tensor([ids[0][0].tolist()])
    rename = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    for k in FAMILIES:
        (tmp_path / k).mkdir()
        out, _ = _calibrated(fixtures_dir / k, tmp_path / k, "gptq", scales="minmax", dampening="fixed")
        ours, theirs = read_all(out), read_all(tmp_path / f"{k}-llmc")
        if "w1" in GATE[k]:
            mapped = {}
            for name, t in ours.items():
                for a, b in rename.items():
                    name = name.replace(a, b) if ".experts." in name else name
                mapped[name] = t
            ours = mapped
        mtp = f"model.layers.{config_of(out)['num_hidden_layers']}."  # ours carries it; transformers drops it
        departed = {n for n in set(ours) ^ set(theirs) if not n.startswith(mtp)}
        assert all(".indexer.w" in n for n in departed) and (bool(departed) == k.startswith("deepseek")), departed
        scales = [n for n in ours if n.endswith(".weight_scale") and n in theirs]
        assert len(scales) > 20 and all(torch.equal(ours[n], theirs[n]) for n in scales), k
        llmc = tmp_path / f"{k}-llmc"
        if "w1" in GATE[k]:  # transformers cannot load llm-compressor's names back: its experts come up random
            llmc = _with_release_names(llmc, tmp_path / f"{k}-llmc-w1")
        mine, ref = _logit_error(out, twins[k], probe), _logit_error(llmc, twins[k], probe)
        codes = [n for n in ours if n.endswith(".weight_packed") and n in theirs]
        same = sum(torch.equal(ours[n], theirs[n]) for n in codes)
        print(f"{k}: logit error ours {mine:.4f}, llm-compressor {ref:.4f}; {same}/{len(codes)} packed tensors equal")
        assert mine < 1.3 * ref, (k, mine, ref)


def test_kv_cache_scales_per_family_and_which_engine_reads_them(fixtures_dir, tmp_path):
    """--kv-cache fp8 measures per-layer scales on each family's own attention (GQA with q/k norms, MLA with the
    DSA indexer), written under the names the engines read. SGLang builds RadixAttention with the quant config
    (so with k_scale / v_scale parameters) in mixtral.py and minimax_m2.py, not in qwen3_moe.py, where the scales
    are dropped and the FP8 cache runs at 1.0; MLA's are read as self_attn.k_proj.k_scale
    (deepseek_common/deepseek_weight_loader.py)."""
    data = calibration_samples(tmp_path)
    loads = {}
    for kind in ("qwen3-moe-fp8", "minimax-m2-fp8", "deepseek-v32-fp8"):
        out = tmp_path / kind
        r = CliRunner().invoke(main, ["convert", str(fixtures_dir / kind), str(out), "--scheme", "w4a16",
                                      "--group-size", "32", "--method", "gptq", "--calib", str(data), "--num-samples",
                                      "4", "--seq-len", "32", "--kv-cache", "fp8", "--json"])
        assert r.exit_code == 0, r.output
        mla = kind.startswith("deepseek")
        written = read_all(out)
        n = config_of(out)["num_hidden_layers"]
        for i in range(n):
            for name in serving.kv_scale_names("", i, mla):
                assert written[name].numel() == 1 and 0 < float(written[name]) <= 1, name  # 1.0 where it rounds best
        (row,) = [x for x in serving.matrix_of(out) if x.engine == serving.SGLANG and x.variant == "FP8 KV cache"]
        loads[kind] = row.loads and not row.notes
    assert loads == {"qwen3-moe-fp8": False, "minimax-m2-fp8": True, "deepseek-v32-fp8": True}


def test_prefill_pair_of_a_minimax_fp8_release(fixtures_dir, tmp_path):
    """--prefill-out on an FP8-block release: INT4 experts for decode and FP8 blocks for prefill in one pass, both
    verify clean, the routers and their float32 correction bias carried as stored in both."""
    src = fixtures_dir / "minimax-m2-fp8"
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "int4"), "--recipe", "recipes/moe-w4a16.yaml",
                                  "--prefill-out", str(tmp_path / "fp8"), "--json"])
    assert r.exit_code == 0, r.output
    bias = "model.layers.1.block_sparse_moe.e_score_correction_bias"
    for name in ("int4", "fp8"):
        assert verify.verify(tmp_path / name).clean
        written = read_all(tmp_path / name)
        assert written[bias].dtype == torch.float32
    assert f"{GATE['minimax-m2-fp8']}.weight_packed" in read_all(tmp_path / "int4")
    assert read_all(tmp_path / "fp8")[f"{GATE['minimax-m2-fp8']}.weight"].dtype == torch.float8_e4m3fn


def test_a_config_that_contradicts_a_familys_weights_is_refused_in_one_line(fixtures_dir, tmp_path):
    """The source check reads each family's own fields: Mixtral's num_local_experts, Qwen3-MoE's num_experts and
    moe_intermediate_size, against the shard headers, before anything is written."""
    for kind, field, value, says in (("mixtral-bf16", "num_local_experts", 16, "num_local_experts=16 but the weights hold 8"),
                                     ("qwen3-moe-fp8", "moe_intermediate_size", 256, "moe_intermediate_size")):
        src = tmp_path / kind
        shutil.copytree(fixtures_dir / kind, src)
        cfg = config_of(src)
        cfg[field] = value
        (src / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(QuantizeError, match=says):
            build(Checkpoint(src), recipe.preset("w4a16", 32), 2**30)


DENSE = ["gemma3-bf16", "phi3-bf16", "mistral-bf16"]


@pytest.mark.parametrize("kind", [*FAMILIES, *DENSE])
def test_the_engines_layer_by_layer_forward_is_transformers_own(kind, fixtures_dir, tmp_path):
    """With only the last layer's o_proj quantized, the engine's hidden states after every earlier layer are what
    transformers' whole model computes there: the embedding (Gemma's sqrt(hidden) scale), the masks (Gemma's
    sliding-window layers, a window of 16 under 48 tokens), the rotary tables (per layer type, MiniMax's
    partial rotary from rotary_dim), the routing (MiniMax's correction bias on the block) and the streamed
    experts under the release's names, and the DSA indexer's top-k (DeepSeek-V3.2)."""
    from transformers import AutoModelForCausalLM

    from quantize.engine.layerwise import LayerwiseQuantizer

    src = fixtures_dir / kind
    n = config_of(src)["num_hidden_layers"]
    r = recipe.from_dict({"method": "gptq", "scheme": {"group_size": 32},
                          "targets": [rf"re:.*layers\.{n - 1}\.self_attn\.o_proj$"], "ignore": ["lm_head"]}, "t")
    plan = build(Checkpoint(src), r, 2**30)
    samples = calib.load_samples(str(calibration_samples(tmp_path, 8)), calib.load_tokenizer(src), 2, 48)
    seen: dict[int, list[torch.Tensor]] = {}
    holder = {}

    def after(report, _total):
        seen[report.layer] = [h.clone() for h in holder["q"].hidden]

    q = LayerwiseQuantizer(plan, samples, torch.device("cpu"), on_layer=after)
    holder["q"] = q
    q.run()
    twin = bf16_twin(src, tmp_path / "twin") if kind.endswith("-fp8") else src
    if "rotary_dim" in config_of(twin):  # MiniMax-M2's release config: transformers reads partial rotary only from
        cfg = config_of(twin)  # rope_parameters (the Hub's converted config, refs/pr/52, spells it so)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                  "partial_rotary_factor": cfg["rotary_dim"] / cfg["head_dim"]}
        (twin / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=q.compute)
    outs: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.register_forward_hook(lambda _m, _a, y, i=i: outs.setdefault(i, []).append(
        y[0] if isinstance(y, tuple) else y)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for s in samples:
            model(s)
    for h in hooks:
        h.remove()
    for i in range(n - 1):
        for ours, theirs in zip(seen[i], outs[i], strict=True):
            err = float((ours.float() - theirs.float()).norm() / theirs.float().norm())
            assert err < 2e-2, (kind, i, err)


def test_a_dense_decoder_of_no_declared_family_is_read_from_its_transformers_class(fixtures_dir, converted):
    """Gemma 3, Phi-3, Mistral: no file of quantize/arch/ names them; their Linears and AWQ's mappings come from the
    model class (arch/generic.py). Gemma 3's MLP reads pre_feedforward_layernorm (its post_attention_layernorm
    normalizes the attention output before the residual: no Linear reads it), and its norms scale by
    (1 + weight), which AWQ folds into as such. Phi-3's fused qkv_proj and gate_up_proj are quantized whole, as
    vLLM's Phi3ForCausalLM (a LlamaForCausalLM) and SGLang's llama.py load them (QKVParallelLinear and
    MergedColumnParallelLinear split a fused weight themselves)."""
    models = {k: arch.resolve(config_of(fixtures_dir / k), list(Checkpoint(fixtures_dir / k).tensors)) for k in DENSE}
    assert all(m.arch.family == "dense" and m.arch.no_awq is None for m in models.values())
    assert models["phi3-bf16"].arch.linear_leaves == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert dict(models["phi3-bf16"].arch.awq_norms) == {"input_layernorm": (r"self_attn\.qkv_proj",),
                                                        "post_attention_layernorm": (r"mlp\.gate_up_proj",)}
    gemma = dict(models["gemma3-bf16"].arch.awq_norms)
    assert set(gemma) == {"input_layernorm", "pre_feedforward_layernorm"}
    assert gemma["pre_feedforward_layernorm"] == (r"mlp\.gate_proj", r"mlp\.up_proj")
    assert models["gemma3-bf16"].arch.norm_offset == 1.0 and models["mistral-bf16"].arch.norm_offset == 0.0
    written = read_all(converted["phi3-bf16"])
    assert {"model.layers.0.self_attn.qkv_proj.weight_packed", "model.layers.0.mlp.gate_up_proj.weight_packed"} <= \
        set(written)


def test_a_norm_whose_output_goes_elsewhere_too_makes_awq_ambiguous_and_is_refused():
    """The trace sees every use of a norm's output: here it feeds a Linear and is also added to the residual
    (scaling the norm would change that sum), so no mapping is declared and AWQ is refused, naming both uses."""
    from torch import nn

    from quantize.arch import generic

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = nn.RMSNorm(8)
            self.proj = nn.Linear(8, 8)

        def forward(self, h):
            x = self.input_layernorm(h)
            return h + x + self.proj(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Layer()])
            self.embed = nn.Embedding(4, 8)

        def forward(self, input_ids):
            return self.model.layers[0](self.embed(input_ids))

    with torch.device("meta"):
        model = Model()
    layer = model.model.layers[0]
    norms, why, _ = generic._awq_norms(model, layer, {"proj": layer.proj})
    assert norms == () and "input_layernorm feeds proj and also add" in why


def test_an_unknown_moe_or_a_model_transformers_does_not_build_is_refused_naming_what_is_missing(fixtures_dir,
                                                                                               tmp_path):
    """An MoE of no declared family (here Qwen2-MoE's model_type on Mixtral's weights) needs its expert naming,
    router and norm mappings declared: refused, naming them; a model_type transformers does not know is unknown."""
    for model_type, says in (("qwen2_moe", "unknown MoE architecture: model_type 'qwen2_moe'.*expert naming, router"),
                             ("not_a_model", "unknown architecture: model_type 'not_a_model'.*any dense decoder")):
        src = tmp_path / model_type
        shutil.copytree(fixtures_dir / "mixtral-bf16" if model_type == "qwen2_moe" else fixtures_dir / "llama-bf16",
                        src)
        cfg = config_of(src)
        cfg["model_type"] = model_type
        (src / "config.json").write_text(json.dumps(cfg))
        r = CliRunner().invoke(main, ["inspect", str(src)])
        assert r.exit_code != 0
        assert __import__("re").search(says, r.output), r.output


def test_qwen3_vl_moe_with_its_experts_fused_on_disk_is_refused_saying_so():
    """Qwen3-VL-MoE's release stores each layer's experts fused and transposed
    (model.language_model.layers.N.mlp.experts.gate_up_proj [experts, hidden, 2 x inter]; transformers'
    conversion_mapping.py transposes it on load): not a layout this tool streams, and it says so."""
    config = {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"],
              "text_config": {"model_type": "qwen3_vl_moe_text", "num_hidden_layers": 2, "hidden_size": 256,
                              "num_experts": 8}}
    names = ["model.language_model.layers.0.mlp.experts.gate_up_proj", "model.language_model.layers.0.mlp.gate.weight"]
    with pytest.raises(QuantizeError, match="stored fused .*experts.gate_up_proj.*one by one"):
        arch.resolve(config, names)


SCHEMES = {"w4a16": ["--scheme", "w4a16", "--group-size", "32"], "w4afp8": ["--scheme", "w4afp8"],
           "nvfp4a16": ["--scheme", "nvfp4a16"], "mxfp4a16": ["--scheme", "mxfp4a16"],
           "fp8-block": ["--scheme", "fp8-block"]}


@pytest.mark.parametrize("kind", [*FAMILIES, *DENSE])
def test_every_scheme_streams_each_family_verifies_and_gets_its_serving_rows(kind, fixtures_dir, tmp_path):
    """Each family under every scheme the stream engine writes: the output verifies against the source (deep),
    carries the release's names, and the serving matrix has a row per engine for it: both engines load every
    one of these (with the GPU notes FP4 and W4AFP8 carry) but SGLang an MXFP4 dense Linear, which it refuses."""
    src = fixtures_dir / kind
    for scheme, args in SCHEMES.items():
        out = tmp_path / scheme
        r = CliRunner().invoke(main, ["convert", str(src), str(out), *args, "--json"])
        assert r.exit_code == 0, (scheme, r.output[-1500:])
        report = verify.verify(out, source=src, deep=True)
        assert report.clean, (scheme, report.findings[:3])
        names = set(read_all(out))
        if kind in GATE:
            suffix = ".weight" if scheme == "fp8-block" else ".weight_packed"
            assert GATE[kind] + suffix in names, scheme
        rows = [x for x in serving.matrix_of(out) if not x.variant.startswith(("FP8 KV", "MTP"))]
        assert {x.engine for x in rows} == {serving.VLLM, serving.SGLANG}, scheme
        for x in rows:  # SGLang refuses a dense MXFP4 Linear (the rule serving.matrix pins); everything else loads
            refused = scheme == "mxfp4a16" and x.engine == serving.SGLANG
            assert x.loads != refused, (scheme, x.engine, x.notes)


@pytest.mark.parametrize("kind", DENSE)
def test_awq_on_a_traced_dense_decoder_smooths_its_own_norms_and_loads(kind, fixtures_dir, tmp_path):
    """AWQ through the traced mappings: the norms it smooths are the ones the trace found (Gemma 3's
    pre_feedforward_layernorm, its (1 + weight) folded as such), every search ends no worse than where it
    started, and the output verifies and loads in transformers with every key."""
    from transformers import AutoModelForCausalLM

    out, stats = _calibrated(fixtures_dir / kind, tmp_path, "awq")
    smoothed = {s["smooth"] for s in stats.awq}
    expected = {"input_layernorm", "pre_feedforward_layernorm" if kind.startswith("gemma") else "post_attention_layernorm"}
    assert expected <= smoothed and all(s["loss_best"] <= s["loss_identity"] for s in stats.awq)
    assert verify.verify(out, source=fixtures_dir / kind, deep=True).clean
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 17, 230, 5, 99]])).logits).all()


def test_a_model_transformers_builds_with_its_layers_elsewhere_is_refused_in_one_line(tmp_path):
    """GPT-2 is a decoder transformers builds, but its layers are transformer.h.N: `plan` on its config says so in
    one line (exit 1), no traceback."""
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 2,
           "vocab_size": 100, "num_hidden_layers": 2, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "config.json")])
    assert r.exit_code == 1 and "elsewhere than model.layers.N" in r.output and "Traceback" not in r.output
