"""FP8 e4m3 weights with block scales (DeepSeek V3 / Kimi K2 on-disk format) and with per-channel or
per-tensor scales (compressed-tensors `float-quantized`)."""

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Every e4m3 code as float32: on CPU a table lookup is ~1.7x faster than the element-wise cast, and exact.
_E4M3_TO_F32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def to_float32(w: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as float32, exactly."""
    if w.dtype == torch.float8_e4m3fn and w.device.type == "cpu":
        return _E4M3_TO_F32.take(w.view(torch.uint8).to(torch.int64))
    return w.to(torch.float32)


def _pad_to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = x.shape
    pad_r, pad_c = -rows % block[0], -cols % block[1]
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x


def dequantize_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype=torch.bfloat16
) -> torch.Tensor:
    """fp8 w [out, in] times float32 scale_inv [ceil(out/bh), ceil(in/bw)], in fp32, cast to dtype.

    Edge blocks are padded, as in the DeepSeek reference and compressed-tensors' FP8BlockDequantizer.
    """
    rows, cols = w.shape
    bh, bw = block
    n_r, n_c = -(-rows // bh), -(-cols // bw)
    assert scale_inv.shape == (n_r, n_c), (
        f"block scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(w.shape)} with blocks {block}"
    )
    x = _pad_to_blocks(to_float32(w), block).view(n_r, bh, n_c, bw)
    x = (x * scale_inv.to(torch.float32).view(n_r, 1, n_c, 1)).view(n_r * bh, n_c * bw)
    return x[:rows, :cols].to(dtype)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, r0: int, block: tuple[int, int],
                    dtype=torch.bfloat16) -> torch.Tensor:
    """Rows r0.. of an fp8 weight, its codes given as uint8 [rows, in], under a float32 scale grid whose cell
    (i, j) covers rows i*bh.. and columns j*bw.. (DeepSeek's blocks; (1, in) is one scale a row, (all rows, in)
    one for the tensor), in `dtype`: each block's 256 values (code times the block's scale in float32, cast) are
    a table, and the codes index it. Exactly dequantize_block's and dequantize_scaled's numbers, in one gather
    instead of four passes over float32 (a CPU's cast from fp8 and its int64 index cost more than the math)."""
    rows, cols = codes.shape
    bh, bw = block
    n_c = -(-cols // bw)
    if cols % bw:  # a partial last block: its padding codes (0) index its table like any other
        codes = torch.nn.functional.pad(codes, (0, n_c * bw - cols))
    b0, b1 = r0 // bh, (r0 + rows - 1) // bh + 1
    tables = (_E4M3_TO_F32.to(codes.device)[None] * scale[b0:b1].to(torch.float32).reshape(-1, 1)).to(dtype)
    block_row = torch.arange(r0, r0 + rows, dtype=torch.int32, device=codes.device) // bh - b0
    first = (block_row[:, None] * n_c + torch.arange(n_c, dtype=torch.int32, device=codes.device)[None]) * 256
    index = torch.add(codes.reshape(rows, n_c, bw), first[..., None])  # uint8 + int32: the int32 index, one pass
    return tables.reshape(-1).index_select(0, index.reshape(-1)).view(rows, n_c * bw)[:, :cols]


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Float w [out, in] -> (fp8 e4m3 [out, in], float32 scale_inv [ceil(out/bh), ceil(in/bw)])."""
    rows, cols = w.shape
    bh, bw = block
    n_r, n_c = -(-rows // bh), -(-cols // bw)
    x = _pad_to_blocks(w.to(torch.float32), block).view(n_r, bh, n_c, bw)
    amax = x.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (x / scale_inv.view(n_r, 1, n_c, 1)).clamp(-FP8_MAX, FP8_MAX).view(n_r * bh, n_c * bw)
    return q[:rows, :cols].contiguous().to(torch.float8_e4m3fn), scale_inv


def dequantize_scaled(w: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """fp8 w [out, in] with a per-tensor ([] or [1]) or per-channel ([out, 1]) scale, in fp32, cast to dtype."""
    s = scale.to(torch.float32)
    if s.numel() == 1:
        s = s.reshape(())
    else:
        assert s.shape in ((w.shape[0], 1), (w.shape[0],)), f"scale {tuple(scale.shape)} for weight {tuple(w.shape)}"
        s = s.reshape(w.shape[0], 1)
    return (to_float32(w) * s).to(dtype)


# ---- compressed-tensors FP8_BLOCK (float-quantized): what `quantize convert --scheme fp8-block` writes ------------


def block_grid(shape: tuple[int, ...], block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """Scale shape of a [out, in] weight with [bh, bw] blocks: edge blocks are partial."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def block_scale(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Per-block scale in w.dtype, as compressed-tensors computes it for FP8_BLOCK: max |w| / 448 per block,
    in the weight's dtype (a bf16 model gets bf16 scales), a zero block getting that dtype's eps.

    Padding an edge block with zeros changes nothing: the range always contains 0."""
    n_r, n_c = block_grid(w.shape, block)
    x = _pad_to_blocks(w, block).view(n_r, block[0], n_c, block[1])
    max_abs = x.abs().amax(dim=(1, 3))
    scale = max_abs / torch.tensor(FP8_MAX, dtype=w.dtype, device=w.device)
    eps = torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype, device=w.device)
    return torch.where(scale == 0, eps, scale)


def quantize_with_block_scale(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """fp8 e4m3 codes of w [out, in] under per-block scale [ceil(out/bh), ceil(in/bw)]: w / scale in w.dtype,
    clamped to +-448, then cast (round to nearest even), as compressed-tensors' quantize does."""
    rows, cols = w.shape
    n_r, n_c = block_grid(w.shape, block)
    assert scale.shape == (n_r, n_c), f"block scale {tuple(scale.shape)} does not fit weight {tuple(w.shape)}"
    x = _pad_to_blocks(w, block).view(n_r, block[0], n_c, block[1])
    q = (x / scale.view(n_r, 1, n_c, 1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n_r * block[0], n_c * block[1])[:rows, :cols].contiguous()
