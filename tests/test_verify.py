"""`quantize verify`: clean outputs pass; flipped bits, tampered tensors, missing scales, NaN scales, stray or
missing files are each found and named."""

import json
import random
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import read_all
from safetensors.torch import load_file, save_file

from quantize.cli import main
from quantize.engine import shard as engine_shard
from quantize.safetensors_file import read_header
from quantize.verify import tensor_crc, verify
from quantize.writer import MANIFEST_NAME, sha256_file


def copy_of(converted, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(converted[kind], dst)
    return dst


def rewrite_shard(folder, shard, change):
    """Rewrite a shard with `change(tensors)` applied and a manifest that agrees with it: only the semantic
    checks can find what changed."""
    tensors = load_file(folder / shard)
    change(tensors)
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["files"][shard] = {"size": (folder / shard).stat().st_size, "sha256": sha256_file(folder / shard)}
    manifest["tensors"] = {t: r for t, r in manifest["tensors"].items() if r["file"] != shard}
    for t, v in tensors.items():
        manifest["tensors"][t] = {"file": shard, "dtype": read_header(folder / shard)[t].dtype, "shape": list(v.shape),
                                  "crc32": tensor_crc(v)}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {t: s for t, s in index["weight_map"].items() if s != shard} | dict.fromkeys(tensors, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    manifest["files"]["model.safetensors.index.json"] = {
        "size": (folder / "model.safetensors.index.json").stat().st_size,
        "sha256": sha256_file(folder / "model.safetensors.index.json")}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def shard_of(folder, tensor):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]


@pytest.mark.parametrize("kind", ["kimi-k2-fp8", "glm4-moe-bf16", "glm5-bf16", "llama-bf16", "kimi-k25-int4"])
def test_a_converted_output_is_clean_and_matches_its_source_deeply(kind, converted, fixtures_dir):
    report = verify(converted[kind], source=fixtures_dir / kind, deep=True)
    assert report.clean, [f.line() for f in report.findings]
    assert report.quantized_modules > 0 and report.deep_checked == report.quantized_modules
    manifest = json.loads((converted[kind] / MANIFEST_NAME).read_text())
    assert set(manifest["tensors"]) == set(read_all(converted[kind]))
    assert {"torch", "safetensors", "compressed-tensors", "transformers"} <= set(manifest["libraries"])
    src_files = manifest["source"]["files"]
    assert all(len(v["sha256"]) == 64 for v in src_files.values()) and "config.json" in src_files


def test_every_flipped_bit_is_found_and_named(converted, tmp_path):
    folder = copy_of(converted, "kimi-k2-fp8", tmp_path)
    files = sorted(p for p in folder.iterdir() if p.name != MANIFEST_NAME)
    assert len([p for p in files if p.suffix == ".safetensors"]) > 1
    rng = random.Random(0)
    trials, named_tensor = 120, 0
    for _ in range(trials):
        path = rng.choice([p for p in files if p.suffix == ".safetensors"] * 3 + files)
        data = bytearray(path.read_bytes())
        pos, bit = rng.randrange(len(data)), 1 << rng.randrange(8)
        data[pos] ^= bit
        path.write_bytes(bytes(data))
        report = verify(folder, workers=2)
        data[pos] ^= bit
        path.write_bytes(bytes(data))
        assert not report.clean, (path.name, pos)
        assert any(f.file == path.name for f in report.findings), [f.line() for f in report.findings]
        named_tensor += any(f.tensor and "crc32" in f.problem for f in report.findings)
    assert named_tensor > trials // 4  # a flip inside tensor data also names the tensor
    assert verify(folder).clean  # every flip was undone


def test_a_missing_scale_and_a_nan_scale_are_found(converted, tmp_path):
    folder = copy_of(converted, "llama-bf16", tmp_path)
    module = "model.layers.0.mlp.down_proj"
    shard = shard_of(folder, f"{module}.weight_scale")
    rewrite_shard(folder, shard, lambda t: t.pop(f"{module}.weight_scale"))
    report = verify(folder)
    assert [f.problem for f in report.findings if f.tensor == module] == ["packed weight without its weight_scale"]

    folder = copy_of(converted, "glm4-moe-bf16", tmp_path / "nan")
    scale = next(t for t in read_all(folder) if t.endswith(".experts.1.up_proj.weight_scale"))

    def poison(t):
        t[scale] = t[scale].clone()
        t[scale][0, 0] = float("nan")
        t[scale][1, 0] = 0

    rewrite_shard(folder, shard_of(folder, scale), poison)
    (finding,) = verify(folder).findings
    assert finding.tensor == scale and finding.problem == "NaN and zero scale(s)"


def test_deep_finds_codes_that_no_longer_match_the_source(converted, fixtures_dir, tmp_path):
    folder = copy_of(converted, "llama-bf16", tmp_path)
    packed = "model.layers.1.self_attn.q_proj.weight_packed"

    def tamper(t):
        t[packed] = t[packed].clone()
        t[packed][3, :4] ^= 0x7777  # four codes in a row move by 7 steps

    rewrite_shard(folder, shard_of(folder, packed), tamper)
    assert verify(folder).clean  # consistent bytes and structure: only the source can tell
    report = verify(folder, source=fixtures_dir / "llama-bf16", deep=True)
    assert [f.tensor for f in report.findings] == ["model.layers.1.self_attn.q_proj"]
    assert "further than half a scale step" in report.findings[0].problem


def test_stray_and_missing_files_and_the_cli_exit_codes(converted, tmp_path):
    folder = copy_of(converted, "glm5-bf16", tmp_path)
    ok = CliRunner().invoke(main, ["verify", str(folder)])
    assert ok.exit_code == 0 and "clean" in ok.output
    (folder / "notes.txt").write_text("x")
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    r = CliRunner().invoke(main, ["verify", str(folder), "--json"])
    assert r.exit_code == 1
    found = {(f["file"], f["problem"]) for f in json.loads(r.output)["findings"]}
    assert ("notes.txt", "not in the manifest") in found
    assert (shard.name, "in the manifest but missing") in found and (shard.name, "named by the index but missing") in found
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "nope")]).exit_code == 1


def test_convert_refuses_to_publish_an_output_that_fails_the_check(fixtures_dir, tmp_path, monkeypatch):
    from quantize import recipe
    from quantize.checkpoint import Checkpoint
    from quantize.engine import stream
    from quantize.errors import QuantizeError
    from quantize.tensor_plan import build

    real = engine_shard.write_shard_pair

    def nan_scales(plan, prefill, index, paths, *a, **k):
        real(plan, prefill, index, paths, *a, **k)
        path = paths[0]
        tensors = load_file(path)
        for t in tensors:
            if t.endswith("weight_scale"):
                tensors[t] = torch.full_like(tensors[t], float("nan"))
        save_file(tensors, path)  # a bug that writes NaN scales, and hashes consistent with what it wrote
        header = read_header(path)
        return (path.stat().st_size, sha256_file(path), {
            t: {"file": path.name, "dtype": header[t].dtype, "shape": list(v.shape), "crc32": tensor_crc(v)}
            for t, v in tensors.items()}), None

    monkeypatch.setattr(engine_shard, "write_shard_pair", nan_scales)
    out = tmp_path / "out"
    plan = build(Checkpoint(fixtures_dir / "llama-bf16"), recipe.preset("w4a16", 64, "rtn"), max_shard_size=2**30)
    with pytest.raises(QuantizeError, match="output check failed.*NaN scale"):
        stream.run(plan, out)
    assert not out.exists() and (tmp_path / "out.partial").is_dir()
