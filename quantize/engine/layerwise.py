"""The layerwise engine: GPTQ or AWQ one decoder layer at a time, never the whole model.

Calibration tokens are embedded once; then for each decoder layer in order the layer is built from the
architecture's transformers class (meta init, then only this layer's weights, decoded from the source
format), the calibration batch runs through it while the inputs of every targeted Linear are accumulated
into Hessians, the Linears are quantized, and the batch runs again through the quantized layer to give the
next layer its inputs (GPTQ's error propagation). Under GPTQ a MoE layer's routed experts are not in the
layer: their inputs are recorded, and engine/experts.py decodes, solves and runs them a chunk at a time, split
over the ranks. Activations live where engine/activations.py keeps them (device, host, or mapped files).

With several ranks under GPTQ the forwards are data parallel: rank 0 holds every sample's hidden states (it
embeds, checkpoints and writes) and sends each rank its own samples' at the start of a layer; every rank runs
the layer on its samples; the dense Hessians are added on rank 0 along a fixed tree (engine/hessians.py), which
solves the dense Linears and sends back their quantized weights; each rank runs its samples through the
quantized layer, and their outputs return to rank 0. Every sum is ordered by fixed groups of samples or
experts, never by the number of ranks, so the bytes are those of one rank.

The layer loop runs in a thread of its own on every rank (`LayerwiseQuantizer.run`), one layer ahead of the
writers at most: a layer's results go to the writers of the rank that computed them (engine/writers.py), which
write its shards while the next layer computes. What the ranks must agree on is decided once, before the first
layer (engine/agreement.py).

This module is the layer loop and the dense work (GPTQ of attention and dense MLPs, AWQ).
"""

import copy
import inspect
import itertools
import json
import re
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import psutil
import torch
from torch import nn

from quantize import compute, kvcache, serving
from quantize.engine import agreement, devices, distributed, memory, writers
from quantize.engine import experts as routed
from quantize.engine import tune as tuning
from quantize.engine.activations import ActivationStore, TokenBuffer, release_freed_memory
from quantize.engine.attention_cache import AttentionCache
from quantize.engine.awq_experts import AWQExperts
from quantize.engine.awq_layer import awq_layer, takes_topk
from quantize.engine.hessians import Hessians
from quantize.engine.layer_state import CALIB_DIR, LayerCheckpoint, Resume, samples_key
from quantize.errors import QuantizeError
from quantize.quant import codec, fp4, gptq, precision, scales
from quantize.quant.signround import START_FROM_RTN, Tunable
from quantize.tensor_plan import Entry, Plan


def _layers(plan: Plan, dtype: torch.dtype, device: torch.device) -> list[memory.Layer]:
    gptq_ = True  # routed experts streamed, whatever the method (calibrated rtn: no Hessians, fewer bytes)
    workers = routed.chunk_workers(device) if device.type == "cuda" else distributed.cpu_threads()

    def stack_of(inter: int, hidden: int) -> int:
        return workers * routed.stack_size(inter, hidden, plan.ckpt.dtype, device, workers) * \
            routed.expert_bytes(inter, hidden, plan.ckpt.dtype)

    tc = plan.model.text_config
    dsa, carry = plan.model.arch.dsa, plan.model.arch.carries_topk  # score top-k per head; GLM-5 carries it (int64)
    g = plan.recipe.gptq
    tuned = min(g.samples(plan.recipe.scheme.grid) + g.tune_holdout, plan.recipe.calibration.num_samples)
    tune = (g.tune_batch, tuned) if plan.recipe.method == "gptq" and tunes(plan.recipe) else (0, 0)
    return memory.layers_of(plan.entries, dtype.itemsize, stack_of, gptq_, carry=8 * (tc.get("index_topk") or 0) * carry,
                            index_heads=(tc.get("index_n_heads") or 0) * dsa, tune=tune,
                            grid=plan.recipe.scheme.grid)


def tunes(recipe) -> bool:
    """Whether GPTQ's dense layers are then tuned (engine/tune.py): steps asked for, and symmetric INT4 or FP4
    weights with 16-bit activations (an asymmetric zero point is not tuned, and NVFP4's W4A4 forward would need its
    activations quantized too)."""
    s = recipe.scheme
    return recipe.gptq.iters > 0 and not s.w4a4 and (bool(s.fp4) or (s.symmetric and s.num_bits == 4))


def results_bytes(plan: Plan, rank: int = 0, world: int = 1) -> int:
    """The results a rank's writers may hold at once: those of two layers (the loop runs one layer ahead of the
    writers), the largest two of the tensors that rank writes (its streams: tensor_plan.calibrated_keys)."""
    by_layer: Counter = Counter()
    for i, shard in enumerate(plan.shards):
        if distributed.stream_owner(plan.stream_of(i), world) == rank:
            for e in shard:
                if e.role.layer is not None and e.role.kind != "mtp":
                    by_layer[e.role.layer] += e.out_bytes
    return sum(sorted(by_layer.values())[-2:])


def memory_reading(plan: Plan, samples: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                   world: int = 1, rank: int = 0) -> agreement.Reading:
    """What the largest decoder layer holds on `device` under each offload (engine/memory.py): its weights but
    the routed experts GPTQ streams, their stacks, the dense Hessians, one sample's forward, the staging and
    NCCL's buffers, and the activations when they stay on the device; and what the host holds besides."""
    layers = _layers(plan, dtype, device)
    free_host = psutil.virtual_memory().available
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else free_host
    lengths = [s.numel() for s in samples]
    tokens = sum(lengths)
    cuda = device.type == "cuda"
    stage = distributed.STAGE_BYTES if world > 1 and cuda else 0
    comm = memory.nccl_bytes(world, rank) if cuda else 0
    accounts = {k: memory.account(layers, tokens, max(lengths, default=0), plan.model.hidden_size, dtype.itemsize, k,
                                  str(device), free, stage, comm) for k in agreement.KINDS}
    results = results_bytes(plan, rank, world)
    host = memory.host_bytes(layers, tokens, plan.model.hidden_size, dtype.itemsize)
    return agreement.read(rank, device, accounts, {k: results + (2 * host if k == "cpu" else 0) for k in agreement.KINDS})


def device_account(plan: Plan, samples: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                   offload: str = "auto") -> memory.Account:
    """One rank's account under the offload it would choose alone (agreement.decide over its own reading)."""
    reading = memory_reading(plan, samples, device, dtype)
    return reading.accounts[agreement.decide([reading], offload)[0]]


def check_layer_memory(account: memory.Account) -> None:
    """Refuse up front, with the numbers, when the largest layer cannot fit where it must run."""
    if not memory.fits(account):
        raise QuantizeError(memory.refusal(account))


@dataclass
class LayerReport:
    layer: int
    seconds: float
    modules: int
    experts_calibrated: int = 0
    fallbacks: list[str] = field(default_factory=list)
    tokens_per_expert: dict[int, int] = field(default_factory=dict)
    kv_scale: list[float] | None = None  # FP8 KV cache (k_scale, v_scale) measured on this layer
    phases: dict[str, float] = field(default_factory=dict)  # seconds: forward, dense, experts, routed_output_...
    routed_bytes: int = 0  # this rank's bytes of the routed-output exchange (the rows its groups touched)
    tuned: list[float] | None = None  # the layer's output error before and after tuning (engine/tune.py)


@dataclass
class Stats:
    layers: list[LayerReport] = field(default_factory=list)
    error: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    offload: str = ""
    awq: list[dict] = field(default_factory=list)
    resumed_layers: int = 0  # layers a --resume took from the checkpoint instead of calibrating again
    # this rank's loop: seconds waiting for its writers (results of two layers held) and for a checkpoint save
    waited_for_writers: float = 0.0
    waited_for_checkpoint: float = 0.0
    ranks: list[dict] = field(default_factory=list)  # rank 0: every rank's summary (LayerwiseQuantizer.summary)

    def mean_error(self) -> dict[str, float]:
        return {k: sum(v) / len(v) for k, v in sorted(self.error.items())}

    def to_dict(self) -> dict:
        """A copy: a layer checkpoint's snapshot is taken after layer i and written at its commit, while the next
        layers' results are appended here (shared lists would carry them into the checkpoint, and a resume would
        report them twice)."""
        return {"layers": [asdict(x) for x in self.layers], "error": {k: list(v) for k, v in self.error.items()},
                "awq": [dict(a) for a in self.awq]}

    def restore(self, saved: dict) -> None:
        for x in saved.get("layers", []):
            x["tokens_per_expert"] = {int(k): v for k, v in x["tokens_per_expert"].items()}
            self.layers.append(LayerReport(**x))
        for kind, v in saved.get("error", {}).items():
            self.error[kind].extend(v)
        self.awq.extend(saved.get("awq", []))


def work_stop(plan: Plan) -> int:
    """One past the last decoder layer whose results anything waits for (a target, a KV scale): the layers
    after it change nothing, so no rank runs them."""
    layers = [e.role.layer for e in plan.entries if e.role.layer is not None and e.role.kind != "mtp"
              and (e.action == "kv_scale" or (e.action == "quantize"))]
    return max(layers, default=-1) + 1


class LayerwiseQuantizer:
    """The quantized tensors of each decoder layer, computed by `run` (the layer loop, in a thread of its own)
    for layers start..stop-1 and taken by the writers through `produce`, which waits for the layer.

    `keep`: the tensor names whose results this rank's writers take (its own shards still to write; all when
    None); nothing else is held. Standalone (tests, one rank) it embeds the samples itself."""

    def __init__(self, plan: Plan, samples: list[torch.Tensor], device: torch.device,
                 offload: "str | memory.Account" = "auto", on_layer: Callable[[LayerReport, int], None] | None = None,
                 on_expert: Callable[[int, int], None] | None = None, checkpoint: LayerCheckpoint | None = None,
                 resume: Resume | None = None, compute_dtype: torch.dtype | None = None, worker: bool = False,
                 start: int = 0, stop: int | None = None, keep: set[str] | None = None,
                 checkpoint_at: set[int] = frozenset(), segments_done: Callable[[int], bool] | None = None):
        self.plan, self.device, self.on_layer, self.on_expert = plan, device, on_layer, on_expert
        self.checkpoint = checkpoint
        self.rank, self.world = agreement.world()
        # the math's thread count is fixed by the machine, never by the number of ranks (distributed.cpu_threads)
        self.threads = distributed.cpu_threads() if device.type == "cpu" else torch.get_num_threads()
        # data-parallel forwards (GPTQ): the samples this rank runs, and each rank's span of the token rows
        self.dp = self.world > 1 and plan.recipe.method == "gptq"
        n = len(samples)
        self.shares = [distributed.share(r, self.world, n) for r in range(self.world)] if self.dp else [range(n)]
        self.mine = self.shares[self.rank if self.dp else 0]
        starts = [0, *itertools.accumulate(smp.numel() for smp in samples)]
        self.spans = [(starts[sh.start], starts[sh.stop]) for sh in self.shares]
        self.worker = worker
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
        self.keep = keep
        self.results: dict[str, list[torch.Tensor]] = {}
        self.stats = Stats()
        self.start, self.stop = start, work_stop(plan) if stop is None else stop
        tokens = sum(s.numel() for s in samples)
        # the ranks' agreed account (Calibrated, run_rank), or this rank's own choice when it runs alone
        self.account = offload if isinstance(offload, memory.Account) else \
            device_account(plan, samples, device, self.compute, offload)
        self.stats.offload = self.account.offload
        # disk offload goes where TMPDIR points: put it on a fast disk with room for the activations
        self._tmp = Path(tempfile.mkdtemp(prefix="quantize-act-")) if self.stats.offload == "disk" else None
        self.hidden = self._store()
        # one sample at a time: batching equal-length samples measured no faster on CPU and held more memory
        self.positions = [torch.arange(s.shape[1], device=device).unsqueeze(0) for s in samples]
        self.carry: list = [None] * len(samples)  # GLM-5's DSA layers pass their top-k indices on
        # the float model's hidden states of the tuned and held-out samples entering the next layer (engine/tune.py);
        # empty where they are the quantized path's own: at the start, and after a layer that was not tuned
        self.float_path: dict[int, torch.Tensor] = {}
        # the samples whose output of the layer in hand the tuning has already put in place of their input (rank 0)
        self.advanced: set[int] = set()
        self._logit_end: list | None = None  # [(final norm, lm_head's weight) or None] while the last layers tune
        self._shared: tuple = (None, None)  # (length, layer type), (mask, rotary embeddings)
        self.rotary = type(self.skeleton.model.rotary_emb)(config=self.config).to(self.device)
        self._rotary_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.tokens = tokens
        # the loop and the writers: results held per layer, layers done, the loop's error, a stop asked
        self._cond = threading.Condition()
        self._held: Counter = Counter()
        self._published = start
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        # checkpoints (rank 0): saved entering these layers, committed once segments_done(layer)
        self._checkpoint_at, self._segments_done = checkpoint_at, segments_done
        self._saver, self._saving = devices.pool(1), None
        self._commit_lock = threading.Lock()
        if worker or start >= self.stop:
            pass  # a rank > 0 holds only its samples' hidden states, sent by rank 0 at the start of each layer
        elif resume is not None:
            self._restore(resume)
        else:
            self._embed(samples)
        if resume is not None and worker is False and start >= self.stop:
            self.stats.restore(resume.stats)
        self.stats.resumed_layers = start
        release_freed_memory()  # the tokenizer and the embedding matrix are gone by now

    def _store(self) -> ActivationStore:
        return ActivationStore(self.stats.offload, self.device, self._tmp)

    def close(self, ok: bool = True) -> None:
        """After a failure with several ranks the loop is not waited for: it may be in a collective that a failed
        peer never joins (the process ends without it; its thread is a daemon)."""
        self.stop_loop()
        if self._thread is not None and (ok or self.world == 1):
            self._thread.join()
        self._saver.shutdown(wait=ok or self.world == 1)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _decode(self, name: str) -> torch.Tensor:
        return self.ckpt.decode(self.ckpt.tensors[name], self.device)

    def _embed(self, samples: list[torch.Tensor]) -> None:
        name = f"{self.model.prefix}model.embed_tokens.weight"
        weight = self._decode(name).to(self.compute)
        # Gemma's embedding multiplies by sqrt(hidden_size) (Gemma3TextScaledWordEmbedding), in the weight's dtype
        scale = getattr(self.skeleton.model.embed_tokens, "scalar_embed_scale", None)
        for ids in samples:
            h = nn.functional.embedding(ids.to(self.device), weight)
            self.hidden.append(h if scale is None else h * torch.tensor(scale).to(weight.dtype))

    def _restore(self, resume: Resume) -> None:
        """Continue from a checkpoint: the activations entering its next layer, the stats so far."""
        for name, t in self.checkpoint.activations(resume):
            kind, s = name.split(".")
            if kind == "hidden":
                self.hidden.append(t.to(self.device))
            elif kind == "float":
                self.float_path[int(s)] = self._kept(t)
            else:
                self.carry[int(s)] = t.to(self.device)
        if len(self.hidden) != len(self.positions):
            raise QuantizeError(f"the checkpoint holds {len(self.hidden)} samples, not {len(self.positions)}; "
                                "rerun with --overwrite")
        self.stats.restore(resume.stats)

    # -- the loop and the writers ----------------------------------------------------------------------------
    def start_loop(self) -> None:
        """Run the layer loop in a thread of its own (its device current, its thread count set)."""
        self._thread = threading.Thread(target=self._loop, name=f"layers-rank{self.rank}", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """The layer loop in the calling thread, start..stop-1, each layer published as it finishes."""
        devices.follow()
        torch.set_num_threads(self.threads)  # OpenMP's count is the calling thread's own
        with precision.exact():  # the codes must not depend on the process's TF32 / matmul precision
            for i in range(self.start, self.stop):
                self._wait_for_writers(i)
                self._quantize_layer(i)
                with self._cond:
                    self._published = i + 1
                    self._cond.notify_all()
                self._after_layer(i)

    def _loop(self) -> None:
        try:
            self.run()
        except writers.Stopped:
            pass
        except BaseException as e:  # the writers raise it, in their threads (produce)
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            with self._cond:
                self._stopping = self._stopping or self._error is not None
                self._cond.notify_all()

    def join(self) -> None:
        """Wait for the loop; its error, if any, is raised here."""
        if self._thread is not None:
            self._thread.join()
        self._wait_for_checkpoint()
        if self._error is not None:
            raise self._error

    def stop_loop(self) -> None:
        """End the run early (a writer failed): the loop stops before its next layer, waiting writers raise."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _wait_for_writers(self, i: int) -> None:
        """Before layer i: no results of layers before i - 1 still held (the writers are at most one behind)."""
        t0 = time.perf_counter()
        with self._cond:
            while not self._stopping and any(n for layer, n in self._held.items() if layer <= i - 2):
                self._cond.wait()
            if self._stopping:
                raise writers.Stopped
        self.stats.waited_for_writers += time.perf_counter() - t0

    def _store_result(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Hold a result for the writer that takes it, if this rank writes it."""
        if self.keep is not None and name not in self.keep:
            return
        with self._cond:
            self.results[name] = tensors
            self._held[self.entries[name].role.layer] += 1

    def produce(self, e: Entry) -> list[torch.Tensor] | None:
        """The output tensors of a calibrated entry (waiting for its layer), or None when the entry is not
        calibrated here (the writer produces it from the source)."""
        layer = e.role.layer
        if layer is None or e.role.kind == "mtp" or layer >= self.stop:
            return None
        if self.recipe.method != "awq" and e.tensor.name not in self.targets and e.action != "kv_scale":
            return None  # GPTQ and RTN change only what they quantize; AWQ smoothing also rescales norms and routers
        if layer < self.start:  # tensor_plan's segments and agreement's start rule make this unreachable
            raise AssertionError(f"{e.tensor.name}: layer {layer} was not computed in this run (it starts at "
                                 f"{self.start})")
        with self._cond:
            while self._published <= layer and self._error is None and not self._stopping:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if self._published <= layer:
                raise writers.Stopped
            out = self.results.pop(e.tensor.name, None)
            if out is not None:
                self._held[layer] -= 1
                self._cond.notify_all()
        if out is None and (e.tensor.name in self.targets or e.action == "kv_scale"):
            # never written from the source instead: that would be RTN bytes under a calibrated recipe
            raise AssertionError(f"{e.tensor.name}: layer {layer} kept no result for this rank's writers")
        return out

    # -- checkpoints (rank 0): the activations entering a segment, committed once the segments before are done --
    def _after_layer(self, i: int) -> None:
        if self.rank != 0 or self.checkpoint is None:
            return
        nxt = i + 1
        if nxt in self._checkpoint_at and nxt < self.stop:
            self._wait_for_checkpoint()
            activations = {f"hidden.{s}": self.hidden.host(s) for s in range(len(self.hidden))}
            activations |= {f"carry.{s}": c for s, c in enumerate(self.carry) if c is not None}
            activations |= {f"float.{s}": t for s, t in self.float_path.items()}  # replaced, never written into
            # written while the next layer's calibration pass runs, which reads the activations but changes
            # nothing; its pass through the quantized layer waits for it (_wait_for_checkpoint)
            self._saving = (nxt, self._saver.submit(self.checkpoint.save, nxt, activations), self.stats.to_dict())
        self.try_commit()

    def _wait_for_checkpoint(self) -> None:
        """Block until the pending activations are on disk; its error (a full disk) is raised here."""
        if self._saving is not None:
            t0 = time.perf_counter()
            self._saving[1].result()
            self.stats.waited_for_checkpoint += time.perf_counter() - t0
            self.try_commit()

    def try_commit(self) -> None:
        """Commit the saved checkpoint once its activations are on disk and every shard of the layers before it
        is finished (any thread: the loop after a layer, a writer after a shard)."""
        with self._commit_lock:
            saving = self._saving
            if saving is None or not saving[1].done() or saving[1].exception() is not None:
                return
            layer, future, stats = saving
            if self._segments_done is None or not self._segments_done(layer):
                return
            self.checkpoint.commit(layer, future.result(), stats)
            self._saving = None

    def _mask(self, h: torch.Tensor, pos: torch.Tensor):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        # a plain causal mask may be skipped (SDPA's is_causal path); a DSA indexer needs it materialized
        args = dict(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
        mask = create_causal_mask(**args, allow_is_causal_skip=not self.model.arch.dsa)
        layer_types = getattr(self.config, "layer_types", None)
        if not isinstance(layer_types, list):
            return mask
        # Gemma, Mistral-style sliding-window layers see only the last sliding_window tokens
        return {t: create_sliding_window_causal_mask(**args) if t == "sliding_attention" else mask
                for t in set(layer_types)}

    def _build_layer(self, i: int) -> nn.Module:
        """Layer i with its weights decoded from the source. A MoE layer's routed experts, when the layer has
        targets, are Deferred: decoded later, a chunk at a time (engine/experts.py, engine/awq_experts.py)."""
        layer = self.skeleton.model.layers[i]
        if self._streams_experts(i):
            layer.mlp.experts = routed.Deferred(layer.mlp.experts.act_fn)
        layer.to_empty(device=self.device)
        prefix = f"{self.model.prefix}model.layers.{i}."
        want = dict(layer.named_parameters()) | dict(layer.named_buffers())
        # transformers' names -> the checkpoint's (Mixtral's block_sparse_moe.gate is the layer's mlp.gate)
        have = {self.model.canonical(n[len(prefix):]): n for n in self.ckpt.tensors if n.startswith(prefix)}
        missing = sorted(set(want) - set(have))
        if missing:
            raise QuantizeError(f"layer {i}: the checkpoint lacks {self.model.stored_name(i, missing[0])} that the "
                                f"{type(layer).__name__} needs")
        with torch.no_grad():
            for rel, t in want.items():
                t.copy_(self._decode(have[rel]).to(t.dtype))
        layer.eval()
        return layer

    def _slot(self, s: int) -> int:
        """Where sample s is in this rank's store (rank 0 holds all samples, the others their own)."""
        return s - self.mine.start if self.worker else s

    def _run(self, layer: nn.Module, i: int, advance: bool, before_sample: Callable[[int], None] | None = None,
             stop: "_StopWhenAllSeen | None" = None) -> None:
        """This rank's calibration samples through `layer`; with `advance`, each output replaces its input in
        place. With `stop`, a sample's forward ends as soon as `stop` has seen all it waits for."""
        layer_type = self.layer_type(i)
        topk = takes_topk(layer)
        # inference mode, not just no_grad: ~12% less dispatch overhead per forward (measured on a SmolLM2 layer)
        with torch.inference_mode():
            for s in self.mine:
                if advance and s in self.advanced:
                    continue  # the tuning has put its output there (_advance)
                if before_sample is not None:
                    before_sample(s)
                h, pos = self.hidden[self._slot(s)], self.positions[s]
                mask, rotary = self._inputs(h, pos, layer_type)
                carry = self.carry[s]
                kwargs = {"prev_topk_indices": carry if carry is None else carry.to(self.device)} if topk else {}
                if stop is not None:
                    stop.reset()
                try:
                    y = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rotary, **kwargs)
                except _StopForward:
                    continue
                if isinstance(y, tuple):
                    y, extra = y[0], y[1]
                    if advance:  # with the activations: GLM-5's top-k indices are 16 KB a token
                        self.carry[s] = extra if self.stats.offload == "gpu" or extra is None else extra.to("cpu")
                if advance:
                    self.hidden[self._slot(s)] = y

    def layer_type(self, i: int) -> str | None:
        """Layer i's attention kind where the config names one per layer (sliding_attention, full_attention)."""
        return (getattr(self.config, "layer_types", None) or [None] * (i + 1))[i]

    def _inputs(self, h: torch.Tensor, pos: torch.Tensor, layer_type: str | None):
        """Attention mask and rotary embeddings of a sample, reused while samples keep the same length (a
        materialized mask of 2048 tokens is 16 MB, so only the last one is kept)."""
        key = (h.shape[1], layer_type)
        if self._shared[0] != key:
            mask = self._mask(h, pos)
            # Gemma 3 keeps a rotary table per layer type (local and global bases)
            rotary = self.rotary(h, pos, layer_type) if self._rotary_by_type else self.rotary(h, pos)
            self._shared = (key, (mask[layer_type] if isinstance(mask, dict) else mask, rotary))
        return self._shared[1]

    def _layer_targets(self, i: int) -> dict[str, Entry]:
        """Layer i's targets by their module's name in transformers' layer (Model.canonical)."""
        prefix = f"{self.model.prefix}model.layers.{i}."
        return {self.model.canonical(n[len(prefix):-len(".weight")]): e for n, e in self.targets.items()
                if e.role.layer == i}

    def _streams_experts(self, i: int) -> bool:
        """Whether layer i's routed experts are streamed (engine/experts.py, engine/awq_experts.py): in every MoE
        layer. transformers fuses a layer's experts into one tensor each (gate_up_proj, down_proj) that the
        checkpoint stores per expert: they are decoded a chunk at a time, solved where they are targets and
        only run where they are not (a recipe of attention alone, a layer it leaves out)."""
        experts = getattr(getattr(self.skeleton.model.layers[i], "mlp", None), "experts", None)
        return isinstance(experts, routed.Deferred) or hasattr(experts, "gate_up_proj")

    def _dense_targets(self, i: int, targets: dict[str, Entry]) -> list[str]:
        """Layer i's targets that GPTQ solves in the layer (all but the routed experts engine/experts.py solves)."""
        streamed = self._streams_experts(i)
        return [m for m in targets if not (streamed and ".experts." in m)]

    def _quantize_layer(self, i: int) -> None:
        """Layer i on this rank: on rank 0 everything, on the others (data parallel GPTQ) their samples' forwards
        and their experts, in the same order of exchanges."""
        t0 = time.perf_counter()
        distributed.layer[0] = i
        self.advanced = set()
        targets = self._layer_targets(i)
        if self.dp:
            self._exchange_inputs()
        # AWQ's forwards run on rank 0 alone: the other ranks only take their share of the routed experts
        layer = self._build_layer(i) if self.rank == 0 or self.dp else None
        report = LayerReport(layer=i, seconds=0.0, modules=len(targets))
        if self.recipe.method == "rtn":
            self._rtn_layer(layer, i, targets, report)
        else:
            self._solve_layer(layer, i, targets, report)
        if report.tuned is None:
            self.float_path = {}  # the float path goes on from the quantized one (a MoE layer is not tuned)
        release_freed_memory()
        self.skeleton.model.layers[i] = nn.Module()  # drop the layer's weights
        report.seconds = time.perf_counter() - t0
        if self.rank == 0:
            self.stats.layers.append(report)
            if self.on_layer:
                self.on_layer(report, self.model.num_hidden_layers)
        else:
            self.stats.layers.append(LayerReport(layer=i, seconds=report.seconds, modules=0, phases=report.phases,
                                                 routed_bytes=report.routed_bytes))

    def _solve_layer(self, layer: nn.Module, i: int, targets: dict[str, Entry], report: LayerReport) -> None:
        """GPTQ or AWQ of layer i: the calibration pass, the solves, the pass through the quantized layer."""
        moe, sending = None, []
        if self.recipe.method == "awq":
            moe = self._layer_experts(i, targets) if self._streams_experts(i) else None
            t = time.perf_counter()
            if self.rank == 0:
                awq_layer(self, layer, i, targets, report, moe)
            elif moe is not None:
                moe.share_calibration()
                if moe.norm_applies:
                    moe.search_norm()
            report.phases["awq_search"] = time.perf_counter() - t
        else:
            moe = self._gptq_layer(layer, i, targets, report)
            if self.dp:
                sending = self._share_dense(layer, i, targets)
        if moe is not None and self.rank != 0:
            t = time.perf_counter()
            moe.solve()  # the others solve their experts while rank 0 solves the dense Linears
            report.phases["experts"] = time.perf_counter() - t
        self._wait_for_checkpoint()  # the previous layer's checkpoint still reads the activations about to change
        t1 = time.perf_counter()
        if moe is not None:
            moe.start_advance()
            if layer is not None:
                self._deferred(layer).record = moe.record_advance
        amax, mla = None, None
        if layer is None:
            pass  # an AWQ rank > 0: no forwards
        elif self.recipe.kv_cache:  # observed on the quantized layer, whose K and V are what serving caches
            mla = self.config.qk_nope_head_dim if hasattr(layer.self_attn, "kv_a_layernorm") else None
            with kvcache.observe(layer.self_attn, mla) as amax:
                self._run(layer, i, advance=True)
        else:
            self._run(layer, i, advance=True)
        report.phases["forward"] = report.phases.get("forward", 0.0) + time.perf_counter() - t1
        if moe is not None and self.rank == 0:
            t2 = time.perf_counter()
            moe.solve()
            report.phases["experts"] = time.perf_counter() - t2
        for work, _ in sending:
            work.wait()
        if self.dp:
            self._exchange_outputs(amax)
        if amax is not None and self.rank == 0:
            self._kv_scales(i, amax, mla is not None, report)
        if moe is not None:
            self._finish_experts(moe, i, targets, report)

    def _rtn_layer(self, layer: nn.Module, i: int, targets: dict[str, Entry], report: LayerReport) -> None:
        """Calibrated RTN of layer i: one pass of the samples through the layer as the source has it, summing
        x^2 per input channel of every targeted Linear (the routed experts' inputs recorded), then each group's
        scale by quant/scales.py's search weighted by those sums, and round to nearest. The pass's outputs are
        the next layer's inputs (no second pass: one forward per layer, no Hessian, no solve); the routed
        experts' share of them comes from their codes, as under GPTQ."""
        t0 = time.perf_counter()
        modules = dict(layer.named_modules())
        moe = self._layer_experts(i, targets) if self._streams_experts(i) else None
        dense = self._dense_targets(i, targets)
        squares: dict[str, torch.Tensor] = {}

        def add(name: str, _module, args) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            sq = (x * x).sum(0)
            squares[name] = sq if name not in squares else squares[name].add_(sq)
        hooks = [modules[m].register_forward_pre_hook(partial(add, m)) for m in dense]
        self._wait_for_checkpoint()  # the previous layer's checkpoint still reads the activations about to change
        if moe is not None:
            moe.start_advance()
            self._deferred(layer).record = moe.record_advance
        self._run(layer, i, advance=True)
        for h in hooks:
            h.remove()
        t1 = time.perf_counter()
        report.phases["forward"] = t1 - t0
        for m in sorted(dense):
            done = self._quantize_stacked([m], [modules[m].weight.data], None, {m: targets[m]}, squares.pop(m, None))
            self._commit(modules[m], targets[m], *done[0], report)
        t2 = time.perf_counter()
        report.phases["dense"] = t2 - t1
        if moe is not None:
            moe.calibrate_from_advance()
            moe.solve()
            report.phases["experts"] = time.perf_counter() - t2
            self._finish_experts(moe, i, targets, report)

    # -- data parallel forwards: the samples' hidden states to their ranks and back, once per layer -------------
    def _exchange_inputs(self) -> None:
        """Rank 0 sends each rank the hidden states (and GLM-5's carried top-k indices) of its samples."""
        for r in range(1, self.world):
            for s in self.shares[r]:
                if self.rank == 0:
                    distributed.send(self.hidden[s], r)
                    distributed.send_any(self.carry[s], r)
                elif self.rank == r:
                    h = distributed.recv(self._empty_hidden(s), 0)
                    if self._slot(s) < len(self.hidden):
                        self.hidden[self._slot(s)] = h
                    else:
                        self.hidden.append(h)
                    self.carry[s] = distributed.recv_any(0, self.device)

    def _empty_hidden(self, s: int) -> torch.Tensor:
        return torch.empty(1, self.positions[s].shape[1], self.model.hidden_size, dtype=self.compute,
                           device=self.device)

    def _exchange_outputs(self, amax: "kvcache.Amax | None") -> None:
        """The quantized layer's outputs of each rank's samples back to rank 0, with what K and V looked like
        (their max, and the sampled values in sample order: rank by rank, each in order)."""
        for r in range(1, self.world):
            if self.rank not in (0, r):
                continue
            for s in self.shares[r]:
                if self.rank == r:
                    distributed.send(self.hidden[self._slot(s)], 0)
                    distributed.send_any(self.carry[s], 0)
                else:
                    h = distributed.recv(self._empty_hidden(s), r)
                    # a sample the tuning advanced keeps rank 0's output: the bytes of one rank (each rank runs its
                    # share whatever rank 0's tuning decided, so the messages never depend on it)
                    if s not in self.advanced:
                        self.hidden[s] = h
                    self.carry[s] = distributed.recv_any(r, self.device)
            if amax is None:
                continue
            for which in ("k", "v"):
                if self.rank == r:
                    distributed.send_any(getattr(amax, which), 0)
                    values = amax.values[which]
                    distributed.send_any(torch.cat(values) if values else None, 0)
                else:
                    m = distributed.recv_any(r, self.device)
                    if m is not None:
                        old = getattr(amax, which)
                        setattr(amax, which, m if old is None else torch.maximum(old, m))
                    values = distributed.recv_any(r, torch.device("cpu"))
                    if values is not None:
                        amax.values[which].append(values)

    def _share_dense(self, layer: nn.Module, i: int, targets: dict[str, Entry]) -> list:
        """Rank 0's quantized dense Linears (their dequantized weights, as the model computes with them) to the
        other ranks, for their samples' pass through the quantized layer; rank 0 does not wait for them."""
        modules = dict(layer.named_modules())
        sending = []
        for m in sorted(self._dense_targets(i, targets)):
            w = modules[m].weight.data
            if self.rank == 0:
                sending.append(distributed.broadcast(w, 0, async_op=True))
            else:
                distributed.broadcast(w, 0)
        return sending

    @staticmethod
    def _deferred(layer: nn.Module) -> "routed.Deferred":
        return next(mod for mod in layer.modules() if isinstance(mod, routed.Deferred))

    def _layer_experts(self, i: int, targets: dict[str, Entry]) -> "routed.LayerExperts":
        """The expert work of MoE layer i, the same on every rank."""
        by_expert: dict[int, dict[str, Entry]] = defaultdict(dict)
        for m, e in targets.items():
            if ".experts." in m:
                by_expert[e.role.expert][m.rsplit(".", 1)[1]] = e
        act_fn = self.skeleton.model.layers[i].mlp.experts.act_fn  # fused, or the Deferred that replaced it
        setting = routed.Setting(self.ckpt, self.device, self.compute, self.dtype, self.recipe.scheme,
                                 self.recipe.gptq, self.recipe.calibration, self.world, self.rank, self.stats.offload,
                                 squares=self.recipe.method == "rtn")
        def weight_name(e: int, leaf: str) -> str:
            return self.model.stored_name(i, f"mlp.experts.{e}.{leaf}.weight")

        args = (setting, weight_name, self.model.n_routed_experts, dict(by_expert), self.tokens, self.model.hidden_size,
                self.config.num_experts_per_tok, act_fn, partial(TokenBuffer, self.stats.offload, self.device, self._tmp),
                self.on_expert, self.spans if self.dp else None)  # without data parallel forwards, rank 0's all
        if self.recipe.method != "awq":
            return routed.LayerExperts(*args)
        starts = [0, *itertools.accumulate(p.numel() for p in self.positions)]
        moe = AWQExperts(*args, awq_params=self.recipe.awq, bounds=list(zip(starts, starts[1:], strict=False)))
        # whether the norm before the experts is smoothed: some Linear it feeds is quantized (awq_layer._mappings)
        patterns = [p for _, ps in self.model.arch.awq_norms for p in ps if "experts" in "".join(ps)]
        moe.norm_applies = any(re.fullmatch(p, m) for p in patterns for m in targets)
        return moe

    def _finish_experts(self, moe: "routed.LayerExperts", i: int, targets: dict[str, Entry],
                        report: LayerReport) -> None:
        """After the quantized layer's pass and the experts' solves: every routed output added to the layer's
        outputs (rank 0 holds them all); each rank's experts' results go to its own writers, and their fallbacks
        and errors (a few numbers) to rank 0's report."""
        t1 = time.perf_counter()
        moe.share_advance()
        y = moe.routed_output()
        report.routed_bytes = moe.routed_bytes
        rel = {e.role.expert: m.split(".experts.")[0] + ".experts." for m, e in targets.items() if ".experts." in m}
        for (e, leaf), r in sorted(moe.results.items()):
            name = moe.weight_name(e, leaf)  # a target's codes, or a weight AWQ rescaled and left float
            if name in self.entries:
                self._store_result(name, r.tensors)
        meta = moe.collect()
        searches = moe.collect_searches() if isinstance(moe, AWQExperts) else {}
        moe.results.clear()
        if self.rank != 0:
            report.phases["routed_output_and_exchange"] = time.perf_counter() - t1
            return
        start = 0
        for s in range(len(self.hidden)):
            n = self.positions[s].numel()
            h = self.hidden[s]
            self.hidden[s] = h + y[start:start + n].to(h.device).view_as(h)
            start += n
        del y
        t2 = time.perf_counter()
        cal = self.recipe.calibration
        report.tokens_per_expert = dict(enumerate(moe.counts))
        for e in sorted(rel):
            if moe.rtn_only(e):
                why = "never routed" if isinstance(moe, AWQExperts) else f"{moe.counts[e]} tokens < {cal.min_expert_tokens}"
                report.fallbacks.append(f"{rel[e]}{e} ({why}: RTN)")
            else:
                report.experts_calibrated += 1
        for e, (ratio, initial, best) in searches.items():
            self.stats.awq.append({"layer": i, "smooth": f"{rel.get(e, 'mlp.experts.')}{e}.up_proj", "ratio": ratio,
                                   "loss_identity": initial, "loss_best": best})
        for (e, leaf), (fallback, error) in sorted(meta.items()):
            entry = targets[f"{rel[e]}{e}.{leaf}"]
            if fallback:
                report.fallbacks.append(f"{entry.role.module} (Hessian not positive definite or not finite: RTN)")
            self.stats.error[entry.role.kind].append(error)
        if self.on_expert is not None:
            self.on_expert(self.model.n_routed_experts - 1, self.model.n_routed_experts)
        report.phases["routed_output_and_exchange"] = t2 - t1

    def _kv_scales(self, i: int, amax: kvcache.Amax, mla: bool, report: LayerReport) -> None:
        k, v = kvcache.scales(amax, self.dtype, mla)
        report.kv_scale = [float(k), float(v)]
        for name, t in zip(serving.kv_scale_names(self.model.prefix, i, mla), (k, v), strict=True):
            if name in self.entries:
                self._store_result(name, [t])

    def _gptq_layer(self, layer: nn.Module, i: int, targets: dict[str, Entry],
                    report: LayerReport) -> "routed.LayerExperts | None":
        """The calibration pass (dense Hessians, the routed experts' inputs), then GPTQ of the dense Linears on
        rank 0. Returns the layer's pending expert work, or None for a layer without routed targets."""
        t0 = time.perf_counter()
        modules = dict(layer.named_modules())
        moe = self._layer_experts(i, targets) if self._streams_experts(i) else None
        dense_targets = self._dense_targets(i, targets)
        routed_targets = moe is not None and any(moe.targets.values())
        if not dense_targets and not routed_targets:
            return moe  # nothing to calibrate here: the layer only runs (its experts too), in the quantized pass
        hessians = Hessians(self.device, len(self.positions), self.rank if self.dp else 0, self.world if self.dp else 1,
                            amax=self.recipe.scheme.w4a4)
        # the pass is only for the Hessians: once every target has seen its input, the rest of the layer (the
        # last down_proj, the shared experts when they are not quantized) is skipped
        stop = _StopWhenAllSeen([*dense_targets, *(["experts"] if routed_targets else [])])
        hooks = [modules[m].register_forward_pre_hook(partial(hessians.hook, m)) for m in dense_targets]
        hooks += [modules[m].register_forward_pre_hook(partial(stop.pre_hook, m)) for m in dense_targets]
        if routed_targets:
            def record(x, top_k_index, top_k_weights):
                moe.record_calibration(x, top_k_index, top_k_weights)
                stop.seen("experts")
            self._deferred(layer).record = record
        self._run(layer, i, advance=False, before_sample=hessians.start_sample, stop=stop)
        for h in hooks:
            h.remove()
        t1 = time.perf_counter()
        report.phases["forward"] = t1 - t0
        if routed_targets:
            self._deferred(layer).record = None
            moe.share_calibration()  # every rank starts on its experts now
        hessians.finish()  # on rank 0, added over all the ranks' samples
        if self.rank != 0:
            return moe
        by_module, input_amax = hessians.by_module(), hessians.amax_by_module() if hessians.amax is not None else {}
        by_input: dict[int, list[str]] = defaultdict(list)  # q/k/v, gate/up: one Hessian, one stacked solve
        for m in sorted(dense_targets):
            by_input[id(by_module[m])].append(m)
        del hessians
        tune_now = self._tunes(i, moe)
        solved: dict[str, tuple] = {}
        for names in by_input.values():
            H = by_module[names[0]]
            done = self._quantize_stacked(names, [modules[m].weight.data for m in names], H, targets, values=tune_now)
            for m, result in zip(names, done, strict=True):
                if tune_now:
                    solved[m] = result  # committed after the tuning, which needs the float layer's outputs
                else:
                    self._commit(modules[m], targets[m], *result[:3], report, input_amax.get(m))
            del H
            release_freed_memory()
        by_module.clear()
        report.phases["dense"] = time.perf_counter() - t1
        if tune_now:
            t2 = time.perf_counter()
            for m, result in self._tune(layer, i, solved, targets, report).items():
                self._commit(modules[m], targets[m], *result, report, input_amax.get(m))
            report.phases["tune"] = time.perf_counter() - t2
        return moe

    def _tunes(self, i: int, moe) -> bool:
        """Whether layer i's dense Linears are tuned after GPTQ (engine/tune.py): asked for, on rank 0, a symmetric
        INT4 scheme, and a layer without routed experts (its output would need them, streamed apart)."""
        return tunes(self.recipe) and self.rank == 0 and moe is None

    def _tune(self, layer: nn.Module, i: int, solved: dict[str, tuple], targets: dict[str, Entry],
              report: LayerReport) -> dict[str, tuple]:
        """GPTQ's results of layer i's dense Linears tuned on the layer's output: (codes, Params, fallback) each.
        The attention's inputs where tuning.tuned leaves them out (the recipe's tune_attention false), a
        Linear whose GPTQ fell back to RTN, or whose groups keep an INT4 source's lattice, stay as solved, and run
        quantized in the tuning's forwards.
        The float path of the tuned and held-out samples moves on through the float layer (its outputs are the
        targets)."""
        p = self.recipe.gptq
        mods = dict(layer.named_modules())
        grid = self.recipe.scheme.grid
        tunables = {m: Tunable.of(self.recipe.scheme, r[3], r[1], mods[m].weight.data, p.tune_rate)
                    for m, r in solved.items()
                    if tuning.tuned(m, p.tune_attention) and r[3] is not None and not r[2]
                    and targets[m].tensor.encoding != "ct-int4"}
        kept = False
        if tunables:
            samples = tuning.subset(len(self.positions), p.samples(grid) + p.tune_holdout)
            float_out: dict[int, torch.Tensor] = {}
            with torch.no_grad():  # not inference mode: the targets are saved for the loss's backward
                for chunk in tuning.chunks(samples, p.tune_batch):
                    float_out |= dict(zip(chunk, self._tuning_forward(layer, i, chunk, None), strict=True))

            def dequantized(names) -> dict[str, torch.Tensor]:
                return {m: codec.dequantize(self.recipe.scheme, solved[m][0], solved[m][1]).to(self.compute)
                        for m in names}

            # the Linears that stay as solved run quantized in the tuning's forwards too
            fixed = dequantized(m for m in solved if m not in tunables)
            # the error to beat is GPTQ's, not the start's
            gptq = dequantized(tunables) if self.recipe.scheme.fp4 in START_FROM_RTN else None
            # attention's inputs fixed (tune_attention false): its context is kept from each sample's first quantized
            # forward
            cache = AttentionCache.of(layer, list(tunables))
            # the last layers' error is measured through the final norm and lm_head (tuning.Head)
            head = self._head(i, float_out) if tuning.on_logits(i, self.model.num_hidden_layers, grid) else None
            def stored() -> dict[str, torch.Tensor]:  # the tuned weights as _commit will put them in the layer
                return {m: codec.dequantize(self.recipe.scheme, t.codes(), t.params(solved[m][1])).to(self.compute)
                        for m, t in tunables.items()}

            # the tuned samples' outputs under the kept weights take their inputs' place now, and the pass through
            # the quantized layer skips them (_run); not where that pass observes K and V for the KV cache's
            # scales, or carries GLM-5's top-k indices on, which the tuning's forwards do not
            emit = None
            if self.recipe.kv_cache is None and not takes_topk(layer):
                self._wait_for_checkpoint()  # the previous layer's checkpoint may still read these activations
                emit = self._advance
            before, after = tuning.tune_layer(partial(self._tuning_forward, layer, i, cache=cache), float_out, tunables,
                                              p.iters, p.tune_batch, self.compute,
                                              seed=self.recipe.calibration.seed * 100003 + i, gptq=gptq,
                                              held=tuning.split(samples, p.tune_holdout)[1],
                                              per_channel=self.recipe.scheme.fp4 not in tuning.PLAIN_ERROR,
                                              fixed=fixed, head=head, final=stored, emit=emit)
            report.tuned = [before, after]
            kept = after < before
            self.float_path = {s: self._kept(y) for s, y in float_out.items()}
        out = {}
        for m, (codes, params, fallback, _) in solved.items():
            t = tunables.get(m)
            if t is not None and kept:
                codes, params = t.codes(), t.params(params)
            out[m] = (codes, params, fallback)
        return out

    def _advance(self, s: int, y: torch.Tensor) -> None:
        """Sample s's output of the quantized layer, computed by the tuning, in place of its input (as _run's pass
        would put it there, which then skips it)."""
        self.hidden[s] = y
        self.advanced.add(s)

    def _head(self, i: int, float_out: dict[int, torch.Tensor]) -> "tuning.Head | None":
        """Layer i's Head (tuning.Head), its Fisher information from `float_out`: what follows the last decoder
        layer, the model's own final norm in float32 and lm_head's weight, or the embedding's where the checkpoint
        ties them; None where the checkpoint has no final norm under the usual name (the layer's error is then the
        per-channel one). The norm and weight are decoded once for the last layers that all read through them (a
        70B's lm_head is 2 GB) and let go after the last layer."""
        if self._logit_end is None:
            pre = self.model.prefix
            names = [f"{pre}model.norm.weight", f"{pre}lm_head.weight", f"{pre}model.embed_tokens.weight"]
            end = None
            if names[0] in self.ckpt.tensors and isinstance(getattr(self.skeleton.model, "norm", None), nn.Module):
                norm = copy.deepcopy(self.skeleton.model.norm).to_empty(device=self.device).float()
                with torch.no_grad():
                    norm.weight.copy_(self._decode(names[0]))
                end = (norm, self._decode(names[1] if names[1] in self.ckpt.tensors else names[2]).to(self.compute))
            self._logit_end = [end]
        end = self._logit_end[0]
        if i == self.model.num_hidden_layers - 1:
            self._logit_end = None
        return tuning.Head.of(*end, list(float_out.values())) if end is not None else None

    def _kept(self, t: torch.Tensor) -> torch.Tensor:
        """A float path's hidden state where the activations are kept (host memory unless they stay on the GPU)."""
        return t.detach() if self.stats.offload == "gpu" else t.detach().to("cpu")

    def _tuning_forward(self, layer: nn.Module, i: int, samples: list[int],
                        weights: dict[str, torch.Tensor] | None,
                        cache: AttentionCache | None = None) -> list[torch.Tensor]:
        """`samples` through layer i, as one batch where they have one length: with `weights` in place of its
        modules' on the quantized path's inputs; with None, the float layer on the float path's inputs. Outside
        inference mode: autograd cannot save the activations and the mask made in it, so they are copied. cache:
        the quantized path's attention contexts (engine/attention_cache.py), where its inputs are not tuned."""
        if weights is None:
            hs = [self.float_path[s].to(self.device) if s in self.float_path else self.hidden[s] for s in samples]
        else:
            hs = [self.hidden[s] for s in samples]
        # GLM-5's carried top-k indices are a sample's own: one at a time (the float path takes the quantized
        # path's indices; it has no indexer of its own)
        topk = takes_topk(layer)
        batched = not topk and len({h.shape[1] for h in hs}) == 1
        groups = [list(range(len(samples)))] if batched else [[k] for k in range(len(samples))]
        clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
        for prm in layer.parameters():
            prm.requires_grad_(False)
        out: list = [None] * len(samples)
        for g in groups:
            h, pos = torch.cat([hs[k] for k in g]), self.positions[samples[g[0]]]
            # a mask and rotary table of one sample broadcast over the batch (and stay cached for _run's)
            mask, rotary = self._inputs(h[:1], pos, self.layer_type(i))
            mask = {k: clone(v) for k, v in mask.items()} if isinstance(mask, dict) else clone(mask)
            rotary = tuple(clone(t) for t in rotary) if isinstance(rotary, tuple) else clone(rotary)
            carry = self.carry[samples[g[0]]]
            kwargs = {"prev_topk_indices": carry if carry is None else carry.to(self.device)} if topk else {}
            args = dict(attention_mask=mask, position_ids=pos, position_embeddings=rotary, **kwargs)
            if weights is None:
                y = layer(h.clone(), **args)
            else:
                with cache.serving([samples[k] for k in g], weights) if cache is not None else nullcontext():
                    y = torch.func.functional_call(layer, weights, (h.clone(),), args, strict=False)
            y = y[0] if isinstance(y, tuple) else y
            for j, k in enumerate(g):
                out[k] = y[j:j + 1]
        return out

    def _quantize_stacked(self, names: list[str], weights: list[torch.Tensor], H: torch.Tensor | None,
                          targets: dict[str, Entry], squares: torch.Tensor | None = None,
                          values: bool = False) -> list[tuple]:
        """(codes, codec.Params, fallback) of each Linear fed the same input, solved as one matrix: GPTQ against H,
        or RTN when H is None (its steps chosen by the inputs' sums of x^2 `squares` [in], when given). GPTQ
        treats the rows of W independently given H (the codes are the same bytes as
        one by one), so H is factored once and each column step updates every Linear at once (q/k/v of SmolLM2:
        130 -> 55 ms). H is consumed: GPTQ frees it as soon as it has its working copy. With `values`, each
        tuple has a fourth member: GPTQ's values before rounding [out, in] float32 (quant/signround.py)."""
        s, p = self.recipe.scheme, self.recipe.gptq
        ws = [w.to(self.dtype) for w in weights]  # steps from the weight in the model's dtype, as compressed-tensors'
        gscales = self._global_scales([targets[m].tensor.name for m in names], ws)
        # an INT4 source's trained lattice stays where the target groups hold it (quant/lattice.py)
        held = [None if s.fp4 else self.ckpt.lattice(targets[m].tensor, s.group_size, self.device) for m in names]
        if H is not None and p.scales == "hessian":  # steps from the Hessian's diagonal blocks, then GPTQ
            blocks = scales.diagonal_blocks(gptq.mirror_upper(H)[None], s.group_size)
            params = [codec.searched(s, [w], [g], blocks, [h])[0] for w, g, h in zip(ws, gscales, held, strict=True)]
        elif H is None and squares is not None:  # calibrated RTN: steps from E[x^2]
            diag = squares.float().reshape(1, -1, s.group_size)
            params = [codec.searched(s, [w], [g], diag, [h])[0] for w, g, h in zip(ws, gscales, held, strict=True)]
        else:
            params = [codec.params(s, w, g, h) for w, g, h in zip(ws, gscales, held, strict=True)]
        if H is None:
            return [(codec.rtn_codes(s, w, q), q, False) for w, q in zip(ws, params, strict=True)]
        zp = None if params[0].zero_point is None else torch.cat([q.zero_point for q in params])
        kept: list | None = [] if values else None
        codes, fallback = gptq.gptq_quantize(torch.cat(ws), H, torch.cat([q.step for q in params]), zp, consume=True,
                                             num_bits=s.num_bits, blocksize=p.block_size, percdamp=p.dampening_frac,
                                             actorder=p.actorder == "static", fp4=bool(s.fp4), values=kept)
        sizes = [w.shape[0] for w in ws]
        if kept is None:
            return [(rows, q, fallback) for rows, q in zip(codes.split(sizes), params, strict=True)]
        return [(rows, q, fallback, v) for rows, q, v in zip(codes.split(sizes), params, kept[0][0].split(sizes),
                                                             strict=True)]

    def _global_scales(self, names: list[str], ws: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """NVFP4: each weight's global scale, its fused set's (plan.fused: the largest magnitude of any member,
        as the engines fuse them); the members share an input, so they are in the same stack (a member outside
        it is decoded from the source). None for the other schemes."""
        if self.recipe.scheme.fp4 != "nvfp4":
            return [None] * len(ws)
        here = dict(zip(names, ws, strict=True))

        def weight(m: str) -> torch.Tensor:
            return here[m] if m in here else self.ckpt.decode(self.ckpt.tensors[m], self.device).to(self.dtype)
        return [fp4.set_global_scale(weight(m) for m in self.plan.fused.get(n, (n,))) for n in names]

    def _commit(self, module: nn.Linear, e: Entry, codes, params: "codec.Params", fallback: bool,
                report: LayerReport, input_amax: torch.Tensor | None = None) -> None:
        """Record the result and make the module compute with it (for the next layer's inputs); input_amax: the
        largest magnitude of its calibration inputs (NVFP4 activations' global scale)."""
        W = module.weight.data
        if fallback:
            report.fallbacks.append(f"{e.role.module} (Hessian not positive definite or not finite: RTN)")
        s = self.recipe.scheme
        Wq = codec.dequantize(s, codes, params).to(W.dtype)
        self.stats.error[e.role.kind].append(float((W.float() - Wq.float()).norm() / W.float().norm().clamp(min=1e-12)))
        module.weight.data = Wq
        if self.keep is not None and e.tensor.name not in self.keep:
            return  # written before a resume, or by another rank
        amax = None if input_amax is None else input_amax.to(self.dtype)
        self._store_result(e.tensor.name, [t.to("cpu") for t in codec.outputs(s, codes, params, e.tensor.shape, amax)])

    def _quantize_module(self, module: nn.Linear, e: Entry, report: LayerReport) -> None:
        """RTN of one Linear (AWQ's last step, after its scales are applied)."""
        self._commit(module, e, *self._quantize_stacked([e.role.module], [module.weight.data], None,
                                                         {e.role.module: e})[0], report)
        release_freed_memory()


def _check_checkpoint_space(partial: Path, plan: Plan, samples: list[torch.Tensor], dtype: torch.dtype) -> None:
    """The layer checkpoint briefly holds two copies of the activations: refuse up front when they cannot fit."""
    need = 2 * sum(s.numel() for s in samples) * plan.model.hidden_size * dtype.itemsize
    free = shutil.disk_usage(partial).free
    if need > free:
        raise QuantizeError(f"the layer checkpoints need {need / 2**30:.1f} GiB in {partial} but "
                            f"{free / 2**30:.1f} GiB is free; free space and rerun")


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


def _quantizer(plan: Plan, samples: list[torch.Tensor], device: torch.device, account: memory.Account,
               dtype: torch.dtype, terms: dict, rank: int, world: int, **kwargs) -> LayerwiseQuantizer:
    """This rank's quantizer for the run rank 0 planned (agreement.run_terms): its layers, and the results its
    writers take (the tensors of its own main shards still to write)."""
    keep = {e.tensor.name for i in writers.own_todo(plan, terms["todo"][0], rank, world) for e in plan.shards[i]}
    return LayerwiseQuantizer(plan, samples, device, account, compute_dtype=dtype, worker=rank != 0,
                              start=terms["start"], stop=terms["stop"], keep=keep, **kwargs)


def _layout_key(plan: Plan) -> str:
    """What every rank's plan must agree on before it writes: the shards' names and tensors."""
    import hashlib

    return hashlib.sha256(json.dumps([[e.tensor.name for e in s] for s in plan.shards]).encode()).hexdigest()


class Calibrated:
    """The `calibrated` hook of stream.run: the ranks, their agreement, then the layer loop and its producer.

    With several ranks, `launch` has started ranks 1.. on devices[1:] (engine/distributed.py; quantize/convert.py
    starts them before planning) and this process is rank 0 on devices[0]; under torchrun the group is up
    already. From here on the process group is the one record of the ranks (agreement.world()).
    Made before OUT.partial exists: the ranks agree on the offload here, so a refusal leaves nothing."""

    def __init__(self, plan: Plan, samples: list[torch.Tensor], device: torch.device, offload: str = "auto",
                 on_layer: Callable[[LayerReport, int], None] | None = None, devices: list[str] | None = None,
                 on_expert: Callable[[int, int], None] | None = None, compute_dtype: str = "auto",
                 launch: "distributed.Launch | None" = None):
        self.devices = devices or []
        self._launch, self._ctx = launch, None
        if len(self.devices) > 1 and launch is None:
            raise AssertionError("several devices: the caller launches their ranks (distributed.Launch)")
        if self._launch is not None:
            self._ctx = self._launch.join()
        self.rank, self.world = agreement.world()
        compute_ = compute.choose(plan.ckpt.dtype, device, compute_dtype)
        self.compute, samples = agreement.setup(compute_, samples)
        self.cpu_capability = compute.cpu_capability() if device.type == "cpu" else None
        reading = memory_reading(plan, samples, device, self.compute, self.world, self.rank)
        self.offload = agreement.memory_terms(reading, offload)
        self.account = reading.accounts[self.offload]
        self.args = (plan, samples, device)
        self.on_layer, self.on_expert = on_layer, on_expert
        self.quantizer: LayerwiseQuantizer | None = None
        self.ranks: list[dict] = []  # every rank's summary, once joined
        self._todo: list[list[int]] = []
        self._partials: list[Path] = []
        self._written: list[set[int]] = []

    def start(self, partials: list[Path], todo: list[list[int]]) -> LayerwiseQuantizer:
        """Plan the run (from the layer checkpoint in partials[0] when one fits what is still to write), tell the
        ranks, and start the layer loop; returns the quantizer whose `produce` the writers call."""
        plan, samples, device = self.args
        checkpoint = LayerCheckpoint(partials[0] / CALIB_DIR, samples_key(samples, device, self.compute))
        resume = checkpoint.load()
        _check_checkpoint_space(partials[0], plan, samples, self.compute)
        stop = work_stop(plan)
        # the first layer any shard still to write needs: a checkpoint at or before it is where the run starts
        pending = set().union(*map(set, todo))
        first = min((plan.segments[seg][0] for i in pending if (seg := plan.segment_of(i)) is not None
                     and plan.segments[seg][0] < stop), default=stop)
        start = stop if first >= stop else resume.next_layer if resume is not None and resume.next_layer <= first else 0
        terms = agreement.run_terms({"start": start, "stop": stop, "partials": [str(p) for p in partials],
                                     "todo": todo, "layout": _layout_key(plan)})
        agreement.check_all(None)  # the other ranks check the layout and that they see OUT.partial
        self._todo, self._partials = todo, partials
        self._written = [set() for _ in todo]
        self.quantizer = _quantizer(plan, samples, device, self.account, self.compute, terms, self.rank, self.world,
                                    on_layer=self.on_layer, on_expert=self.on_expert, checkpoint=checkpoint,
                                    resume=resume if resume is not None and start == resume.next_layer else None,
                                    checkpoint_at={lo for lo, _ in plan.segments},
                                    segments_done=self._segments_done)
        self.quantizer.start_loop()
        return self.quantizer

    def shard_written(self, i: int, pair: tuple) -> None:
        """Rank 0's writer finished shard i: a checkpoint waiting for it may commit now."""
        for side, written in zip(self._written, pair, strict=True):
            if written is not None:
                side.add(i)
        self.quantizer.try_commit()

    def _segments_done(self, layer: int) -> bool:
        """Whether every shard of the segments before `layer` is on disk, in every output (rank 0's writers, or
        another rank's receipt)."""

        plan = self.args[0]
        names = plan.shard_names
        for i in range(len(plan.shards)):
            seg = plan.segment_of(i)
            if seg is None or plan.segments[seg][1] > layer:
                continue
            for todo, written in zip(self._todo, self._written, strict=True):
                if i in todo and i not in written and not writers.receipt_path(self._partials[0], names[i]).is_file():
                    return False
        return True

    def join(self, writer_stats: list[dict]) -> None:
        """Wait for the loop (its error raised here), then take every rank's summary."""
        self.quantizer.join()
        mine = summary(self.quantizer, str(self.args[2]), writer_stats)
        self.ranks = [mine] + [json.loads(distributed.recv_text(r)) for r in range(1, self.world)]
        self.quantizer.stats.ranks = self.ranks

    def close(self, ok: bool = True) -> None:
        if self.quantizer is not None:
            self.quantizer.close(ok)
        if self._ctx is not None:
            distributed.finish(self._ctx, ok, self._launch.stopped, self.devices)
        elif self._launch is not None:
            self._launch.close()  # started, never given work


def summary(q: LayerwiseQuantizer, device: str, writers: list[dict] | None = None) -> dict:
    """One rank's seconds: per phase summed over its layers, its loop's waits, and its writers'."""
    phases: Counter = Counter()
    for x in q.stats.layers:
        phases.update(x.phases)
    return {"rank": q.rank, "device": device, "layers": len(q.stats.layers),
            "seconds": round(sum(x.seconds for x in q.stats.layers), 3),
            "phases": {k: round(v, 3) for k, v in sorted(phases.items())},
            "routed_bytes": sum(x.routed_bytes for x in q.stats.layers),
            "waited_for_writers": round(q.stats.waited_for_writers, 3),
            "waited_for_checkpoint": round(q.stats.waited_for_checkpoint, 3),
            "writers": writers or []}


def rank_job(src: Path, recipe, devices: list[str], offload: str, allow_nonfinite: bool = False,
             timeout_s: float = distributed.DEFAULT_TIMEOUT_S, max_shard_size: int = 1 << 62, prefill_recipe=None):
    """The Job of ranks 1.. (the CLI makes it before planning, to start them early)."""
    return distributed.Job(str(src), recipe.to_dict(), max_shard_size, devices, offload, allow_nonfinite, timeout_s,
                           prefill_recipe.to_dict() if prefill_recipe is not None else None)


def run_rank(job, device: torch.device) -> None:
    """A rank > 0 (engine/distributed.py's Job): the same plan as rank 0, rank 0's samples and terms, then its
    share of every layer's work, and the shards of its expert groups written by its own writers."""
    from quantize import recipe
    from quantize.checkpoint import Checkpoint
    from quantize.tensor_plan import build, pair

    ckpt = Checkpoint(Path(job.src), job.allow_nonfinite)
    # workers=0: no check of this rank's memory alone (agreement.memory_terms checks every rank's, together)
    plan = build(ckpt, recipe.from_dict(job.recipe, "rank job"), job.max_shard_size, workers=0)
    prefill = None
    if job.prefill_recipe is not None:
        plan, prefill = pair(plan, build(ckpt, recipe.from_dict(job.prefill_recipe, "rank job"), job.max_shard_size,
                                         workers=0), job.max_shard_size)
    plan.model.causal_lm_class()  # transformers' model code imports (seconds) while rank 0 still plans
    rank, world = agreement.world()
    dtype, samples = agreement.setup(None, None)
    reading = memory_reading(plan, samples, device, dtype, world, rank)
    offload = agreement.memory_terms(reading, job.offload)
    terms = agreement.run_terms(None)
    problem = None
    if terms["layout"] != _layout_key(plan):
        problem = f"rank {rank} planned other shards than rank 0 (another source or quantize version?)"
    elif not all(Path(p).is_dir() for p in terms["partials"]):
        problem = (f"rank {rank} cannot see {terms['partials'][0]}: every rank writes its own shards there, so OUT "
                   "must be on a filesystem every node shares")
    agreement.check_all(problem)
    q = _quantizer(plan, samples, device, reading.accounts[offload], dtype, terms, rank, world)
    partials = [Path(p) for p in terms["partials"]]
    q.start_loop()
    try:
        stats = writers.run(plan, prefill, partials, terms["todo"], writers.own_todo(plan, sorted(set().union(
            *map(set, terms["todo"]))), rank, world), q, device,
            on_written=lambda i, written: writers.write_receipt(partials[0], plan.shard_names[i], written))
        q.join()
    except BaseException:
        q.close(ok=False)
        raise
    q.close()
    distributed.send_text(json.dumps(summary(q, str(device), stats)), 0)
