"""What the layerwise engine holds on its compute device, counted before offload is chosen and before the run
starts: a GPU that cannot hold it is refused with the numbers, never an out-of-memory error an hour in.

Per decoder layer, on the device, whatever the offload:
- the layer's weights but the routed experts (GPTQ decodes those a stack at a time);
- the stacks of routed experts solved at once (engine/experts.py: expert_bytes x stack_size, fixed per device);
- the dense Hessians of the layer (all alive until solved) and the solve's working copies of the largest;
- one sample's forward (its hidden states, attention and MLP temporaries; a DSA layer's index scores);
- NCCL's staging of host buffers, a bounded chunk at a time (distributed.STAGE_BYTES), and its communicators'
  buffers (nccl_bytes);
- where a dense layer is tuned after GPTQ (engine/tune.py), the tuning's (TUNE_BYTES_PER_WEIGHT, one step's
  forward, the targets and attention contexts), and in the last tune.HEAD_LAYERS layers the logit head they
  measure through (head_bytes).
With `--offload gpu` also every sample's hidden states, a MoE layer's inputs recorded twice (the calibration
pass and the quantized pass), the routed experts' partial sums (a group's and the total) and a DSA layer's
top-k indices carried to the next layer; with `cpu` or `disk` those live on the host, or in mapped files.
"""

import dataclasses
import math
from dataclasses import dataclass

GIB = 2**30
USABLE = 0.9  # of the free device memory: the allocator's fragmentation and cuBLAS / cuSOLVER workspaces
ROUTER_TOP_K_BYTES = 8 + 4  # per token and slot: the expert index (int64) and its weight (float32), on the host
# One NCCL communicator's buffers, at most: a send and a receive buffer of NCCL_BUFFSIZE (4 MiB by default) on
# each of up to 32 channels (NVLink/NVSwitch machines open that many). An estimate, checked against the peak
# on a GPU by scripts/gpu_check.py.
NCCL_COMM_BYTES = 2 * (4 << 20) * 32


def nccl_bytes(world: int, rank: int) -> int:
    """The communicators a rank holds under NCCL: the world's (broadcasts) and one per peer it exchanges with
    point to point (torch's ProcessGroupNCCL opens a communicator per pair): rank 0 with every rank, each
    other rank with rank 0."""
    if world <= 1:
        return 0
    return NCCL_COMM_BYTES * (1 + (world - 1 if rank == 0 else 1))


@dataclass(frozen=True)
class Layer:
    """One decoder layer as the account sees it: shapes and bytes, nothing loaded."""

    index: int
    weights: int  # its weights but the routed experts GPTQ streams, in the compute dtype
    hessians: tuple[int, ...]  # the input width of each distinct Hessian of its dense GPTQ targets
    stack: int  # bytes of the expert stacks solved at once (0 without routed GPTQ targets)
    moe: bool  # routed experts run outside the layer: their inputs are recorded, their outputs summed
    carry: int  # bytes per token a DSA layer passes to the next (its top-k indices)
    index_heads: int = 0  # a DSA layer's indexer heads: one sample's [heads, seq, seq] float32 scores
    tune: tuple[int, int] = (0, 0)  # (batch, samples) of the tuning after GPTQ (engine/tune.py); (0, 0): none
    head: int = 0  # bytes of the model's end the last layers' tuning measures its error through (tune.Head)


# The tuning's bytes per weight of a tuned layer: GPTQ's values before rounding, the offset and its gradient (float32
# each), the rounded values autograd keeps for the scale's gradient and the clamp's (float32), the weight rebuilt
# in the compute dtype (2 more); on FP4's e2m1 grid also the spacing the offset is counted in (float32, kept for the
# offset's gradient) and the clamp's mask (1 byte); on MXFP4, which starts from round to nearest, GPTQ's weights in
# the compute dtype, whose error the tuning must beat (2 more). Counted for every scheme (INT4 overcounts by 7) and
# every weight of the layer (attention's inputs a recipe keeps as solved only hold their dequantized weight, 2)
TUNE_BYTES_PER_WEIGHT = 29


@dataclass(frozen=True)
class Account:
    device: str
    offload: str
    layer: int
    parts: dict[str, int]  # what is on the device, by part
    free: int

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        unit, size = ("GiB", GIB) if self.total >= GIB // 2 else ("MiB", 2**20)  # a small model's parts in MiB
        parts = ", ".join(f"{k} {v / size:.1f}" for k, v in self.parts.items() if v >= self.total // 50)
        where = {"gpu": "on the GPU", "cpu": "in host memory", "disk": "in mapped files"}[self.offload]
        return (f"{self.device}: {self.total / size:.1f} {unit} of {self.free / GIB:.1f} GiB free for layer "
                f"{self.layer}, activations {where} ({parts} {unit})")


def layer_parts(layer: Layer, tokens: int, seq_len: int, hidden: int, itemsize: int, resident: bool,
                stage_bytes: int, comm_bytes: int = 0) -> dict[str, int]:
    """Bytes on the compute device for one layer, by part (the module docstring says what each is); resident:
    the activations are on the device too (offload gpu, or a CPU device, whose memory is the host's)."""
    hessians = sum(4 * n * n for n in layer.hessians)
    largest = max(layer.hessians, default=0)
    forward = 12 * seq_len * hidden * itemsize + layer.index_heads * seq_len * seq_len * 4
    parts = {"layer weights": layer.weights, "expert stack": layer.stack,
             "dense Hessians": hessians + 2 * 4 * largest * largest, "one sample's forward": forward,
             "staging": stage_bytes, "NCCL communicators": comm_bytes}
    batch, samples = layer.tune
    if batch:  # one step's forward kept for its backward, the float path's targets of the tuned samples, and their
        # attention contexts (engine/attention_cache.py: o_proj's inputs, counted at the widest input's width), and
        # the judged samples' outputs held until the tuning is judged (tune.tune_layer's emit)
        from quantize.engine.tune import JUDGED

        widest = max(layer.hessians, default=hidden)
        parts["tuning"] = (layer.weights // itemsize * TUNE_BYTES_PER_WEIGHT
                           + batch * seq_len * (12 * hidden + 6 * widest) * itemsize
                           + samples * seq_len * (2 * hidden + widest) * itemsize
                           + min(samples, JUDGED) * seq_len * hidden * itemsize)
        parts["logit head"] = layer.head
    if resident:
        act = tokens * hidden * itemsize
        parts |= {"hidden states": act, "MoE inputs (2 passes)": 2 * act if layer.moe else 0,
                  "routed sums": 2 * act if layer.moe else 0, "top-k carry": tokens * layer.carry}
    return parts


def account(layers: list[Layer], tokens: int, seq_len: int, hidden: int, itemsize: int, offload: str, device: str,
            free: int, stage_bytes: int, comm_bytes: int = 0) -> Account:
    """The largest layer's need under `offload`."""
    best = None
    resident = offload == "gpu" or (offload == "cpu" and not device.startswith("cuda"))
    for layer in layers:
        parts = layer_parts(layer, tokens, seq_len, hidden, itemsize, resident, stage_bytes, comm_bytes)
        if best is None or sum(parts.values()) > sum(best[1].values()):
            best = (layer.index, parts)
    index, parts = best if best else (0, {})
    return Account(device, offload, index, parts, free)


def host_bytes(layers: list[Layer], tokens: int, hidden: int, itemsize: int) -> int:
    """What `cpu` offload keeps in host memory: the activations the device would otherwise hold."""
    moe = any(x.moe for x in layers)
    carry = max((x.carry for x in layers), default=0)
    return tokens * hidden * itemsize * (1 + (4 if moe else 0)) + tokens * carry


def fits(a: Account) -> bool:
    return a.total <= USABLE * a.free


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def refusal(a: Account) -> str:
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in a.parts.items() if v >= GIB // 20)
    fix = "pass --offload cpu (activations in host memory), or" if a.offload == "gpu" else ""
    return (f"layer {a.layer} needs {gib(a.total)} on {a.device} with activations offloaded to {a.offload} ({parts} "
            f"GiB) but {gib(a.free)} is free ({USABLE:.0%} of it usable); {fix} use a device with more memory or "
            "free some").replace(";  use", "; use")


def hessian_widths(targets: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """The distinct Hessians GPTQ builds for a layer's dense targets: one per parent module and input width
    (q/k/v share one, gate/up share one, MLA's q_a and kv_a read the same hidden states)."""
    return tuple(sorted({(name.rsplit(".", 2)[0], shape[1]): shape[1] for name, shape in targets}.values()))


def head_bytes(vocab: int, hidden: int, itemsize: int) -> int:
    """What tune.Head holds for one of the last layers' tuning: lm_head's weight in the compute dtype and in
    float32, the Fisher information and its running sum (float32), and one chunk of tokens' probabilities over the
    vocabulary with the product that sums them."""
    from quantize.engine.tune import HEAD_CHUNK

    return vocab * hidden * (itemsize + 4) + 2 * 4 * hidden * hidden + 4 * vocab * (2 * HEAD_CHUNK + 1)


def layers_of(entries, itemsize: int, stack_of, gptq: bool, carry: int = 0, index_heads: int = 0,
              tune: tuple[int, int] = (0, 0), grid: str | None = None) -> list[Layer]:
    """The decoder layers of a plan's entries (anything with tensor.name, tensor.shape, role and action). Under
    GPTQ a layer whose routed experts are targets streams them (`stack_of(inter, hidden)`: the bytes of its
    stacks); otherwise they are built into the layer with its other weights. Under the scheme's `grid` the layers
    whose tuning is measured through the logits (tune.on_logits, where tuned) also hold the logit head (head_bytes)
    of lm_head's vocabulary (or the embedding's it is tied to)."""
    by_layer: dict[int, list] = {}
    for e in entries:
        if e.role.layer is not None and e.role.kind != "mtp":
            by_layer.setdefault(e.role.layer, []).append(e)
    out = []
    for i, es in sorted(by_layer.items()):
        gate = next((e for e in es if e.role.kind == "expert" and e.action == "quantize"
                     and e.tensor.name.endswith("gate_proj.weight")), None)
        streamed = gptq and gate is not None
        weights = sum(math.prod(e.tensor.shape) * itemsize for e in es if not (streamed and e.role.kind == "expert"))
        dense = [(e.tensor.name, tuple(e.tensor.shape)) for e in es
                 if gptq and e.action == "quantize" and e.role.kind != "expert" and len(e.tensor.shape) == 2]
        out.append(Layer(i, weights, hessian_widths(dense), stack_of(*gate.tensor.shape) if streamed else 0, streamed,
                         carry, index_heads, tune if dense and gate is None else (0, 0)))
    ends = [e.tensor.shape for e in entries if e.role.layer is None and len(e.tensor.shape) == 2
            and e.tensor.name.endswith(("lm_head.weight", "embed_tokens.weight"))]
    if grid is not None and ends:
        from quantize.engine.tune import on_logits

        layers = out[-1].index + 1 if out else 0
        out = [dataclasses.replace(x, head=head_bytes(*max(ends), itemsize))
               if x.tune[0] and on_logits(x.index, layers, grid) else x for x in out]
    return out
