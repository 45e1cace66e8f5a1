"""`quantize plan`: KV bytes per token by attention kind, weights per GPU, and the published figures for Kimi K2
and GLM-5 recomputed from their real configs."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from quantize import plan, recipe
from quantize.arch.layout import from_config
from quantize.checkpoint import Checkpoint
from quantize.cli import main

DATA = Path(__file__).parent / "data"
KIMI = json.loads((DATA / "kimi-k2-instruct-config.json").read_text())
GLM5 = json.loads((DATA / "glm-5-fp8-config.json").read_text())


def run_plan(*args) -> dict:
    r = CliRunner().invoke(main, ["plan", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_kimi_k2_kv_bytes_and_tokens_match_the_published_figures():
    assert plan.kv_per_token(KIMI, 2).bytes_per_token == (512 + 64) * 61 * 2 == 70272
    assert plan.kv_per_token(KIMI, 1).bytes_per_token == 35136
    assert plan.kv_per_token(KIMI, 2, tp=8).bytes_per_token == 70272  # the latent is replicated, not split
    report = run_plan(DATA / "kimi-k2-instruct-config.json", "--kv-budget-gib", "44.9")
    tokens = {s["kv_dtype"]: s["total_tokens"] for s in report["scenarios"]}
    assert tokens["bf16"] == int(44.9 * 2**30 // 70272) and abs(tokens["bf16"] - 686e3) < 0.01 * 686e3
    assert abs(tokens["fp8"] - 1.37e6) < 0.01 * 1.37e6
    assert report["claims"] and all(c["holds"] for c in report["claims"])
    # the FP8 checkpoint is ~1T parameters at one byte each: ~959 GiB, as the release is
    total = report["scenarios"][0]["weights_total_gib"]
    assert 930 < total < 990, total


def test_glm5_dsa_kv_adds_the_indexer_cache():
    kv = plan.kv_per_token(GLM5, 2)
    assert kv.kind == "dsa"
    assert kv.bytes_per_token == (512 + 64) * 78 * 2 + (128 + 4) * 78
    assert plan.kv_per_token(GLM5, 1).bytes_per_token == (512 + 64) * 78 + (128 + 4) * 78  # indexer stays FP8
    assert plan.kv_per_token(GLM5, 2, mtp_layers=1).layers == 79


def test_glm5_checkpoint_sizes_and_the_int4_claim_that_needs_the_mtp_experts():
    report = run_plan(DATA / "glm-5-fp8-config.json", "--weights", RECIPES / "glm-w4a16.yaml", "--kv-dtype", "fp8")
    src, int4 = report["scenarios"]
    assert abs(src["weights_total_gib"] - 704) < 0.01 * 704
    # per GPU at TP 8: 88 -> 52-54 GiB; replicated parts (MLA down-projections, indexer, routers, norms) add a little
    assert src["weights_total_gib"] / 8 <= src["weights_per_gpu_gib"] < src["weights_total_gib"] / 8 * 1.03
    assert 88 < src["weights_per_gpu_gib"] < 91 and 55 < int4["weights_per_gpu_gib"] < 59
    claims = {c["what"]: c for c in report["claims"] if not c["what"].startswith("INT4 g32")}
    assert claims["FP8 checkpoint size"]["holds"]
    every, ours = [c for c in report["claims"] if c["what"].startswith("INT4 g32")]
    assert every["holds"] and abs(every["computed"] - 420) < 5  # every routed expert INT4, MTP's included
    assert not ours["holds"] and ours["computed"] > 425  # what convert writes keeps the MTP layer BF16
    assert abs(int4["weights_total_gib"] - ours["computed"]) < 0.01
    assert any("does not follow" in n and "MTP" in n for n in report["notes"]), report["notes"]
    # 88 -> 52 GiB per GPU is the checkpoint divided by 8; the replicated MLA down-projections and indexer add more
    for what, published in (("FP8 weights per GPU at TP 8", 88), ("INT4 weights per GPU at TP 8", 52)):
        assert not claims[what]["holds"] and published < claims[what]["computed"] < published * 1.1, claims[what]
        assert any(what in n and "replicates" in n for n in report["notes"])


def test_gqa_kv_heads_replicate_when_tp_exceeds_them():
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert plan.kv_per_token(cfg, 2, tp=1).bytes_per_token == 8 * 256 * 32 * 2
    assert plan.kv_per_token(cfg, 2, tp=4).bytes_per_token == 2 * 256 * 32 * 2
    assert plan.kv_per_token(cfg, 2, tp=16).bytes_per_token == 1 * 256 * 32 * 2


def test_config_layout_is_the_checkpoints_own(fixtures_dir):
    """The shapes laid out from config.json alone are exactly the tensors of a real checkpoint of that config,
    and its FP8 block format gives each tensor's stored bytes, scales included."""
    ckpt = Checkpoint(fixtures_dir / "kimi-k2-fp8")
    model, layout = from_config(ckpt.config)
    shapes = dict(layout)
    stored = {n: t for n, t in ckpt.tensors.items()}
    # DeepSeek-style MTP layers also carry copies of the embedding and the head, which servers do not load
    extra = {n for n in stored if n not in shapes}
    assert all(".embed_tokens." in n or ".shared_head.head." in n for n in extra), sorted(extra)[:5]
    assert all(stored[n].shape == s for n, s in shapes.items()), [n for n, s in shapes.items() if stored[n].shape != s][:5]
    weights = plan.weights_of(plan.roles_of(model, layout), plan.source_format_bytes(ckpt.config))
    wrong = [w.name for w in weights if w.nbytes != stored[w.name].stored_bytes]
    assert not wrong, wrong[:5]


def test_recipe_weights_match_what_convert_writes(fixtures_dir, tmp_path):
    src = fixtures_dir / "kimi-k2-fp8"
    r = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    report = run_plan(src, "--weights", RECIPES / "kimi-k2-w4a16.yaml", "--kv-dtype", "bf16", "--tp", "1", "--gpus", "1")
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--recipe",
                                       str(RECIPES / "kimi-k2-w4a16.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    from quantize.safetensors_file import read_header

    written = sum(i.nbytes for f in (tmp_path / "out").glob("*.safetensors") for i in read_header(f).values())
    source, int4 = report["scenarios"]
    assert int4["weights"].startswith(r.name)
    assert round(written / 2**30, 2) == int4["weights_total_gib"]
    assert source["weights_total_gib"] == round(sum(t.stored_bytes for t in Checkpoint(src).tensors.values()) / 2**30, 2)


def test_budget_from_gpu_memory_and_bad_layouts(fixtures_dir):
    s = plan.Setup(gpus=8, tp=8, gpu_mem_gib=100, mem_fraction=0.5)
    sc = plan.capacity(DATA / "kimi-k2-instruct-config.json", s, ["fp8"]).scenarios[0]
    assert sc.kv_budget_per_gpu == pytest.approx(50 * 2**30 - sc.weights_per_gpu)
    assert sc.tokens == 0  # ~120 GiB of FP8 weights per GPU do not fit in 50: nothing left for KV
    r = CliRunner().invoke(main, ["plan", str(DATA / "kimi-k2-instruct-config.json"), "--gpus", "8", "--tp", "4"])
    assert r.exit_code == 2 and "--gpus 8 is not --tp 4 x --dp 1" in r.output


# (config, the family's KV bytes per token at TP 1 in BF16, its formula)
FAMILY_KV = {
    "qwen3-235b-a22b-fp8-config.json": (2 * 4 * 128 * 94 * 2, "gqa"),
    "minimax-m2-config.json": (2 * 8 * 128 * 62 * 2, "gqa"),
    "mixtral-8x7b-config.json": (2 * 8 * 128 * 32 * 2, "gqa"),
    "deepseek-v32-fp8-config.json": ((512 + 64) * 61 * 2 + (128 + 4) * 61, "dsa"),  # the indexer's cache stays FP8
}


@pytest.mark.parametrize("name", list(FAMILY_KV))
def test_each_familys_published_config_gives_its_cards_parameters_and_its_kv_bytes(name):
    """The cards' totals and activated parameters (plan.CARDS cites each) follow from the configs' tensors as
    transformers builds them, within 2% and 3%; KV bytes per token by attention kind, GQA heads split by TP up to
    their number; an INT4 routed-experts recipe leaves every family's attention and router as the source stores
    them."""
    cfg = json.loads((DATA / name).read_text())
    kv, kind = FAMILY_KV[name]
    got = plan.kv_per_token(cfg, 2)
    assert (got.bytes_per_token, got.kind) == (kv, kind)
    if kind == "gqa":
        heads = cfg["num_key_value_heads"]
        assert plan.kv_per_token(cfg, 1, tp=heads).bytes_per_token == kv // 2 // heads
    report = run_plan(DATA / name, "--weights", RECIPES / "moe-w4a16.yaml", "--gpus", "8", "--tp", "8")
    claims = {c["what"]: c for c in report["claims"]}
    assert len(claims) == 2 and all(c["holds"] for c in claims.values()), claims
    src, int4 = report["scenarios"][0], report["scenarios"][-1]
    assert int4["weights_total_gib"] < src["weights_total_gib"]
