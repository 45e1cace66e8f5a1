"""An INT4 source's lattice, kept where the target's groups hold it.

Moonshot's Kimi K2-Thinking, K2.5 and K2.6 ship their routed experts as symmetric INT4 at group 32, trained for
it (quantization-aware training on the codes -7..7): each weight is code x scale of its group, and the model
was trained to answer well on exactly those points. Re-quantizing them at another group size decodes them to
bf16, and a scale from min/max (max|w| / 7.5) would move every weight of a group off its trained point, even
where the target grid holds the source's points exactly. A target group holds them when every source group
inside it has the same scale (or, for a target group inside a source group, always): its step is then that
scale, and round to nearest gives back the source's codes. Such groups are fixed: no scale search and no other
rule may move them. Elsewhere (source groups of unequal scale under one target group) no target step holds
both lattices, and the largest of the source scales, which keeps its own group's points, is a candidate of
the search.

FP4 targets hold no INT4 lattice (e2m1 has no 5 or 7): they quantize the decoded weights as any float source.
"""

import torch


def steps(source_scale: torch.Tensor, in_features: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(step, held) per target group [out, in_features / group_size] for a source whose symmetric INT4 scale is
    source_scale [out, in_features / source group]: where `held`, the source's scale (round to nearest under it
    gives back the source's codes); elsewhere the largest source scale inside the target group. None when the
    two group sizes do not nest (neither divides the other)."""
    out, n_src = source_scale.shape
    src_group = in_features // n_src
    if in_features % group_size or in_features % n_src:
        return None
    if group_size % src_group == 0:  # target groups of whole source groups: held where their scales agree
        sub = source_scale.reshape(out, in_features // group_size, group_size // src_group)
        return sub.amax(-1), (sub == sub[..., :1]).all(-1)
    if src_group % group_size == 0:  # each target group inside one source group: always held
        step = source_scale.repeat_interleave(src_group // group_size, dim=1)
        return step, torch.ones_like(step, dtype=torch.bool)
    return None


def codes_range(codes: torch.Tensor) -> tuple[int, int]:
    """The least and the largest code of an INT4 tensor: (-7, 7) or inside it on a quantization-aware trained
    lattice (Kimi K2-Thinking's), where min/max round to nearest also uses -8."""
    return int(codes.min()), int(codes.max())
