"""The compute dtype follows the device: on a CPU without native bf16 (torch reports AVX2), forwards run in float32,
while what is written keeps the model's dtype and RTN's bytes; the libraries' chatter stays behind --verbose; the
CLI answers --help and path errors without importing torch."""

import json
import logging
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from conftest import RECIPES, read_all
from test_gptq import calibration_samples

from quantize import calib, compute, lmeval, quiet, recipe
from quantize.checkpoint import Checkpoint
from quantize.cli import main
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.tensor_plan import build


@pytest.fixture
def avx2(monkeypatch):
    """This process as on an AMD EPYC that torch reports as AVX2: no native bf16 or fp16."""
    monkeypatch.setattr(compute, "cpu_capability", lambda: "AVX2")


def test_float32_is_chosen_where_bf16_is_not_native(avx2):
    assert not compute.native(torch.bfloat16, "cpu") and not compute.native(torch.float16, "cpu")
    assert compute.choose(torch.bfloat16, "cpu") == torch.float32
    assert compute.choose(torch.float16, "cpu") == torch.float32
    assert compute.choose(torch.bfloat16, "cpu", "model") == torch.bfloat16
    assert compute.choose(torch.bfloat16, "cuda") == torch.bfloat16  # GPUs have bf16 tensor cores
    assert "bfloat16 is slow on this CPU (AVX2)" in compute.describe(torch.bfloat16, torch.float32, "cpu")
    with pytest.raises(ValueError):
        compute.choose(torch.bfloat16, "cpu", "int8")


def test_an_avx512_bf16_cpu_keeps_the_model_dtype(monkeypatch):
    monkeypatch.setattr(compute, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert compute.choose(torch.bfloat16, "cpu") == torch.bfloat16


def test_lm_eval_runs_float32_where_the_checkpoints_dtype_is_slow(fixtures_dir, monkeypatch):
    llama = fixtures_dir / "llama-bf16"
    monkeypatch.setattr(compute, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert lmeval.eval_dtype(llama, "hf", "cpu") == "auto"
    monkeypatch.setattr(compute, "cpu_capability", lambda: "AVX2")
    assert lmeval.eval_dtype(llama, "hf", "cpu") == "float32"
    assert lmeval.eval_dtype(llama, "hf", "cuda:0") == "auto" and lmeval.eval_dtype(llama, "vllm", "cpu") == "auto"
    assert "dtype=float32" in lmeval.model_args("hf", llama, 1, False, "float32")


def gptq_kimi(src, out, data, compute_dtype):
    import dataclasses

    r = recipe.load(RECIPES / "kimi-k2-w4a16.yaml")
    # a minimum no expert reaches: every routed expert falls back to RTN from the weight in its own dtype
    r = dataclasses.replace(r, method="gptq", calibration=dataclasses.replace(
        r.calibration, data=str(data), num_samples=4, seq_len=64, min_expert_tokens=10**9))
    plan = build(Checkpoint(src), r, 2**20)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 4, 64)
    hook = Calibrated(plan, samples, torch.device("cpu"), compute_dtype=compute_dtype)
    try:
        stream.run(plan, out, calibrated=hook)
    finally:
        hook.close()
    return hook


def test_float32_forwards_write_the_model_dtype_and_the_rtn_bytes(fixtures_dir, tmp_path, converted, avx2):
    """Kimi fixture, GPTQ with every routed expert falling back to RTN: float32 forwards (chosen by auto on this
    'AVX2' CPU) and bf16 forwards write the same dtypes and shapes, and the experts' bytes are exactly the stream
    RTN conversion's, which the tests pin to compressed-tensors."""
    data = calibration_samples(tmp_path)
    src = fixtures_dir / "kimi-k2-fp8"
    fp32 = gptq_kimi(src, tmp_path / "fp32", data, "auto")
    bf16 = gptq_kimi(src, tmp_path / "bf16", data, "model")
    assert fp32.compute == torch.float32 and bf16.compute == torch.bfloat16
    a, b, rtn_out = read_all(tmp_path / "fp32"), read_all(tmp_path / "bf16"), read_all(converted["kimi-k2-fp8"])
    assert a.keys() == b.keys() == rtn_out.keys()
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape) == (rtn_out[k].dtype, rtn_out[k].shape), k
        if ".experts." in k:
            assert torch.equal(a[k], rtn_out[k]) and torch.equal(b[k], rtn_out[k]), k
    assert all(a[k].dtype == torch.bfloat16 for k in a if k.endswith("weight_scale"))


def test_convert_reports_the_compute_dtype_and_the_cpu(fixtures_dir, tmp_path, avx2):
    data = calibration_samples(tmp_path, n=8)
    r = CliRunner().invoke(main, ["convert", str(fixtures_dir / "llama-bf16"), str(tmp_path / "o"), "--recipe",
                                  str(RECIPES / "dense-w4a16.yaml"), "--method", "gptq", "--calib", str(data),
                                  "--num-samples", "2", "--seq-len", "32", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    cal = json.loads(r.stdout)["calibration"]
    assert cal["compute_dtype"] == "float32" and cal["cpu_capability"] == "AVX2"
    assert "layer forwards in float32 (bfloat16 is slow on this CPU (AVX2)" in r.stderr


def test_truncations_are_counted_once_and_other_warnings_still_show(caplog):
    lm = logging.getLogger("lm_eval.models.huggingface")
    with caplog.at_level(logging.WARNING), quiet.libraries() as dropped:
        for n in (751, 687):
            lm.warning(f"Combined length of context ({n}) and continuation (1) exceeds model's maximum length (512). "
                       "Truncating 9 tokens from the left.")
        lm.warning("Failed to get model SHA for x")
    assert dropped.truncated == 2 and dropped.max_length == 512
    assert [r.getMessage() for r in caplog.records] == ["Failed to get model SHA for x"]
    with caplog.at_level(logging.WARNING), quiet.libraries(verbose=True) as shown:
        lm.warning("Left truncation applied. Original sequence length was 600")
    assert shown.truncated == 0 and "Left truncation applied" in caplog.records[-1].getMessage()


def test_help_and_path_errors_do_not_import_torch(tmp_path):
    code = ("import sys; from click.testing import CliRunner; from quantize.cli import main; "
            "h = CliRunner().invoke(main, ['--help']); c = CliRunner().invoke(main, ['convert', 'nope', 'out']); "
            "u = CliRunner().invoke(main, ['convert']); "
            "print(h.exit_code, c.exit_code, u.exit_code, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.stdout.split() == ["0", "2", "2", "False"], p.stdout + p.stderr
