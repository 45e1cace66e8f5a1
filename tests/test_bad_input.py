"""Bad input: a one-line error that says what to do, exit 2 for usage and 1 for runtime, and no OUT."""

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from quantize.cli import main


def run_cli(*args, env=None):
    result = CliRunner().invoke(main, [str(a) for a in args], env=env)
    return result.exit_code, result.stderr.strip()


def convert(src, out, *extra):
    return run_cli("convert", src, out, "--recipe", RECIPES / "kimi-k2-w4a16.yaml", *extra)


@pytest.fixture
def kimi(fixtures_dir, tmp_path):
    """A private copy of the Kimi FP8 fixture to break."""
    dst = tmp_path / "src"
    shutil.copytree(fixtures_dir / "kimi-k2-fp8", dst)
    return dst


def assert_fails(code, err, expected_code, *words, out=None):
    assert code == expected_code, err
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    if out is not None:
        assert not out.exists() and not out.with_name(out.name + ".partial").exists() or expected_code == 2


def index_of(src):
    return json.loads((src / "model.safetensors.index.json").read_text())


def write_index(src, index):
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_src_is_a_usage_error(tmp_path):
    out = tmp_path / "out"
    code, err = convert(tmp_path / "nope", out)
    assert_fails(code, err, 2, "does not exist", "has no nope")
    assert "Hub" not in err  # an absolute path cannot be a repo id
    assert not out.exists()


def test_repo_id_while_offline_says_to_download_first(tmp_path):
    # a real process: huggingface_hub reads HF_HUB_OFFLINE once, at import
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    p = subprocess.run([sys.executable, "-m", "quantize", "convert", "moonshotai/Kimi-K2-Instruct", str(out), "--recipe",
                        str(RECIPES / "kimi-k2-w4a16.yaml")], env=env, capture_output=True, text=True, timeout=120)
    assert_fails(p.returncode, p.stderr.strip(), 1, "not in the HF cache", "quantize download")
    assert not out.exists()


def test_missing_shard(kimi, tmp_path):
    (kimi / "model-00002-of-00003.safetensors").unlink()
    code, err = convert(kimi, tmp_path / "out")
    assert_fails(code, err, 1, "model-00002-of-00003.safetensors", "missing", out=tmp_path / "out")


def test_weight_without_its_scale(kimi, tmp_path):
    from safetensors.torch import load_file, save_file

    shard = kimi / "model-00003-of-00003.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"  # the scale that lives apart from its weight
    del tensors[name]
    save_file(tensors, shard)
    index = index_of(kimi)
    del index["weight_map"][name]
    write_index(kimi, index)
    code, err = convert(kimi, tmp_path / "out")
    assert_fails(code, err, 1, "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv", out=tmp_path / "out")


@pytest.mark.parametrize("target", ["../elsewhere.safetensors", "/etc/passwd", "link.safetensors"])
def test_index_entry_outside_the_folder(kimi, tmp_path, target):
    if target == "link.safetensors":
        outside = tmp_path / "outside.safetensors"
        shutil.copy(kimi / "model-00001-of-00003.safetensors", outside)
        os.symlink(outside, kimi / target)
    index = index_of(kimi)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = target
    write_index(kimi, index)
    code, err = convert(kimi, tmp_path / "out")
    what = "leaves the checkpoint folder" if target == "link.safetensors" else "outside the checkpoint folder"
    assert_fails(code, err, 1, what,
                 out=tmp_path / "out")


class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('BOOM_MARKER', '/tmp/boom')}",))


def test_pickle_only_weights_are_refused_and_never_loaded(fixtures_dir, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(fixtures_dir / "llama-bf16" / "config.json", src)
    marker = tmp_path / "executed"
    monkeypatch.setenv("BOOM_MARKER", str(marker))
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    code, err = convert(src, tmp_path / "out")
    assert_fails(code, err, 1, "pickle", "pytorch_model.bin", out=tmp_path / "out")
    assert not marker.exists()


def test_group_size_that_does_not_divide_is_a_usage_error(tmp_path):
    import make_fixture

    src = tmp_path / "src"
    make_fixture.build("llama-bf16", src)
    cfg = json.loads((src / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    shard = src / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    for i in range(cfg["num_hidden_layers"]):  # intermediate 512 -> 480: down_proj in_features 480 % 128 != 0
        p = f"model.layers.{i}.mlp."
        tensors[p + "gate_proj.weight"] = tensors[p + "gate_proj.weight"][:480].contiguous()
        tensors[p + "up_proj.weight"] = tensors[p + "up_proj.weight"][:480].contiguous()
        tensors[p + "down_proj.weight"] = tensors[p + "down_proj.weight"][:, :480].contiguous()
    save_file(tensors, shard)
    (src / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 480}))
    out = tmp_path / "out"
    code, err = run_cli("convert", src, out, "--scheme", "w4a16", "--group-size", "128")
    assert_fails(code, err, 2, "group_size 128", "down_proj", "480")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_existing_out_needs_overwrite(fixtures_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, err = convert(fixtures_dir / "kimi-k2-fp8", out)
    assert_fails(code, err, 2, "already exists", "--overwrite")
    assert (out / "keep.txt").read_text() == "precious"


def test_truncated_shard(kimi, tmp_path):
    shard = kimi / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, err = convert(kimi, tmp_path / "out")
    assert_fails(code, err, 1, "model-00001-of-00003.safetensors", "truncated", out=tmp_path / "out")


def test_header_length_past_the_end(kimi, tmp_path):
    shard = kimi / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(data) * 2) + data[8:])
    code, err = convert(kimi, tmp_path / "out")
    assert_fails(code, err, 1, "header length", out=tmp_path / "out")


def test_unknown_architecture_lists_the_supported_ones(kimi, tmp_path):
    """A MoE's config (routed experts) under a model_type no family declares: the supported MoE families, and
    what a family must declare."""
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["model_type"] = "mamba2"
    (kimi / "config.json").write_text(json.dumps(cfg))
    code, err = convert(kimi, tmp_path / "out")
    assert_fails(code, err, 1, "unknown MoE architecture", "expert naming", "kimi_k2", "glm_moe_dsa", "mixtral",
                 "qwen3_moe", out=tmp_path / "out")


def test_config_layer_count_that_disagrees_with_the_weights(kimi, tmp_path):
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (kimi / "config.json").write_text(json.dumps(cfg))
    code, err = convert(kimi, tmp_path / "out")
    assert_fails(code, err, 1, "num_hidden_layers=5", out=tmp_path / "out")


def test_recipe_with_unknown_key(fixtures_dir, tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text((RECIPES / "kimi-k2-w4a16.yaml").read_text() + "\ngroup_sise: 64\n")
    code, err = run_cli("convert", fixtures_dir / "kimi-k2-fp8", tmp_path / "out", "--recipe", bad)
    assert_fails(code, err, 2, "unknown key", "group_sise")


def test_cli_convert_json_and_inspect_json(fixtures_dir, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(fixtures_dir / "glm5-bf16"), str(tmp_path / "o"), "--recipe",
                                       str(RECIPES / "glm-w4a16.yaml"), "--json", "--tp", "2"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tensors"]["quantize"] == 48 and report["tp_served"] == [1, 2]
    result = CliRunner().invoke(main, ["inspect", str(fixtures_dir / "glm5-bf16"), "--recipe", str(RECIPES / "glm-w4a16.yaml"),
                                       "--json"])
    assert result.exit_code == 0, result.stderr
    s = json.loads(result.stdout)
    assert s["architecture"] == "glm_moe_dsa" and s["parameters_by_kind"]["indexer"] > 0


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"])
def test_nonfinite_weights_are_refused_unless_allowed(fixtures_dir, tmp_path, tensor):
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "llama-bf16", src)
    shard = src / index_of(src)["weight_map"][tensor]
    tensors = load_file(shard)
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor].view(-1)[7] = float("nan")
    tensors[tensor].view(-1)[9] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    code, err = run_cli("convert", src, out, "--recipe", RECIPES / "dense-w4a16.yaml")
    assert code == 1, err
    line = err.splitlines()[-1]  # found mid-run: the progress lines come first, the error is one line
    assert line.startswith("error:") and all(w in line for w in (shard.name, tensor, "2 NaN/Inf", "--allow-nonfinite"))
    assert not out.exists()
    code, err = run_cli("convert", src, out, "--recipe", RECIPES / "dense-w4a16.yaml", "--allow-nonfinite", "--overwrite")
    assert code == 0, err
    written = load_file(next(out.glob("*.safetensors")))
    if tensor.endswith("up_proj.weight"):  # quantized: the values became 0, the scales stay finite
        assert torch.isfinite(written[tensor.replace(".weight", ".weight_scale")].float()).all()
    else:  # kept: copied as it is
        assert torch.isnan(written[tensor].float()).sum() == 1 and torch.isinf(written[tensor].float()).sum() == 1


@pytest.mark.parametrize("scheme", ["w4afp8", "nvfp4a16", "mxfp4a16", "fp8-block"])
def test_a_nonfinite_weight_to_quantize_is_refused_under_every_scheme(scheme, fixtures_dir, tmp_path):
    """A weight to quantize is checked on its scales (a group holding a NaN or Inf has a non-finite scale, engine/
    shard.py), MXFP4's, whose power-of-two scales lose a NaN, element by element: refused alike, in one line."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "llama-bf16", src)
    tensor = "model.layers.1.mlp.up_proj.weight"
    shard = src / index_of(src)["weight_map"][tensor]
    tensors = load_file(shard)
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor].view(-1)[7] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    code, err = run_cli("convert", src, tmp_path / "out", "--scheme", scheme)
    assert code == 1, err
    line = err.splitlines()[-1]
    assert line.startswith("error:") and tensor in line and "1 NaN/Inf" in line and not (tmp_path / "out").exists()


def test_a_downloaded_file_is_checked_against_the_hubs_sha256(tmp_path):
    """The HF cache layout: snapshots/<rev>/<file> -> ../../blobs/<etag>; an LFS file's etag is its sha256."""
    import hashlib

    from quantize import hub
    from quantize.errors import QuantizeError

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    weights, small = b"\x01" * 1000, b'{"a": 1}'
    for name, data, etag in (("model.safetensors", weights, hashlib.sha256(weights).hexdigest()),
                             ("config.json", small, hashlib.sha1(small).hexdigest())):
        (blobs / etag).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{etag}")
    assert hub.check_blobs(snap) == 1  # the LFS file; the small file's etag is a git sha1
    blob = (snap / "model.safetensors").resolve()
    blob.write_bytes(b"\x01" * 999 + b"\x00")
    with pytest.raises(QuantizeError, match="model.safetensors: its sha256 differs from the Hub's"):
        hub.check_blobs(snap)


def test_the_hub_token_is_never_printed_or_written(fixtures_dir, tmp_path):
    token = "hf_ThisIsASecretTokenThatMustNotLeak"
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), str(out), "--scheme", "w4a16",
                                  "--group-size", "64", "--json"], env={"HF_TOKEN": token})
    assert r.exit_code == 0, r.output
    assert token not in r.output and token not in r.stderr
    for p in out.iterdir():
        assert token.encode() not in p.read_bytes(), p.name


def test_a_missing_relative_path_is_said_to_be_missing_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    """`fixtures/does-not-exist` where ./fixtures is a folder is a missing path (exit 2, no Hub word); `org/name`
    with no such local folder is read as a Hub repo id, and its error says it is not a local folder either."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fixtures").mkdir()
    code, err = convert("fixtures/does-not-exist", tmp_path / "out")
    assert_fails(code, err, 2, "fixtures/does-not-exist does not exist", "fixtures/ has no does-not-exist")
    assert "Hub" not in err and "download" not in err
    code, err = run_cli("inspect", "nobody/model", env={"HF_HUB_OFFLINE": "1"})
    assert code == 1 and "is not a local folder" in err, err


def test_plan_reads_a_hub_id_from_its_config_alone(tmp_path, monkeypatch):
    """plan SRC with a Hub repo id fetches config.json only (here from an HF cache laid out by hand, offline)."""
    from huggingface_hub import constants

    snap = tmp_path / "hub" / "models--moonshotai--Kimi-K2-Instruct" / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    shutil.copy(RECIPES.parent / "tests" / "data" / "kimi-k2-instruct-config.json", snap / "config.json")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("c" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    r = CliRunner().invoke(main, ["plan", "moonshotai/Kimi-K2-Instruct", "--kv-budget-gib", "44.9", "--json"])
    assert r.exit_code == 0, r.output
    tokens = {(s["weights"].split(" ")[0], s["kv_dtype"]): s["total_tokens"] for s in json.loads(r.stdout)["scenarios"]}
    assert tokens[("source", "bf16")] == 686_062 and tokens[("source", "fp8")] == 1_372_125  # README's Kimi figures
    code, err = run_cli("plan", "nobody/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    assert code == 1 and "not in the HF cache" in err, err


def test_small_usage_errors_are_caught_up_front(kimi, tmp_path):
    code, err = run_cli("verify", tmp_path, "--deep")  # --deep needs the source: a usage error, before any hashing
    assert code == 2 and "--source" in err, err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nscheme: [unclosed\n")
    code, err = convert(kimi, tmp_path / "out", "--recipe", bad)
    assert code == 2 and "\\n" not in err and "line 3" in err, err


def test_piped_plan_output_keeps_every_figure_and_a_recipe_less_convert_says_its_default(fixtures_dir, tmp_path):
    """Rich wraps non-terminal output at 80 columns and cut table cells; a convert with neither --recipe nor
    --scheme used to quantize every Linear at g128 without a word."""
    r = CliRunner().invoke(main, ["plan", str(RECIPES.parent / "tests" / "data" / "glm-5-fp8-config.json"),
                                  "--weights", str(RECIPES / "glm-w4a16.yaml"), "--disaggregated"])
    assert r.exit_code == 0, r.output
    assert "1,332,361" in r.stdout and "713.3 / 91.2" in r.stdout and "…" not in r.stdout
    r = CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "no --recipe or --scheme: every Linear but lm_head becomes w4a16 g128" in r.stderr
