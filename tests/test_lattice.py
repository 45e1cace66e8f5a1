"""An INT4 source's trained lattice (Kimi K2-Thinking / K2.5 / K2.6: codes -7..7 at group 32) kept where the
target's groups hold it (quant/lattice.py): re-quantized at group 64 or 128, by round to nearest, calibrated
round to nearest or GPTQ with either scale rule, every target group whose source groups share one scale keeps
the source's codes and scale, byte for byte, where min/max would have moved every weight of it."""

import dataclasses
import shutil

import pytest
import torch
from conftest import RECIPES, read_all
from safetensors.torch import load_file, save_file
from test_gptq import calibration_samples

from quantize import calib, recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.quant import codec, lattice, pack, rtn
from quantize.tensor_plan import build
from quantize.verify import verify


def test_steps_hold_the_source_where_its_groups_agree_and_always_inside_one_group():
    s = torch.tensor([[1.0, 1.0, 2.0, 3.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.bfloat16)  # [2, 128 / 32]
    step, held = lattice.steps(s, 128, 64)
    assert held.tolist() == [[True, False], [True, True]]
    assert step.tolist() == [[1.0, 3.0], [0.5, 0.5]]  # elsewhere: the largest source step inside the group
    step, held = lattice.steps(s, 128, 128)
    assert held.tolist() == [[False], [True]] and step.tolist() == [[3.0], [0.5]]
    step, held = lattice.steps(s, 128, 16)  # target groups inside the source's: always held
    assert held.all() and torch.equal(step, s.repeat_interleave(2, dim=1))
    assert lattice.steps(torch.ones(1, 3), 96, 64) is None  # groups of 64 do not tile 96 inputs
    assert lattice.steps(torch.ones(1, 2), 96, 32) is None  # sources groups of 48 and target groups of 32 do not nest


def test_held_steps_give_back_the_source_codes_where_min_max_moves_them():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-7, 8, (64, 256), generator=g, dtype=torch.int8)
    scale = (torch.rand(64, 8, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
    scale[::2] = scale[::2, :1]  # even rows: one scale for all their groups
    w = rtn.dequantize_groups(codes, scale, None).to(torch.bfloat16)
    s = recipe.preset("w4a16", 64).scheme
    held = lattice.steps(scale, 256, 64)
    p = codec.params(s, w, None, held)
    got = codec.rtn_codes(s, w, p)
    assert torch.equal(got[::2], codes[::2]) and torch.equal(p.step[::2], scale[::2, ::2])
    plain = codec.params(s, w)
    assert not torch.equal(codec.rtn_codes(s, w, plain)[::2], codes[::2])  # what min/max would have written


def qat_source(fixtures_dir, tmp_path):
    """The Kimi K2.5 fixture with its routed experts on a trained lattice: codes -7..7, and on every even row
    one scale for the whole row (so groups of 64 and 128 hold its points), other rows a scale per 32."""
    src = tmp_path / "k25-qat"
    shutil.copytree(fixtures_dir / "kimi-k25-int4", src)
    g = torch.Generator().manual_seed(1)
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            module = name[: -len(".weight_packed")]
            out, n = tensors[f"{module}.weight_shape"].tolist()
            codes = torch.randint(-7, 8, (out, n), generator=g, dtype=torch.int8)
            scale = (torch.rand(out, n // 32, generator=g) * 0.004 + 0.002).to(torch.bfloat16)
            scale[::2] = scale[::2, :1]
            tensors[name], tensors[f"{module}.weight_scale"] = pack.pack_int4(codes), scale
        save_file(tensors, f, metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("group_size, method, rule", [(64, "rtn", None), (128, "rtn", "calib"),
                                                      (64, "gptq", "minmax"), (64, "gptq", "hessian")])
def test_a_trained_lattice_stays_where_the_target_groups_hold_it(group_size, method, rule, fixtures_dir, tmp_path):
    src = qat_source(fixtures_dir, tmp_path)
    raw = recipe.load(RECIPES / "kimi-k2-w4a16.yaml").to_dict()
    raw["scheme"] = {**raw["scheme"], "group_size": group_size}
    raw["method"] = method
    r = recipe.from_dict(raw, f"g{group_size}")
    if rule is not None:
        r = dataclasses.replace(r, calibration=dataclasses.replace(
            r.calibration, data=str(calibration_samples(tmp_path)), num_samples=8, seq_len=64, min_expert_tokens=4))
    if method == "gptq":
        r = dataclasses.replace(r, gptq=dataclasses.replace(r.gptq, scales=rule))
    ckpt = Checkpoint(src)
    plan = build(ckpt, r, 2**30)
    assert any("-7..7: quantization-aware trained" in w and "kept where" in w for w in plan.warnings)
    hook = None
    if r.calibrated:
        samples = calib.load_samples(r.calibration.data, calib.load_tokenizer(src), 8, 64)
        hook = Calibrated(plan, samples, torch.device("cpu"))
    stream.run(plan, tmp_path / "out", calibrated=hook)
    source, out = read_all(src), read_all(tmp_path / "out")
    checked = 0
    for name in [n for n in source if n.endswith(".weight_packed")]:
        module = name[: -len(".weight_packed")]
        n = int(source[f"{module}.weight_shape"][1])
        want_codes = pack.unpack_int4(source[name])[::2, :n]
        got_codes = pack.unpack_int4(out[name])[::2, :n]
        assert torch.equal(got_codes, want_codes), module  # the even rows' codes: the source's
        assert torch.equal(out[f"{module}.weight_scale"][::2], source[f"{module}.weight_scale"][::2, ::group_size // 32])
        assert out[f"{module}.weight_scale"].shape[1] == n // group_size
        checked += 1
    assert checked == sum(1 for e in plan.entries if e.action == "quantize")
    assert not verify(tmp_path / "out", deep=True, source=src).findings
