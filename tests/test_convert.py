"""End-to-end conversions of the tiny fixtures: layout, schema, loading in transformers, passthrough."""

import json
import math

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from conftest import RECIPES, config_of, dies_on_call, read_all

from quantize import recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import shard as engine_shard
from quantize.engine import stream
from quantize.errors import UsageError
from quantize.quant import rtn
from quantize.safetensors_file import TensorSpec
from quantize.tensor_plan import build


def test_kimi_fp8_output_is_byte_identical_to_compressed_tensors(fixtures_dir, converted):
    """Every quantized expert: dequantize the FP8 source with the library's FP8BlockDequantizer, compress with
    the library's PackedQuantizationCompressor, and compare bytes with what we wrote."""
    src = read_all(fixtures_dir / "kimi-k2-fp8")
    out = read_all(converted["kimi-k2-fp8"])
    args = QuantizationArgs(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    dequant = FP8BlockDequantizer()
    modules = sorted(k[: -len(".weight_packed")] for k in out if k.endswith(".weight_packed"))
    assert len(modules) == 2 * 8 * 3  # two MoE decoder layers x 8 experts x gate/up/down; MTP stays float
    for m in modules:
        w = dequant._create_dequantized_weight(src[f"{m}.weight"], src[f"{m}.weight_scale_inv"])
        scale, zp = compute_dynamic_scales_and_zp(w, args, module=None)
        ref = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        for part in ("weight_packed", "weight_scale", "weight_shape"):
            assert out[f"{m}.{part}"].dtype == ref[part].dtype, (m, part)
            assert torch.equal(out[f"{m}.{part}"], ref[part]), (m, part)
    # FP8 weights the recipe leaves alone become BF16, dequantized exactly as the library does
    attn = "model.layers.1.self_attn.kv_a_proj_with_mqa"
    assert out[f"{attn}.weight"].dtype == torch.bfloat16
    ref = dequant._create_dequantized_weight(src[f"{attn}.weight"], src[f"{attn}.weight_scale_inv"])
    assert torch.equal(out[f"{attn}.weight"], ref)
    assert not any(k.endswith(("weight_scale_inv", "input_scale")) for k in out)
    # router and its float32 bias, norms, embeddings pass through untouched
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias", "model.embed_tokens.weight",
              "lm_head.weight", "model.norm.weight"):
        assert torch.equal(out[k], src[k]) and out[k].dtype == src[k].dtype


def test_output_config_and_index_schema(fixtures_dir, converted):
    out = converted["kimi-k2-fp8"]
    cfg = config_of(out)
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"], w["type"]) == (4, 32, True, "group", "int")
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    kimi_ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
    assert qc["ignore"][:4] == kimi_ignore
    assert r"re:model\.layers\.3\..*" in qc["ignore"]  # the MTP layer stays BF16 and says so
    assert "weight_block_size" not in json.dumps(qc)
    assert cfg["model_type"] == "kimi_k2" and cfg["auto_map"]["AutoConfig"] == "configuration_deepseek.DeepseekV3Config"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = read_all(out)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and all(p.stat().st_size <= 2**20 + 2**14 for p in shards)  # --max-shard-size 1 MiB + header
    assert not list(out.glob("*.tmp")) and not (out.parent / f"{out.name}.partial").exists()
    manifest = json.loads((out / "quantize-manifest.json").read_text())
    assert set(manifest["files"]) >= {p.name for p in shards} | {"config.json", "model.safetensors.index.json"}


def test_mtp_layer_and_remote_code_are_carried(fixtures_dir, converted):
    out = converted["kimi-k2-fp8"]
    tensors = read_all(out)
    mtp = {k for k in tensors if k.startswith("model.layers.3.")}
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight", "model.layers.3.enorm.weight",
            "model.layers.3.mlp.experts.7.down_proj.weight"} <= mtp
    assert all(tensors[k].dtype in (torch.bfloat16, torch.float32) for k in mtp)
    for f in ("configuration_deepseek.py", "modeling_deepseek.py", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja", "generation_config.json"):
        assert (out / f).read_bytes() == (fixtures_dir / "kimi-k2-fp8" / f).read_bytes()


def _fake_quant_reference(src_dir, out_dir, tmp_path):
    """A BF16 folder of the source weights with every quantized module replaced by its RTN fake-quantization."""
    from safetensors.torch import save_file

    ckpt = Checkpoint(src_dir)
    out_cfg = config_of(out_dir)
    quantized = {k[: -len(".weight_packed")] for k in read_all(out_dir) if k.endswith(".weight_packed")}
    group = out_cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    tensors = {}
    for name, t in ckpt.tensors.items():
        w = ckpt.decode(t)
        if name[: -len(".weight")] in quantized:
            w = rtn.fake_quantize(w.to(torch.bfloat16), group)
        tensors[name] = w.contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    out_cfg.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(out_cfg))
    return tmp_path


def _load(folder):
    """Load with transformers; kimi_k2 is not registered there, so it goes through a DeepseekV3Config."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = config_of(folder)
    if cfg["model_type"] == "kimi_k2":
        cfg.pop("auto_map")
        cfg["model_type"] = "deepseek_v3"
        return DeepseekV3ForCausalLM.from_pretrained(folder, config=DeepseekV3Config(**cfg), output_loading_info=True,
                                                     dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["kimi-k2-fp8", "glm4-moe-bf16", "glm4-moe-fp8", "glm5-bf16", "llama-bf16",
                                  "deepseek-v32-fp8", "qwen3-moe-fp8", "minimax-m2-fp8", "mixtral-bf16",
                                  "gemma3-bf16", "phi3-bf16", "mistral-bf16"])
def test_converted_fixture_loads_in_transformers_and_matches_fake_quant(kind, fixtures_dir, converted, tmp_path):
    model, info = _load(converted[kind])
    n_layers = config_of(converted[kind])["num_hidden_layers"]
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    # transformers drops MTP layers on load; nothing else may be left over
    assert all(k.startswith(f"model.layers.{n_layers}.") for k in info["unexpected_keys"])
    ref, ref_info = _load(_fake_quant_reference(fixtures_dir / kind, converted[kind], tmp_path))
    ids = torch.tensor([[1, 17, 230, 5, 99, 512, 3]])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=0), (got - want).abs().max()
    # and the quantization is real: the unquantized source gives different logits
    src, _ = _load(fixtures_dir / kind) if not kind.endswith("-fp8") else (None, None)
    if src is not None:
        with torch.no_grad():
            assert not torch.allclose(src(ids).logits.float(), got.float(), atol=1e-3)


def test_kimi_k25_int4_same_scheme_passes_through_bytes(fixtures_dir, converted):
    src, out = read_all(fixtures_dir / "kimi-k25-int4"), read_all(converted["kimi-k25-int4"])
    assert set(src) == set(out)
    for k in src:
        assert torch.equal(src[k], out[k]) and src[k].dtype == out[k].dtype, k
    qc = config_of(converted["kimi-k25-int4"])["quantization_config"]
    assert r"re:vision_tower\..*" in qc["ignore"] and r"re:mm_projector\..*" in qc["ignore"]
    assert config_of(converted["kimi-k25-int4"])["text_config"]["model_type"] == "kimi_k2"


def test_int4_source_with_another_group_size_is_requantized_with_a_warning(fixtures_dir, tmp_path):
    raw = {**recipe.load(RECIPES / "kimi-k2-w4a16.yaml").to_dict()}
    raw["scheme"] = {**raw["scheme"], "group_size": 64}
    plan = build(Checkpoint(fixtures_dir / "kimi-k25-int4"), recipe.from_dict(raw, "g64"), 2**30)
    assert any("re-quantizes" in w for w in plan.warnings)
    stream.run(plan, tmp_path / "out")
    out = read_all(tmp_path / "out")
    m = "language_model.model.layers.1.mlp.experts.0.up_proj"
    assert out[f"{m}.weight_scale"].shape == (128, 256 // 64)


def test_two_workers_and_one_give_identical_bytes(fixtures_dir, tmp_path):
    r = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    for workers in (1, 2):
        plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), r, max_shard_size=2**20, workers=workers)
        stream.run(plan, tmp_path / f"w{workers}", workers=workers)
    files = sorted(p.name for p in (tmp_path / "w1").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "w2").glob("*.safetensors"))
    for f in files:
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes()


def test_resume_after_a_failure_finishes_with_identical_bytes(fixtures_dir, tmp_path, monkeypatch):
    r = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), r, max_shard_size=2**20)
    stream.run(plan, tmp_path / "clean")
    dies_on_call(monkeypatch, engine_shard, "write_shard_pair", 3, lambda: stream.run(plan, tmp_path / "out"))
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial" / "state.json").exists()
    with pytest.raises(UsageError, match="--resume"):
        stream.run(plan, tmp_path / "out")
    result = stream.run(plan, tmp_path / "out", resume=True)
    assert 2 <= result.resumed_shards < result.shards  # finished shards kept; the failed one redone
    for f in sorted((tmp_path / "clean").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "out" / f.name).read_bytes()


def test_resume_with_another_recipe_is_refused(fixtures_dir, tmp_path):
    ckpt = Checkpoint(fixtures_dir / "llama-bf16")
    (tmp_path / "out.partial").mkdir()
    plan = build(ckpt, recipe.preset("w4a16", 128), 2**30)
    from quantize.engine.state import State

    State.open(tmp_path / "out.partial", stream.plan_fingerprint(plan), resume=False)
    other = build(ckpt, recipe.preset("w4a16", 64), 2**30)
    with pytest.raises(UsageError, match="started with another recipe; it cannot be resumed"):
        stream.run(other, tmp_path / "out", resume=True)


def test_refused_resume_names_what_changed_calibration_or_source(fixtures_dir, tmp_path):
    import dataclasses
    import shutil

    from quantize.engine.state import State

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "llama-bf16", src)
    calib_a, calib_b = tmp_path / "a.txt", tmp_path / "b.txt"
    calib_a.write_text("one text " * 50)
    calib_b.write_text("another text " * 50)
    r = recipe.preset("w4a16", 128, "gptq")
    with_calib = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, data=str(calib_a)))
    (tmp_path / "out.partial").mkdir()
    State.open(tmp_path / "out.partial", stream.plan_fingerprint(build(Checkpoint(src), with_calib, 2**30)),
               resume=False)
    calib_a.write_text("the same path, other bytes " * 50)  # the data's bytes count, not only its path
    with pytest.raises(UsageError, match=r"another calibration \(data, samples"):
        stream.run(build(Checkpoint(src), with_calib, 2**30), tmp_path / "out", resume=True)
    other = dataclasses.replace(r, calibration=dataclasses.replace(r.calibration, data=str(calib_b), seed=1))
    State.open(tmp_path / "out.partial", stream.plan_fingerprint(build(Checkpoint(src), other, 2**30)), resume=False)
    (src / "model-00001-of-00001.safetensors").touch()  # same tensors, but not the same file any more
    with pytest.raises(UsageError, match=r"another source \(its files or config\); it cannot"):
        stream.run(build(Checkpoint(src), other, 2**30), tmp_path / "out", resume=True)


def test_tp_that_marlin_cannot_serve_is_refused_before_writing(fixtures_dir):
    r = recipe.load(RECIPES / "glm-w4a16.yaml")
    ckpt = Checkpoint(fixtures_dir / "glm4-moe-bf16")
    assert build(ckpt, r, 2**30).tp_served == [1, 2]  # moe_intermediate 128: 128 / 4 = 32 < 64
    with pytest.raises(UsageError, match=r"--tp 4 .* serves at TP \[1, 2\]"):
        build(ckpt, r, 2**30, tp=4)


def test_inspect_summary_counts_what_the_recipe_touches(fixtures_dir):
    from quantize.tensor_plan import summary

    s = summary(build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), recipe.load(RECIPES / "kimi-k2-w4a16.yaml"), 2**30))
    assert s["architecture"] == "deepseek_v3" and s["model_type"] == "kimi_k2"
    assert s["source_format"] == "fp8-block" and s["mtp_layers"] == [3]
    assert s["quantized_modules_by_kind"] == {"expert": 48}
    assert s["parameters_by_kind"]["expert"] == 2 * 8 * 3 * 128 * 256
    assert 0 < s["output_bytes"] and s["shards"] == 3


def test_a_full_disk_is_a_clear_error_that_keeps_the_finished_shards(fixtures_dir, tmp_path, monkeypatch):
    import errno

    from quantize import writer
    from quantize.errors import QuantizeError

    r = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), r, max_shard_size=2**20)
    stream.run(plan, tmp_path / "clean")
    real, budget = writer.ShardWriter._write, [600_000]  # the disk fills up 600 kB into the output

    def fills_up(self, data):
        budget[0] -= memoryview(data).nbytes
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(writer.ShardWriter, "_write", fills_up)
    with pytest.raises(QuantizeError, match=r"disk full while writing model-\d+-of-\d+\.safetensors; finished shards "
                                            r"are kept in .*out\.partial: free space and rerun with --resume"):
        stream.run(plan, tmp_path / "out")
    partial = tmp_path / "out.partial"
    assert not (tmp_path / "out").exists() and not list(partial.glob("*.tmp"))
    kept = json.loads((partial / "state.json").read_text())["done"]
    assert kept and all((partial / n).is_file() for n in kept)
    monkeypatch.setattr(writer.ShardWriter, "_write", real)
    result = stream.run(plan, tmp_path / "out", resume=True)
    assert result.resumed_shards == len(kept)
    assert {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}


def test_group_size_given_with_a_recipe_overrides_its_int4_group_size(fixtures_dir, tmp_path):
    """`--recipe R --group-size G` quantizes at G (it was silently ignored, R's size written); a recipe whose scheme
    fixes its own size (FP4, FP8 blocks, W4AFP8) refuses an explicit other one."""
    from click.testing import CliRunner

    from quantize.cli import main

    src = fixtures_dir / "llama-bf16"
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "g64"), "--recipe",
                                  str(RECIPES / "dense-w4a16.yaml"), "--group-size", "64"])
    assert r.exit_code == 0, r.output
    group = config_of(tmp_path / "g64")["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["group_size"] == 64
    fp4 = tmp_path / "nvfp4.yaml"
    fp4.write_text("name: nvfp4\nscheme: {num_bits: 4, type: float, strategy: tensor_group, group_size: 16}\n")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "x"), "--recipe", str(fp4), "--group-size", "32"])
    assert r.exit_code == 2 and "fixes its own group size" in r.output and not (tmp_path / "x").exists()


def test_a_command_line_option_cannot_pass_what_the_recipe_file_is_refused_for(fixtures_dir, tmp_path):
    """`--recipe fp8-block.yaml --method gptq` printed a plan, started the layers and ended in a traceback
    (TypeError at `G = n // group_size`, exit 1), while the same recipe with `method: gptq` in its file is refused
    in one line: the options now go through every rule of recipe.from_dict, before anything runs."""
    import yaml
    from click.testing import CliRunner

    from quantize import recipe
    from quantize.cli import main

    f = tmp_path / "fp8-block.yaml"
    f.write_text(yaml.safe_dump(recipe.preset("fp8-block", 128).to_dict()))
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    r = CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), str(tmp_path / "out"), "--recipe",
                                  str(f), "--method", "gptq", "--calib", str(calib)])
    assert r.exit_code == 2, r.output
    assert "FP8 block weights are data-free" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out.partial").exists()
    written = f.read_text().replace("method: rtn", "method: gptq")
    f.write_text(written)
    same = CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), str(tmp_path / "out"), "--recipe",
                                     str(f), "--calib", str(calib)])
    assert same.exit_code == 2 and "FP8 block weights are data-free" in same.output


def test_every_option_combination_gets_the_same_verdict_from_the_file_and_from_the_command_line():
    """method x scheme x group size x kv cache x scale rule, written in the recipe file or given as the command
    line's options over a plain recipe of the same scheme (recipe.with_overrides, what `convert` calls): the same
    verdict either way, and the same recipe when both accept it."""
    import itertools

    from quantize import recipe
    from quantize.errors import UsageError

    def verdict(make, *args):
        try:
            return make(*args)
        except UsageError:
            return "refused"

    checked = refused = 0
    for scheme, group_size in itertools.product(("w4a16", "fp8-block", "w4afp8", "nvfp4", "nvfp4a16", "mxfp4a16"),
                                                (32, 128)):
        base = next((r for m in recipe.METHODS if (r := verdict(recipe.preset, scheme, group_size, m)) != "refused"),
                    None)
        if base is None:  # the scheme fixes another group size (w4afp8 is 128): --group-size's own refusal
            continue
        for method, kv, scales in itertools.product(recipe.METHODS, (None, "fp8"), (None, "hessian")):
            d = {**base.to_dict(), "method": method, "calibration": {"data": "calib.jsonl"}}
            d.pop("gptq", None), d.pop("awq", None)
            if kv:
                d["kv_cache"] = kv
            if scales and method == "gptq":
                d["gptq"] = {"scales": scales}
            written = verdict(recipe.from_dict, d, "the file")
            given = verdict(recipe.with_overrides, base, "the command line", method, {"data": "calib.jsonl"}, kv,
                            scales)
            assert (written == "refused") == (given == "refused"), (scheme, group_size, method, kv, scales)
            if written != "refused":
                assert written.to_dict() == given.to_dict(), (scheme, group_size, method, kv, scales)
            checked += 1
            refused += written == "refused"
    assert checked >= 80 and 0 < refused < checked, (checked, refused)

def test_convert_is_a_library_call_that_reports_through_events_and_raises_for_a_bad_request(fixtures_dir, tmp_path):
    """quantize.convert.convert, as release calls it: no CLI, nothing printed; what a user would see comes through
    Events, the report is returned, and a request that cannot be carried out raises UsageError (exit 2), the same
    refusal as the command line's, before any output exists."""
    from quantize.convert import Events, Options, convert

    lines, done = [], []
    result = convert(str(fixtures_dir / "llama-bf16"), tmp_path / "out", Options(scheme="w4a16", group_size=32),
                     Events(status=lines.append, converted=lambda n, total: done.append((n, total))))
    assert result.report["out"] == str(tmp_path / "out") and result.report["shards"] >= 1
    assert result.stats is None and str(tmp_path / "out") in result.serving  # plain RTN: no calibration stats
    assert (tmp_path / "out" / "config.json").exists() and done and done[-1][0] == done[-1][1] == result.src_bytes
    assert any("w4a16 g32" in line for line in lines)
    with pytest.raises(UsageError, match="FP8 block weights are data-free"):
        convert(str(fixtures_dir / "llama-bf16"), tmp_path / "fp8", Options(scheme="fp8-block", method="gptq",
                                                                            calib=str(tmp_path / "none.txt")))
    assert not (tmp_path / "fp8").exists() and not (tmp_path / "fp8.partial").exists()


def test_json_reports_where_the_time_went_phase_by_phase(fixtures_dir, tmp_path):
    """`--json` carries thread-seconds per phase of the stream engine (quantize/phases.py): the workers' read,
    decode, finite check and quantize, the writer's crc32, sha256 and write and its waits, the background hash
    of the source and the finish. Worker phases fit in the workers' time: at most 2 threads x the wall."""
    from click.testing import CliRunner

    from quantize.cli import main

    r = CliRunner().invoke(main, ["convert", str(fixtures_dir / "kimi-k2-fp8"), str(tmp_path / "o"), "--recipe",
                                  str(RECIPES / "kimi-k2-w4a16.yaml"), "--workers", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    phases = report["phases"]
    assert {"read", "decode", "finite check", "quantize", "crc32", "sha256", "write", "writer waited",
            "source sha256 (background)", "finish (index, manifest, verify)"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and phases["quantize"] > 0 and phases["decode"] > 0
    assert sum(phases[k] for k in ("read", "decode", "finite check", "quantize")) <= 2 * report["seconds"] + 0.5
    cpu = report["phases_cpu"]  # CPU seconds in each: no more than the phase's thread-seconds, none for a wait
    assert set(cpu) == set(phases) and cpu["writer waited"] == 0 and cpu["quantize"] > 0
    assert all(cpu[k] <= phases[k] + 0.05 for k in phases)


def test_a_local_dir_downloads_sha256_is_the_hubs_not_rehashed(fixtures_dir, tmp_path):
    """`hf download --local-dir` records each file's etag (the LFS sha256) in .cache/huggingface/download/NAME.metadata:
    the manifest takes the source's sha256 from there while the file is no newer than the record, and hashes the
    file once it is (the record no longer speaks for it)."""
    import os
    import shutil

    from quantize.hub import hub_sha256
    from quantize.writer import MANIFEST_NAME, sha256_file

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "llama-bf16", src)
    shard = sorted(src.glob("*.safetensors"))[0]
    meta = src / ".cache" / "huggingface" / "download" / f"{shard.name}.metadata"
    meta.parent.mkdir(parents=True)
    recorded = "ab" * 32  # not the file's sha256: taken from the record, the file was not read for it
    meta.write_text(f"{'c' * 40}\n{recorded}\n{shard.stat().st_mtime + 0.5}\n")
    assert hub_sha256(shard) == recorded
    stream.run(build(Checkpoint(src), recipe.load(RECIPES / "dense-w4a16.yaml"), max_shard_size=2**20), tmp_path / "o")
    manifest = json.loads((tmp_path / "o" / MANIFEST_NAME).read_text())
    assert manifest["source"]["files"][shard.name]["sha256"] == recorded
    os.utime(shard, (shard.stat().st_atime, shard.stat().st_mtime + 10))  # modified after the download
    assert hub_sha256(shard) is None and sha256_file(shard) != recorded


def test_shards_written_several_at_once_give_the_same_bytes(fixtures_dir, tmp_path, monkeypatch):
    """Past 8 workers the stream engine writes output shards several at once (tensor_plan.shards_in_flight), on
    the same worker threads: two were in flight at a time here, and every file is the one a single worker
    writes, each shard recorded in the state."""
    import threading

    from quantize import tensor_plan

    def convert(out, workers):
        plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), recipe.load(RECIPES / "kimi-k2-w4a16.yaml"),
                     max_shard_size=2**18)
        stream.run(plan, out, workers=workers)
        return plan

    plan = convert(tmp_path / "one", 1)
    assert len(plan.shards) >= 4 and tensor_plan.shards_in_flight(9, len(plan.shards)) == 2
    assert tensor_plan.shards_in_flight(2, 10) == 1 and tensor_plan.shards_in_flight(64, 3) == 3
    now, most, lock = [0], [0], threading.Lock()
    real = engine_shard.write_shard_pair

    def counted(*a, **k):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return real(*a, **k)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(engine_shard, "write_shard_pair", counted)
    convert(tmp_path / "nine", 9)
    assert most[0] == 2
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "nine").iterdir())
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "nine" / n).read_bytes(), n


def test_workers_auto_is_the_cores_within_memory(fixtures_dir, monkeypatch):
    """--workers auto: one worker a core, fewer where the largest tensors in flight would pass three quarters of
    the free memory, never fewer than one; anything but auto or 1..64 is a usage error."""
    from click.testing import CliRunner

    from quantize import tensor_plan
    from quantize.cli import main

    plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), recipe.load(RECIPES / "kimi-k2-w4a16.yaml"),
                 max_shard_size=2**20)
    need3 = tensor_plan.peak_work_bytes(plan, 3)
    assert tensor_plan.peak_work_bytes(plan, 2) < need3 < tensor_plan.peak_work_bytes(plan, 4)
    monkeypatch.setattr(tensor_plan, "_free_bytes", lambda device: (10**15, "host RAM"))
    assert tensor_plan.auto_workers(plan, "cpu", 6) == 6
    monkeypatch.setattr(tensor_plan, "_free_bytes", lambda device: (need3 * 4 // 3 + 4, "host RAM"))
    assert tensor_plan.auto_workers(plan, "cpu", 6) == 3
    monkeypatch.setattr(tensor_plan, "_free_bytes", lambda device: (1, "host RAM"))
    assert tensor_plan.auto_workers(plan, "cpu", 6) == 1
    for bad in ("0", "65", "many"):
        r = CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), "/tmp/never", "--workers", bad])
        assert r.exit_code == 2 and "expected auto or a whole number from 1 to 64" in r.output, r.output


def test_memory_in_flight_is_counted_by_what_each_tensor_holds(fixtures_dir, monkeypatch):
    """The stream engine's memory account (tensor_plan.work_bytes): a kept tensor holds its bytes (read, then
    written as they are), a banded weight its source, its outputs and one band's temporaries, a whole one its float
    copies. Counted at 10 bytes an element as before, Kimi K2's kept embedding and lm_head (163840 x 7168 bf16,
    2.3 GB each) made 23.5 GB, and a 24 GB machine was refused the RTN of Kimi K2 it can run."""
    from pathlib import Path

    from quantize import tensor_plan
    from quantize.checkpoint import LogicalTensor
    from quantize.safetensors_file import TensorInfo

    plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), recipe.load(RECIPES / "kimi-k2-w4a16.yaml"),
                 max_shard_size=2**20)
    monkeypatch.setattr(tensor_plan, "BAND_ELEMENTS", 256)
    kinds = set()
    for e in plan.entries:
        got = tensor_plan.work_bytes(plan, e)
        if e.action in ("keep", "passthrough"):
            assert got == e.tensor.stored_bytes
            kinds.add("kept")
        elif tensor_plan.band_rows(plan, e, "cpu"):
            assert got == e.tensor.stored_bytes + e.out_bytes + 256 * tensor_plan.WORK_BYTES_PER_ELEMENT
            kinds.add("banded")
        else:
            assert got == math.prod(e.tensor.shape) * tensor_plan.WORK_BYTES_PER_ELEMENT
            kinds.add("whole")
    assert {"kept", "banded"} <= kinds
    shape = (163840, 7168)
    info = TensorInfo("model.embed_tokens.weight", Path("x.safetensors"), "BF16", shape, 0, 2 * shape[0] * shape[1])
    embed = tensor_plan.Entry(LogicalTensor(info.name, shape, "float", {"tensor": info}), plan.entries[0].role,
                              "keep", (TensorSpec(info.name, "BF16", shape),))
    assert tensor_plan.work_bytes(plan, embed) == 2 * 163840 * 7168  # 2.35 GB, not 11.7
