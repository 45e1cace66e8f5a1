"""CUDA runs of the same conversions; each has a CPU twin that checks the same logic at small size."""

import pytest
import torch
from conftest import RECIPES

from quantize import recipe
from quantize.checkpoint import Checkpoint
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
