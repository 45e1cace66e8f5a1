"""The layerwise engine: GPTQ or AWQ one decoder layer at a time, never the whole model.

Calibration tokens are embedded once; then for each decoder layer in order the layer is built from the
architecture's transformers class (meta init, then only this layer's weights, decoded from the source
format), the calibration batch runs through it while the inputs of every targeted Linear are accumulated
into Hessians, the Linears are quantized, and the batch runs again through the quantized layer to give the
next layer its inputs (GPTQ's error propagation). Routed experts are unfused into per-expert Linears; their
inputs are recorded with the router's choice and each expert is quantized on its own, so only one expert's
Hessian is ever held. Activations stay on the compute device, in host memory or in memory-mapped files.
"""

import ctypes
import ctypes.util
import math
import re
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import psutil
import torch
from torch import nn

from quantize import compute, kvcache, serving
from quantize.engine.layer_state import CALIB_DIR, LayerCheckpoint, Resume, samples_key
from quantize.errors import QuantizeError
from quantize.quant import awq, gptq, pack, rtn
from quantize.tensor_plan import Entry, Plan


def _libc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Hand memory freed by torch back to the OS. glibc keeps freed mid-sized blocks in its heap, and the many
    short-lived GPTQ buffers of varied sizes fragment it: without this, resident memory grows by ~100 MB over
    the first layers of even a 135M model and never comes back."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class ActivationStore:
    """One tensor per calibration sample, kept where the engine decided: gpu, cpu or disk (memory-mapped)."""

    def __init__(self, kind: str, device: torch.device, folder: Path | None = None):
        self.kind, self.device, self.folder = kind, device, folder
        self.items: list = []

    def append(self, t: torch.Tensor) -> None:
        self.items.append(None)
        self[len(self.items) - 1] = t

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        """Store t as sample i; a layer's output replaces its input, so one copy of the activations is held."""
        old = self.items[i]
        if isinstance(old, torch.Tensor) and (old.dtype, old.shape) == (t.dtype, t.shape):
            # written into the input's memory: a fresh tensor per sample would hold all the old ones until the
            # allocator reuses them (+70% of the activations in layer 0's pass, measured), and re-pin each one
            old.copy_(t.detach())
        elif self.kind == "gpu":
            self.items[i] = t.detach()
        elif self.kind == "cpu":
            cpu = t.detach().to("cpu")
            self.items[i] = cpu.pin_memory() if self.device.type == "cuda" else cpu
        elif self.items[i] is not None and self.items[i][1:] == (t.dtype, tuple(t.shape)):
            self._mapped(self.items[i]).copy_(t.detach())  # same file, rewritten through its mapping
        else:
            path = self.folder / f"{id(self)}-{i}.bin"
            t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tofile(path)
            self.items[i] = (path, t.dtype, tuple(t.shape))

    @staticmethod
    def _mapped(item) -> torch.Tensor:
        path, dtype, shape = item
        return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)

    def __getitem__(self, i: int) -> torch.Tensor:
        item = self.items[i]
        if self.kind == "disk":
            item = self._mapped(item)
        return item.to(self.device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        if self.kind == "disk":
            for path, _, _ in self.items:
                path.unlink(missing_ok=True)
        self.items = []


def choose_offload(offload: str, device: torch.device, need: int) -> str:
    """gpu when the activations fit in half the free GPU memory, else cpu when they fit in half the free
    host memory, else disk."""
    if offload != "auto":
        return offload
    if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] // 2 > need:
        return "gpu"
    if psutil.virtual_memory().available // 2 > need:
        return "cpu"
    return "disk"


def layer_bytes(plan: Plan, dtype: torch.dtype) -> int:
    """The largest decoder layer's weights decoded to `dtype`: what the engine holds besides activations."""
    per_layer: dict[int, int] = defaultdict(int)
    for e in plan.entries:
        if e.role.layer is not None and e.role.kind != "mtp":
            per_layer[e.role.layer] += math.prod(e.tensor.shape) * dtype.itemsize
    return max(per_layer.values(), default=0)


def check_layer_memory(plan: Plan, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse up front, with the numbers, when one layer cannot fit where it must run."""
    need = layer_bytes(plan, dtype)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if need > free:
        raise QuantizeError(
            f"one decoder layer needs {need / 2**30:.1f} GiB on {device} but {free / 2**30:.1f} GiB is free; "
            "use a device with more memory or free some"
        )


class UnfusedExperts(nn.ModuleList):
    """transformers' fused `experts` (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as per-expert Linears named
    as in the checkpoint (`experts.E.{gate,up,down}_proj`), with the same forward, recording what it is sent."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act_fn, dtype: torch.dtype):
        super().__init__()
        for _ in range(num_experts):
            e = nn.Module()
            e.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
            e.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype)
            e.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype)
            self.append(e)
        self.__dict__["act_fn"] = act_fn  # not a child: the children are exactly the experts, as in the checkpoint
        self.record: Callable | None = None

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        m = self[e]
        return m.down_proj(self.act_fn(m.gate_proj(x)) * m.up_proj(x))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.record is not None:
            self.record(hidden_states, top_k_index)
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            token_idx, top_k_pos = torch.where(top_k_index == e)
            y = self.expert_forward(e, hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


@dataclass
class LayerReport:
    layer: int
    seconds: float
    modules: int
    experts_calibrated: int = 0
    fallbacks: list[str] = field(default_factory=list)
    tokens_per_expert: dict[int, int] = field(default_factory=dict)
    kv_scale: list[float] | None = None  # FP8 KV cache (k_scale, v_scale) measured on this layer


@dataclass
class Stats:
    layers: list[LayerReport] = field(default_factory=list)
    error: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    offload: str = ""
    awq: list[dict] = field(default_factory=list)
    resumed_layers: int = 0  # layers a --resume took from the checkpoint instead of calibrating again

    def mean_error(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in sorted(self.error.items())}

    def to_dict(self) -> dict:
        return {"layers": [asdict(x) for x in self.layers], "error": dict(self.error), "awq": self.awq}

    def restore(self, saved: dict) -> None:
        for x in saved.get("layers", []):
            x["tokens_per_expert"] = {int(k): v for k, v in x["tokens_per_expert"].items()}
            self.layers.append(LayerReport(**x))
        for kind, v in saved.get("error", {}).items():
            self.error[kind].extend(v)
        self.awq.extend(saved.get("awq", []))


class LayerwiseQuantizer:
    """Produces the quantized tensors of each decoder layer on demand, layers in order.

    `produce(entry)` is called by the shard writer in layer order; asking for a tensor of layer L runs the
    calibration of every layer up to L that has not run yet.
    """

    def __init__(self, plan: Plan, samples: list[torch.Tensor], device: torch.device, offload: str = "auto",
                 on_layer: Callable[[LayerReport, int], None] | None = None,
                 on_expert: Callable[[int, int], None] | None = None, checkpoint: LayerCheckpoint | None = None,
                 resume: Resume | None = None, finished: Callable[[], set[str]] = frozenset,
                 compute_dtype: torch.dtype | None = None):
        self.plan, self.device, self.on_layer, self.on_expert = plan, device, on_layer, on_expert
        self.checkpoint, self.finished = checkpoint, finished
        self.written = finished()  # tensors of shards finished before a resume: not kept if recomputed
        self.lock = threading.Lock()
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.recipe, self.model, self.ckpt = plan.recipe, plan.model, plan.ckpt
        # what is written keeps the model's dtype; forwards and activations use the compute dtype (compute.py)
        self.dtype = plan.ckpt.dtype
        self.compute = compute_dtype or compute.choose(self.dtype, device)
        self.config = self.model.transformers_config(self.compute)
        with torch.device("meta"):
            self.skeleton = self.model.causal_lm_class()._from_config(self.config, dtype=self.compute)
        self.entries = {e.tensor.name: e for e in plan.entries}
        self.awq_rows = self.recipe.awq.max_tokens
        self.targets = {e.tensor.name: e for e in plan.entries if e.action == "quantize" and e.role.layer is not None
                        and e.role.kind != "mtp"}
        self.results: dict[str, list[torch.Tensor]] = {}
        self.stats = Stats()
        self.next_layer = 0
        hidden = self.model.hidden_size
        tokens = sum(s.numel() for s in samples)
        need = tokens * hidden * self.compute.itemsize * 3
        self.stats.offload = choose_offload(offload, device, need)
        # disk offload goes where TMPDIR points: put it on a fast disk with room for the activations
        self._tmp = Path(tempfile.mkdtemp(prefix="quantize-act-")) if self.stats.offload == "disk" else None
        self.hidden = self._store()
        # one sample at a time: batching equal-length samples measured no faster on CPU and held more memory
        self.positions = [torch.arange(s.shape[1], device=device).unsqueeze(0) for s in samples]
        self.carry: list = [None] * len(samples)  # GLM-5's DSA layers pass their top-k indices on
        self._shared: tuple = (None, None)  # (length, layer type), (mask, rotary embeddings)
        self.rotary = type(self.skeleton.model.rotary_emb)(config=self.config).to(self.device)
        self.resumed_from = 0
        self._saver, self._saving = ThreadPoolExecutor(max_workers=1), None
        if resume is not None:
            self._restore(resume)
        else:
            self._embed(samples)
        release_freed_memory()  # the tokenizer and the embedding matrix are gone by now

    def _store(self) -> ActivationStore:
        return ActivationStore(self.stats.offload, self.device, self._tmp)

    def close(self) -> None:
        self._saver.shutdown(wait=True)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _decode(self, name: str) -> torch.Tensor:
        return self.ckpt.decode(self.ckpt.tensors[name], self.device)

    def _embed(self, samples: list[torch.Tensor]) -> None:
        name = f"{self.model.prefix}model.embed_tokens.weight"
        weight = self._decode(name).to(self.compute)
        for ids in samples:
            self.hidden.append(nn.functional.embedding(ids.to(self.device), weight))

    def _restore(self, resume: Resume) -> None:
        """Continue from a checkpoint: the activations entering its next layer, the stats so far."""
        for name, t in self.checkpoint.activations(resume):
            kind, s = name.split(".")
            if kind == "hidden":
                self.hidden.append(t.to(self.device))
            else:
                self.carry[int(s)] = t.to(self.device)
        if len(self.hidden) != len(self.positions):
            raise QuantizeError(f"the checkpoint holds {len(self.hidden)} samples, not {len(self.positions)}; "
                                "rerun with --overwrite")
        self.stats.restore(resume.stats)
        self.next_layer = self.resumed_from = self.stats.resumed_layers = resume.next_layer

    def _save_checkpoint(self, i: int) -> None:
        results = {n: ts for n, ts in self.results.items() if self.entries[n].role.layer == i}
        activations = {f"hidden.{s}": self.hidden[s] for s in range(len(self.hidden))}
        activations |= {f"carry.{s}": c for s, c in enumerate(self.carry) if c is not None}
        prefix = f"{self.model.prefix}model.layers.{i}."
        # written while the next layer's calibration pass runs, which reads the activations but changes nothing
        self._saving = self._saver.submit(self.checkpoint.save, i, results, activations, self.stats.to_dict(),
                                          self.finished(), {n for n in self.entries if n.startswith(prefix)})

    def _wait_for_checkpoint(self) -> None:
        """Block until the pending layer checkpoint is on disk; its error (a full disk) is raised here."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.result()

    def _mask(self, h: torch.Tensor, pos: torch.Tensor):
        from transformers.masking_utils import create_causal_mask

        # a plain causal mask may be skipped (SDPA's is_causal path); GLM-5's DSA indexer needs it materialized
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                                  position_ids=pos, allow_is_causal_skip=self.model.arch.family != "glm_moe_dsa")
        layer_types = getattr(self.config, "layer_types", None)
        return {t: mask for t in set(layer_types)} if isinstance(layer_types, list) else mask

    def _build_layer(self, i: int) -> nn.Module:
        layer = self.skeleton.model.layers[i]
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            with torch.device("meta"):
                layer.mlp.experts = UnfusedExperts(experts.num_experts, experts.hidden_dim, experts.intermediate_dim,
                                                   experts.act_fn, self.compute)
        layer.to_empty(device=self.device)
        prefix = f"{self.model.prefix}model.layers.{i}."
        want = dict(layer.named_parameters()) | dict(layer.named_buffers())
        have = {n[len(prefix):]: n for n in self.ckpt.tensors if n.startswith(prefix)}
        missing = sorted(set(want) - set(have))
        if missing:
            raise QuantizeError(f"layer {i}: the checkpoint lacks {prefix}{missing[0]} that the "
                                f"{type(layer).__name__} needs")
        with torch.no_grad():
            for rel, t in want.items():
                t.copy_(self._decode(have[rel]).to(t.dtype))
        layer.eval()
        return layer

    def _run(self, layer: nn.Module, i: int, advance: bool, after_sample: Callable[[], None] | None = None,
             stop: "_StopWhenAllSeen | None" = None) -> None:
        """The calibration samples through `layer`; with `advance`, each output replaces its input in place.
        With `stop`, a sample's forward ends as soon as `stop` has seen all it waits for."""
        layer_type = (getattr(self.config, "layer_types", None) or [None] * (i + 1))[i]
        takes_topk = _takes_topk(layer)
        # inference mode, not just no_grad: ~12% less dispatch overhead per forward (measured on a SmolLM2 layer)
        with torch.inference_mode():
            for s in range(len(self.hidden)):
                h, pos = self.hidden[s], self.positions[s]
                mask, rotary = self._inputs(h, pos, layer_type)
                kwargs = {"prev_topk_indices": self.carry[s]} if takes_topk else {}
                if stop is not None:
                    stop.reset()
                try:
                    y = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rotary, **kwargs)
                except _StopForward:
                    if after_sample is not None:
                        after_sample()
                    continue
                if isinstance(y, tuple):
                    y, extra = y[0], y[1]
                    if advance:
                        self.carry[s] = extra
                if advance:
                    self.hidden[s] = y
                if after_sample is not None:
                    after_sample()

    def _inputs(self, h: torch.Tensor, pos: torch.Tensor, layer_type: str | None):
        """Attention mask and rotary embeddings of a sample, reused while samples keep the same length (a
        materialized mask of 2048 tokens is 16 MB, so only the last one is kept)."""
        key = (h.shape[1], layer_type)
        if self._shared[0] != key:
            mask = self._mask(h, pos)
            self._shared = (key, (mask[layer_type] if isinstance(mask, dict) else mask, self.rotary(h, pos)))
        return self._shared[1]

    def produce(self, e: Entry) -> list[torch.Tensor] | None:
        """The output tensors of a calibrated entry, or None when the entry is not calibrated here."""
        layer = e.role.layer
        if layer is None or e.role.kind == "mtp":
            return None
        if self.recipe.method == "gptq" and e.tensor.name not in self.targets and e.action != "kv_scale":
            return None  # GPTQ changes only what it quantizes; AWQ smoothing also rescales norms and routers
        with self.lock:  # writer threads ask concurrently; layers must run one at a time, in order
            if layer < self.resumed_from:
                return self.checkpoint.result(layer, e.tensor.name)
            while self.next_layer <= layer:
                self._quantize_layer(self.next_layer)
                self.next_layer += 1
            return self.results.pop(e.tensor.name, None)

    def _layer_targets(self, i: int) -> dict[str, Entry]:
        prefix = f"{self.model.prefix}model.layers.{i}."
        return {n[len(prefix):-len(".weight")]: e for n, e in self.targets.items() if e.role.layer == i}

    def _quantize_layer(self, i: int) -> None:
        t0 = time.perf_counter()
        targets = self._layer_targets(i)
        layer = self._build_layer(i)
        report = LayerReport(layer=i, seconds=0.0, modules=len(targets))
        if self.recipe.method == "awq":
            self._awq_layer(layer, i, targets, report)
        else:
            self._gptq_layer(layer, i, targets, report)
        self._wait_for_checkpoint()  # the previous layer's checkpoint still reads the activations about to change
        if self.recipe.kv_cache:  # observed on the quantized layer, whose K and V are what serving caches
            mla = self.config.qk_nope_head_dim if hasattr(layer.self_attn, "kv_a_layernorm") else None
            with kvcache.observe(layer.self_attn, mla) as amax:
                self._run(layer, i, advance=True)
            self._kv_scales(i, amax, mla is not None, report)
        else:
            self._run(layer, i, advance=True)
        release_freed_memory()
        self.skeleton.model.layers[i] = nn.Module()  # drop the layer's weights
        report.seconds = time.perf_counter() - t0
        self.stats.layers.append(report)
        if self.checkpoint is not None:
            self._save_checkpoint(i)
            if i == self.model.num_hidden_layers - 1:
                self._wait_for_checkpoint()
        if self.on_layer:
            self.on_layer(report, self.model.num_hidden_layers)

    def _kv_scales(self, i: int, amax: kvcache.Amax, mla: bool, report: LayerReport) -> None:
        k, v = kvcache.scales(amax, self.dtype, mla)
        report.kv_scale = [float(k), float(v)]
        for name, t in zip(serving.kv_scale_names(self.model.prefix, i, mla), (k, v), strict=True):
            if name in self.entries and name not in self.written:
                self.results[name] = [t]

    def _gptq_layer(self, layer: nn.Module, i: int, targets: dict[str, Entry], report: LayerReport) -> None:
        modules = dict(layer.named_modules())
        expert_targets = {m for m in targets if ".experts." in m}
        hessians = _Hessians(self.device)
        dense_targets = [m for m in targets if m not in expert_targets]
        moe_inputs, routes = self._store(), []
        experts_module = next((mod for mod in modules.values() if isinstance(mod, UnfusedExperts)), None)
        record_moe = bool(expert_targets) and experts_module is not None
        # the pass is only for the Hessians: once every target has seen its input, the rest of the layer (the
        # last down_proj, the routed experts' own forward) is skipped
        stop = _StopWhenAllSeen([*dense_targets, *(["experts"] if record_moe else [])])
        hooks = [modules[m].register_forward_pre_hook(partial(hessians.hook, m)) for m in dense_targets]
        hooks += [modules[m].register_forward_pre_hook(partial(stop.pre_hook, m)) for m in dense_targets]
        if record_moe:
            def record(x, top_k_index):
                moe_inputs.append(x)
                routes.append(top_k_index.to("cpu"))
                stop.seen("experts")
            experts_module.record = record
        self._run(layer, i, advance=False, after_sample=hessians.next_sample, stop=stop)
        hessians.flush()
        for h in hooks:
            h.remove()
        if experts_module is not None:
            experts_module.record = None
        if expert_targets and self.world > 1:
            _broadcast_moe_inputs(moe_inputs, routes)
        by_input: dict[int, list[str]] = defaultdict(list)  # q/k/v, gate/up: one Hessian, one stacked solve
        for m in sorted(set(targets) - expert_targets):
            by_input[id(hessians.by_module[m])].append(m)
        for names in by_input.values():
            H = hessians.by_module[names[0]]
            done = self._quantize_stacked([modules[m].weight.data for m in names], H)
            for m, result in zip(names, done, strict=True):
                self._commit(modules[m], targets[m], *result, report)
            release_freed_memory()
        hessians.by_module.clear()
        if expert_targets:
            self._quantize_experts(experts_module, targets, moe_inputs, routes, report)
        moe_inputs.clear()

    def _awq_mappings(self, modules: dict[str, nn.Module], targets: dict[str, Entry]) -> list[tuple[str, list[str]]]:
        """(smooth, balance) pairs present in this layer whose balance layers include something quantized."""
        pairs = []
        for smooth, patterns in self.model.arch.awq_norms:
            if smooth in modules:
                balance = [n for n in modules if any(re.fullmatch(p, n) for p in patterns)
                           and getattr(modules[n], "weight", None) is not None]
                pairs.append((smooth, balance))
        for n, mod in modules.items():
            if n.endswith("up_proj") and (down := n[: -len("up_proj")] + "down_proj") in modules:
                pairs.append((n, [down]))
            if n.endswith("self_attn.v_proj") and (o := n[: -len("v_proj")] + "o_proj") in modules:
                if mod.out_features == modules[o].in_features:
                    pairs.append((n, [o]))
        return [(sm, bal) for sm, bal in pairs if bal and any(b in targets for b in bal)]

    def _attention_loss(self, layer: nn.Module, quantized: list[nn.Module], inputs: list[torch.Tensor]):
        """AWQ loss at the attention block's output, over whole calibration batches."""
        takes_topk = _takes_topk(layer.self_attn)

        def run() -> list[torch.Tensor]:
            outs = []
            with torch.no_grad():
                for b, x in enumerate(inputs):
                    pos = self.positions[b]
                    mask = self._mask(x, pos)
                    if isinstance(mask, dict):
                        mask = next(iter(mask.values()))
                    kwargs = {"prev_topk_indices": self.carry[b]} if takes_topk else {}
                    y = layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=pos,
                                        position_embeddings=self.rotary(x, pos), **kwargs)
                    outs.append(y[0] if isinstance(y, tuple) else y)
            return outs

        return _swapped_loss(run, quantized, self.recipe.scheme.group_size, self.recipe.scheme.symmetric)

    def _awq_layer(self, layer: nn.Module, i: int, targets: dict[str, Entry], report: LayerReport) -> None:
        """Record the inputs each mapping's balance layers see, search and apply the scales, then RTN."""
        modules = dict(layer.named_modules())
        mappings = self._awq_mappings(modules, targets)
        experts = next((mod for mod in modules.values() if isinstance(mod, UnfusedExperts)), None)
        rec = _AWQRecorder(self.awq_rows, len(self.hidden))
        hooks = []
        for smooth, balance in mappings:
            if isinstance(modules[smooth], nn.Linear):  # up -> down, v -> o: record what the balance layer receives
                hooks.append(modules[balance[0]].register_forward_pre_hook(partial(rec.pre_hook, smooth)))
            else:
                hooks.append(modules[smooth].register_forward_hook(partial(rec.hook, smooth)))
        if experts is not None:
            experts.record = rec.record_routes
        self._run(layer, i, advance=False)
        for h in hooks:
            h.remove()
        if experts is not None:
            experts.record = None

        s, g = self.recipe.scheme, self.recipe.scheme.group_size
        modified: set[str] = set()
        for smooth, balance in mappings:
            x_mean, X = rec.stats(smooth)
            if X is None:
                continue
            quantized = [b for b in balance if b in targets]
            parent = _parent(smooth, balance, modules)
            if parent == "self_attn":
                loss = self._attention_loss(layer, [modules[b] for b in quantized], rec.attention_inputs)
            elif parent == "mlp":
                loss = _module_loss(layer.mlp, [modules[b] for b in quantized], [X.to(self.device, self.compute)[None]], g,
                                    s.symmetric)
            else:
                loss = awq.linear_loss([(modules[b].weight.data, X.to(self.device)) for b in quantized], g, s.symmetric)
            scales, ratio, initial, best = awq.search(x_mean.to(self.device), [modules[b].weight.data for b in quantized],
                                                     loss, g, self.recipe.awq.n_grid)
            self.stats.awq.append({"layer": i, "smooth": smooth, "ratio": ratio, "loss_identity": initial,
                                   "loss_best": best})
            _apply_scales(modules[smooth], [modules[b] for b in balance], scales.to(self.device))
            modified.update([smooth, *balance])
            if smooth == "input_layernorm":  # later attention losses must see the rescaled norm's output
                rec.attention_inputs = [(x.float() / scales.to(x.device)).to(x.dtype) for x in rec.attention_inputs]
        rec.attention_inputs.clear()
        for m, e in targets.items():
            self._quantize_module(modules[m], e, report)
        prefix = f"{self.model.prefix}model.layers.{i}."
        for m in sorted(modified - set(targets)):
            for leaf in ("weight", "bias"):
                name = f"{prefix}{m}.{leaf}"
                t = getattr(modules[m], leaf, None)
                if t is None or name not in self.entries or name in self.written:
                    continue
                self.results[name] = [t.detach().to("cpu", _dtype(self.entries[name].outputs[0].dtype))]

    def _quantize_weight(self, W: torch.Tensor, H: torch.Tensor | None):
        """(codes, scale, zero_point, fallback) of one weight: GPTQ against H, or RTN when H is None. H is
        consumed (every Linear that shares it is in W): GPTQ frees it as soon as it has its working copy."""
        s, p = self.recipe.scheme, self.recipe.gptq
        W = W.to(self.dtype)  # scales from the weight in the model's dtype, as compressed-tensors computes them
        scale, zp = rtn.group_qparams(W, s.group_size, s.num_bits, s.symmetric)
        if H is None:
            return rtn.quantize_groups(W, scale, zp, s.num_bits), scale, zp, False
        codes, fallback = gptq.gptq_quantize(W, H, scale, zp, s.num_bits, p.block_size, p.dampening_frac,
                                             actorder=p.actorder == "static", consume=True)
        return codes, scale, zp, fallback

    def _quantize_stacked(self, weights: list[torch.Tensor], H: torch.Tensor) -> list[tuple]:
        """_quantize_weight of Linears fed the same input, as one matrix: GPTQ treats the rows of W
        independently given H (the codes are the same bytes as one by one), so H is factored once and each
        column step updates every Linear at once (q/k/v of SmolLM2: 130 -> 55 ms). H is consumed."""
        W = torch.cat(weights) if len(weights) > 1 else weights[0]
        codes, scale, zp, fallback = self._quantize_weight(W, H)
        done, row = [], 0
        for w in weights:
            rows = slice(row, row + w.shape[0])
            row = rows.stop
            done.append((codes[rows], scale[rows].clone(), None if zp is None else zp[rows].clone(), fallback))
        return done

    def _commit(self, module: nn.Linear, e: Entry, codes, scale, zp, fallback: bool, report: LayerReport) -> None:
        """Record the result and make the module compute with it (for the next layer's inputs)."""
        W = module.weight.data
        if fallback:
            report.fallbacks.append(f"{e.role.module} (Hessian not positive definite: RTN)")
        Wq = rtn.dequantize_groups(codes, scale, zp).to(W.dtype)
        self.stats.error[e.role.kind].append(float((W.float() - Wq.float()).norm() / W.float().norm().clamp(min=1e-12)))
        module.weight.data = Wq
        if e.tensor.name in self.written:
            return
        out = [pack.pack_int4(codes), scale, torch.tensor(e.tensor.shape, dtype=torch.int64)]
        if zp is not None:
            out.append(pack.pack_int4(zp, packed_dim=0))
        self.results[e.tensor.name] = [t.to("cpu") for t in out]

    def _quantize_module(self, module: nn.Linear, e: Entry, report: LayerReport) -> None:
        """RTN of one Linear (AWQ's last step, after its scales are applied)."""
        self._commit(module, e, *self._quantize_weight(module.weight.data, None), report)
        release_freed_memory()

    def _quantize_experts(self, experts: UnfusedExperts, targets: dict[str, Entry], inputs: ActivationStore,
                          routes: list[torch.Tensor], report: LayerReport) -> None:
        """GPTQ of the routed experts one at a time; with several ranks, expert e is computed on rank
        e % world and its result broadcast, so every rank holds one expert's Hessians at a time."""
        cal = self.recipe.calibration
        n_experts = len(experts)
        counts = torch.zeros(n_experts, dtype=torch.long)
        for r in routes:
            counts += torch.bincount(r.flatten(), minlength=n_experts)
        report.tokens_per_expert = {e: int(c) for e, c in enumerate(counts)}
        prefix = next(iter(targets)).split(".experts.")[0] + ".experts."
        for e in range(n_experts):
            names = {leaf: f"{prefix}{e}.{leaf}" for leaf in ("gate_proj", "up_proj", "down_proj")}
            names = {k: v for k, v in names.items() if v in targets}
            if not names:
                continue
            m = experts[e]
            rtn_only = counts[e] < max(cal.min_expert_tokens, 1) and not cal.calibrate_all_experts
            if rtn_only:
                report.fallbacks.append(f"{prefix}{e} ({int(counts[e])} tokens < {cal.min_expert_tokens}: RTN)")
            else:
                report.experts_calibrated += 1
            owner = e % self.world
            done = {}
            if owner == self.rank:
                done = self._one_expert(experts, e, names, inputs, routes, rtn_only)
            for leaf, name in names.items():
                module = getattr(m, leaf)
                if self.world > 1:
                    done[leaf] = _broadcast_result(done.get(leaf), module.weight.shape, self.recipe.scheme, owner,
                                                   self.dtype, self.device)
                if self.rank == 0:
                    self._commit(module, targets[name], *done[leaf], report)
            if self.on_expert is not None:
                self.on_expert(e, n_experts)

    def _one_expert(self, experts: UnfusedExperts, e: int, names: dict[str, str], inputs: ActivationStore,
                    routes: list[torch.Tensor], rtn_only: bool) -> dict[str, tuple]:
        cal, m = self.recipe.calibration, experts[e]
        if rtn_only:
            return {leaf: self._quantize_weight(getattr(m, leaf).weight.data, None) for leaf in names}
        H_in = torch.zeros(m.gate_proj.in_features, m.gate_proj.in_features, device=self.device)
        H_down = torch.zeros(m.down_proj.in_features, m.down_proj.in_features, device=self.device)

        def routed():
            for s in range(len(inputs)):
                x = inputs[s]
                yield x if cal.calibrate_all_experts else x[(routes[s] == e).any(dim=-1).to(x.device)]

        with torch.no_grad():
            for x in gptq.batched_rows(routed()):
                gptq.add_batch(H_in, x)
                gptq.add_batch(H_down, experts.act_fn(m.gate_proj(x)) * m.up_proj(x))
        done = {}
        for group, H in (([leaf for leaf in names if leaf != "down_proj"], H_in), (["down_proj"], H_down)):
            group = [leaf for leaf in group if leaf in names]
            if group:
                stacked = self._quantize_stacked([getattr(m, leaf).weight.data for leaf in group], H)
                done |= zip(group, stacked, strict=True)
        return done

    def run_worker(self) -> None:
        """Rank > 0: take part in every layer's expert split; rank 0 does everything else and writes."""
        for i in range(self.next_layer, self.model.num_hidden_layers):
            targets = self._layer_targets(i)
            expert_targets = {m for m in targets if ".experts." in m}
            if not expert_targets or self.recipe.method != "gptq":
                continue
            layer = self._build_layer(i)
            experts = next(mod for mod in layer.modules() if isinstance(mod, UnfusedExperts))
            inputs, routes = self._store(), []
            for s in range(len(self.positions)):
                tokens = self.positions[s].numel()
                inputs.append(_receive(torch.empty(tokens, self.model.hidden_size, dtype=self.compute,
                                                   device=self.device)))
                routes.append(_receive(torch.empty(tokens, self.config.num_experts_per_tok, dtype=torch.int64,
                                                   device=self.device)).to("cpu"))
            self._quantize_experts(experts, targets, inputs, routes, LayerReport(layer=i, seconds=0.0, modules=0))
            inputs.clear()
            self.skeleton.model.layers[i] = nn.Module()


def _check_checkpoint_space(partial: Path, plan: Plan, samples: list[torch.Tensor], dtype: torch.dtype) -> None:
    """The layer checkpoint briefly holds two copies of the activations: refuse up front when they cannot fit."""
    need = 2 * sum(s.numel() for s in samples) * plan.model.hidden_size * dtype.itemsize
    free = shutil.disk_usage(partial).free
    if need > free:
        raise QuantizeError(f"the layer checkpoints need {need / 2**30:.1f} GiB in {partial} but "
                            f"{free / 2**30:.1f} GiB is free; free space and rerun")


def _parent(smooth: str, balance: list[str], modules: dict[str, nn.Module]) -> str | None:
    """Where AWQ measures its loss: the attention or MLP block holding every balance layer of a norm mapping
    (as llm-compressor does), else at the balance layers themselves (up -> down, v -> o)."""
    if isinstance(modules[smooth], nn.Linear):
        return None
    for parent in ("self_attn", "mlp"):
        if all(b.startswith(parent + ".") for b in balance):
            return parent
    return None


def _swapped_loss(run: Callable[[], list[torch.Tensor]], quantized: list[nn.Module], group_size: int, symmetric: bool):
    """Loss over scales: squared error of `run()` with each quantized module computing Q(W * s) / s."""
    refs = [r.float() for r in run()]

    def loss(s: torch.Tensor) -> float:
        originals = [m.weight.data for m in quantized]
        try:
            for m, w in zip(quantized, originals, strict=True):
                m.weight.data = awq.scaled_fake_quant(w, s, group_size, symmetric)
            outs = run()
        finally:
            for m, w in zip(quantized, originals, strict=True):
                m.weight.data = w
        err = sum(float((o.float() - r).pow(2).sum()) for o, r in zip(outs, refs, strict=True))
        return err / max(sum(r.numel() for r in refs), 1)

    return loss


def _module_loss(module: nn.Module, quantized: list[nn.Module], inputs: list[torch.Tensor], group_size: int,
                 symmetric: bool):
    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [module(x) for x in inputs]

    return _swapped_loss(run, quantized, group_size, symmetric)


def _receive(t: torch.Tensor) -> torch.Tensor:
    torch.distributed.broadcast(t.view(torch.uint8) if t.dtype.itemsize > 1 and t.dtype.is_floating_point else t, src=0)
    return t


def _broadcast_moe_inputs(inputs: "ActivationStore", routes: list[torch.Tensor]) -> None:
    """Rank 0 sends every sample's MoE input and routing to the other ranks (bytes, so any dtype crosses)."""
    for s in range(len(inputs)):
        x = inputs[s].contiguous()
        torch.distributed.broadcast(x.view(torch.uint8), src=0)
        torch.distributed.broadcast(routes[s].to(x.device).contiguous(), src=0)


def _broadcast_result(result: tuple | None, shape: torch.Size, scheme, owner: int, dtype: torch.dtype,
                      device: torch.device) -> tuple:
    """(codes, scale, zero_point, fallback) from the rank that computed it to every rank."""
    out_f, in_f = shape
    n_groups = in_f // scheme.group_size
    if result is None:
        codes = torch.empty(out_f, in_f, dtype=torch.int8, device=device)
        scale = torch.empty(out_f, n_groups, dtype=dtype, device=device)
        zp = None if scheme.symmetric else torch.empty(out_f, n_groups, dtype=torch.int8, device=device)
        flag = torch.zeros(1, dtype=torch.int8, device=device)
    else:
        codes, scale, zp, fallback = result
        flag = torch.tensor([int(fallback)], dtype=torch.int8, device=device)
    for t in (codes, scale.view(torch.uint8) if scale.dtype.itemsize > 1 else scale, zp, flag):
        if t is not None:
            torch.distributed.broadcast(t.contiguous(), src=owner)
    return codes, scale, zp, bool(flag.item())


def _expert_index(name: str) -> int | None:
    m = re.search(r"experts\.(\d+)\.", name)
    return int(m[1]) if m else None


def _dtype(name: str) -> torch.dtype:
    from quantize.safetensors_file import DTYPES

    return DTYPES[name]


@torch.no_grad()
def _apply_scales(smooth: nn.Module, balance: list[nn.Module], s: torch.Tensor) -> None:
    """smooth's output / s, every balance layer's input columns * s: the float model is unchanged."""
    w = smooth.weight
    if w.ndim == 1:
        w.copy_((w.float() / s).to(w.dtype))
    else:
        w[-s.numel():].copy_((w[-s.numel():].float() / s.view(-1, 1)).to(w.dtype))
    if getattr(smooth, "bias", None) is not None:
        smooth.bias[-s.numel():].copy_((smooth.bias[-s.numel():].float() / s).to(smooth.bias.dtype))
    for b in balance:
        b.weight.copy_((b.weight.float() * s.view(1, -1)).to(b.weight.dtype))


class _StopForward(Exception):
    """Raised inside a calibration forward once nothing after this point is needed."""


class _StopWhenAllSeen:
    """Ends a sample's forward (by raising _StopForward) once every name it waits for has been seen."""

    def __init__(self, names: list[str]):
        self.names = set(names)
        self._seen: set[str] = set()

    def reset(self) -> None:
        self._seen = set()

    def seen(self, name: str) -> None:
        self._seen.add(name)
        if self.names and self._seen >= self.names:
            raise _StopForward

    def pre_hook(self, name: str, _module, _args) -> None:
        self.seen(name)


class _Hessians:
    """One Hessian per distinct input: Linears fed the very same tensor (q/k/v, gate/up) share one, so each
    input's x^T x is computed once per sample. Inputs wait until gptq.BATCH_ROWS of them can go in one product;
    `flush` adds what is left."""

    def __init__(self, device: torch.device):
        self.device = device
        self.by_module: dict[str, torch.Tensor] = {}
        self._seen: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (input kept alive, first module fed it)
        self._pending: dict[str, tuple[list[torch.Tensor], int]] = {}  # first module of an H -> (inputs, rows)

    def hook(self, name: str, _module: nn.Module, args: tuple) -> None:
        x = args[0]
        first = self._seen.get(id(x))
        if name not in self.by_module:
            if first is not None:
                self.by_module[name] = self.by_module[first[1]]
            else:
                with torch.inference_mode(False):  # GPTQ updates it in place later, outside the forward's inference mode
                    self.by_module[name] = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float32, device=self.device)
        if first is None:
            self._seen[id(x)] = (x, name)
            self._add(name, x)
        elif self.by_module[name] is not self.by_module[first[1]]:
            self._add(name, x)

    def _add(self, name: str, x: torch.Tensor) -> None:
        xs, rows = self._pending.get(name, ([], 0))
        xs.append(x)
        rows += x.numel() // x.shape[-1]
        self._pending[name] = (xs, rows)
        if rows >= gptq.BATCH_ROWS:
            self._flush(name)

    def _flush(self, name: str) -> None:
        xs, _ = self._pending.pop(name)
        gptq.add_batch(self.by_module[name], torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]))

    def flush(self) -> None:
        for name in list(self._pending):
            self._flush(name)

    def next_sample(self) -> None:
        self._seen.clear()


class _AWQRecorder:
    """What AWQ needs of one calibration pass: mean |x| per channel of every mapping's input over all tokens,
    and the inputs themselves at a fixed, evenly spread subset of token positions (the grid search's data)."""

    def __init__(self, max_rows: int, n_samples: int):
        self.max_rows, self.n_samples = max_rows, n_samples
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = defaultdict(int)
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.routes: list[torch.Tensor] = []
        self.attention_inputs: list[torch.Tensor] = []  # whole batches: attention needs whole sequences

    def _keep(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        a = x.abs().sum(0, dtype=torch.float64)
        self.sums[name] = self.sums[name] + a if name in self.sums else a
        self.counts[name] += x.shape[0]
        per_sample = max(1, self.max_rows // self.n_samples)
        stride = max(1, x.shape[0] // per_sample)
        self.rows[name].append(x[::stride][:per_sample].to("cpu", copy=True))  # the compute dtype, as the layer sees it

    def hook(self, name: str, _module, _args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if name == "input_layernorm":
            self.attention_inputs.append(out)
        self._keep(name, out)

    def pre_hook(self, name: str, _module, args) -> None:
        self._keep(name, args[0])

    def record_routes(self, x: torch.Tensor, top_k_index: torch.Tensor) -> None:
        per_sample = max(1, self.max_rows // self.n_samples)
        stride = max(1, x.shape[0] // per_sample)
        self.routes.append(top_k_index[::stride][:per_sample].to("cpu"))

    def stats(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.counts.get(name):
            return None, None
        return (self.sums[name] / self.counts[name]).float(), torch.cat(self.rows[name])

    def routed_rows(self, expert: int) -> torch.Tensor:
        return (torch.cat(self.routes) == expert).any(dim=-1)


def _takes_topk(module: nn.Module) -> bool:
    """Whether the module is one of GLM-5's DSA blocks, which pass their indexer's top-k on."""
    import inspect

    return "prev_topk_indices" in inspect.signature(module.forward).parameters


class Calibrated:
    """The `calibrated` hook of stream.run: builds the LayerwiseQuantizer once the destination is ready.

    With `devices` of more than one entry, ranks 1.. are spawned for devices[1:] (engine/distributed.py) and
    this process is rank 0 on devices[0]."""

    def __init__(self, plan: Plan, samples: list[torch.Tensor], device: torch.device, offload: str = "auto",
                 on_layer: Callable[[LayerReport, int], None] | None = None, devices: list[str] | None = None,
                 on_expert: Callable[[int, int], None] | None = None, compute_dtype: str = "auto"):
        self.compute = compute.choose(plan.ckpt.dtype, device, compute_dtype)
        self.cpu_capability = compute.cpu_capability() if device.type == "cpu" else None
        check_layer_memory(plan, device, self.compute)  # before OUT.partial exists: a refusal leaves nothing
        self.args = (plan, samples, device, offload)
        self.on_layer, self.on_expert = on_layer, on_expert
        self.devices = devices or []
        self.quantizer: LayerwiseQuantizer | None = None
        self._ranks = None

    def __call__(self, partial: Path, finished: Callable[[], set[str]]) -> Callable[[Entry], list[torch.Tensor] | None]:
        """The producer for stream.run, which converts into `partial`; `finished()` names the tensors of the
        output shards finished so far. Continues from the layer checkpoint in `partial` when there is one."""
        from quantize.engine import distributed

        plan, samples, device, offload = self.args
        checkpoint = LayerCheckpoint(partial / CALIB_DIR, samples_key(samples, device, self.compute))
        resume = checkpoint.load()
        _check_checkpoint_space(partial, plan, samples, self.compute)
        if len(self.devices) > 1 and not torch.distributed.is_initialized():
            job = distributed.Job(str(plan.ckpt.root), plan.recipe.to_dict(), 1 << 62,
                                  [s[0].tolist() for s in samples], self.devices, offload, plan.ckpt.allow_nonfinite,
                                  start_layer=resume.next_layer if resume else 0,
                                  compute_dtype=str(self.compute).removeprefix("torch."))
            self._ranks = distributed.spawn(job)
        self.quantizer = LayerwiseQuantizer(plan, samples, device, offload, on_layer=self.on_layer,
                                            on_expert=self.on_expert, checkpoint=checkpoint, resume=resume,
                                            finished=finished, compute_dtype=self.compute)
        return self.quantizer.produce

    def close(self, ok: bool = True) -> None:
        from quantize.engine import distributed

        if self.quantizer is not None:
            self.quantizer.close()
        if self._ranks is not None:
            distributed.finish(self._ranks, ok)
