"""The pure tensor functions against compressed-tensors' own implementations, bit for bit."""

import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from quantize.quant import fp8, pack, rtn


def library_compress(w: torch.Tensor, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    args = QuantizationArgs(num_bits=4, group_size=group_size, symmetric=symmetric, strategy="group", type="int")
    scale, zp = compute_dynamic_scales_and_zp(w, args, module=None)
    sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    return PackedQuantizationCompressor.compress(sd, QuantizationScheme(targets=["Linear"], weights=args))


@pytest.mark.parametrize("shape", [(16, 64), (5, 40), (3, 7), (8, 256)])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_pack_int4_matches_compressed_tensors_pack_to_int32(shape, packed_dim):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    ours = pack.pack_int4(q, packed_dim=packed_dim)
    theirs = pack_to_int32(q, 4, packed_dim=packed_dim)
    assert ours.dtype == torch.int32
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_int4_trim(ours, shape, packed_dim), unpack_from_int32(theirs, 4, torch.Size(shape), packed_dim))


def unpack_int4_trim(packed, shape, packed_dim):
    q = pack.unpack_int4(packed, packed_dim=packed_dim)
    return q[: shape[0], : shape[1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_bytes_match_compressed_tensors(dtype, group_size, symmetric):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 256, generator=g) * 0.05).to(dtype)
    w[3, :group_size] = 0  # an all-zero group takes the eps scale path
    w[5, 7] = 4.0  # an outlier widens one group's range
    scale, zp = rtn.group_qparams(w, group_size, symmetric=symmetric)
    q = rtn.quantize_groups(w, scale, zp)
    ref = library_compress(w, group_size, symmetric)
    assert scale.dtype == dtype
    assert torch.equal(scale, ref["weight_scale"])
    assert torch.equal(pack.pack_int4(q), ref["weight_packed"])
    assert torch.equal(torch.tensor(w.shape), ref["weight_shape"])
    if symmetric:
        assert zp is None and "weight_zero_point" not in ref
    else:
        assert torch.equal(pack.pack_int4(zp, packed_dim=0), ref["weight_zero_point"])


def test_fake_quantize_is_a_round_trip_with_bounded_error():
    w = torch.randn(64, 128, dtype=torch.float32)
    fq = rtn.fake_quantize(w, 32)
    scale, _ = rtn.group_qparams(w, 32)
    # RTN error is at most half a step per element
    assert ((w - fq).abs().reshape(64, 4, 32) <= scale.unsqueeze(-1) / 2 + 1e-6).all()
    assert (w - fq).abs().max() > 0


@pytest.mark.parametrize("shape", [(256, 384), (160, 256), (300, 200)])
def test_fp8_block_dequant_matches_compressed_tensors(shape):
    w = torch.randn(shape) * 0.1
    q, scale_inv = fp8.quantize_block(w)
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ours = fp8.dequantize_block(q, scale_inv)
    theirs = FP8BlockDequantizer()._create_dequantized_weight(q, scale_inv)
    assert torch.equal(ours, theirs)
    # e4m3 has 3 mantissa bits: relative error per element at most 2^-4, plus bf16 rounding
    assert ((ours.float() - w).abs() <= w.abs() * 0.07 + 1e-3).all()


def test_fp8_channel_dequant_scales_each_row():
    w = torch.randn(8, 16)
    scale = w.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    out = fp8.dequantize_scaled(q, scale, torch.float32)
    assert torch.allclose(out, w, rtol=0.07, atol=1e-3)
