"""INT4 codes to and from the int32 layout of compressed-tensors `pack-quantized`.

Eight consecutive columns share one int32: column i of a word sits in bits 4i..4i+3, stored as q + 8.
Building the words as bytes (two nibbles each) and viewing them as little-endian int32 gives exactly that
layout with a quarter of the integer work of shifting int32 lanes.
"""

import sys

import torch

assert sys.byteorder == "little", "the packed layout is defined on little-endian int32"


def pack_int4(q: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """q: int8 in [-8, 7], [rows, cols] -> int32 [rows, ceil(cols / 8)] (packed_dim=1) or
    [ceil(rows / 8), cols] (packed_dim=0, the layout of asymmetric zero points). A partial last word is
    filled with zero bits, as compressed-tensors pads."""
    assert q.dtype == torch.int8 and q.ndim == 2, f"expected 2-D int8 codes, got {q.dtype} {tuple(q.shape)}"
    if packed_dim == 0:
        return pack_int4(q.t().contiguous()).t().contiguous()
    rows, cols = q.shape
    u = (q + 8).to(torch.uint8)
    if cols % 8:
        u = torch.nn.functional.pad(u, (0, -cols % 8))
    # two codes a byte: as little-endian int16 a pair is lo + 256 * hi, and (v | v >> 4) holds lo + 16 * hi in its
    # low byte, which the cast keeps: three contiguous passes over half the elements, no strided ones
    v = u.view(torch.int16)
    return (v | (v >> 4)).to(torch.uint8).view(torch.int32)


def unpack_int4(packed: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int4: int32 [rows, cols / 8] -> int8 [rows, cols] in [-8, 7]."""
    assert packed.dtype == torch.int32 and packed.ndim == 2
    if packed_dim == 0:
        return unpack_int4(packed.t().contiguous()).t().contiguous()
    rows = packed.shape[0]
    b = packed.contiguous().view(torch.uint8)
    nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(rows, -1)
    return nibbles.to(torch.int8) - 8
