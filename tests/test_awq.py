"""AWQ: the grid search, the smoothing that leaves the float model unchanged (every consumer of a norm,
routers and the DSA indexer included), and converted outputs that load."""

import dataclasses
import json

import pytest
import torch
from conftest import RECIPES, read_all
from test_gptq import calibration_samples, interrupted_run

from quantize import calib, recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import stream
from quantize.engine.awq_layer import _apply_scales, _mappings
from quantize.engine.layerwise import Calibrated, LayerwiseQuantizer
from quantize.quant import awq
from quantize.tensor_plan import build


def test_search_starts_from_identity_and_helps_on_outlier_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g)
    x[:, :4] *= 40  # a few salient input channels, as in real activations
    w = torch.randn(128, 256, generator=g) * 0.05
    loss = awq.linear_loss([(w, x)], group_size=64)
    scales, ratio, initial, best = awq.search(x.abs().mean(0), [w], loss, group_size=64)
    assert awq.grid()[0] == (0.0, False) and len(awq.grid()) == 20
    assert best < 0.9 * initial and ratio > 0
    assert scales.shape == (256,) and torch.isfinite(scales).all() and (scales > 0).all()
    assert scales[:4].mean() > scales[4:].mean()  # salient channels are protected by larger scales


def forward(q: LayerwiseQuantizer, layer, h, pos) -> torch.Tensor:
    """One float32 forward of a decoder layer on one calibration sample."""
    mask = q._mask(h, pos)
    mask = next(iter(mask.values())) if isinstance(mask, dict) else mask
    kwargs = {"prev_topk_indices": None} if "prev_topk_indices" in type(layer).forward.__code__.co_varnames else {}
    with torch.no_grad():
        y = layer(h, attention_mask=mask, position_ids=pos,
                  position_embeddings=tuple(t.float() for t in q.rotary(h, pos)), **kwargs)
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("kind", ["llama-bf16", "kimi-k2-fp8", "glm5-bf16", "glm4-moe-bf16"])
def test_smoothing_every_mapping_leaves_the_float_layer_unchanged(kind, fixtures_dir, tmp_path):
    """Random scales through every mapping the engine finds: a consumer left out (router, indexer) would show."""
    r = recipe.from_dict({"method": "awq", "scheme": {"group_size": 32}, "targets": ["Linear"], "ignore": ["lm_head"]}, "t")
    plan = build(Checkpoint(fixtures_dir / kind), r, 2**30)
    samples = calib.load_samples(str(calibration_samples(tmp_path, 8)), calib.load_tokenizer(fixtures_dir / kind), 2, 48)
    q = LayerwiseQuantizer(plan, samples, torch.device("cpu"))
    q.dtype = torch.float32
    for i in range(plan.model.num_hidden_layers):
        layer = q._build_layer(i).float()
        modules = dict(layer.named_modules())
        mappings = _mappings(q, modules, q._layer_targets(i))
        assert mappings
        h = q.hidden[0].float()
        pos = q.positions[0]
        before = forward(q, layer, h, pos)
        g = torch.Generator().manual_seed(i)
        for smooth, balance in mappings:
            n = modules[balance[0]].weight.shape[1]
            _apply_scales(modules[smooth], [modules[b] for b in balance], torch.rand(n, generator=g) + 0.5)
        after = forward(q, layer, h, pos)
        assert torch.allclose(before, after, atol=2e-4, rtol=1e-3), (kind, i, (before - after).abs().max())
        smooths = {sm for sm, _ in mappings}
        if plan.model.arch.moe and i >= 1:
            assert "post_attention_layernorm" in smooths
            bal = dict(mappings)["post_attention_layernorm"]
            assert "mlp.gate" in bal and "mlp.experts.7.up_proj" in bal and "mlp.shared_experts.gate_proj" in bal
        if kind == "glm5-bf16":
            assert "self_attn.indexer.wk" in dict(mappings)["input_layernorm"]
            assert "self_attn.indexer.wq_b" in dict(mappings)["self_attn.q_a_layernorm"]


@pytest.mark.parametrize("kind,r", [("llama-bf16", "dense-w4a16"), ("kimi-k2-fp8", "kimi-k2-w4a16"),
                                    ("glm5-bf16", "glm-w4a16")])
def test_awq_output_loads_and_writes_the_rescaled_norms(kind, r, fixtures_dir, tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    rec = recipe.load(RECIPES / f"{r}.yaml")
    data = calibration_samples(tmp_path)
    rec = dataclasses.replace(rec, method="awq", calibration=dataclasses.replace(rec.calibration, data=str(data),
                                                                                 num_samples=8, seq_len=64))
    plan = build(Checkpoint(fixtures_dir / kind), rec, 2**20)
    samples = calib.load_samples(str(data), calib.load_tokenizer(fixtures_dir / kind), 8, 64)
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "out", calibrated=hook)
    assert hook.quantizer.stats.awq and all(a["loss_best"] <= a["loss_identity"] for a in hook.quantizer.stats.awq)
    src, out = read_all(fixtures_dir / kind), read_all(tmp_path / "out")
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert out[norm].dtype == src[norm].dtype and not torch.equal(out[norm], src[norm])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    if cfg["model_type"] == "kimi_k2":
        cfg.pop("auto_map")
        cfg["model_type"] = "deepseek_v3"
        model, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", config=DeepseekV3Config(**cfg),
                                                            output_loading_info=True, dtype=torch.bfloat16)
        router = "model.layers.1.mlp.gate.weight"
        assert not torch.equal(out[router], src[router])  # the router is rescaled with the norm that feeds it
    else:
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                           dtype=torch.bfloat16)
    n = cfg["num_hidden_layers"]
    assert info["missing_keys"] == set() and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    with torch.no_grad():
        assert torch.isfinite(model(samples[0]).logits).all()


def test_awq_resume_from_a_layer_checkpoint_gives_the_uninterrupted_bytes(fixtures_dir, tmp_path, monkeypatch):
    """The checkpoint must carry what AWQ changed besides the quantized weights (rescaled norms and routers) and
    the FP8 KV cache scales (here of Kimi's MLA latent)."""
    rec = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    data = calibration_samples(tmp_path)
    rec = dataclasses.replace(rec, method="awq", kv_cache="fp8",
                              calibration=dataclasses.replace(rec.calibration, data=str(data), num_samples=4, seq_len=32))
    src = fixtures_dir / "kimi-k2-fp8"
    plan = build(Checkpoint(src), rec, 2**18)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 4, 32)
    clean = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "clean", calibrated=clean)
    meta = tmp_path / "out.partial" / "calib" / "layers.json"
    interrupted_run(plan, samples, tmp_path / "out", monkeypatch,
                    lambda: meta.exists() and json.loads(meta.read_text())["next_layer"] >= 2)
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "out", resume=True, calibrated=hook)
    assert hook.quantizer.stats.resumed_layers == 2
    assert hook.quantizer.stats.awq == clean.quantizer.stats.awq  # the resumed layers' searches are still reported
    for f in sorted((tmp_path / "clean").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "out" / f.name).read_bytes(), f.name
    out = read_all(tmp_path / "out")
    for i in range(plan.model.num_hidden_layers):  # MLA: one latent, one scale, measured on every layer
        k, v = out[f"model.layers.{i}.self_attn.k_proj.k_scale"], out[f"model.layers.{i}.self_attn.v_proj.v_scale"]
        assert torch.equal(k, v) and 0 < float(k) <= 1
