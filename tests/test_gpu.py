"""CUDA runs of the same conversions; each has a CPU twin that checks the same logic at small size."""

import pytest
import torch
from conftest import RECIPES

from quantize import recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import shard as engine_shard
from quantize.engine import stream
from quantize.tensor_plan import build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_conversion_is_byte_identical_to_cpu(fixtures_dir, converted, tmp_path):
    """CPU twin: test_convert.py::test_kimi_fp8_output_is_byte_identical_to_compressed_tensors (same fixture,
    same recipe, same shard size); on CUDA the bytes must equal the CPU output file for file."""
    plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), recipe.load(RECIPES / "kimi-k2-w4a16.yaml"),
                 max_shard_size=2**20, device="cuda")
    stream.run(plan, tmp_path / "cuda", device="cuda")
    cpu = converted["kimi-k2-fp8"]
    files = sorted(p.name for p in cpu.glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "cuda").glob("*.safetensors"))
    for f in files:
        assert (cpu / f).read_bytes() == (tmp_path / "cuda" / f).read_bytes(), f


def test_cuda_fp8_block_conversion_is_byte_identical_to_cpu(fixtures_dir, tmp_path):
    """CPU twin: test_fp8_block.py::test_fp8_block_output_is_byte_identical_to_model_free_ptq (the same math
    against compressed-tensors and llm-compressor); on CUDA the FP8 blocks and scales must be the CPU's bytes."""
    outs = {}
    for device in ("cpu", "cuda"):
        plan = build(Checkpoint(fixtures_dir / "glm4-moe-bf16"), recipe.preset("fp8-block", 128), 2**20, device=device)
        stream.run(plan, tmp_path / device, device=device)
        outs[device] = sorted((tmp_path / device).glob("*.safetensors"))
    assert [p.name for p in outs["cpu"]] == [p.name for p in outs["cuda"]]
    for a, b in zip(outs["cpu"], outs["cuda"], strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_cuda_batched_expert_solve_is_deterministic_and_agrees_with_the_cpu():
    """CPU twin: test_gptq.py::test_a_batched_solve_of_experts_gives_each_experts_solo_codes. On CUDA a stack's
    codes must repeat exactly (the engine always solves an expert in the same stack: experts._chunks) and agree
    with the CPU's but for rare rounding ties (cuSOLVER and MKL factor in another order)."""
    from quantize.quant import gptq, rtn

    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 512, 1024, generator=g) * 0.05
    X = torch.randn(8, 2048, 1024, generator=g)
    H = torch.einsum("eni,enj->eij", X, X)
    scale = torch.stack([rtn.group_qparams(w, 32)[0] for w in W])
    cpu = gptq.gptq_quantize_batched(W, H.clone(), scale)[0]
    runs = [gptq.gptq_quantize_batched(W.cuda(), H.cuda(), scale.cuda())[0].cpu() for _ in range(2)]
    assert torch.equal(*runs)
    assert (runs[0] == cpu).float().mean() > 0.999


def _calibrated(fixtures_dir, tmp_path, kind, out, method="gptq", offload="auto", device="cuda", recipe_name=None,
                scheme=None, kv=None, resume=False):
    """A calibrated conversion on `device` (8 samples of 64 tokens), verified; its shard bytes."""
    import dataclasses

    from test_gptq import calibration_samples

    from quantize import calib
    from quantize.engine import devices
    from quantize.engine.layerwise import Calibrated
    from quantize.verify import verify

    data = calibration_samples(tmp_path, n=16)
    r = recipe.load(RECIPES / f"{recipe_name}.yaml") if recipe_name else recipe.preset(scheme, 128, method)
    r = dataclasses.replace(r, method=method, kv_cache=kv, calibration=dataclasses.replace(
        r.calibration, data=str(data), num_samples=8, seq_len=64))
    src = fixtures_dir / kind
    plan = build(Checkpoint(src), r, 2**18, device=device)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 8, 64)
    devices.bind(device)
    hook = Calibrated(plan, samples, torch.device(device), offload)
    try:
        stream.run(plan, out, device=device, calibrated=hook, resume=resume)
    finally:
        hook.close()
        devices.bind("cpu")
    assert verify(out).clean
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


RELEASES = [("kimi-k2-fp8", "kimi-k2-w4a16"), ("glm4-moe-bf16", "glm-w4a16"), ("glm5-bf16", "glm-w4a16"),
            ("llama-bf16", "dense-w4a16")]


@pytest.mark.parametrize("kind, recipe_name", RELEASES)
def test_cuda_gptq_repeats_its_bytes_under_every_offload(kind, recipe_name, fixtures_dir, tmp_path):
    """CPU twin: test_gptq.py::test_gptq_conversion_is_deterministic_and_offload_does_not_change_bytes. On the GPU
    the activations, the MoE inputs, the routed sums and GLM-5's carry move between device, host and files."""
    runs = [_calibrated(fixtures_dir, tmp_path, kind, tmp_path / name, offload=off, recipe_name=recipe_name)
            for name, off in (("a", "gpu"), ("b", "gpu"), ("c", "cpu"), ("d", "disk"))]
    assert all(r == runs[0] for r in runs[1:])


@pytest.mark.parametrize("method, scheme, kv", [("awq", "w4a16", None), ("gptq", "nvfp4a16", None),
                                                ("gptq", "nvfp4", None), ("gptq", "mxfp4a16", None),
                                                ("gptq", "w4a16", "fp8")])
def test_cuda_awq_fp4_and_kv_scales_repeat_their_bytes(method, scheme, kv, fixtures_dir, tmp_path):
    """CPU twins: test_awq.py, test_fp4_gptq.py and test_kvcache.py on the same fixture and recipes."""
    a = _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "a", method=method, scheme=scheme, kv=kv)
    b = _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "b", method=method, scheme=scheme, kv=kv)
    assert a == b


def test_cuda_codes_do_not_follow_tf32(fixtures_dir, tmp_path):
    """CPU twin: test_gptq.py::test_codes_do_not_follow_the_process_wide_matmul_precision."""
    ref = _calibrated(fixtures_dir, tmp_path, "llama-bf16", tmp_path / "ieee", recipe_name="dense-w4a16")
    torch.set_float32_matmul_precision("high")  # TF32 in cuBLAS, as TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 sets it
    try:
        got = _calibrated(fixtures_dir, tmp_path, "llama-bf16", tmp_path / "tf32", recipe_name="dense-w4a16")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert got == ref


def test_cuda_resume_after_a_failure_gives_the_uninterrupted_bytes(fixtures_dir, tmp_path, monkeypatch):
    """CPU twin: test_gptq.py::test_gptq_resume_after_a_failure_gives_the_uninterrupted_bytes."""
    clean = _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "clean", recipe_name="kimi-k2-w4a16")
    real, calls = engine_shard.write_shard_pair, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "I/O error")
        return real(*a, **k)

    monkeypatch.setattr(engine_shard, "write_shard_pair", dying)
    with pytest.raises(OSError):
        _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "out", recipe_name="kimi-k2-w4a16")
    monkeypatch.setattr(engine_shard, "write_shard_pair", real)
    resumed = _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "out", recipe_name="kimi-k2-w4a16",
                          resume=True)
    assert resumed == clean


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_cuda_one_gives_the_bytes_of_cuda_zero(fixtures_dir, tmp_path):
    """CPU twin: test_devices.py::test_every_thread_the_engine_starts_computes_and_stages_on_the_ranks_gpu."""
    a = _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "a", device="cuda:0", recipe_name="kimi-k2-w4a16")
    b = _calibrated(fixtures_dir, tmp_path, "kimi-k2-fp8", tmp_path / "b", device="cuda:1", recipe_name="kimi-k2-w4a16")
    assert a == b


def test_cuda_cholesky_flags_a_broken_hessian_in_a_stack():
    """CPU twin: test_gptq.py::test_singular_hessian_falls_back_to_rtn. cuSOLVER's batched potrf reports each
    matrix's failure: a non-positive-definite and a NaN Hessian fall back to RTN, the good one is its solo solve."""
    from quantize.quant import gptq, rtn

    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 256, 512, generator=g) * 0.05
    X = torch.randn(3, 1024, 512, generator=g)
    H = torch.einsum("eni,enj->eij", X, X)
    H[1] = -torch.eye(512)
    H[2, 3, 5] = float("nan")
    scale = torch.stack([rtn.group_qparams(w, 32)[0] for w in W])
    codes, fallback = gptq.gptq_quantize_batched(W.cuda(), H.cuda(), scale.cuda())
    assert fallback.tolist() == [False, True, True]
    for e in (1, 2):
        assert torch.equal(codes[e].cpu(), rtn.quantize_groups(W[e], scale[e]))
    assert torch.equal(codes[0], gptq.gptq_quantize(W[0].cuda(), H[0].clone().cuda(), scale[0].cuda())[0])
