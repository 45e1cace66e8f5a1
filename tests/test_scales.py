"""Scales chosen by the Hessian (quant/scales.py), and damping by token count: never worse than min/max on the
error they weigh, the format unchanged (positive scales in the model's dtype, e4m3 and e8m0 micro-scales), a
stack's choice the same as each matrix's alone, and `scales: minmax` the bytes of before."""

import dataclasses

import pytest
import torch
from conftest import RECIPES
from test_gptq import calibration_samples, correlated_inputs

from quantize import calib, recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.quant import codec, gptq, scales, signround
from quantize.tensor_plan import build
from quantize.verify import verify

SCHEMES = {"w4a16": 64, "nvfp4a16": 16, "mxfp4a16": 32}


def problem(seed: int = 0, stack: int = 3):
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(stack, 96, 256, generator=g) * 0.05).to(torch.bfloat16)
    X = torch.stack([correlated_inputs(1024, 256, seed + k) for k in range(stack)])
    return W, torch.einsum("eni,enj->eij", X, X)


def weighted_error(s, w, p, H) -> torch.Tensor:
    """Per group [out, groups]: e^T H_g e of round to nearest under p."""
    e = (w.float() - codec.dequantize(s, codec.rtn_codes(s, w, p), p).float()).reshape(w.shape[0], -1, s.group_size)
    return torch.einsum("ogi,gij,ogj->og", e, scales.diagonal_blocks(H[None], s.group_size)[0], e)


@pytest.mark.parametrize("name", SCHEMES)
def test_a_chosen_scale_never_weighs_more_error_than_min_max_and_keeps_the_format(name):
    s = recipe.preset(name, SCHEMES[name], "gptq").scheme
    W, H = problem()
    chosen = codec.searched(s, list(W), [None] * len(W), scales.diagonal_blocks(H, s.group_size))
    for e, w in enumerate(W):
        base = codec.params(s, w)
        better = weighted_error(s, w, chosen[e], H[e])
        assert (better <= weighted_error(s, w, base, H[e]) * (1 + 1e-6)).all()  # per group, never worse
        gain = 0.95 if name != "mxfp4a16" else 0.995  # MXFP4 has three candidates, powers of two apart
        assert better.sum() < gain * weighted_error(s, w, base, H[e]).sum()  # and better overall
        assert [t.dtype for t in chosen[e].stored] == [t.dtype for t in base.stored]
        assert [t.shape for t in chosen[e].stored] == [t.shape for t in base.stored]
        assert (chosen[e].step > 0).all()
        if name == "w4a16":  # ratios of the min/max scale, in the model's dtype
            assert chosen[e].stored[0].dtype == torch.bfloat16
            ratio = (chosen[e].step.float() / base.step.float())
            assert ratio.min() >= 0.69 and ratio.max() <= 1.08


@pytest.mark.parametrize("name", SCHEMES)
def test_a_stack_chooses_each_matrixs_own_scales(name):
    s = recipe.preset(name, SCHEMES[name], "gptq").scheme
    W, H = problem(1)
    blocks = scales.diagonal_blocks(H, s.group_size)
    together = codec.searched(s, list(W), [None] * len(W), blocks)
    for e in range(len(W)):
        alone = codec.searched(s, [W[e]], [None], blocks[e:e + 1])[0]
        assert all(torch.equal(a, b) for a, b in zip(together[e].stored, alone.stored, strict=True))


def test_without_a_better_step_min_max_stays():
    """A tie keeps the min/max scale: with no inputs on a group's columns its error weighs nothing."""
    s = recipe.preset("w4a16", 64, "gptq").scheme
    W, _ = problem(2, stack=1)
    chosen = codec.searched(s, [W[0]], [None], torch.zeros(1, 4, 64, 64))[0]
    assert torch.equal(chosen.step, codec.params(s, W[0]).step)


def test_damping_grows_for_a_hessian_of_fewer_tokens_than_inputs():
    assert gptq.damping(0.01, 4096, 576) == 0.01
    assert gptq.damping(0.01, 576, 576) == 0.01
    assert gptq.damping(0.01, 288, 576) == pytest.approx(0.02)
    assert gptq.damping(0.01, 16, 7168) == 0.1  # at most MoE-Quant's
    assert gptq.damping(0.05, 4096, 576) == 0.05


def _convert(fixtures_dir, tmp_path, name, **gptq_params):
    src = fixtures_dir / "kimi-k2-fp8"
    data = calibration_samples(tmp_path, n=16)
    r = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    r = dataclasses.replace(r, method="gptq", gptq=dataclasses.replace(r.gptq, **{"scales": "minmax",
                                                                                   "dampening": "fixed", **gptq_params}),
                            calibration=dataclasses.replace(r.calibration, data=str(data), num_samples=8, seq_len=64,
                                                            min_expert_tokens=1))
    plan = build(Checkpoint(src), r, 2**20)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 8, 64)
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / name, calibrated=hook)
    hook.close()
    return {p.name: p.read_bytes() for p in sorted((tmp_path / name).glob("*.safetensors"))}


def test_hessian_scales_and_token_damping_reach_every_expert_and_verify(fixtures_dir, tmp_path, monkeypatch):
    """The Kimi fixture's routed experts (few tokens each: the diagonal weighs their groups, and damping grows):
    the output verifies and differs from min/max's; min/max is the bytes of before."""
    seen = []
    real = gptq.gptq_quantize_batched

    def spy(W, H, scale, zp, num_bits, blocksize, percdamp, **k):
        seen.append(percdamp)
        return real(W, H, scale, zp, num_bits, blocksize, percdamp, **k)

    monkeypatch.setattr(gptq, "gptq_quantize_batched", spy)
    minmax = _convert(fixtures_dir, tmp_path, "minmax")
    assert all(d == 0.01 for d in seen)
    seen.clear()
    chosen = _convert(fixtures_dir, tmp_path, "hessian", scales="hessian", dampening="tokens")
    assert verify(tmp_path / "hessian").clean
    assert any(isinstance(d, list) and max(d) > 0.01 for d in seen)  # experts routed fewer tokens than inputs
    assert chosen != minmax
    again = _convert(fixtures_dir, tmp_path, "hessian-again", scales="hessian", dampening="tokens")
    assert again == chosen


def _rtn_calibrated(src, tmp_path, name, data, group_size=32):
    r = dataclasses.replace(recipe.preset("w4a16", group_size), calibration=dataclasses.replace(
        recipe.Calibration(), data=str(data), num_samples=8, seq_len=64, min_expert_tokens=1))
    assert r.calibrated and r.method == "rtn" and r.to_dict()["calibration"]["data"] == str(data)
    plan = build(Checkpoint(src), r, 2**30)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 8, 64)
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / name, calibrated=hook)
    hook.close()
    return hook.quantizer.stats


def test_calibrated_rtn_weighs_each_group_by_its_inputs_in_one_forward_per_layer(fixtures_dir, tmp_path, monkeypatch):
    """--method rtn --calib on the tiny Llama: one pass per layer (no second, no Hessian, no solve); each Linear's
    steps are those the search picks under the inputs' x^2 sums, whose weighted error is below min/max's, and
    the codes are round to nearest under them; the output verifies against the source (clipped codes allowed)."""
    from conftest import read_all

    from quantize.engine import layerwise

    src, data = fixtures_dir / "llama-bf16", calibration_samples(tmp_path, n=16)
    passes, squares, real_run = [], {}, layerwise.LayerwiseQuantizer._run

    def run(self, layer, i, advance, *a, **k):
        passes.append((i, advance))
        hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: squares.setdefault((i, n), []).append(args[0]))
                 for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
        try:
            return real_run(self, layer, i, advance, *a, **k)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr(layerwise.LayerwiseQuantizer, "_run", run)
    monkeypatch.setattr(gptq, "gptq_quantize_batched", None)  # no solve may run
    monkeypatch.setattr(gptq, "gptq_quantize", None)
    _rtn_calibrated(src, tmp_path, "out", data)
    layers = sorted({i for i, _ in passes})
    assert passes == [(i, True) for i in layers]  # one pass a layer, and it advances
    out, source = read_all(tmp_path / "out"), read_all(src)
    s = recipe.preset("w4a16", 32).scheme
    lower = moved = 0
    for (i, n), xs in squares.items():
        name = f"model.layers.{i}.{n}"
        if f"{name}.weight_scale" not in out:
            continue
        diag = None  # summed as the engine sums them: sample by sample
        for t in xs:
            x = t.reshape(-1, t.shape[-1]).float()
            diag = (x * x).sum(0) if diag is None else diag.add_((x * x).sum(0))
        diag = diag.reshape(1, -1, 32)
        w = source[f"{name}.weight"]
        want = codec.searched(s, [w], [None], diag)[0]
        assert torch.equal(out[f"{name}.weight_scale"], want.stored[0]), name
        base = codec.params(s, w)

        def err(p, w=w, diag=diag):
            e = (w.float() - codec.dequantize(s, codec.rtn_codes(s, w, p), p).float()).reshape(w.shape[0], -1, 32)
            return float((e * e * diag).sum())
        lower += err(want) < err(base)
        moved += not torch.equal(want.step, base.step)
    assert lower == moved > 0
    assert verify(tmp_path / "out", deep=True, source=src).clean


def test_calibrated_rtn_searches_every_routed_expert_and_refuses_what_it_cannot_choose(fixtures_dir, tmp_path):
    """The Kimi fixture: the routed experts' steps come from their own tokens' x^2 (so differ from min/max), the
    output verifies deep; FP8 blocks and asymmetric INT4 with calibration data are refused, not silently min/max."""
    src, data = fixtures_dir / "kimi-k2-fp8", calibration_samples(tmp_path, n=16)
    stats = _rtn_calibrated(src, tmp_path, "moe", data)
    assert sum(x.experts_calibrated for x in stats.layers) > 0
    plain = tmp_path / "plain"
    stream.run(build(Checkpoint(src), recipe.preset("w4a16", 32), 2**30), plain)
    from conftest import read_all

    got, before = read_all(tmp_path / "moe"), read_all(plain)
    expert_scales = [k for k in got if ".experts." in k and k.endswith("weight_scale")]
    assert expert_scales and sum(not torch.equal(got[k], before[k]) for k in expert_scales) > len(expert_scales) // 2
    assert verify(tmp_path / "moe", deep=True, source=src).clean
    for raw in ({"scheme": "fp8-block"}, {"scheme": {"num_bits": 4, "group_size": 32, "symmetric": False}}):
        if raw["scheme"] == "fp8-block":
            raw = {"scheme": recipe.preset("fp8-block", 128).to_dict()["scheme"]}
        with pytest.raises(recipe.UsageError, match="calibrated rtn"):
            recipe.from_dict({**raw, "method": "rtn", "calibration": {"data": str(data)}}, "r")


def test_json_and_the_model_card_say_which_scales_damping_and_samples_made_it(fixtures_dir, tmp_path):
    import json
    from types import SimpleNamespace

    from click.testing import CliRunner

    from quantize import release
    from quantize.cli import main

    src, data = fixtures_dir / "llama-bf16", calibration_samples(tmp_path, n=16)
    common = ["--scheme", "w4a16", "--group-size", "32", "--calib", str(data), "--num-samples", "4", "--seq-len",
              "32", "--seed", "3", "--device", "cpu", "--json"]
    reports = {}
    for name, extra in (("rtn", []), ("gptq", ["--method", "gptq"]),
                        ("minmax", ["--method", "gptq", "--scales", "minmax"]),
                        ("held", ["--method", "gptq", "--tune-holdout", "2"])):
        r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / name), *common, *extra])
        assert r.exit_code == 0, r.output
        reports[name] = json.loads(r.stdout)["calibration"]
    assert reports["rtn"]["scales"] == "inputs-x2" and "gptq" not in reports["rtn"]
    assert (reports["rtn"]["samples"], reports["rtn"]["seq_len"], reports["rtn"]["seed"]) == (4, 32, 3)
    assert reports["gptq"]["gptq"] == {"scales": "hessian", "dampening": "tokens", "dampening_frac": 0.01,
                                         "tune_iters": recipe.TUNE_ITERS,
                                         "tune_samples": recipe.TUNE_SAMPLES["int4"], "tune_holdout": 0,
                                         "tune_rate": signround.LR["int4"], "tune_attention": True}
    # minmax is llm-compressor's bytes: no tuning unless asked for
    assert reports["minmax"]["gptq"]["scales"] == "minmax" and reports["minmax"]["gptq"]["tune_iters"] == 0
    # the tuning judged on held-out samples when asked (engine/tune.py), each layer's error reported
    assert reports["held"]["gptq"]["tune_holdout"] == 2 and len(reports["held"]["tuned_error"]) == 2
    r = dataclasses.replace(recipe.preset("w4a16", 32), calibration=dataclasses.replace(
        recipe.Calibration(), data=str(data), num_samples=8))
    card = {method: release.model_card(
        repo_id="me/x", base_model=None, license=None, recipe=dataclasses.replace(r, method=method), plan_summary={},
        src_bytes=1, out_bytes=1, capacity=None, setup=SimpleNamespace(tp=1), gate_markdown=None, tp_sizes=[1],
        remote_code=False, architecture="llama") for method in ("rtn", "gptq")}
    assert "8 samples x 2048 tokens" in card["rtn"] and "E[x^2]" in card["rtn"]
    assert "scales chosen by the Hessian" in card["gptq"] and "fewer tokens than their width" in card["gptq"]
