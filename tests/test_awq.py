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
from quantize.engine.experts import Deferred
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


def forward(q: LayerwiseQuantizer, layer, h, pos, i: int = 0) -> torch.Tensor:
    """One float32 forward of decoder layer i on one calibration sample (its layer type's mask and rotary)."""
    q._shared = (None, None)
    mask, rotary = q._inputs(h, pos, q.layer_type(i))
    kwargs = {"prev_topk_indices": None} if "prev_topk_indices" in type(layer).forward.__code__.co_varnames else {}
    with torch.no_grad():
        y = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=tuple(t.float() for t in rotary),
                  **kwargs)
    return y[0] if isinstance(y, tuple) else y


class WholeExperts(torch.nn.ModuleList):
    """A layer's routed experts built whole, as Linears named as in the checkpoint (`experts.E.gate_proj`), with
    transformers' forward: the float layer that AWQ's smoothing must leave unchanged (the engine streams them)."""

    def __init__(self, q: LayerwiseQuantizer, i: int, act_fn):
        super().__init__()
        for e in range(q.model.n_routed_experts):
            m = torch.nn.Module()
            for leaf in ("gate_proj", "up_proj", "down_proj"):  # stored as the family names them (Mixtral: w1)
                w = q._decode(q.model.stored_name(i, f"mlp.experts.{e}.{leaf}.weight")).float()
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data = w
                setattr(m, leaf, lin)
            self.append(m)
        self.__dict__["act_fn"] = act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            token_idx, pos = torch.where(top_k_index == e)
            m, x = self[e], hidden_states[token_idx]
            y = m.down_proj(self.act_fn(m.gate_proj(x)) * m.up_proj(x)) * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


@pytest.mark.parametrize("kind", ["llama-bf16", "kimi-k2-fp8", "glm5-bf16", "glm4-moe-bf16", "deepseek-v32-fp8",
                                  "qwen3-moe-fp8", "minimax-m2-fp8", "mixtral-bf16", "mistral-bf16", "phi3-bf16",
                                  "gemma3-bf16"])
def test_smoothing_every_mapping_leaves_the_float_layer_unchanged(kind, fixtures_dir, tmp_path):
    """Random scales through every mapping the engine finds: a consumer left out (router, indexer) would show."""
    r = recipe.from_dict({"method": "awq", "scheme": {"group_size": 32}, "targets": ["Linear"], "ignore": ["lm_head"]}, "t")
    plan = build(Checkpoint(fixtures_dir / kind), r, 2**30)
    samples = calib.load_samples(str(calibration_samples(tmp_path, 8)), calib.load_tokenizer(fixtures_dir / kind), 2, 48)
    q = LayerwiseQuantizer(plan, samples, torch.device("cpu"))
    q.dtype = torch.float32
    for i in range(plan.model.num_hidden_layers):
        layer = q._build_layer(i).float()
        deferred = next((m for m in layer.modules() if isinstance(m, Deferred)), None)
        streamed = None
        if deferred is not None:  # the engine's view: the routed experts named, not built
            moe = q._layer_experts(i, q._layer_targets(i))
            streamed = _mappings(q, dict(layer.named_modules()), q._layer_targets(i), tuple(moe.linear_names()))
            layer.mlp.experts = WholeExperts(q, i, deferred.act_fn)
        modules = dict(layer.named_modules())
        mappings = _mappings(q, modules, q._layer_targets(i))
        assert mappings
        if streamed is not None:  # the same smooth -> balance pairs, experts included, as the whole layer's; each
            # expert's own up -> down is searched where the expert is (awq_experts.AWQExperts._solve_expert)
            whole = {sm: set(b) for sm, b in mappings}
            own = {sm for sm in whole if ".experts." in sm}
            assert own == {f"mlp.experts.{e}.up_proj" for e in range(plan.model.n_routed_experts)}
            assert {sm: set(b) for sm, b in streamed} == {sm: b for sm, b in whole.items() if sm not in own}
        h = q.hidden[0].float()
        pos = q.positions[0]
        before = forward(q, layer, h, pos, i)
        g = torch.Generator().manual_seed(i)
        for smooth, balance in mappings:
            n = modules[balance[0]].weight.shape[1]
            offset = plan.model.arch.norm_offset if modules[smooth].weight.ndim == 1 else 0.0  # Gemma: 1 + weight
            _apply_scales(modules[smooth], [modules[b] for b in balance], torch.rand(n, generator=g) + 0.5, offset)
        after = forward(q, layer, h, pos, i)
        assert torch.allclose(before, after, atol=2e-4, rtol=1e-3), (kind, i, (before - after).abs().max())
        smooths = {sm for sm, _ in mappings}
        if plan.model.arch.moe and i >= 1:
            assert "post_attention_layernorm" in smooths
            bal = dict(mappings)["post_attention_layernorm"]
            assert "mlp.gate" in bal and "mlp.experts.7.up_proj" in bal
            assert "mlp.shared_experts.gate_proj" in bal or "n_shared_experts" not in plan.model.text_config
        if plan.model.arch.family == "dense":  # traced from the class (arch/generic.py), not declared
            assert "input_layernorm" in smooths and len(smooths & {"post_attention_layernorm",
                                                                  "pre_feedforward_layernorm"}) == 1
        if kind in ("glm5-bf16", "deepseek-v32-fp8"):
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


def test_an_experts_share_of_the_norms_loss_is_its_weighted_output_error():
    """quant/awq.expert_errors against the error written out: the expert with gate and up computing Q(W s) / s,
    its output times the router's weight, squared and summed; the identity scales give the plain RTN error."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 64, generator=g), torch.rand(300, generator=g)
    gate, up, down = (torch.randn(*shape, generator=g) * 0.1 for shape in ((96, 64), (96, 64), (64, 96)))
    act = torch.nn.functional.silu
    scales = [torch.ones(64), torch.rand(64, generator=g) + 0.5]
    got = awq.expert_errors(x, w, gate, up, down, act, scales, 32)

    def expert(gw, uw):
        return (act(x @ gw.t()) * (x @ uw.t())) @ down.t() * w[:, None]
    for k, s in enumerate(scales):
        want = (expert(awq.scaled_fake_quant(gate, s, 32, True), awq.scaled_fake_quant(up, s, 32, True))
                - expert(gate, up)).double().pow(2).sum()
        assert torch.allclose(got[k], want, rtol=1e-5), (k, got[k], want)
    left = awq.expert_errors(x, w, gate, up, down, act, scales, 32, quantized=(False, True))
    assert (left < got).all() and (left > 0).all()  # a gate left float adds no error of its own


def test_the_experts_search_rows_are_the_recorders():
    """awq_experts.sample_rows keeps of each sample's tokens what _AWQRecorder keeps of the same forward."""
    from quantize.engine.awq_experts import sample_rows
    from quantize.engine.awq_layer import _AWQRecorder

    lengths = [37, 5, 64, 20]
    starts = [0, 37, 42, 106]
    bounds = [(a, a + n) for a, n in zip(starts, lengths, strict=True)]
    for max_rows in (8, 40, 1000):
        rec = _AWQRecorder(max_rows, len(lengths))
        for a, n in zip(starts, lengths, strict=True):
            rec.pre_hook("x", None, (torch.arange(a, a + n, dtype=torch.float32)[:, None],))
        kept = torch.cat(rec.rows["x"]).flatten().long()
        assert torch.equal(sample_rows(bounds, torch.arange(126), max_rows), kept), max_rows


def test_awq_streams_the_routed_experts_a_chunk_at_a_time(fixtures_dir, tmp_path, monkeypatch):
    """Under AWQ a MoE layer's routed experts are never modules of the layer: each is decoded from the source
    three times a layer (weights, the norm's error, the solve), a chunk at a time."""
    from collections import Counter

    from quantize.engine import experts as routed

    rec = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    data = calibration_samples(tmp_path)
    rec = dataclasses.replace(rec, method="awq", calibration=dataclasses.replace(rec.calibration, data=str(data),
                                                                                 num_samples=4, seq_len=32))
    src = fixtures_dir / "kimi-k2-fp8"
    plan = build(Checkpoint(src), rec, 2**20)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 4, 32)
    decoded, built = Counter(), []
    source = routed.LayerExperts._source

    def counted(self, e):
        decoded[(self.weight_name(e, "gate_proj"), e)] += 1
        return source(self, e)
    monkeypatch.setattr(routed.LayerExperts, "_source", counted)
    build_layer = LayerwiseQuantizer._build_layer

    def record(self, i):
        layer = build_layer(self, i)
        built.append([n for n, _ in layer.named_parameters() if ".experts." in n])
        return layer
    monkeypatch.setattr(LayerwiseQuantizer, "_build_layer", record)
    hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "out", calibrated=hook)
    n = plan.model.n_routed_experts
    moe_layers = plan.model.num_hidden_layers - 1
    assert built and all(not names for names in built)  # no expert weight in any layer built
    # 3 passes per expert and layer; the routed output reads the results, and the source only for a Linear
    # without one (none here: every expert Linear is a target)
    assert len(decoded) == moe_layers * n and set(decoded.values()) == {3}, decoded


@pytest.mark.parametrize("kind,ranks", [("kimi-k2-fp8", "cpu,cpu"), ("glm4-moe-bf16", "cpu,cpu,cpu"),
                                        ("minimax-m2-fp8", "cpu,cpu")])
def test_awq_on_several_ranks_gives_the_bytes_of_one(kind, ranks, fixtures_dir, tmp_path):
    """AWQ's routed experts split by expert groups over gloo ranks (the norm's error summed per group in group
    order, each rank smoothing and rounding its own): the bytes of one rank. GLM's recipe also quantizes the
    shared experts, whose error rank 0 adds to the groups'; MiniMax-M2's experts are stored as w1/w3/w2 under
    block_sparse_moe, which each rank reads and writes under those names."""
    import subprocess
    import sys

    data = calibration_samples(tmp_path)
    outs = {}
    for name, extra in (("one", []), ("several", ["--devices", ranks])):
        outs[name] = tmp_path / name
        cmd = [sys.executable, "-m", "quantize", "convert", str(fixtures_dir / kind), str(outs[name]), "--recipe",
               str(RECIPES / f"{ {'kimi': 'kimi-k2', 'glm4': 'glm'}.get(kind.split('-')[0], 'moe')}-w4a16.yaml"),
               "--method", "awq",
               "--calib", str(data), "--num-samples", "8", "--seq-len", "64", "--max-shard-size", "1MB",
               "--device", "cpu", *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
    files = sorted(f.name for f in outs["one"].glob("*.safetensors"))
    assert files and files == sorted(f.name for f in outs["several"].glob("*.safetensors"))
    for f in files:
        assert (outs["one"] / f).read_bytes() == (outs["several"] / f).read_bytes(), f


def test_a_checkpoints_stats_are_a_snapshot_the_next_layers_do_not_write_into():
    """engine/layerwise.py takes a checkpoint's stats after layer i and writes them at its commit, while layer i+1
    runs: what that layer appends (its AWQ searches, its errors) must not reach the snapshot, or a resume reports
    them twice (seen as a flaky test_awq_resume_from_a_layer_checkpoint_gives_the_uninterrupted_bytes under load)."""
    from quantize.engine.layerwise import Stats

    stats = Stats()
    stats.awq.append({"layer": 1, "smooth": "input_layernorm"})
    stats.error["attention"].append(0.1)
    snapshot = stats.to_dict()
    stats.awq.append({"layer": 2, "smooth": "input_layernorm"})
    stats.awq[0]["ratio"] = 0.5
    stats.error["attention"].append(0.2)
    assert snapshot["awq"] == [{"layer": 1, "smooth": "input_layernorm"}]
    assert snapshot["error"] == {"attention": [0.1]}
