"""A source that contradicts itself is refused before the first write: one line naming the file, the tensor or the
config field, exit 1, no traceback, no OUT, no OUT.partial and no lock left beside them. Each class of source
here once ended in a Python traceback, or in exit 0 with the lie written through to OUT's config."""

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import RECIPES
from safetensors.torch import load_file, save_file

from quantize.cli import main

SHARD3 = "model-00003-of-00003.safetensors"


@pytest.fixture
def kimi(fixtures_dir, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(fixtures_dir / "kimi-k2-fp8", dst)
    return dst


def edit_config(src, **changes):
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is KeyError:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (src / "config.json").write_text(json.dumps(cfg))


def edit_tensor(src, name, make):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = make(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard.name


def not_an_object(src):
    (src / "config.json").write_text("[1, 2, 3]")
    return ["config.json", "expected a JSON object, found list"]


def negative_hidden_size(src):
    edit_config(src, hidden_size=-256)
    return ["hidden_size is -256", "a whole number"]


def layer_count_as_text(src):
    edit_config(src, num_hidden_layers="3")
    return ["num_hidden_layers is '3'"]


def far_more_experts_than_the_shards_hold(src):
    edit_config(src, n_routed_experts=4096)
    return ["n_routed_experts=4096", "hold 8 experts"]


def unknown_dtype(src):
    edit_config(src, torch_dtype="bfloat17")
    return ["torch_dtype is 'bfloat17'", "bfloat16"]


def fp8_block_size_zero(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [0, 0]
    (src / "config.json").write_text(json.dumps(cfg))
    return ["weight_block_size is [0, 0]"]


def quantization_config_that_is_a_list(src):
    edit_config(src, quantization_config=["fp8"])
    return ["quantization_config is list"]


def a_scale_that_does_not_fit_its_weight(src):
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"
    shard = edit_tensor(src, name, lambda t: torch.ones(t.shape[0] + 1, t.shape[1], dtype=t.dtype))
    return [shard, name, "[3, 1]", "needs [2, 1]"]


def a_weight_that_contradicts_the_config(src):
    edit_config(src, moe_intermediate_size=256)  # the experts hold 128
    return ["model.layers.1.mlp.experts.0.gate_proj.weight is [128, 256]", "config.json implies [256, 256]",
            "moe_intermediate_size"]


def a_shard_that_is_a_link_loop(src):
    (src / SHARD3).unlink()
    os.symlink(src / "loop.safetensors", src / SHARD3)
    os.symlink(src / SHARD3, src / "loop.safetensors")
    return [SHARD3, "symbolic link that loops"]


def a_dangling_shard_link(src):
    (src / SHARD3).unlink()
    os.symlink(src / "gone.safetensors", src / SHARD3)
    return [SHARD3, "points nowhere"]


def a_quantization_config_that_lies(src):
    """FP8 blocks claimed for a BF16 checkpoint: converted as BF16 it would be written with no word."""
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({k: (v.float().to(torch.bfloat16) if v.dtype == torch.float8_e4m3fn else v)
                   for k, v in tensors.items() if not k.endswith("weight_scale_inv")}, f, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("weight_scale_inv")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["quantization_config says the weights are fp8-block", "no tensor is stored that way"]


CASES = [not_an_object, negative_hidden_size, layer_count_as_text, far_more_experts_than_the_shards_hold, unknown_dtype,
         fp8_block_size_zero, quantization_config_that_is_a_list, a_scale_that_does_not_fit_its_weight,
         a_weight_that_contradicts_the_config, a_shard_that_is_a_link_loop, a_dangling_shard_link,
         a_quantization_config_that_lies]


@pytest.mark.parametrize("breaks", CASES, ids=[c.__name__ for c in CASES])
def test_a_source_that_contradicts_itself_is_refused_in_one_line(kimi, tmp_path, breaks):
    words = breaks(kimi)
    out = tmp_path / "out"
    for command in (["convert", str(kimi), str(out)], ["inspect", str(kimi)]):
        r = CliRunner().invoke(main, [*command, "--recipe", str(RECIPES / "kimi-k2-w4a16.yaml")])
        assert r.exit_code == 1, (r.output, r.exception)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no traceback
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        for w in words:
            assert w in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT, no OUT.partial, no lock file
