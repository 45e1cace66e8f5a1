"""`--scheme fp8-block`: FP8 e4m3 weights with 128x128 block scales (compressed-tensors FP8_BLOCK), byte for byte
what the library and llm-compressor's model_free_ptq write; and `--prefill-out`, the FP8 prefill variant
written beside the INT4 output in the same pass over the source."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant
from conftest import RECIPES, config_of, dies_on_call, read_all
from test_gptq import calibration_samples

from quantize import calib, plan, recipe
from quantize.arch.layout import from_config
from quantize.checkpoint import Checkpoint
from quantize.cli import main
from quantize.engine import shard as engine_shard
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.errors import UsageError
from quantize.quant import fp8
from quantize.tensor_plan import build, pair
from quantize.verify import verify

FP8_BLOCK = PRESET_SCHEMES["FP8_BLOCK"]


def library_fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own path: min/max per padded 128x128 block -> calculate_qparams -> the float-quantized
    compressor (pads, quantizes, crops)."""
    p = maybe_pad_tensor_for_block_quant(w, (128, 128))
    nr, nc = p.shape[0] // 128, p.shape[1] // 128
    blocks = p.reshape(nr, 128, nc, 128).transpose(1, 2).reshape(nr, nc, -1)
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), FP8_BLOCK["weights"])
    scheme = QuantizationScheme(targets=["Linear"], **FP8_BLOCK)
    return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 77), (5, 1000)])
def test_block_math_is_byte_identical_to_compressed_tensors(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    w[0, 0] = 3.0  # one outlier block
    w[-min(shape[0], 128):, :128] = 0  # an all-zero block: eps scale, not a division by zero
    ref = library_fp8_block(w)
    scale = fp8.block_scale(w)
    codes = fp8.quantize_with_block_scale(w, scale)
    assert scale.dtype == ref["weight_scale"].dtype == dtype
    assert torch.equal(scale, ref["weight_scale"])
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    assert torch.equal(codes.view(torch.uint8), ref["weight"].view(torch.uint8))



@pytest.mark.parametrize("kind", ["glm4-moe-bf16", "glm5-bf16"])
def test_fp8_block_output_is_byte_identical_to_model_free_ptq(kind, fixtures_dir, tmp_path, model_free_ptq):
    """The reference tool on the same source (in its own process: llm-compressor rewrites transformers' globals),
    given our output's ignore list (lm_head, the MTP layer) and what our Linear target never names (routers,
    embeddings), gives the same tensors and scheme."""
    src = fixtures_dir / kind
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "ours"), "--scheme", "fp8-block", "--json"])
    assert result.exit_code == 0, result.output
    ignore = config_of(tmp_path / "ours")["quantization_config"]["ignore"] + [r"re:.*mlp\.gate$", r"re:.*embed_tokens$"]
    model_free_ptq(src, tmp_path / "ref", "FP8_BLOCK", ignore)
    ours, ref = read_all(tmp_path / "ours"), read_all(tmp_path / "ref")
    assert set(ours) == set(ref)
    fp8_weights = [k for k, v in ours.items() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8_weights) > 20
    for k in ours:
        a, b = ours[k], ref[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b), k
        if a.dtype == torch.float8_e4m3fn:
            assert ours[f"{k}_scale"].shape == fp8.block_grid(a.shape)
    qc, ref_qc = config_of(tmp_path / "ours")["quantization_config"], config_of(tmp_path / "ref")["quantization_config"]
    assert qc["format"] == ref_qc["format"] == "float-quantized"
    (group,), (ref_group,) = qc["config_groups"].values(), ref_qc["config_groups"].values()
    for part in ("weights", "input_activations", "format", "targets"):
        assert group[part] == ref_group[part], part


def test_fp8_block_output_loads_in_transformers_with_the_library_dequantized_weights(fixtures_dir, tmp_path):
    """transformers + compressed-tensors load the output (no missing or unexpected keys) into Linears that hold
    the library's own dequantization of what we stored, and the model (W8A8: activations quantized per group of
    128 on the fly) stays close to the source's logits."""
    from transformers import AutoModelForCausalLM

    src, out = fixtures_dir / "llama-bf16", tmp_path / "fp8"
    assert CliRunner().invoke(main, ["convert", str(src), str(out), "--scheme", "fp8-block"]).exit_code == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 17, 230, 5, 99, 512, 3]])
    with torch.no_grad():
        got, orig = model(ids).logits.float(), source(ids).logits.float()  # the first forward decompresses
    stored = read_all(out)
    fp8_weights = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert len(fp8_weights) == 2 * 7  # two layers x q, k, v, o, gate, up, down
    for k in fp8_weights:
        want = dequantize(stored[k], stored[f"{k}_scale"], args=FP8_BLOCK["weights"], dtype=torch.bfloat16)
        assert torch.equal(model.get_parameter(k).data, want), k
    assert not torch.equal(got, orig)  # really FP8: not the source's logits ...
    assert (got - orig).abs().max() < 0.1 * orig.abs().max()  # ... but close to them


@pytest.mark.parametrize("kind", ["kimi-k25-int4", "kimi-k2-fp8"])
def test_fp8_block_from_int4_and_fp8_sources_is_within_fp8_rounding(kind, fixtures_dir, tmp_path):
    """INT4 and DeepSeek-FP8 sources dequantize, then quantize to blocks; verify --deep bounds every element by
    e4m3 rounding of the source, MTP layers stay float, and an FP8 source is warned about."""
    p = build(Checkpoint(fixtures_dir / kind), recipe.preset("fp8-block", 128), 2**20)
    assert any("already FP8" in w for w in p.warnings) == (kind == "kimi-k2-fp8")
    stream.run(p, tmp_path / "out")
    report = verify(tmp_path / "out", deep=True, source=fixtures_dir / kind)
    assert report.clean, [f.line() for f in report.findings]
    assert report.deep_checked == report.quantized_modules > 40
    out = read_all(tmp_path / "out")
    mtp = [e.tensor.name for e in p.entries if e.role.kind == "mtp" and e.tensor.name.endswith("proj.weight")]
    assert (len(mtp) > 0) == (kind == "kimi-k2-fp8")  # the K2 fixture carries an MTP layer
    assert all(out[k].dtype == torch.bfloat16 for k in mtp)
    assert not any(k.endswith(("weight_packed", "weight_scale_inv")) for k in out)


def test_verify_finds_a_misshapen_and_a_zero_block_scale(fixtures_dir, tmp_path):
    from test_verify import rewrite_shard

    out = tmp_path / "out"
    stream.run(build(Checkpoint(fixtures_dir / "llama-bf16"), recipe.preset("fp8-block", 128), 2**30), out)
    shard = next(out.glob("*.safetensors")).name

    def damage(tensors):
        a, b = sorted(k for k in tensors if k.endswith("proj.weight_scale"))[:2]
        tensors[a] = torch.cat([tensors[a], tensors[a]], dim=1)
        tensors[b] = torch.zeros_like(tensors[b])

    rewrite_shard(out, shard, damage)  # with a manifest that agrees: only the scheme checks can tell
    problems = [f.problem for f in verify(out).findings]
    assert any("not one per 128x128 block" in p for p in problems), problems
    assert any("zero scale" in p for p in problems), problems


def test_fp8_block_recipes_and_tp_are_checked(fixtures_dir):
    rec = recipe.from_dict({"scheme": recipe.FP8_BLOCK, "ignore": ["lm_head", "re:.*self_attn.*"]}, "r.yaml")
    assert rec.scheme.fp8_block and rec.scheme.label == "fp8 block 128x128"
    for bad in ({"scheme": {**recipe.FP8_BLOCK, "block_structure": [64, 64]}},
                {"scheme": {**recipe.FP8_BLOCK, "group_size": 128}},
                {"scheme": {"num_bits": 4, "block_structure": [128, 128]}},
                {"scheme": recipe.FP8_BLOCK, "method": "gptq"}):
        with pytest.raises(UsageError):
            recipe.from_dict(bad, "bad.yaml")
    # self_attn ignored: only the MLP's FP8
    p = build(Checkpoint(fixtures_dir / "llama-bf16"), rec, 2**30)
    quantized = [e.role.module for e in p.entries if e.action == "quantize"]
    assert quantized and not any("self_attn" in m for m in quantized)
    # TP: each rank's slice must start on a block. The MLP alone (intermediate 512) splits up to 4 ways; with
    # attention too, k/v's 128 rows do not split at all
    assert p.tp_served == [1, 2, 4]
    assert build(Checkpoint(fixtures_dir / "llama-bf16"), recipe.preset("fp8-block", 128), 2**30).tp_served == [1]
    with pytest.raises(UsageError, match="--tp 2 cannot serve this FP8 block output"):
        build(Checkpoint(fixtures_dir / "glm4-moe-bf16"), recipe.preset("fp8-block", 128), 2**30, tp=2)


def test_a_fp8_block_source_passes_through_and_plan_counts_its_bytes(fixtures_dir, tmp_path):
    """Our FP8 output read back as a source: the same scheme passes through untouched, and `plan`'s arithmetic
    for the fp8-block recipe equals the bytes convert wrote."""
    first = build(Checkpoint(fixtures_dir / "glm5-bf16"), recipe.preset("fp8-block", 128), 2**30)
    stream.run(first, tmp_path / "a")
    again = build(Checkpoint(tmp_path / "a"), recipe.preset("fp8-block", 128), 2**30)
    assert again.counts()["passthrough"] == first.counts()["quantize"]
    stream.run(again, tmp_path / "b")
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    model, layout = from_config(json.loads((fixtures_dir / "glm5-bf16" / "config.json").read_text()))
    fp8_block = recipe.preset("fp8-block", 128)
    arithmetic = plan.weights_of(plan.roles_of(model, layout), plan.recipe_bytes(fp8_block, model.arch.family))
    assert sum(w.nbytes for w in arithmetic) == first.out_bytes


def test_prefill_pair_in_one_pass_equals_two_separate_conversions(fixtures_dir, tmp_path):
    """`convert --prefill-out`: INT4 for decode and FP8 blocks for prefill from one read of each source tensor;
    each output holds exactly the tensors of its own conversion, both verify clean, shards stay in bounds."""
    src = fixtures_dir / "kimi-k2-fp8"
    int4 = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "int4"), "--recipe",
                                       str(RECIPES / "kimi-k2-w4a16.yaml"), "--prefill-out", str(tmp_path / "fp8"),
                                       "--max-shard-size", "1MB", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prefill"]["scheme"] == "fp8 block 128x128" and report["prefill"]["out"] == str(tmp_path / "fp8")
    stream.run(build(Checkpoint(src), int4, 2**30), tmp_path / "int4-alone")
    stream.run(build(Checkpoint(src), int4.fp8_block_variant(), 2**30), tmp_path / "fp8-alone")
    decoded = []
    real = Checkpoint.decode
    for name in ("int4", "fp8"):
        both, alone = read_all(tmp_path / name), read_all(tmp_path / f"{name}-alone")
        assert both.keys() == alone.keys()
        for k in both:
            assert both[k].dtype == alone[k].dtype and torch.equal(both[k].view(torch.uint8), alone[k].view(torch.uint8)), k
        assert verify(tmp_path / name).clean
        assert all(p.stat().st_size < 2 * 2**20 for p in (tmp_path / name).glob("*.safetensors"))
    assert len(list((tmp_path / "int4").glob("*.safetensors"))) == len(list((tmp_path / "fp8").glob("*.safetensors")))
    # one decode per source tensor for the pair
    p1 = build(Checkpoint(src), int4, 2**20)
    main_plan, prefill_plan = pair(p1, build(p1.ckpt, int4.fp8_block_variant(), 2**20), 2**20)

    def counting(self, t, *a, **k):
        decoded.append(t.name)
        return real(self, t, *a, **k)

    Checkpoint.decode = counting
    try:
        stream.run(main_plan, tmp_path / "again", prefill=(prefill_plan, tmp_path / "again-fp8"))
    finally:
        Checkpoint.decode = real
    assert len(decoded) == len(set(decoded)) > 0


def test_prefill_pair_beside_gptq_and_resume(fixtures_dir, tmp_path, monkeypatch):
    """With the calibrated engine the INT4 side is GPTQ's and the FP8 side is the data-free variant; a pair
    interrupted after some shards resumes to the same bytes."""
    src = fixtures_dir / "llama-bf16"
    data = calibration_samples(tmp_path)
    r = recipe.load(RECIPES / "dense-w4a16.yaml")
    r = dataclasses.replace(r, method="gptq", calibration=dataclasses.replace(r.calibration, data=str(data),
                                                                              num_samples=8, seq_len=64))
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 8, 64)

    def run(out, resume=False):
        ckpt = Checkpoint(src)
        a, b = pair(build(ckpt, r, 2**18), build(ckpt, r.fp8_block_variant(), 2**18), 2**18)
        hook = Calibrated(a, samples, torch.device("cpu"))
        try:
            return stream.run(a, tmp_path / out, resume=resume, calibrated=hook, prefill=(b, tmp_path / f"{out}-fp8"))
        finally:
            hook.close()

    run("clean")
    dies_on_call(monkeypatch, engine_shard, "write_shard_pair", 3, lambda: run("out"))
    result = run("out", resume=True)
    assert result.resumed_shards == 2 and result.shards > 3
    for name in ("out", "out-fp8"):
        clean = "clean" + name[3:]
        for f in sorted((tmp_path / clean).glob("*.safetensors")):
            assert f.read_bytes() == (tmp_path / name / f.name).read_bytes(), (name, f.name)
    fp8_alone = tmp_path / "fp8-alone"
    stream.run(build(Checkpoint(src), r.fp8_block_variant(), 2**30), fp8_alone)
    a, b = read_all(tmp_path / "out-fp8"), read_all(fp8_alone)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_plan_shows_the_disaggregated_pair():
    from conftest import ROOT

    result = CliRunner().invoke(main, ["plan", str(ROOT / "tests" / "data" / "glm-5-fp8-config.json"), "--weights",
                                       str(RECIPES / "glm-w4a16.yaml"), "--disaggregated", "--kv-dtype", "fp8", "--json"])
    assert result.exit_code == 0, result.output
    rows = {s["weights"].split(":")[0]: s for s in json.loads(result.stdout)["scenarios"]}
    assert set(rows) == {"source (FP8 blocks)", "prefill", "decode", "or one checkpoint for both"}  # W4AFP8
    # FP8 blocks everywhere but lm_head (the MTP layer in BF16) is about the FP8 release; INT4 decode about 60% of it
    assert rows["prefill"]["weights_total_gib"] == pytest.approx(rows["source (FP8 blocks)"]["weights_total_gib"], rel=0.02)
    assert rows["decode"]["weights_total_gib"] < 0.65 * rows["prefill"]["weights_total_gib"]
    assert rows["decode"]["total_tokens"] > 1.8 * rows["prefill"]["total_tokens"]
