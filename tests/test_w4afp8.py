"""W4AFP8 (`--scheme w4afp8`): compressed-tensors' preset of INT4 g128 weights with FP8 per-token dynamic
activations, one checkpoint with INT4's memory that runs FP8 tensor-core GEMMs on Hopper."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import config_of, read_all

from quantize import arch, recipe, serving
from quantize.cli import main
from quantize.errors import UsageError
from quantize.tensor_plan import moe_tp_ok


@pytest.mark.parametrize("kind", ["glm4-moe-bf16", "glm5-bf16"])
def test_w4afp8_has_model_free_ptqs_codes_packed_as_the_engines_read_them(kind, fixtures_dir, tmp_path, model_free_ptq):
    """model_free_ptq(scheme="W4AFP8") writes the same codes and scales, but unpacked (`int-quantized`: an int8
    `weight` per Linear), which neither engine serves as W4AFP8: SGLang's _is_wint4afp8 asks for the
    pack-quantized format, and vLLM's CompressedTensorsW4A8Fp8.create_weights registers `weight_packed`. Ours is
    pack-quantized: its codes unpacked are the reference's int8 weights, the scales and config groups the same
    (weights and input_activations), and the tensors exactly those of W4A16 g128 (only the config differs)."""
    from quantize.quant import pack

    src = fixtures_dir / kind
    for scheme, out in (("w4afp8", "ours"), ("w4a16", "int4")):
        result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / out), "--scheme", scheme])
        assert result.exit_code == 0, result.output
    ignore = config_of(tmp_path / "ours")["quantization_config"]["ignore"] + [r"re:.*mlp\.gate$", r"re:.*embed_tokens$"]
    model_free_ptq(src, tmp_path / "ref", "W4AFP8", ignore)
    ours, ref, int4 = read_all(tmp_path / "ours"), read_all(tmp_path / "ref"), read_all(tmp_path / "int4")
    assert set(ours) == set(int4) and all(torch.equal(ours[k], int4[k]) for k in ours)
    modules = [k.removesuffix(".weight_packed") for k in ours if k.endswith(".weight_packed")]
    assert len(modules) > 20
    for m in modules:
        codes = pack.unpack_int4(ours[f"{m}.weight_packed"])
        assert ref[f"{m}.weight"].dtype == torch.int8 and torch.equal(codes, ref[f"{m}.weight"]), m
        assert torch.equal(ours[f"{m}.weight_scale"], ref[f"{m}.weight_scale"]), m
    rest = [k for k in ref if not k.startswith(tuple(f"{m}." for m in modules))]
    assert rest and all(torch.equal(ours[k], ref[k]) for k in rest)
    qc, ref_qc = config_of(tmp_path / "ours")["quantization_config"], config_of(tmp_path / "ref")["quantization_config"]
    assert (qc["format"], ref_qc["format"]) == ("pack-quantized", "int-quantized")
    (group,), (ref_group,) = qc["config_groups"].values(), ref_qc["config_groups"].values()
    for part in ("weights", "input_activations", "targets"):
        assert group[part] == ref_group[part], part
    acts = group["input_activations"]
    assert (acts["num_bits"], acts["type"], acts["strategy"], acts["dynamic"]) == (8, "float", "token", True)


def _model(cfg: dict):
    return arch.resolve(cfg, ["model.layers.0.x"])


def test_w4afp8_tp_follows_the_engines_group_rule(fixtures_dir):
    """vLLM's CompressedTensorsW4A8Fp8 checks each rank's input partition with verify_group_size_divides_partition
    (group 128): Kimi K2's 2048-wide experts split in 8 give 256 (whole groups), GLM-4.5's 1536 give 192 (not),
    and convert refuses that TP with the sizes that work."""
    kimi = json.loads((Path(__file__).parent / "data" / "kimi-k2-instruct-config.json").read_text())
    assert moe_tp_ok(_model(kimi), 128, 8)
    glm45 = {**json.loads((fixtures_dir / "glm4-moe-bf16" / "config.json").read_text()), "hidden_size": 5120,
             "moe_intermediate_size": 1536}
    assert [tp for tp in (1, 2, 4, 8, 16) if moe_tp_ok(_model(glm45), 128, tp)] == [1, 2, 4]
    result = CliRunner().invoke(main, ["convert", str(fixtures_dir / "glm4-moe-bf16"), "/nonexistent/out",
                                       "--scheme", "w4afp8", "--tp", "2"])
    assert result.exit_code == 2 and "W4AFP8" in result.output and "128 / 2 = 64" in result.output
    assert "serves at TP [1]" in result.output


def test_w4afp8_needs_group_128_and_the_matrix_says_where_it_runs(fixtures_dir, tmp_path):
    """vLLM 0.33 takes W4AFP8 only on SM 9.0 (compressed_tensors.py _is_fp8_w4a8_sm90, match_exact); SGLang
    0.5.23 runs routed experts in CompressedTensorsW4AFP8MoE and dense Linears as W4A16 (_is_wNa16_group_channel
    comes first in _get_scheme_from_parts)."""
    with pytest.raises(UsageError, match="group_size 128"):
        recipe.preset("w4afp8", 64)
    with pytest.raises(UsageError, match="W4AFP8"):
        recipe.from_dict({"scheme": {"num_bits": 4, "group_size": 32, "activations": "fp8"}}, "r.yaml")
    out = tmp_path / "w4afp8"
    assert CliRunner().invoke(main, ["convert", str(fixtures_dir / "kimi-k2-fp8"), str(out), "--scheme",
                                     "w4afp8"]).exit_code == 0
    rows = {r.engine: r for r in serving.matrix_of(out) if r.variant.startswith("W4AFP8")}
    assert rows[serving.VLLM].loads and "SM 9.0" in rows[serving.VLLM].notes[0]
    assert rows[serving.SGLANG].loads and "W4A16" in rows[serving.SGLANG].notes[0]


def test_plan_disaggregated_shows_the_single_w4afp8_checkpoint_beside_the_pair():
    """`plan --disaggregated`: the FP8 prefill / INT4 decode pair, and W4AFP8 as one checkpoint for both, sized
    as INT4 g128 of the same targets (the weights are the same tensors)."""
    import dataclasses

    from quantize import plan

    glm = recipe.load(Path(__file__).parents[1] / "recipes" / "glm-w4a16.yaml")
    config = Path(__file__).parent / "data" / "glm-5-fp8-config.json"
    report = plan.capacity(config, plan.Setup(), ["fp8"], glm, disaggregated=True)
    labels = [s.weights for s in report.scenarios]
    assert [lb.split(":")[0] for lb in labels] == ["source (FP8 blocks)", "prefill", "decode", "or one checkpoint for both"]
    single = report.scenarios[-1]
    assert "FP8 activations" in single.weights and any("W4AFP8" in n for n in report.notes)
    int4_g128 = dataclasses.replace(glm, scheme=recipe.Scheme(num_bits=4, group_size=128))
    same = plan.capacity(config, plan.Setup(), ["fp8"], int4_g128).scenarios[-1]
    assert single.weights_total == same.weights_total < report.scenarios[2].weights_total  # fewer scales than g32
