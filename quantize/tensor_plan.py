"""The conversion plan: for every tensor, what happens to it and what it becomes on disk, decided and
validated before a byte is written (group size vs shapes, serving rules, memory)."""

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import psutil
import torch

from quantize import arch, serving
from quantize.arch import layout
from quantize.checkpoint import BANDED, FP4_FORMATS, Checkpoint, LogicalTensor
from quantize.errors import QuantizeError, UsageError
from quantize.quant import fp8, lattice, pack
from quantize.recipe import Recipe
from quantize.safetensors_file import DTYPE_NAMES, TensorSpec, read_tensor

TP_SIZES = (1, 2, 4, 8, 16)
# a whole tensor's decode (fp32) + model-dtype copy + scaled copy + codes + packed, per element
WORK_BYTES_PER_ELEMENT = 4 + 2 + 2 + 1 + 1


@dataclass(frozen=True)
class Entry:
    tensor: LogicalTensor
    role: arch.Role
    action: str  # quantize | passthrough | keep | dequantize | kv_scale (made by the calibrated engine)
    outputs: tuple[TensorSpec, ...]

    @property
    def out_bytes(self) -> int:
        return sum(s.nbytes for s in self.outputs)


@dataclass
class Plan:
    ckpt: Checkpoint
    model: arch.Model
    recipe: Recipe
    entries: list[Entry]
    shards: list[list[Entry]]
    extra_ignore: tuple[str, ...]
    tp_served: list[int]
    warnings: list[str] = field(default_factory=list)
    # NVFP4: each quantized weight an engine fuses with others -> the weights of its set, which share one global
    # scale (fused_sets)
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Calibrated plans (calibrated_layout): each shard's stream (0: all but the routed experts; 1 + g: the routed
    # experts of group g, written by the rank that solves them) and its segment (an index into `segments`, the
    # layer ranges whose shards close together: the unit of resume; None outside the decoder layers). Empty
    # for a stream plan: one stream, no segments.
    shard_streams: list[int] = field(default_factory=list)
    shard_segments: list[int | None] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)
    max_shard_size: int = 0  # what build was given (another rank rebuilds the same layout from it)

    def stream_of(self, shard: int) -> int:
        return self.shard_streams[shard] if self.shard_streams else 0

    def segment_of(self, shard: int) -> int | None:
        return self.shard_segments[shard] if self.shard_segments else None

    @property
    def shard_names(self) -> list[str]:
        n = len(self.shards)
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    @property
    def out_bytes(self) -> int:
        return sum(e.out_bytes for e in self.entries)

    @property
    def src_bytes(self) -> int:
        return sum(e.tensor.stored_bytes for e in self.entries)

    def quantization_config(self) -> dict:
        return self.recipe.quantization_config(self.extra_ignore)

    def counts(self) -> Counter:
        return Counter(e.action for e in self.entries)


def quantized_specs(name: str, shape: tuple[int, ...], recipe: Recipe, scale_dtype: str) -> tuple[TensorSpec, ...]:
    """The tensors that replace `X.weight` [out, in]: pack-quantized INT4 (weight_packed, weight_scale,
    weight_shape), or float-quantized FP8 blocks (weight in e4m3, weight_scale per 128x128 block)."""
    module = name.rpartition(".")[0]
    out_f, in_f = shape
    if recipe.scheme.fp4:  # two e2m1 codes a byte; NVFP4's e4m3 scales under a global scale, MXFP4's e8m0
        packed = TensorSpec(f"{module}.weight_packed", "U8", (out_f, in_f // 2))
        if recipe.scheme.fp4 == "mxfp4":
            return packed, TensorSpec(f"{module}.weight_scale", "U8", (out_f, in_f // recipe.scheme.group_size))
        specs = (packed, TensorSpec(f"{module}.weight_scale", "F8_E4M3", (out_f, in_f // recipe.scheme.group_size)),
                 TensorSpec(f"{module}.weight_global_scale", "F32", (1,)))
        if recipe.scheme.w4a4:  # the activations' global scale (NVFP4 W4A4), measured by calibration
            specs += (TensorSpec(f"{module}.input_global_scale", "F32", (1,)),)
        return specs
    if recipe.scheme.fp8_block:
        grid = fp8.block_grid(shape, tuple(recipe.scheme.block_structure))
        return TensorSpec(name, "F8_E4M3", shape), TensorSpec(f"{module}.weight_scale", scale_dtype, grid)
    g = recipe.scheme.group_size
    specs = [
        TensorSpec(f"{module}.weight_packed", "I32", (out_f, in_f * recipe.scheme.num_bits // 32)),
        TensorSpec(f"{module}.weight_scale", scale_dtype, (out_f, in_f // g)),
        TensorSpec(f"{module}.weight_shape", "I64", (2,)),
    ]
    if not recipe.scheme.symmetric:
        specs.append(TensorSpec(f"{module}.weight_zero_point", "I32", (math.ceil(out_f / 8), in_f // g)))
    return tuple(specs)


# The Linears vLLM and SGLang run as one GEMM, and so with one NVFP4 global scale (vLLM: the max of the parts'
# in CompressedTensorsW4A4Fp4.process_weights_after_loading, the gate's for an expert's w13 in
# CompressedTensorsW4A4Nvfp4MoEMethod.process_weights_after_loading): attention's q/k/v (qkv_proj), MLA's q_a and
# kv_a (DeepSeek-V2's fused_qkv_a_proj, when q_lora_rank is set), and every gate/up pair (gate_up_proj, w13).
FUSED = (("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj"),
         ("w1", "w3"))  # Mixtral's and MiniMax-M2's expert gate and up


def fused_sets(names: list[str]) -> dict[str, tuple[str, ...]]:
    """Each weight name of a complete fused set (FUSED, same module prefix) -> the set's names, in FUSED order."""
    have = set(names)
    out = {}
    for name in names:
        module, _, leaf = name.removesuffix(".weight").rpartition(".")
        for group in FUSED:
            if leaf in group:
                members = tuple(f"{module}.{m}.weight" for m in group)
                if all(m in have for m in members):
                    out[name] = members
    return out


def _same_scheme(ckpt: Checkpoint, recipe: Recipe) -> bool:
    f, s = ckpt.format, recipe.scheme
    if s.fp4:  # the same layout, and for NVFP4 the same activations: W4A4's input scales pass through with it
        return f.kind == f"ct-{s.fp4}" and f.w4a4 == s.w4a4
    if s.fp8_block:
        return f.kind == "ct-fp8" and f.block == tuple(s.block_structure)
    return f.kind == "ct-int4" and (f.num_bits, f.group_size, f.symmetric) == (s.num_bits, s.group_size, s.symmetric)


def moe_tp_ok(model: arch.Model, group_size: int, tp: int) -> bool:
    """vLLM / SGLang Marlin MoE: hidden % 128 == 0 and (moe_intermediate / tp) % max(64, group_size) == 0."""
    inter = model.moe_intermediate_size
    if inter is None or inter % tp:
        return False
    return model.hidden_size % 128 == 0 and (inter // tp) % max(64, group_size) == 0


def attention_tp_ok(model: arch.Model, tp: int) -> bool:
    """vLLM and SGLang split attention by heads: num_attention_heads % tp == 0, and the KV heads split evenly or,
    at tp above their number, replicate (tp % kv_heads == 0); MLA's latent is replicated whole."""
    cfg = model.text_config
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    if not heads or heads % tp:
        return False
    return bool(cfg.get("kv_lora_rank")) or (kv % tp == 0 if kv >= tp else tp % kv == 0)


def dense_tp_ok(entries: list[Entry], group_size: int, tp: int, model: arch.Model | None = None) -> bool:
    """Marlin dense: per-rank out % 64 and in % 128 (in % group_size) for column- and row-parallel Linears.

    A fused Linear stored whole (Phi-3's qkv_proj, gate_up_proj) is split by the engines part by part (vLLM
    QKVParallelLinear / MergedColumnParallelLinear weight_loader with no shard id): qkv_proj's rank holds
    heads / tp query heads and max(1, kv_heads / tp) key and value heads; gate_up_proj's each half / tp."""
    cfg = model.text_config if model is not None else {}
    for e in entries:
        if e.action not in ("quantize", "passthrough") or e.role.kind == "expert":
            continue
        out_f, in_f = e.tensor.shape
        row_parallel = e.role.leaf in ("o_proj", "down_proj")
        if row_parallel:
            if in_f % tp or (in_f // tp) % 128 or (in_f // tp) % group_size or out_f % 64:
                return False
            continue
        if e.role.leaf == "qkv_proj" and cfg.get("num_attention_heads"):
            heads = cfg["num_attention_heads"]
            kv = cfg.get("num_key_value_heads") or heads
            head_dim = out_f // (heads + 2 * kv)
            per_rank = (heads // tp + 2 * max(1, kv // tp)) * head_dim
            if heads % tp or per_rank % 64 or in_f % 128:
                return False
            continue
        if e.role.leaf == "gate_up_proj" and (out_f // 2) % tp:
            return False
        if out_f % tp or (out_f // tp) % 64 or in_f % 128:
            return False
    return True


def fp8_block_tp_ok(model: arch.Model, entries: list[Entry], tp: int, block: int = 128) -> bool:
    """vLLM's validate_fp8_block_shape: at tp > 1 every rank's slice of a block-FP8 Linear starts on a block,
    i.e. in / tp (row-parallel: o_proj, down_proj) or out / tp (column-parallel) is a multiple of 128; fused
    MoE needs moe_intermediate / tp on a block."""
    if tp == 1:
        return True
    for e in entries:
        if e.action not in ("quantize", "passthrough") or serving.REPLICATED.search(e.tensor.name):
            continue
        if e.role.kind == "expert":
            inter = model.moe_intermediate_size
            if inter is None or inter % tp or (inter // tp) % block:
                return False
            continue
        out_f, in_f = e.tensor.shape
        split = in_f if e.role.leaf in ("o_proj", "down_proj") else out_f
        if split % tp or (split // tp) % block:
            return False
    return True


def _extra_ignore(model: arch.Model, names: list[str]) -> tuple[str, ...]:
    """Patterns for what stays float outside the recipe's reach: MTP layers (under both engines' names for the
    draft) and a multimodal wrapper's towers."""
    extra = []
    mtp = sorted({r.layer for r in (model.role(x) for x in names) if r.kind == "mtp"})
    for layer in mtp:
        extra += [p for p in serving.mtp_ignore(model.prefix, layer) if p not in extra]
    if model.prefix:
        towers = sorted({x.split(".", 1)[0] for x in names if not x.startswith(model.prefix)})
        extra += [f"re:{re.escape(t)}\\..*" for t in towers]
    return tuple(extra)


def build(ckpt: Checkpoint, recipe: Recipe, max_shard_size: int, tp: int | None = None, workers: int = 1,
          device: str = "cpu") -> Plan:
    """Decide every tensor's fate and the output shards; raise before anything is written if it cannot work."""
    model = arch.resolve(ckpt.config, list(ckpt.tensors))
    if recipe.method == "awq" and model.arch.no_awq:
        raise UsageError(f"--method awq cannot run on {model.model_type}: {model.arch.no_awq}; use --method gptq "
                         "or rtn")
    layout.check(model, {n: t.shape for n, t in ckpt.tensors.items()}, {n: t.main.path.name for n, t in ckpt.tensors.items()})
    dtype = DTYPE_NAMES[ckpt.dtype]
    g = recipe.scheme.group_size
    entries: list[Entry] = []
    bad_groups: list[str] = []
    warnings: list[str] = []
    passthrough = _same_scheme(ckpt, recipe)
    engine_kept = False
    for name, t in ckpt.tensors.items():
        role = model.role(name, len(t.shape))
        targeted = recipe.targets_module(role.module, role.linear)
        if targeted and serving.keep_float(model.arch.family, role.module, recipe.scheme.fp8_block):
            targeted, engine_kept = False, True
        if targeted:
            if g is not None and t.shape[1] % g:
                bad_groups.append(f"{name} (in_features {t.shape[1]})")
                continue
            if passthrough and t.encoding == ckpt.format.kind:
                specs = tuple(TensorSpec(p.name, p.dtype, p.shape) for p in t.parts.values())
                entries.append(Entry(t, role, "passthrough", specs))
            else:
                entries.append(Entry(t, role, "quantize", quantized_specs(name, t.shape, recipe, dtype)))
        elif t.encoding == "float":
            entries.append(Entry(t, role, "keep", (TensorSpec(name, t.stored_dtype, t.shape),)))
        else:
            entries.append(Entry(t, role, "dequantize", (TensorSpec(name, dtype, t.shape),)))
    if bad_groups:
        raise UsageError(
            f"group_size {g} does not divide in_features of {len(bad_groups)} targeted weight(s), e.g. "
            f"{bad_groups[0]}; choose a group size that divides it or ignore those modules"
        )
    if not any(e.action in ("quantize", "passthrough") for e in entries):
        raise UsageError(
            f"recipe {recipe.name} quantizes nothing in this {model.model_type} checkpoint; check its targets and ignore"
        )
    if ckpt.format.kind == "ct-int4":
        requantized = [e for e in entries if e.tensor.encoding == "ct-int4" and e.action == "quantize"]
        if not passthrough and requantized:
            warnings.append(
                f"source is INT4 {ckpt.format.group_size=} {ckpt.format.symmetric=}; a different scheme dequantizes and "
                "re-quantizes its weights (error compounds)" + _lattice_note(requantized[0], recipe.scheme)
            )
        if any(e.action == "dequantize" and e.tensor.encoding == "ct-int4" for e in entries):
            warnings.append("INT4 source weights the recipe does not target are written back as BF16 (larger)")
    if ckpt.format.kind in FP4_FORMATS.values():
        fmt = "NVFP4" + (" W4A4" if ckpt.format.w4a4 else "A16") if ckpt.format.kind == "ct-nvfp4" else "MXFP4A16"
        if any(e.tensor.encoding == ckpt.format.kind and e.action == "quantize" for e in entries):
            warnings.append(f"source is {fmt}; another scheme dequantizes and re-quantizes its weights (error compounds)")
        if any(e.action == "dequantize" and e.tensor.encoding == ckpt.format.kind for e in entries):
            warnings.append(f"{fmt} source weights the recipe does not target are written back as BF16 (larger)")
    if recipe.method != "rtn" and any(e.action == "passthrough" for e in entries):
        warnings.append(f"source weights already in this scheme are passed through as they are; {recipe.method} "
                        "is applied only to weights that are re-quantized")
    experts_quantized = any(e.role.kind == "expert" and e.action != "keep" for e in entries)
    if recipe.scheme.fp8_block:
        served = [n for n in TP_SIZES if fp8_block_tp_ok(model, entries, n)]
        if ckpt.format.kind in ("fp8-block", "ct-fp8") and not passthrough:
            warnings.append("source is already FP8; re-quantizing its blocks compounds rounding (serve the source "
                            "itself for prefill when its format loads)")
    elif experts_quantized:
        served = [n for n in TP_SIZES if moe_tp_ok(model, g, n)]
    else:
        served = [n for n in TP_SIZES if dense_tp_ok(entries, g, n, model)]
    served = [n for n in served if attention_tp_ok(model, n)]
    if tp is not None and tp not in served:
        if recipe.scheme.fp8_block:
            raise UsageError(f"--tp {tp} cannot serve this FP8 block output: some rank's slice of a Linear would not "
                             f"start on a 128 block; it serves at TP {served or 'none'}")
        if experts_quantized and recipe.scheme.w4afp8:
            inter = model.moe_intermediate_size
            raise UsageError(
                f"--tp {tp} cannot serve this W4AFP8 output: each rank's share of moe_intermediate_size ({inter} / "
                f"{tp} = {inter / tp:g}) must be whole groups of 128 (vLLM's verify_group_size_divides_partition, "
                f"SGLang's W4A8 MoE); it serves at TP {served or 'none'}"
            )
        if experts_quantized:
            inter = model.moe_intermediate_size
            raise UsageError(
                f"--tp {tp} cannot serve this output: Marlin MoE needs hidden_size % 128 == 0 (hidden {model.hidden_size}) "
                f"and (moe_intermediate_size / tp) % max(64, group_size) == 0 ({inter} / {tp} with group {g}); "
                f"it serves at TP {served or 'none'}; pick another --tp or group size"
            )
        warnings.append(f"TP {tp} is outside what Marlin kernels serve for these shapes (TP {served or 'none'})")
    if recipe.kv_cache:
        entries += kv_scale_entries(model, dtype)
    extra = _extra_ignore(model, list(ckpt.tensors))
    if engine_kept:
        extra += serving.engine_ignore(model.arch.family, recipe.scheme.fp8_block)
    if recipe.calibrated:
        # the calibrated engine finishes one layer at a time, the routed experts on the rank that owns them
        entries.sort(key=_layer_order)
        keys = calibrated_keys(entries, max_shard_size, model.n_routed_experts or 0)
        entries = sorted(entries, key=lambda e: keys[e.tensor.name])  # stable: a layer keeps the source's order
        shards, shard_keys = _assign_shards(entries, max_shard_size, [keys[e.tensor.name] for e in entries])
        segments = layer_segments(keys.values(), model.num_hidden_layers)
        starts = [lo for lo, _ in segments]
        plan = Plan(ckpt, model, recipe, entries, shards, extra, served, warnings,
                    shard_streams=[k[1] for k in shard_keys],
                    shard_segments=[starts.index(k[0]) if 0 <= k[0] < POST else None for k in shard_keys],
                    segments=segments, max_shard_size=max_shard_size)
    else:
        plan = Plan(ckpt, model, recipe, entries, _assign_shards(entries, max_shard_size)[0], extra, served, warnings,
                    max_shard_size=max_shard_size)
    if recipe.scheme.fp4 == "nvfp4":
        plan.fused = fused_sets([e.tensor.name for e in entries if e.action == "quantize"])
    check_memory(plan, workers, device)
    return plan


def pair(plan: Plan, prefill: Plan, max_shard_size: int) -> tuple[Plan, Plan]:
    """Two plans over the same source laid out for one pass (engine/stream.py write_shard_pair): the prefill
    plan's entries in the main plan's order and shard i of both holding the same source tensors, each shard
    split where either output would pass max_shard_size (and, for a calibrated plan, never across its streams
    and segments). Entries with no twin (KV scales) never open a shard."""
    assert plan.ckpt is prefill.ckpt, "a pair converts one source"
    twins = {e.tensor.name: e for e in prefill.entries}
    entries = [e for shard in plan.shards for e in shard]
    keys = [(plan.segment_of(i), plan.stream_of(i)) for i, shard in enumerate(plan.shards) for _ in shard]
    size = {e.tensor.name: max(e.out_bytes, twins[e.tensor.name].out_bytes if e.tensor.name in twins else 0)
            for e in entries}
    a, shard_keys = _assign_shards(entries, max_shard_size, keys, lambda e: size[e.tensor.name],
                                   opens=lambda e: e.tensor.name in twins)
    b = [[twins[e.tensor.name] for e in shard if e.tensor.name in twins] for shard in a]
    assert sum(map(len, b)) == len(prefill.entries), "the prefill plan has tensors the main plan does not"
    layout = {}
    if plan.shard_streams:
        layout = dict(shard_streams=[k[1] for k in shard_keys], shard_segments=[k[0] for k in shard_keys],
                      segments=plan.segments)
    return (dataclasses.replace(plan, shards=a, **layout),
            dataclasses.replace(prefill, entries=[e for s in b for e in s], shards=b, **layout))


def kv_scale_entries(model: arch.Model, dtype: str) -> list[Entry]:
    """The K and V scales of every decoder layer, named as the engines read them (serving.kv_scale_names): new
    tensors, [1] in the model dtype, that the calibrated engine measures (quantize/kvcache.py)."""
    out = []
    for i in range(model.num_hidden_layers):
        for name in serving.kv_scale_names(model.prefix, i, bool(model.text_config.get("kv_lora_rank"))):
            t = LogicalTensor(name, (1,), "float", {})
            out.append(Entry(t, model.role(name, 1), "kv_scale", (TensorSpec(name, dtype, (1,)),)))
    return out


def _lattice_note(e: Entry, scheme) -> str:
    """What becomes of a symmetric INT4 source's lattice (quant/lattice.py), read from one weight's codes: on
    -7..7 it was trained for (Kimi K2-Thinking / K2.5 / K2.6), which min/max round to nearest never gives."""
    t = e.tensor
    if "weight_zero_point" in t.parts:
        return ""
    low, high = lattice.codes_range(pack.unpack_int4(read_tensor(t.parts["weight_packed"]))[:, : t.shape[1]])
    trained = " (its codes lie on -7..7: quantization-aware trained, as Kimi K2-Thinking's)" if low >= -7 else ""
    if scheme.fp4:
        return f"; FP4 holds no INT4 lattice{trained}"
    return (f"; its lattice{trained} is kept where a target group of {scheme.group_size} holds it (its source groups "
            "share one scale): those codes and scales stay the source's")


# Where a calibrated plan's entries go: (position, stream). Position -1 is before the decoder layers (the
# embedding), POST after them (norm, lm_head, MTP); a layer's position is its segment's first layer.
POST = 1 << 30


def _layer_order(e: Entry) -> int:
    if e.role.kind == "embedding":
        return -1
    if e.role.layer is not None and e.role.kind != "mtp":
        return e.role.layer
    return POST


def _assign_shards(entries: list[Entry], max_shard_size: int, keys: list | None = None, size=None,
                   opens=None) -> tuple[list[list[Entry]], list]:
    """Consecutive entries into shards of at most max_shard_size (`size(e)`, its output bytes by default; one
    larger entry alone), a new shard wherever the key changes; returns the shards and each one's key. An entry
    with opens(e) false never starts a shard of its own (a pair's KV scales, which have no twin)."""
    size = size or (lambda e: e.out_bytes)
    keys = keys if keys is not None else [None] * len(entries)
    shards: list[list[Entry]] = [[]]
    shard_keys = [keys[0] if keys else None]
    n = 0
    for e, k in zip(entries, keys, strict=True):
        if shards[-1] and (k != shard_keys[-1] or (n + size(e) > max_shard_size and (opens is None or opens(e)))):
            shards.append([])
            shard_keys.append(k)
            n = 0
        shards[-1].append(e)
        n += size(e)
    return shards, shard_keys


def _expert_group(e: Entry, n_experts: int) -> int | None:
    """The group (engine/distributed.GROUPS) of a routed expert's tensor, None for any other."""
    from quantize.engine.distributed import group_of

    if e.role.kind != "expert" or e.role.expert is None or not n_experts:
        return None
    return group_of(e.role.expert, n_experts)


def calibrated_keys(entries: list[Entry], max_shard_size: int, n_experts: int) -> dict[str, tuple[int, int]]:
    """(segment start, stream) of each entry of a calibrated plan, by tensor name (entries in layer order).

    The routed experts of group g are stream 1 + g, everything else stream 0; the rank that solves a group
    writes its stream, rank 0 the rest (engine/writers.py). Segments are runs of consecutive layers in which no
    stream passes max_shard_size (a layer alone may), so every stream's shards break where a segment does, and
    a segment's shards are all finished together: the activations entering a segment are the one layer
    checkpoint that a resume needs (engine/layer_state.py). Shards are laid out the same way for any number of
    ranks, so the output's bytes never depend on it. Before the layers is -1 (the embedding), after them POST."""
    stream = {e.tensor.name: 1 + g if (g := _expert_group(e, n_experts)) is not None else 0 for e in entries}
    by_layer: dict[int, dict[int, int]] = {}
    for e in entries:
        p = _layer_order(e)
        if 0 <= p < POST:
            sizes = by_layer.setdefault(p, {})
            sizes[stream[e.tensor.name]] = sizes.get(stream[e.tensor.name], 0) + e.out_bytes
    start_of: dict[int, int] = {}
    lo, held = None, {}
    for layer, sizes in sorted(by_layer.items()):
        grown = {k: held.get(k, 0) + sizes.get(k, 0) for k in held.keys() | sizes.keys()}
        if lo is None or max(grown.values()) > max_shard_size:
            lo, grown = layer, dict(sizes)
        start_of[layer], held = lo, grown
    out = {}
    for e in entries:
        p = _layer_order(e)
        out[e.tensor.name] = (start_of[p] if 0 <= p < POST else -1 if p < 0 else POST, stream[e.tensor.name])
    return out


def layer_segments(keys, num_layers: int) -> list[tuple[int, int]]:
    """[lo, hi) of each layer segment, from calibrated_keys' segment starts."""
    starts = sorted({k[0] for k in keys if 0 <= k[0] < POST})
    return list(zip(starts, [*starts[1:], num_layers], strict=True))


# One shard's writer thread and its hasher keep up with about this many workers (a worker makes ~0.45 GB/s of FP8
# source into INT4; a hasher takes ~1.8 GB/s of output): more workers write more shards at once.
WORKERS_A_SHARD = 8


def shards_in_flight(workers: int, shards: int | None = None) -> int:
    """Output shards the stream engine writes at once for `workers`, at most the shards left to write."""
    return max(1, min(shards or 1 << 30, -(-workers // WORKERS_A_SHARD)))


def shard_depth(workers: int, in_flight: int) -> int:
    """Tensors a shard has in flight: twice its share of the workers, and one more, so that one is ready whenever
    its writer is and a large tensor holds no worker idle behind it (2 workers: 3 in flight gave 6.1-6.6 s on the
    2.43 GB bench, 5 gave 5.6-5.9 s, at the same peak RSS)."""
    return 2 * -(-workers // in_flight) + 1


# Rows a band (engine/shard.py's _banded converts a large weight a band of rows at a time): about half a million
# elements, whose float temporaries (a few MB) stay in the cache. Whole, a Kimi expert's (2048 x 7168) are 59 MB
# each: above glibc's mmap threshold (32 MB at most), so every one is fresh pages, faulted in one at a time, and
# its conversion ran 4x slower (12 against 2.7 ns an element).
BAND_ELEMENTS = 1 << 19


def band_rows(plan: Plan, e: Entry, device: torch.device | str) -> int:
    """The rows of a band when `e` is converted a band of rows at a time, else 0 (whole): a large 2-D weight on the
    CPU, of an encoding whose rows decode alone, under a scheme whose numbers are made row by row (NVFP4's global
    scale is the whole tensor's, taken over its bands first), and not one of a fused set."""
    t, s = e.tensor, plan.recipe.scheme
    if (torch.device(device).type != "cpu" or e.action not in ("quantize", "dequantize") or len(t.shape) != 2
            or t.encoding not in BANDED):
        return 0
    align = 1
    if e.action == "quantize":
        if t.name in plan.fused or s.w4a4:
            return 0
        if s.fp8_block:
            align = s.block_structure[0]  # a band holds whole blocks
        elif not s.fp4 and not s.symmetric:
            align = 8  # asymmetric zero points pack eight rows an int32
    rows, cols = t.shape
    band = max(align, BAND_ELEMENTS // max(cols, 1) // align * align)
    return band if rows >= 2 * band else 0


def work_bytes(plan: Plan, e: Entry, device: str = "cpu") -> int:
    """Memory one tensor in flight holds: a kept tensor its bytes (read, then written as they are); a banded one
    its source and outputs and one band's float temporaries; a whole one its float copies (WORK_BYTES_PER_ELEMENT)."""
    if e.action in ("keep", "passthrough"):
        return e.tensor.stored_bytes
    if band_rows(plan, e, device):
        return e.tensor.stored_bytes + e.out_bytes + BAND_ELEMENTS * WORK_BYTES_PER_ELEMENT
    return math.prod(e.tensor.shape) * WORK_BYTES_PER_ELEMENT


def peak_work_bytes(plan: Plan, workers: int, device: str = "cpu") -> int:
    """Memory the stream engine needs at once: the largest tensors in flight (each shard in flight's depth, see
    engine/stream.py)."""
    in_flight = shards_in_flight(workers, len(plan.shards))
    sizes = sorted((work_bytes(plan, e, device) for e in plan.entries), reverse=True)
    return sum(sizes[: in_flight * shard_depth(workers, in_flight)])


def auto_workers(plan: Plan, device: str, cores: int) -> int:
    """`--workers auto`: one a core, fewer where the largest tensors in flight would pass three quarters of the
    free memory (of the GPU, with --device cuda); at least one (check_memory then says what does not fit)."""
    free = _free_bytes(device)[0] * 3 // 4
    return next((w for w in range(max(1, cores), 1, -1) if peak_work_bytes(plan, w, device) <= free), 1)


def _free_bytes(device: str) -> tuple[int, str]:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0], device
    return psutil.virtual_memory().available, "host RAM"


def check_memory(plan: Plan, workers: int, device: str) -> None:
    if workers == 0:  # a rank > 0: what its writers hold is in the account every rank agrees on (agreement.py)
        return
    need = peak_work_bytes(plan, workers, device)
    free, where = _free_bytes(device)
    if need > free:
        raise QuantizeError(
            f"converting needs about {need / 2**30:.1f} GiB of {where} for {workers} worker(s) but "
            f"{free / 2**30:.1f} GiB is free; use fewer --workers or free memory"
        )


def parameter_counts(plan: Plan) -> dict[str, int]:
    counts: Counter = Counter()
    for e in plan.entries:
        counts[e.role.kind] += math.prod(e.tensor.shape)
    return dict(counts.most_common())


def summary(plan: Plan) -> dict:
    """What `inspect` reports: architecture, parameters by kind, source format and size, what the recipe does."""
    model, ckpt = plan.model, plan.ckpt
    by_kind: Counter = Counter()
    for e in plan.entries:
        if e.action in ("quantize", "passthrough"):
            by_kind[e.role.kind] += 1
    return {
        "source": str(ckpt.root),
        "architecture": model.arch.family,
        "model_type": model.model_type,
        "num_hidden_layers": model.num_hidden_layers,
        "mtp_layers": sorted({e.role.layer for e in plan.entries if e.role.kind == "mtp"}),
        "hidden_size": model.hidden_size,
        "n_routed_experts": model.n_routed_experts,
        "moe_intermediate_size": model.moe_intermediate_size,
        "source_format": ckpt.format.kind,
        "dtype": DTYPE_NAMES[ckpt.dtype],
        "shards": len(ckpt.shards),
        "bytes_on_disk": ckpt.total_bytes,
        "parameters": sum(parameter_counts(plan).values()),
        "parameters_by_kind": parameter_counts(plan),
        "recipe": plan.recipe.name,
        "scheme": plan.recipe.scheme.label,
        "quantized_modules": sum(by_kind.values()),
        "quantized_modules_by_kind": dict(by_kind),
        "actions": dict(plan.counts()),
        "output_bytes": plan.out_bytes,
        "output_shards": len(plan.shards),
        "tp_served": plan.tp_served,
        "warnings": plan.warnings,
    }
