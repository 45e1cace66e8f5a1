"""Sign-gradient rounding seeded from GPTQ (quant/signround.py) and its layer loop (engine/tune.py): it starts at
GPTQ's codes exactly, moves only what lowers the layer's output error, keeps GPTQ's bytes where it does not, and
gives the bytes of one rank on two."""

import json

import pytest
import torch
from test_gptq import calibration_samples, correlated_inputs
from test_ranks import convert as convert_cli
from test_ranks import gptq_args, shard_bytes

from quantize.engine import tune
from quantize.quant import gptq, signround
from quantize.quant.signround import Tunable


def _solved(out=24, n=64, group=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g)
    X = correlated_inputs(512, n, seed)
    H = X.t() @ X
    scale = W.reshape(out, n // group, group).abs().amax(-1) / 7.5
    values: list = []
    codes, fallback = gptq.gptq_quantize(W, H.clone(), scale, values=values)
    return W, X, scale, codes, values[0][0], fallback


def test_gptq_values_round_to_its_codes_and_a_fresh_tunable_is_gptq_exactly():
    """values are GPTQ's w / step at the moment it rounded each column (activation order undone): rounded and
    clamped they are its codes, so a tunable with offset 0 and factor 1 is GPTQ's weight, byte for byte."""
    W, _, scale, codes, values, fallback = _solved()
    assert not fallback
    assert torch.equal(values.round().clamp(-8, 7).to(torch.int8), codes)
    t = Tunable.start(values, scale)
    assert torch.equal(t.codes(), codes) and torch.equal(t.steps(), scale)
    gptq_weight = (codes.float().reshape(24, -1, 16) * scale[..., None]).reshape(W.shape)
    assert torch.equal(t.weight(torch.float32), gptq_weight)
    # the codes do not depend on whether the values are kept
    again, _ = gptq.gptq_quantize(W, (correlated_inputs(512, 64, 0).t() @ correlated_inputs(512, 64, 0)), scale)
    assert torch.equal(again, codes)


def test_a_signed_step_moves_each_offset_by_the_rate_against_its_gradient_and_stays_in_range():
    values = torch.tensor([[0.2, -1.4, 3.0, 7.4]])
    t = Tunable.start(values, torch.ones(1, 1))
    (t.weight(torch.float32) * torch.tensor([[1.0, -2.0, 0.0, 1.0]])).sum().backward()
    # straight through the rounding: d weight / d offset is the scale
    assert torch.equal(t.offset.grad, torch.tensor([[1.0, -2.0, 0.0, 1.0]]))
    t.step(1.0)
    assert torch.allclose(t.offset, torch.tensor([[-signround.LR, signround.LR, 0.0, -signround.LR]]))
    assert t.offset.grad is None and t.factor.grad is None
    for _ in range(1000):
        t.weight(torch.float32).sum().backward()
        t.step(2.0)
    assert float(t.offset.detach().min()) == -0.5 and float(t.factor.detach().min()) == pytest.approx(-signround.SCALE_RANGE)
    assert t.codes().tolist() == [[0, -2, 2, 7]]  # 7.4 - 0.5 rounds to 7; never past the range
    t.reset()
    assert torch.equal(t.codes(), torch.tensor([[0, -1, 3, 7]], dtype=torch.int8))


def _toy(seed=0):
    """A Linear 'layer' with GPTQ's values spoiled by +0.4 (round to nearest lands a step too high on many): the
    tuning has something to find. Returns the forward tune_layer takes and the float layer's targets."""
    W, X, scale, codes, values, _ = _solved(seed=seed)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 24, bias=False))
    layer[0].weight.data = W
    chunks = list(X.split(64))

    def forward(samples, weights):
        return [torch.func.functional_call(layer, weights, (chunks[s],)) for s in samples]
    with torch.no_grad():
        targets = {s: layer(c) for s, c in enumerate(chunks)}
    return forward, targets, values, scale


def test_tuning_lowers_the_layers_error_and_keeps_its_result():
    forward, targets, values, scale = _toy()
    tunables = {"0": Tunable.start(values + 0.4, scale)}
    start = tunables["0"].codes().clone()
    before, after = tune.tune_layer(forward, targets, tunables, iters=60, batch=4, dtype=torch.float32, seed=0)
    assert after < 0.9 * before
    assert not torch.equal(tunables["0"].codes(), start)


def test_tuning_that_does_not_lower_the_error_leaves_gptqs_codes_and_scales(monkeypatch):
    forward, targets, values, scale = _toy()
    monkeypatch.setattr(signround, "LR", 0.0)
    monkeypatch.setattr(signround, "SCALE_LR", 0.0)
    tunables = {"0": Tunable.start(values, scale)}
    before, after = tune.tune_layer(forward, targets, tunables, iters=3, batch=2, dtype=torch.float32, seed=0)
    assert after == before
    assert float(tunables["0"].offset.abs().max()) == 0 and float(tunables["0"].factor.abs().max()) == 0


def test_the_tuning_samples_spread_over_all_of_them():
    assert tune.subset(128, 32) == list(range(0, 128, 4))
    assert tune.subset(8, 32) == list(range(8))


SMALL_STEPS = (0.005, 0.00025)  # (LR, SCALE_LR)


def _layer_errors(report: dict) -> list:
    return report["calibration"]["tuned_error"]


def test_convert_with_tuning_reports_each_layer_and_keeps_gptqs_bytes_where_nothing_moved(fixtures_dir, tmp_path,
                                                                                          monkeypatch):
    """Through the library call: every dense layer is tuned and reports its error before and after; with the
    steps at zero nothing moves, and the output is GPTQ's, byte for byte (the commits wait for the tuning, the
    codes and scales come back from the tunables unchanged)."""
    from quantize.convert import Events, Options, convert

    calib = calibration_samples(tmp_path, 16)
    opts = dict(scheme="w4a16", group_size=32, method="gptq", calib=str(calib), num_samples=8, seq_len=48,
                device="cpu")
    # the tiny fixture's GPTQ error is near bf16's own; smaller steps than the default find a drop in it
    monkeypatch.setattr(signround, "LR", SMALL_STEPS[0])
    monkeypatch.setattr(signround, "SCALE_LR", SMALL_STEPS[1])
    plain = convert(str(fixtures_dir / "llama-bf16"), tmp_path / "plain", Options(**opts, tune_iters=0), Events())
    tuned = convert(str(fixtures_dir / "llama-bf16"), tmp_path / "tuned", Options(**opts, tune_iters=4), Events())
    errors = _layer_errors(tuned.report)
    assert len(errors) == tuned.report["calibration"]["layers"] and all(e is not None for e in errors)
    assert any(after < before for before, after in errors), errors
    assert "tuned_error" not in plain.report["calibration"]
    assert shard_bytes(tmp_path / "plain") != shard_bytes(tmp_path / "tuned")

    monkeypatch.setattr(signround, "LR", 0.0)
    monkeypatch.setattr(signround, "SCALE_LR", 0.0)
    still = convert(str(fixtures_dir / "llama-bf16"), tmp_path / "still", Options(**opts, tune_iters=2), Events())
    assert all(after == before for before, after in _layer_errors(still.report))
    assert shard_bytes(tmp_path / "still") == shard_bytes(tmp_path / "plain")


def test_tuning_on_two_ranks_gives_the_bytes_of_one(fixtures_dir, tmp_path):
    """Rank 0 tunes on a fixed subset of all the samples (not its share), with a seeded draw: rank 1 only waits
    for the tuned weights in the broadcast it already joined."""
    import os

    site = tmp_path / "site"  # every process of the run, spawned ranks too, takes the small steps
    site.mkdir()
    (site / "sitecustomize.py").write_text("import quantize.quant.signround as s\n"
                                           f"s.LR, s.SCALE_LR = {SMALL_STEPS}\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    outs = {}
    for name, extra in (("one", []), ("two", ["--devices", "cpu,cpu"])):
        outs[name] = tmp_path / name
        p, _ = convert_cli(gptq_args(fixtures_dir, tmp_path, "llama-bf16", outs[name], "--scheme", "w4a16",
                                     "--group-size", "32", "--tune-iters", "3", "--json", *extra), env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert any(a < b for b, a in json.loads(p.stdout)["calibration"]["tuned_error"])
    assert shard_bytes(outs["one"]) == shard_bytes(outs["two"])


def test_a_negative_tune_iters_is_refused_as_a_recipe_would_be(tmp_path):
    from quantize import recipe
    from quantize.errors import UsageError

    with pytest.raises(UsageError, match="tune_iters >= 0"):
        recipe.from_dict({"method": "gptq", "scheme": {"num_bits": 4, "group_size": 32},
                          "gptq": {"tune_iters": -1}, "calibration": {"data": "x.jsonl"}}, "r.yaml")


def test_tuning_is_the_default_under_hessian_scales_and_off_under_minmax_unless_asked():
    """minmax is llm-compressor's bytes, so it is not tuned by default; --scales minmax on a hessian recipe must not
    keep the hessian default's steps, and an explicit count holds under either rule."""
    from quantize import recipe

    base = {"method": "gptq", "scheme": {"num_bits": 4, "group_size": 32}, "calibration": {"data": "x.jsonl"}}
    r = recipe.from_dict(base, "r.yaml")
    assert r.gptq.iters == recipe.TUNE_ITERS > 0
    assert recipe.with_overrides(r, "cli", scales="minmax").gptq.iters == 0
    assert recipe.with_overrides(r, "cli", scales="minmax", tune_iters=5).gptq.iters == 5
    assert recipe.with_overrides(r, "cli", tune_iters=0).gptq.iters == 0
    assert recipe.from_dict({**base, "gptq": {"scales": "minmax"}}, "r.yaml").gptq.iters == 0
    with pytest.raises(Exception, match="tune_iters >= 0"):
        recipe.from_dict({**base, "gptq": {"tune_iters": "many"}}, "r.yaml")


def test_the_model_card_says_when_the_layers_were_tuned():
    import dataclasses
    from types import SimpleNamespace

    from quantize import recipe, release

    r = recipe.preset("w4a16", 32, "gptq")
    cards = {n: release.model_card(
        repo_id="me/x", base_model=None, license=None, plan_summary={}, src_bytes=1, out_bytes=1, capacity=None,
        setup=SimpleNamespace(tp=1), gate_markdown=None, tp_sizes=[1], remote_code=False, architecture="llama",
        recipe=dataclasses.replace(r, gptq=dataclasses.replace(r.gptq, tune_iters=n))) for n in (0, 20)}
    assert "tuned towards the float model's output (20 signed steps" in cards[20] and "tuned" not in cards[0]


def _tuned_plan(fixtures_dir, tmp_path, iters=2, num_samples=6, seq_len=32):
    import dataclasses

    from test_gptq import calibrated_plan

    plan, samples = calibrated_plan(fixtures_dir / "llama-bf16", "dense-w4a16", tmp_path, num_samples, seq_len)
    r = plan.recipe
    r = dataclasses.replace(r, scheme=dataclasses.replace(r.scheme, group_size=32),
                            gptq=dataclasses.replace(r.gptq, tune_iters=iters, tune_samples=4, tune_batch=2))
    from quantize.checkpoint import Checkpoint
    from quantize.tensor_plan import build

    return build(Checkpoint(fixtures_dir / "llama-bf16"), r, 2**18), samples


def test_the_tuning_targets_are_the_float_models_own_hidden_states(fixtures_dir, tmp_path, monkeypatch):
    """SignRound's target: the float layer on the float layers' inputs, not on the quantized path's. Layer k's
    targets are the float model's hidden states after layer k, as transformers computes them, while the
    quantized path has drifted from them by more than the two forwards differ."""
    from transformers import AutoModelForCausalLM

    from quantize.engine import stream
    from quantize.engine.layerwise import Calibrated

    plan, samples = _tuned_plan(fixtures_dir, tmp_path)
    seen = []
    real = tune.tune_layer

    def spy(forward, targets, *a, **k):
        with torch.no_grad():
            quantized = {s: forward([s], {})[0] for s in targets}  # the quantized path's inputs, float weights
        seen.append(({s: t.clone() for s, t in targets.items()}, quantized))
        return real(forward, targets, *a, **k)

    monkeypatch.setattr(tune, "tune_layer", spy)
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "out", calibrated=hook)
    n = plan.model.num_hidden_layers
    assert len(seen) == n  # every layer tuned
    model = AutoModelForCausalLM.from_pretrained(fixtures_dir / "llama-bf16", dtype=hook.quantizer.compute)
    tuned = tune.subset(len(samples), 4)
    outputs: dict[int, torch.Tensor] = {}
    for k, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda _m, _a, y, k=k: outputs.__setitem__(k, y[0] if isinstance(y, tuple) else y))
    for s in tuned:
        with torch.no_grad():
            model(samples[s])
        for k in range(1, n):  # layer 0's inputs are the embeddings on both paths
            targets, quantized = seen[k]
            ref = outputs[k].float()
            off = float((targets[s].float() - ref).norm() / ref.norm())
            drift = float((quantized[s].float() - ref).norm() / ref.norm())
            assert off < 0.02 and drift > 3 * off, (k, s, off, drift)


def test_a_tuned_run_resumed_from_a_layer_checkpoint_gives_the_uninterrupted_bytes(fixtures_dir, tmp_path,
                                                                                   monkeypatch):
    """The float path of the tuned samples is saved with the activations: a resumed run tunes the layers after
    the checkpoint against the same targets."""
    from test_gptq import interrupted_run

    from quantize.engine import stream
    from quantize.engine.layerwise import Calibrated

    monkeypatch.setattr(signround, "LR", SMALL_STEPS[0])
    monkeypatch.setattr(signround, "SCALE_LR", SMALL_STEPS[1])
    plan, samples = _tuned_plan(fixtures_dir, tmp_path)
    stream.run(plan, tmp_path / "clean", calibrated=Calibrated(plan, samples, torch.device("cpu")))
    partial = tmp_path / "out.partial"
    interrupted_run(plan, samples, tmp_path / "out", monkeypatch,
                    lambda: (partial / "calib" / "layers.json").exists())
    saved = json.loads((partial / "calib" / "layers.json").read_text())
    assert saved["next_layer"] >= 1 and any(n.startswith("float.") for n in saved["activations"]["crc32"])
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "out", resume=True, calibrated=hook)
    assert hook.quantizer.stats.resumed_layers == saved["next_layer"]
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "clean")
