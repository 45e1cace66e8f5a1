"""GPTQ with FP4 codes (NVFP4A16, MXFP4A16): the column loop's e2m1 rounding against compressed-tensors' cast, the
solve against llm-compressor's own GPTQ, and the layerwise engine's outputs (dense Linears and routed experts):
the steps stay those of the original weight (the same e4m3 / e8m0 scales and global scales as round to nearest,
fused sets sharing theirs), only the codes move, and the output loads in transformers."""

import dataclasses
import json

import pytest
import torch
from conftest import read_all
from test_gptq import calibration_samples, correlated_inputs

from quantize import calib, recipe
from quantize.arch.layout import from_config
from quantize.checkpoint import Checkpoint
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.quant import codec, fp4, gptq
from quantize.tensor_plan import build


def test_e2m1_rounding_of_a_column_is_the_librarys_cast():
    """round_e2m1_ (five ops, used per GPTQ column) gives cast_to_fp4's values on a dense sweep and on every
    tie and its neighbours either side (ties go to the even code, as the library's thresholds send them)."""
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([ties, torch.nextafter(ties, torch.tensor(0.0)), torch.nextafter(ties, torch.tensor(9.0))])
    x = torch.cat([torch.linspace(-6, 6, 48001), near, -near, torch.tensor([6.0, -6.0, 1e-30, -1e-30])])
    x = torch.cat([x, torch.tensor([0.0, -0.0])])
    want, got = cast_to_fp4(x.clone()), fp4.round_e2m1_(x.clone())
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))  # signed zeros too
    # the codes of the rounded values are the round-to-nearest packer's codes of the values themselves, but for
    # -0.0: GPTQ's zeros are stored as the library compresses a dequantized weight, +0 (code 0, not 8)
    rtn = fp4.codes(x[None], torch.ones(1, 1))[0]
    assert (rtn == 8).any() and torch.equal(fp4.value_codes(got), torch.where(rtn == 8, 0, rtn))


@pytest.mark.parametrize("actorder", [None, "static"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_fp4_gptq_is_llm_compressors_and_beats_round_to_nearest(scheme, actorder):
    """The same weight, Hessian and the library's observer scales into llm-compressor's quantize_weight: the same
    dequantized weight; and each of a stack of experts gets the codes of solving it alone."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    s = recipe.preset(scheme, 128).scheme
    g = torch.Generator().manual_seed(3)
    W = (torch.randn(64, 256, generator=g) * 0.05).bfloat16()
    X = correlated_inputs(1024, 256, seed=1)
    H = torch.zeros(256, 256)
    gptq.add_batch(H, X)
    p = codec.params(s, W)
    codes, fallback = gptq.gptq_quantize(W.float(), H.clone(), p.step, fp4=True, actorder=actorder == "static")
    assert not fallback and codes.dtype == torch.int8 and codes.min() >= 0 and codes.max() <= 15
    ours = codec.dequantize(s, codes, p)
    scale, gscale = (p.stored[0].to(W.dtype), p.stored[1][None]) if s.fp4 == "nvfp4" else (p.step.to(W.dtype), None)
    args = s.args().model_copy(update={"actorder": actorder})
    theirs, _, _ = quantize_weight(W.float()[None], (2 * H / X.shape[0])[None], scale[None], torch.zeros_like(scale)[None],
                                   gscale, args)
    assert (ours == theirs[0]).float().mean() > 0.999  # float summation order may flip a rare tie
    # and the bytes: llm-compressor keeps the dequantized weight (in the model's dtype) and compressed-tensors'
    # compressor packs it at save, where an exact -0.0 casts to +0 (code 0): a GPTQ zero is never code 8, unlike a
    # round-to-nearest small negative (llm-compressor's SmolLM2 NVFP4A16 GPTQ output holds no code 8 at all)
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    state = {"weight": theirs[0].to(W.dtype), "weight_scale": scale} | ({"weight_global_scale": gscale}
                                                                          if gscale is not None else {})
    compressor = NVFP4PackedCompressor if s.fp4 == "nvfp4" else MXFP4PackedCompressor
    packed = compressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))["weight_packed"]
    nibbles = lambda t: torch.stack([t & 15, t >> 4], -1)  # noqa: E731
    assert (nibbles(fp4.pack(codes.to(torch.uint8))) == nibbles(packed)).float().mean() > 0.999
    assert not (codes == 8).any()

    def loss(Q):
        return (X @ (W.float() - Q).t()).norm()
    assert loss(ours) < 0.9 * loss(codec.dequantize(s, codec.rtn_codes(s, W, p), p))

    Ws = torch.stack([W.float(), W.float().flip(0), 0.5 * W.float()])
    ps = [codec.params(s, w.to(W.dtype)) for w in Ws]
    stacked, _ = gptq.gptq_quantize_batched(Ws, H.expand(3, -1, -1).clone(), torch.stack([q.step for q in ps]),
                                            fp4=True, actorder=actorder == "static")
    for k in range(3):
        alone, _ = gptq.gptq_quantize(Ws[k], H.clone(), ps[k].step, fp4=True, actorder=actorder == "static")
        assert torch.equal(stacked[k], alone)


def _gptq(src, scheme: str, tmp_path, method: str = "gptq", min_expert_tokens: int = 4):
    """GPTQ under min/max scales and fixed damping (llm-compressor's: its layout and scales byte for byte)."""
    r = recipe.preset(scheme, 128, method=method)
    r = dataclasses.replace(r, gptq=dataclasses.replace(r.gptq, scales="minmax", dampening="fixed"))
    r = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, data=str(calibration_samples(tmp_path)),
                                                               num_samples=8, seq_len=64,
                                                               min_expert_tokens=min_expert_tokens))
    plan = build(Checkpoint(src), r, 2**30)
    out = tmp_path / f"{scheme}-{method}"
    hook = None
    if method == "gptq":
        samples = calib.load_samples(r.calibration.data, calib.load_tokenizer(src), 8, 64)
        hook = Calibrated(plan, samples, torch.device("cpu"))
    result = stream.run(plan, out, calibrated=hook)
    return out, (hook.quantizer.stats if hook else None), result


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
@pytest.mark.parametrize("kind", ["llama-bf16", "kimi-k2-fp8"])
def test_fp4_gptq_moves_codes_under_the_scales_of_round_to_nearest(kind, scheme, fixtures_dir, tmp_path):
    """Every weight_scale and weight_global_scale is RTN's byte for byte (fixed microscales; NVFP4's fused sets
    share theirs: q/k/v, MLA's q_a/kv_a, gate/up, each routed expert's gate/up), the codes differ, routed experts
    are calibrated too, and verify --deep finds the output within GPTQ's bound of the source."""
    from quantize import verify

    src = fixtures_dir / kind
    ours, stats, _ = _gptq(src, scheme, tmp_path)
    rtn, _, _ = _gptq(src, scheme, tmp_path, method="rtn")
    a, b = read_all(ours), read_all(rtn)
    assert a.keys() == b.keys()
    scales = [k for k in a if k.endswith(("weight_scale", "weight_global_scale"))]
    packed = [k for k in a if k.endswith("weight_packed")]
    assert scales and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in scales)
    moved = [k for k in packed if not torch.equal(a[k], b[k])]
    assert len(moved) > 0.8 * len(packed), (len(moved), len(packed))
    if kind == "kimi-k2-fp8":
        assert any(".experts." in k for k in moved) and sum(x.experts_calibrated for x in stats.layers) > 0
        if scheme == "nvfp4a16":
            for m in {k.rsplit(".", 2)[0] for k in a if ".experts." in k and k.endswith("gate_proj.weight_packed")}:
                assert torch.equal(a[f"{m}.gate_proj.weight_global_scale"], a[f"{m}.up_proj.weight_global_scale"])
            attn = "model.layers.1.self_attn."
            assert torch.equal(a[f"{attn}q_a_proj.weight_global_scale"], a[f"{attn}kv_a_proj_with_mqa.weight_global_scale"])
    elif scheme == "nvfp4a16":
        attn = "model.layers.1.self_attn."
        assert torch.equal(a[f"{attn}q_proj.weight_global_scale"], a[f"{attn}v_proj.weight_global_scale"])
    report = verify.verify(ours, source=src, deep=True)
    assert not report.findings and report.deep_checked == len(packed)
    manifest = json.loads((ours / verify.MANIFEST_NAME).read_text())
    assert manifest["recipe"]["method"] == "gptq" and manifest["recipe"]["scheme"]["type"] == "float"


def test_fp4_gptq_output_loads_in_transformers_with_every_key(fixtures_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _, _ = _gptq(fixtures_dir / "llama-bf16", "nvfp4a16", tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():  # the first forward decompresses
        assert torch.isfinite(model(torch.tensor([[1, 17, 230, 5]])).logits).all()
    stored = read_all(out)
    m = "model.layers.0.mlp.down_proj"
    parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == m}
    assert torch.equal(model.get_parameter(f"{m}.weight").data, fp4.dequantize(parts, True)[0].to(torch.bfloat16))


LLMC_NVFP4 = r"""
import json, sys, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
src, out, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
recipe = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["NVFP4"])},
                      ignore=["lm_head"], dampening_frac=0.01, block_size=128, actorder="static")
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ids), max_seq_length=max(map(len, ids)),
        shuffle_calibration_samples=False, output_dir=out)
"""


def test_nvfp4_w4a4_is_llm_compressors_layout_with_its_activation_scales(fixtures_dir, tmp_path):
    """--scheme nvfp4 (W4A4) beside llm-compressor's oneshot + GPTQModifier with the NVFP4 preset, on the same
    samples: the same tensors, every weight_scale and weight_global_scale byte-identical, the config group's
    input_activations the library's, and the input_global_scale of every Linear of the first layer (whose inputs
    both tools compute from the same unquantized embeddings, the layer's own Linears unquantized: GPTQ
    calibrates each layer before quantizing it) identical; deeper layers within 10% (llm-compressor's forwards
    also quantize the activations of the layers before). plan's sizes are the bytes written."""
    import subprocess
    import sys

    from conftest import config_of

    from quantize import plan as planner

    src = fixtures_dir / "llama-bf16"
    out, _, _ = _gptq(src, "nvfp4", tmp_path)
    samples = calib.load_samples(str(calibration_samples(tmp_path)), calib.load_tokenizer(src), 8, 64)
    subprocess.run([sys.executable, "-c", LLMC_NVFP4, str(src), str(tmp_path / "llmc"),
                    json.dumps([s[0].tolist() for s in samples])], check=True, capture_output=True)
    ours, ref = read_all(out), read_all(tmp_path / "llmc")
    assert ours.keys() == ref.keys()
    inputs = [k for k in ours if k.endswith("input_global_scale")]
    assert len(inputs) == 14 and all(ours[k].dtype == torch.float32 and ours[k].shape == (1,) for k in inputs)
    for k in ours:
        if k.endswith(("weight_scale", "weight_global_scale")):
            assert torch.equal(ours[k].view(torch.uint8), ref[k].view(torch.uint8)), k
    for k in inputs:
        if k.startswith("model.layers.0."):
            assert torch.equal(ours[k], ref[k]), k
        else:
            assert 0.9 < float(ours[k] / ref[k]) < 1.1, (k, ours[k], ref[k])
    (group,), (ref_group,) = (config_of(d)["quantization_config"]["config_groups"].values() for d in (out, tmp_path / "llmc"))
    assert group["input_activations"] == ref_group["input_activations"] and group["format"] == ref_group["format"]
    model, layout = from_config(json.loads((src / "config.json").read_text()))
    nvfp4 = recipe.preset("nvfp4", 128, method="gptq")
    arithmetic = planner.weights_of(planner.roles_of(model, layout), planner.recipe_bytes(nvfp4, model.arch.family))
    assert sum(w.nbytes for w in arithmetic) == sum(t.numel() * t.element_size() for t in ours.values())
    from transformers import AutoModelForCausalLM  # and it loads, every key taken (W4A4 modules too)

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert torch.isfinite(loaded(samples[0]).logits).all()


def test_nvfp4_w4a4_experts_get_their_own_input_ranges(fixtures_dir, tmp_path):
    """Routed experts: gate and up share their input's global scale, down has its own (act(gate x) * up x);
    every Linear has one, the rarely routed experts' too, and verify finds the layout whole."""
    from quantize import verify

    out, stats, _ = _gptq(fixtures_dir / "kimi-k2-fp8", "nvfp4", tmp_path, min_expert_tokens=64)
    a = read_all(out)
    packed = [k.removesuffix(".weight_packed") for k in a if k.endswith(".weight_packed")]
    assert packed and all(f"{m}.input_global_scale" in a for m in packed)
    experts = {m.rsplit(".", 1)[0] for m in packed if ".experts." in m}
    for e in experts:
        assert torch.equal(a[f"{e}.gate_proj.input_global_scale"], a[f"{e}.up_proj.input_global_scale"])
        assert not torch.equal(a[f"{e}.gate_proj.input_global_scale"], a[f"{e}.down_proj.input_global_scale"])
    assert any("RTN" in f for x in stats.layers for f in x.fallbacks)  # some experts had too few tokens
    assert not verify.verify(out).findings
    # both engines load it: W4A4 on Blackwell, weight-only FP4 Marlin elsewhere (vLLM 0.33 init_nvfp4_linear_kernel's
    # CUDA list falls back to MarlinNvFp4LinearKernel; SGLang 0.5.23 _get_scheme_from_parts: W4A4 at capability
    # >= 10.0, else CompressedTensorsW4A16Fp4(has_input_global_scale=True))
    from quantize import serving

    rows = {r.engine: r for r in serving.matrix_of(out) if r.variant.startswith("NVFP4 (W4A4")}
    assert rows.keys() == {serving.VLLM, serving.SGLANG} and all(r.loads for r in rows.values())
    assert all("Blackwell" in r.notes[0] or ">= 10.0" in r.notes[0] for r in rows.values())
    assert all("Marlin" in r.notes[0] for r in rows.values())
    del a[f"{packed[0]}.input_global_scale"]  # and verify misses one that is not there
    from safetensors.torch import save_file

    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(a, out / "model-00001-of-00001.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(a, "model-00001-of-00001.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    found = verify.verify(out, rehash=False).findings
    assert any("input_global_scale missing" in f.problem for f in found), found


def test_nvfp4_w4a4_needs_calibration_and_nvfp4_weights():
    from quantize.errors import UsageError

    with pytest.raises(UsageError, match="input_global_scale.*--method gptq"):
        recipe.preset("nvfp4", 128)
    with pytest.raises(UsageError, match="activations: nvfp4"):
        recipe.from_dict({"method": "gptq", "scheme": {**recipe.FP4["mxfp4a16"], "activations": "nvfp4"}}, "r.yaml")
    r = recipe.preset("nvfp4", 128, method="gptq")
    assert r.scheme.w4a4 and r.quantization_config()["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4
