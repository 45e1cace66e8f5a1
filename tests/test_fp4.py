"""FP4 weights (quant/fp4.py) against the reference: llm-compressor's model-free converter (the per-tensor work of
`model_free_ptq`), which quantizes and compresses through compressed-tensors' own observers and compressors."""

import pytest
import torch

from quantize.arch.layout import from_config
from quantize.quant import fp4


def _reference(tensors: dict[str, torch.Tensor], preset: str) -> dict[str, torch.Tensor]:
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter

    fmt = {"NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized"}[preset]
    cfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], format=fmt,
                                                                          **PRESET_SCHEMES[preset])})
    return ModelFreePtqConverter(cfg).process(dict(tensors))


def _weights(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.05
    w[0, :16] = 0  # a zero group: the scale becomes the e4m3 eps
    w[1, 3] = 1.5  # an outlier: the global scale comes from it
    w[2, 16:48] *= 1e-4  # tiny groups: e4m3 subnormal scales
    return w.to(dtype)


def _nvfp4(w: torch.Tensor, gscale: torch.Tensor | None = None) -> list[torch.Tensor]:
    """What convert writes for w (round to nearest, NVFP4A16): weight_packed, weight_scale, weight_global_scale."""
    from quantize import recipe
    from quantize.engine.shard import rtn_outputs

    return rtn_outputs(recipe.preset("nvfp4a16", 128).scheme, w, gscale)


def _mxfp4(w: torch.Tensor) -> list[torch.Tensor]:
    from quantize import recipe
    from quantize.engine.shard import rtn_outputs

    return rtn_outputs(recipe.preset("mxfp4a16", 128).scheme, w)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 64), (48, 160), (8, 2048)])
def test_nvfp4_and_mxfp4_bytes_are_the_libraries(dtype, shape):
    w = _weights(shape, dtype, sum(shape))
    name = "model.layers.0.self_attn.o_proj"
    ref = _reference({f"{name}.weight": w}, "NVFP4A16")
    packed, scale, gscale = _nvfp4(w)
    assert _same(packed, ref[f"{name}.weight_packed"]) and _same(scale, ref[f"{name}.weight_scale"])
    assert _same(gscale, ref[f"{name}.weight_global_scale"])
    if shape[1] % 32 == 0:
        ref = _reference({f"{name}.weight": w}, "MXFP4A16")
        packed, scale = _mxfp4(w)
        assert _same(packed, ref[f"{name}.weight_packed"]) and _same(scale, ref[f"{name}.weight_scale"])


def test_a_fused_set_shares_the_global_scale_of_its_largest_member():
    """q/k/v and gate/up are one GEMM in vLLM and SGLang, which take one global scale for the fused weight: the
    set's scale comes from the max over all members, as model_free_ptq fuses them."""
    gate, up = _weights((64, 256), torch.bfloat16, 1), 3 * _weights((64, 256), torch.bfloat16, 2)
    prefix = "model.layers.0.mlp."
    ref = _reference({f"{prefix}gate_proj.weight": gate, f"{prefix}up_proj.weight": up}, "NVFP4A16")
    shared = fp4.global_scale(torch.max(fp4.absmax(gate), fp4.absmax(up)))
    for leaf, w in (("gate_proj", gate), ("up_proj", up)):
        packed, scale, gscale = _nvfp4(w, shared)
        assert _same(packed, ref[f"{prefix}{leaf}.weight_packed"]) and _same(scale, ref[f"{prefix}{leaf}.weight_scale"])
        assert _same(gscale, ref[f"{prefix}{leaf}.weight_global_scale"])
    assert not torch.equal(_nvfp4(gate)[2], shared)  # alone, gate would have had its own


def _compare(ours: dict, ref: dict, ckpt, scheme: str) -> set[str]:
    """Every tensor of ours equals the reference's, but for members of the fused sets model_free_ptq does not
    fuse, which must share their set's global scale and be the library's quantization under it; returns those."""
    from quantize.tensor_plan import fused_sets

    assert set(ours) == set(ref)
    assert len([k for k in ours if k.endswith(".weight_packed")]) >= 14
    sets = fused_sets([n for n in ckpt.tensors if n.endswith(".weight")])
    theirs = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    departed = set()
    for k in ours:
        if ours[k].dtype == ref[k].dtype and torch.equal(ours[k].view(torch.uint8), ref[k].view(torch.uint8)):
            continue
        module = k.rpartition(".")[0]
        assert scheme == "nvfp4a16" and f"{module}.weight" in sets, k
        assert not module.endswith(theirs) or ".experts." in module or "shared_experts" in module, k
        departed.add(module)
    for module in departed:
        members = sets[f"{module}.weight"]
        ws = [ckpt.decode(ckpt.tensors[m], torch.device("cpu")).to(ckpt.dtype) for m in members]
        shared = fp4.set_global_scale(ws)
        mine = _nvfp4(ws[members.index(f"{module}.weight")], shared)
        for part, t in zip(("weight_packed", "weight_scale", "weight_global_scale"), mine, strict=True):
            assert _same(ours[f"{module}.{part}"], t), (module, part)
        for m in members:
            assert torch.equal(ours[f"{m.removesuffix('.weight')}.weight_global_scale"], shared)
    return departed



@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
@pytest.mark.parametrize("kind", ["glm4-moe-bf16", "glm5-bf16", "llama-bf16"])
def test_fp4_output_is_model_free_ptqs_but_for_the_sets_it_does_not_fuse(kind, scheme, fixtures_dir, tmp_path,
                                                                       model_free_ptq):
    """model_free_ptq on the same source (its own process), given our ignore list and what our Linear target never
    names, writes the same tensors, config and bytes. The one departure is on purpose: model_free_ptq shares an
    NVFP4 global scale only within attention's q/k/v and a dense MLP's gate/up, while vLLM also runs MLA's q_a /
    kv_a (fused_qkv_a_proj) and every shared or routed expert's gate/up (w13) as one GEMM with one global scale
    (tensor_plan.FUSED): there our members share the set's scale, and each is exactly the library's quantization
    under that scale."""
    from click.testing import CliRunner
    from conftest import config_of, read_all

    from quantize.checkpoint import Checkpoint
    from quantize.cli import main

    src = fixtures_dir / kind
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "ours"), "--scheme", scheme, "--json"])
    assert result.exit_code == 0, result.output
    ignore = config_of(tmp_path / "ours")["quantization_config"]["ignore"] + [r"re:.*mlp\.gate$", r"re:.*embed_tokens$"]
    model_free_ptq(src, tmp_path / "ref", scheme.upper(), ignore)
    ours, ref = read_all(tmp_path / "ours"), read_all(tmp_path / "ref")
    departed = _compare(ours, ref, Checkpoint(src), scheme)
    if scheme == "nvfp4a16" and kind != "llama-bf16":
        assert departed  # the fixture has the sets model_free_ptq leaves apart (experts, shared experts, MLA)
    qc, ref_qc = config_of(tmp_path / "ours")["quantization_config"], config_of(tmp_path / "ref")["quantization_config"]
    assert qc["format"] == ref_qc["format"] == f"{scheme[:5]}-pack-quantized"
    (group,), (ref_group,) = qc["config_groups"].values(), ref_qc["config_groups"].values()
    for part in ("weights", "input_activations", "format", "targets"):
        assert group[part] == ref_group[part], part


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_fp4_output_loads_in_transformers_with_the_library_dequantized_weights(scheme, fixtures_dir, tmp_path):
    """transformers + compressed-tensors load the output with no missing or unexpected keys, into Linears that
    hold the library's own dequantization of what we stored, and the model stays close to the source's logits."""
    from click.testing import CliRunner
    from conftest import read_all
    from transformers import AutoModelForCausalLM

    from quantize.cli import main

    src, out = fixtures_dir / "llama-bf16", tmp_path / scheme
    assert CliRunner().invoke(main, ["convert", str(src), str(out), "--scheme", scheme]).exit_code == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 17, 230, 5, 99, 512, 3]])
    with torch.no_grad():
        got, orig = model(ids).logits.float(), source(ids).logits.float()
    stored = read_all(out)
    modules = [k.removesuffix(".weight_packed") for k in stored if k.endswith(".weight_packed")]
    assert len(modules) == 2 * 7
    for m in modules:
        parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == m}
        want, _ = fp4.dequantize(parts, scheme == "nvfp4a16")
        assert torch.equal(model.get_parameter(f"{m}.weight").data, want.to(torch.bfloat16)), m
    assert not torch.equal(got, orig)
    assert (got - orig).abs().max() < 0.25 * orig.abs().max()


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
@pytest.mark.parametrize("kind", ["glm5-bf16", "glm4-moe-bf16"])
def test_plan_sizes_of_fp4_are_the_bytes_convert_writes(kind, scheme, fixtures_dir, tmp_path):
    """`plan`'s arithmetic from config.json alone, the conversion plan, and the tensors on disk agree to the byte."""
    import json

    from conftest import read_all

    from quantize import plan, recipe
    from quantize.checkpoint import Checkpoint
    from quantize.engine import stream
    from quantize.tensor_plan import build

    r = recipe.preset(scheme, 128)
    built = build(Checkpoint(fixtures_dir / kind), r, 2**30)
    stream.run(built, tmp_path / "out")
    written = sum(t.numel() * t.element_size() for t in read_all(tmp_path / "out").values())
    model, layout = from_config(json.loads((fixtures_dir / kind / "config.json").read_text()))
    arithmetic = plan.weights_of(plan.roles_of(model, layout), plan.recipe_bytes(r, model.arch.family))
    assert sum(w.nbytes for w in arithmetic) == built.out_bytes == written


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_fp4_from_deepseek_fp8_blocks_is_the_libraries_on_the_decoded_weights(scheme, fixtures_dir, tmp_path):
    """The Kimi K2 fixture (DeepSeek FP8 blocks with weight_scale_inv, MLA, routed and shared experts, an MTP
    layer): model_free_ptq's FP8 dequantizer crashes on the fixture's small shapes (TRAPS.md), so the reference
    is its converter on our decoded BF16 weights, layer by layer; the same departures as above, and no more."""
    from click.testing import CliRunner
    from conftest import read_all

    from quantize.checkpoint import Checkpoint
    from quantize.cli import main

    src = fixtures_dir / "kimi-k2-fp8"
    assert CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "ours"), "--scheme", scheme]).exit_code == 0
    ours = read_all(tmp_path / "ours")
    ckpt = Checkpoint(src)
    quantized = {k.removesuffix(".weight_packed") + ".weight" for k in ours if k.endswith(".weight_packed")}
    ref = {k: v for k, v in ours.items() if not k.startswith(tuple(q.removesuffix("weight") for q in quantized))}
    layers: dict[str, dict] = {}
    for name in quantized:
        layer = ".".join(name.split(".")[:3])
        layers.setdefault(layer, {})[name] = ckpt.decode(ckpt.tensors[name], torch.device("cpu")).to(ckpt.dtype)
    for tensors in layers.values():
        ref.update(_reference(tensors, scheme.upper()))
    departed = _compare(ours, ref, ckpt, scheme)
    assert bool(departed) == (scheme == "nvfp4a16")
    assert any("q_a_proj" in m for m in departed) and any(".experts." in m for m in departed) or not departed


def test_the_serving_matrix_says_how_each_engine_runs_fp4(fixtures_dir, tmp_path):
    """NVFP4A16: vLLM 0.33 (compressed_tensors.py get_scheme -> CompressedTensorsW4A4Fp4(use_a16=True)) and
    SGLang 0.5.23 (compressed_tensors.py _get_scheme_from_parts -> CompressedTensorsW4A16Fp4) both load it,
    weight-only. MXFP4A16: vLLM loads it (CompressedTensorsW4A4Mxfp4); SGLang's _get_scheme_from_parts first asks
    _is_wNa16_group_channel, which checks no type, and then refuses the mxfp4-pack-quantized format with
    'Other method (CompressedTensorsW4A16Sparse24) is not supported now' for a dense Linear."""
    from click.testing import CliRunner

    from quantize import serving
    from quantize.cli import main

    rows = {}
    for scheme in ("nvfp4a16", "mxfp4a16"):
        out = tmp_path / scheme
        assert CliRunner().invoke(main, ["convert", str(fixtures_dir / "glm4-moe-bf16"), str(out), "--scheme",
                                         scheme]).exit_code == 0
        rows[scheme] = {r.engine: r for r in serving.matrix_of(out) if "FP4" in r.variant}
    assert rows["nvfp4a16"][serving.VLLM].loads and rows["nvfp4a16"][serving.SGLANG].loads
    assert all("weight-only" in r.notes[0] and "Hopper" in r.notes[0] for r in rows["nvfp4a16"].values())
    assert rows["mxfp4a16"][serving.VLLM].loads and not rows["mxfp4a16"][serving.SGLANG].loads
    assert "serve it with vLLM" in rows["mxfp4a16"][serving.SGLANG].notes[0]


def test_fp4_schemes_are_refused_where_they_cannot_work(fixtures_dir):
    """AWQ's scale search is INT4's: asking for it with FP4 says so instead of writing INT4 math into FP4 tensors
    (RTN and GPTQ are FP4's methods); a recipe's FP4 scheme must be one of compressed-tensors' two layouts."""
    from quantize import recipe
    from quantize.errors import UsageError

    with pytest.raises(UsageError, match="AWQ"):
        recipe.preset("nvfp4a16", 128, method="awq")
    assert recipe.preset("mxfp4a16", 128, method="gptq").method == "gptq"
    with pytest.raises(UsageError, match="NVFP4 .* or MXFP4"):
        recipe.from_dict({"scheme": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}, "r.yaml")
    r = recipe.preset("mxfp4a16", 128)
    assert (r.scheme.fp4, r.scheme.format, r.scheme.group_size) == ("mxfp4", "mxfp4-pack-quantized", 32)
    assert recipe.preset("nvfp4a16", 128).scheme.format == "nvfp4-pack-quantized"


def test_a_source_already_in_the_fp4_scheme_passes_through_and_feeds_the_others(fixtures_dir, tmp_path):
    """An NVFP4A16 checkpoint (ours, whose bytes are the library's) converted to NVFP4A16 again is every tensor
    byte for byte (passthrough: nothing re-rounded); to MXFP4A16 or INT4 it is decoded by compressed-tensors'
    own dequantization and quantized again, with a warning that error compounds."""
    from click.testing import CliRunner
    from conftest import config_of, read_all

    from quantize import recipe, verify
    from quantize.checkpoint import Checkpoint
    from quantize.cli import main
    from quantize.tensor_plan import build

    fp4_src = tmp_path / "nvfp4"
    assert CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), str(fp4_src), "--scheme",
                                     "nvfp4a16"]).exit_code == 0
    ckpt = Checkpoint(fp4_src)
    assert ckpt.format.kind == "ct-nvfp4" and not ckpt.format.w4a4
    plan = build(ckpt, recipe.preset("nvfp4a16", 128), 2**30)
    assert plan.counts()["passthrough"] == 14 and "quantize" not in plan.counts()
    again = tmp_path / "again"
    assert CliRunner().invoke(main, ["convert", str(fp4_src), str(again), "--scheme", "nvfp4a16"]).exit_code == 0
    a, b = read_all(fp4_src), read_all(again)
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    assert config_of(again)["quantization_config"]["config_groups"] == config_of(fp4_src)["quantization_config"]["config_groups"]

    mx = tmp_path / "mx"
    result = CliRunner().invoke(main, ["convert", str(fp4_src), str(mx), "--scheme", "mxfp4a16"])
    assert result.exit_code == 0 and "source is NVFP4A16" in result.output
    m = "model.layers.1.mlp.down_proj"
    parts = {k.rpartition(".")[2]: v for k, v in a.items() if k.rpartition(".")[0] == m}
    decoded = fp4.dequantize(parts, True)[0].to(torch.bfloat16)
    packed, scale = _mxfp4(decoded)
    got = read_all(mx)
    assert _same(got[f"{m}.weight_packed"], packed) and _same(got[f"{m}.weight_scale"], scale)
    int4 = tmp_path / "int4"
    assert CliRunner().invoke(main, ["convert", str(fp4_src), str(int4), "--scheme", "w4a16", "--group-size",
                                     "32"]).exit_code == 0
    assert not verify.verify(int4, source=fp4_src, deep=True).findings


@pytest.mark.parametrize("kind, scheme", [("kimi-k25-int4", "nvfp4a16"), ("glm4-moe-fp8", "mxfp4a16")])
def test_compressed_tensors_int4_and_fp8_sources_feed_fp4(kind, scheme, fixtures_dir, tmp_path):
    """compressed-tensors INT4 (Kimi K2.5's routed experts, inside its multimodal wrapper) and FP8 (GLM FP8
    releases) sources decode and quantize to FP4; verify --deep compares each FP4 weight with the decoded source."""
    from click.testing import CliRunner

    from quantize import verify
    from quantize.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(fixtures_dir / kind), str(out), "--scheme", scheme])
    assert result.exit_code == 0, result.output
    report = verify.verify(out, source=fixtures_dir / kind, deep=True)
    assert not report.findings and report.deep_checked == report.quantized_modules > 0


def test_plan_shows_every_scheme_side_by_side():
    """plan --weights schemes: a row for the source and one for each scheme, per KV dtype; the 4-bit schemes
    leave more KV budget than FP8 blocks, and NVFP4 W4A4 weighs what NVFP4A16 does."""
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from quantize import recipe
    from quantize.cli import main

    cfg = Path(__file__).parent / "data" / "glm-5-fp8-config.json"
    result = CliRunner().invoke(main, ["plan", str(cfg), "--weights", "schemes", "--gpu", "b200", "--tp", "8", "--json"])
    assert result.exit_code == 0, result.output
    rows = {(s["weights"].split(" ")[0], s["kv_dtype"]): s for s in json.loads(result.output)["scenarios"]}
    names = ["w4a16-g128", "w4afp8-g128", "fp8-block", "nvfp4a16", "nvfp4", "mxfp4a16"]
    assert len(rows) == 2 * (1 + len(recipe.SCHEMES)) and all((n, "fp8") in rows for n in names)
    size = {n: rows[n, "fp8"]["weights_total_gib"] for n in names}
    assert max(size[n] for n in names if n != "fp8-block") < 0.6 * size["fp8-block"]
    assert size["nvfp4"] == size["nvfp4a16"]  # its input_global_scale, 4 bytes a Linear, is below 0.01 GiB
    assert rows["mxfp4a16", "fp8"]["total_tokens"] > rows["fp8-block", "fp8"]["total_tokens"]
