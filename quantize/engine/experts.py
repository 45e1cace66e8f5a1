"""A MoE layer's routed experts under GPTQ: ownership, routing, streamed chunks, batched solves, one exchange.

The routed experts are never built as modules, and never whole in memory. In the layer they are `Deferred`:
its forward records what the router sends (tokens, top-k experts and weights) and returns zeros. That is exact
because the routed output is only ever added (to the shared experts' output, then to the residual), so the
engine adds it afterwards, from `LayerExperts.routed_output`.

Per layer, on every rank (the same code with one rank):
- each rank runs the forwards of its own samples (engine/layerwise.py) and records their MoE inputs into its
  span of one [tokens, hidden] buffer; the spans are then exchanged (one broadcast per rank and pass), so
  every rank holds every token's input;
- the buffer is sorted by expert once (`route`: one stable argsort), so each expert reads a contiguous run of
  token indices;
- the experts are split into distributed.GROUPS fixed groups; a rank owns whole groups, decodes only their
  experts, chunk by chunk of bounded bytes, from the source, builds their Hessians from their own tokens and
  solves each chunk as one stack (`gptq.gptq_quantize_batched`), with no collective per expert;
- after the quantized layer's pass, each group's routed output is summed on its owner, expert by expert in
  order, and rank 0 adds the groups in order: the same sums in the same order for any number of ranks, so
  the bytes never depend on it;
- the codes and scales stay on the rank that solved them, whose writers write its groups' shards (each group
  is a stream of shards of its own: tensor_plan.calibrated_keys); rank 0 gets each Linear's fallback and error.
"""

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from quantize.engine.activations import TokenBuffer, release_freed_memory
from quantize.engine.distributed import GROUPS, broadcast, expert_groups, group_members, recv, recv_any, send, send_any
from quantize.engine.ordered import in_order, single_threaded
from quantize.quant import codec, fp4, gptq, scales
from quantize.tensor_plan import Entry

LEAVES = ("gate_proj", "up_proj", "down_proj")
MAX_CHUNK = 32  # experts solved as one stack at most: beyond this a stack is no faster, only bigger
# A stack's working memory at most, on the CPU (the rest of the host holds activations and results) and on a
# GPU (a group of Kimi K2's experts, 24 of 1.3 GB; fixed, not read from free memory: see _chunks)
CHUNK_BYTES = {False: 1 << 29, True: 32 << 30}
HESSIAN_ROWS = 8192  # an expert's tokens go into its Hessians this many rows at a time (fixed: same sums always)


def _add(acc: torch.Tensor, x: torch.Tensor) -> None:
    """x's rows into a Hessian [n, n] (gptq.add_batch), or into a sum of squares per column [n] (calibrated RTN)."""
    if acc.dim() == 2:
        gptq.add_batch(acc, x)
    else:
        xf = x.float()
        acc.add_((xf * xf).sum(0))


def expert_bytes(inter: int, hidden: int, dtype: torch.dtype) -> int:
    """Working memory of one routed expert in a stack: its weights and their float32 copies, its two
    Hessians with the factor and the inverse of each."""
    return 3 * inter * hidden * (dtype.itemsize + 12) + 3 * 4 * (hidden * hidden + inter * inter)


def stack_size(inter: int, hidden: int, dtype: torch.dtype, device: torch.device, workers: int = 1) -> int:
    """Experts solved as one stack: as many as the `workers` stacks solved at once hold in CHUNK_BYTES, at most
    MAX_CHUNK, at least one."""
    fits = CHUNK_BYTES[device.type == "cuda"] // workers // expert_bytes(inter, hidden, dtype)
    return max(1, min(MAX_CHUNK, fits))


def each(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """fn of each item, in order: with several workers, on a pool whose threads run torch on one thread each
    (chunk_workers), at most `workers` results ahead of the one the caller waits for (memory stays bounded)."""
    if workers == 1:
        yield from map(fn, items)
        return
    with single_threaded(workers) as pool:
        yield from in_order(pool, fn, items, workers + 1)


def chunk_workers(device: torch.device) -> int:
    """Chunks of experts solved at once: on the CPU one per core of the rank, each on one thread; on a GPU one.

    A chunk's small ops (GPTQ's column steps, [stack, out] each) are below ATen's grain and run on the calling
    thread, while its mid-sized ones fork and join an OpenMP team per op; off the main thread (the engine runs
    in a writer thread) that team is slow to wake: 8 experts of 1024 x 512 took 133 ms there against 97 on the
    main thread, and 69 ms as two stacks of 4, each on one thread. One thread per chunk also keeps LAPACK's
    Cholesky on one thread (gptq._thread_invariant), and the codes never depend on the stacks (test_gptq)."""
    return max(1, torch.get_num_threads()) if device.type == "cpu" else 1


class Deferred(nn.Module):
    """Stand-in for a layer's routed experts: no weights; records what it is sent and returns zeros."""

    def __init__(self, act_fn):
        super().__init__()
        self.__dict__["act_fn"] = act_fn  # not a child module
        self.record: Callable | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.record is not None:
            self.record(hidden_states, top_k_index, top_k_weights)
        return torch.zeros_like(hidden_states)


@dataclass
class Routing:
    """Every (token, slot) of a layer's MoE input sorted by expert: expert e's are order[offsets[e]:offsets[e+1]],
    as flat positions token * top_k + slot, tokens in increasing order."""

    order: torch.Tensor
    offsets: list[int]
    top_k: int

    @property
    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False)]

    def positions(self, e: int) -> torch.Tensor:
        return self.order[self.offsets[e]:self.offsets[e + 1]]

    def tokens(self, e: int) -> torch.Tensor:
        return self.positions(e) // self.top_k


def route(top_k_index: torch.Tensor, n_experts: int) -> Routing:
    flat = top_k_index.reshape(-1).to("cpu")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    return Routing(order, offsets, top_k_index.shape[-1])


@dataclass
class Setting:
    """What the expert work needs of the run, the same on every rank."""

    ckpt: object  # checkpoint.Checkpoint: decodes expert weights from the source
    device: torch.device
    compute: torch.dtype  # forwards and activations
    dtype: torch.dtype  # the model's: scales are computed from the weight in it
    scheme: object  # recipe.Scheme
    gptq: object  # recipe.GPTQ
    calibration: object  # recipe.Calibration
    world: int = 1
    rank: int = 0
    offload: str = "gpu"  # where activations live (activations.choose): the routed sums too, under cpu or disk
    squares: bool = False  # calibrated RTN: sums of x^2 per input channel instead of Hessians, no solve

    @property
    def sums(self) -> torch.device:
        """Where the routed experts' partial sums are added: the device, or the host when activations are
        offloaded (Kimi K2 at 1M tokens: 28 GiB that the GPU would otherwise hold)."""
        return self.device if self.offload == "gpu" else torch.device("cpu")


@dataclass
class Result:
    tensors: list[torch.Tensor]  # what replaces the weight, in the order of its plan entry's outputs (on the CPU)
    fallback: bool  # Hessian not positive definite or not finite: RTN
    error: float  # relative Frobenius error of the dequantized weight
    quantized: bool = True  # False: a float weight AWQ rescaled but the recipe leaves unquantized


class LayerExperts:
    """One MoE layer's routed experts on one rank.

    `targets[e][leaf]`: the plan entry of each quantized expert Linear (leaf: gate_proj, up_proj, down_proj, as
    transformers names them); `weight_name(e, leaf)`: the checkpoint's name of that weight (Mixtral's `...w1.weight`)."""

    def __init__(self, s: Setting, weight_name: Callable[[int, str], str], n_experts: int,
                 targets: dict[int, dict[str, Entry]], tokens: int,
                 hidden: int, top_k: int, act_fn, store: Callable[[int, int, torch.dtype], TokenBuffer],
                 on_expert: Callable[[int, int], None] | None = None, spans: list[tuple[int, int]] | None = None):
        self.s, self.weight_name, self.n, self.targets = s, weight_name, n_experts, targets
        self.tokens, self.hidden, self.top_k, self.act_fn = tokens, hidden, top_k, act_fn
        # the token rows whose forwards each rank runs (its samples'), in rank order; by default rank 0's all
        self.spans = spans or [(0, tokens)] + [(tokens, tokens)] * (s.world - 1)
        self.store, self.on_expert = store, on_expert
        self.groups = expert_groups(s.rank, s.world)
        self.owned = [e for g in self.groups for e in group_members(g, n_experts)]
        self.x_cal = store(tokens, hidden, s.compute)
        self.idx_cal = torch.empty(tokens, top_k, dtype=torch.int64)
        self.x_adv = self.idx_adv = self.w_adv = None
        self.results: dict[tuple[int, str], Result] = {}
        self.input_amax: dict[tuple[int, str], torch.Tensor] = {}  # NVFP4 activations: (expert, leaf) -> amax
        self.counts: list[int] = []
        self._filled = self.spans[s.rank][0]
        self._progress, self._freed, self._lock = -1, 0, threading.Lock()  # chunks end on several threads

    # -- what the layer's passes record (each rank, its own samples' tokens) --------------------------------
    def record_calibration(self, x: torch.Tensor, top_k_index: torch.Tensor, _weights: torch.Tensor) -> None:
        n = x.shape[0]
        self.x_cal.write(self._filled, x)
        self.idx_cal[self._filled:self._filled + n] = top_k_index.to("cpu")
        self._filled += n

    def start_advance(self) -> None:
        self.x_adv = self.store(self.tokens, self.hidden, self.s.compute)
        self.idx_adv = torch.empty(self.tokens, self.top_k, dtype=torch.int64)
        self.w_adv = torch.empty(self.tokens, self.top_k, dtype=torch.float32)
        self._filled = self.spans[self.s.rank][0]

    def record_advance(self, x: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor) -> None:
        n = x.shape[0]
        self.x_adv.write(self._filled, x)
        self.idx_adv[self._filled:self._filled + n] = top_k_index.to("cpu")
        self.w_adv[self._filled:self._filled + n] = weights.to("cpu", torch.float32)
        self._filled += n

    # -- the collectives: one broadcast per rank and pass, one message per rank and group ------------------
    def calibrate_from_advance(self) -> None:
        """Calibrated RTN: the layer's one pass (recorded by record_advance) is the calibration's too."""
        self.x_cal, self.idx_cal = self.x_adv, self.idx_adv

    def share_calibration(self) -> None:
        self._share(self.x_cal.t, self.idx_cal)

    def share_advance(self) -> None:
        self._share(self.x_adv.t, self.idx_adv, self.w_adv)

    def _share(self, *buffers: torch.Tensor) -> None:
        """Every rank's span of each buffer to every rank."""
        if self.s.world > 1:
            for r, (a, b) in enumerate(self.spans):
                if b > a:
                    for t in buffers:
                        broadcast(t[a:b], src=r)

    # -- the solve -----------------------------------------------------------------------------------------
    def solve(self) -> None:
        """GPTQ (or RTN for experts with too few tokens) of this rank's experts, a chunk at a time, or on the CPU
        a chunk per core at a time (`chunk_workers`)."""
        if not any(self.targets.values()):  # the layer's experts only run (no routed target): nothing was recorded
            if self.x_cal is not self.x_adv:
                self.x_cal.close()
            return
        routing = route(self.idx_cal, self.n)
        self.counts = routing.counts
        work = [e for e in self.owned if self.targets.get(e)]
        all_rows = shared_in = None
        if self.s.calibration.calibrate_all_experts:  # every expert sees every token: one input Hessian for all
            all_rows = torch.arange(self.tokens)
            shared_in = torch.zeros(*(self.hidden,) * (1 if self.s.squares else 2), device=self.s.device)
            for r in range(0, self.tokens, HESSIAN_ROWS):
                _add(shared_in, self.x_cal.rows(all_rows[r:r + HESSIAN_ROWS]))
        workers = chunk_workers(self.s.device)
        for _ in each(lambda c: self._solve_chunk(c, routing, all_rows, shared_in), self._chunks(work, workers),
                          workers):
            pass
        if self.x_cal is not self.x_adv:  # calibrated RTN's inputs are the pass's, still to be run through the codes
            self.x_cal.close()
        release_freed_memory()

    def _solve_chunk(self, chunk: list[int], routing: "Routing", all_rows, shared_in) -> None:
        weights = {e: self._source(e) for e in chunk}
        calibrated = [e for e in chunk if not self.rtn_only(e)]
        h_in, h_down = {}, {}
        sch = self.s.scheme
        for e in calibrated:
            h_in[e], h_down[e] = self._hessians(weights[e], routing.tokens(e) if all_rows is None else all_rows,
                                                shared_in, e if sch.w4a4 else None)
        for e in chunk:
            if e not in h_in and sch.w4a4:
                # an expert too rarely routed for GPTQ still needs its inputs' range: its own tokens, or for one
                # the router never chose, the first rows of the layer's (an expert's gate/up see the same inputs)
                tokens = routing.tokens(e)
                if not tokens.numel():
                    tokens = torch.arange(min(self.tokens, HESSIAN_ROWS))
                self._hessians(weights[e], tokens, amax_of=e, hessians=False)
            if e not in h_in:
                for leaf in self.targets[e]:
                    w = weights[e][leaf]
                    p = codec.params(sch, w, self._global_scale(e, weights[e], leaf), self._lattice(e, leaf))
                    self._keep(e, leaf, w, codec.rtn_codes(sch, w, p), p, False)
        for group, hs in ((["gate_proj", "up_proj"], h_in), (["down_proj"], h_down)):
            stacks: dict[tuple, list[int]] = {}  # experts whose targeted Linears of the group are the same
            for e in calibrated:
                leaves = tuple(x for x in group if x in self.targets[e])
                if leaves:
                    stacks.setdefault(leaves, []).append(e)
            for leaves, members in stacks.items():
                (self._round_stack if self.s.squares else self._solve_stack)(list(leaves), members, weights, hs)
        del weights, h_in, h_down
        self._release(len(chunk) * expert_bytes(*self._shape(chunk[0]), self.s.dtype))
        if self.on_expert is not None and self.s.rank == 0:
            with self._lock:
                self._progress = max(self._progress, chunk[-1])
                self.on_expert(self._progress, self.n)

    def _release(self, n_bytes: int) -> None:
        """Trim the heap once CHUNK_BYTES of chunks have come and gone: after every chunk of Kimi's experts
        (1.3 GB each), after every few of small ones (a trim takes ~13 ms: 0.15 s a layer of 128 small experts)."""
        with self._lock:
            self._freed += n_bytes
            if self._freed < CHUNK_BYTES[False]:
                return
            self._freed = 0
        release_freed_memory()

    def _shape(self, e: int) -> tuple[int, int]:
        """(inter, hidden) of expert e, from its gate projection."""
        return tuple(self.s.ckpt.tensors[self.weight_name(e, "gate_proj")].shape)

    def rtn_only(self, e: int) -> bool:
        cal = self.s.calibration
        return self.counts[e] < max(cal.min_expert_tokens, 1) and not cal.calibrate_all_experts

    def _source(self, e: int) -> dict[str, torch.Tensor]:
        s = self.s
        return {leaf: s.ckpt.decode(s.ckpt.tensors[self.weight_name(e, leaf)], s.device).to(s.dtype)
                for leaf in LEAVES}

    def _hessians(self, w: dict[str, torch.Tensor], tokens: torch.Tensor, shared_in: torch.Tensor | None = None,
                  amax_of: int | None = None, hessians: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The input Hessian (a copy of `shared_in` when given) and the down projection's, from these rows;
        amax_of: also record expert amax_of's input ranges (NVFP4 activations) from the same products, or only
        those with hessians=False (an expert too rarely routed for GPTQ)."""
        c = self.s.compute
        gate, up = w["gate_proj"].to(c), w["up_proj"].to(c)
        H_in = H_down = None
        if hessians:  # calibrated RTN: the diagonals alone, sums of x^2
            dims = 1 if self.s.squares else 2
            H_in = shared_in.clone() if shared_in is not None else torch.zeros(*(gate.shape[1],) * dims,
                                                                               device=self.s.device)
            H_down = torch.zeros(*(gate.shape[0],) * dims, device=self.s.device)
        a_in = a_down = torch.zeros((), dtype=c, device=self.s.device)
        with torch.no_grad():
            for r in range(0, tokens.numel(), HESSIAN_ROWS):
                x = self.x_cal.rows(tokens[r:r + HESSIAN_ROWS])
                if hessians and shared_in is None:
                    _add(H_in, x)
                h = self.act_fn(F.linear(x, gate)) * F.linear(x, up)
                if hessians:
                    _add(H_down, h)
                if amax_of is not None:
                    a_in, a_down = torch.maximum(a_in, x.abs().amax()), torch.maximum(a_down, h.abs().amax())
        if amax_of is not None:
            self._keep_amax(amax_of, a_in, a_down)
        return H_in, H_down

    def _keep_amax(self, e: int, a_in: torch.Tensor, a_down: torch.Tensor) -> None:
        """gate and up share the expert's input; down's input is act(gate x) * up x. In the model's dtype, as
        llm-compressor's observers see the inputs."""
        a_in, a_down = a_in.to(self.s.dtype), a_down.to(self.s.dtype)
        self.input_amax.update({(e, "gate_proj"): a_in, (e, "up_proj"): a_in, (e, "down_proj"): a_down})

    def _global_scale(self, e: int, w: dict[str, torch.Tensor], leaf: str) -> torch.Tensor | None:
        """NVFP4: the global scale expert e's Linear shares with its fused set (gate and up, when both are
        quantized: the engines' w13), from the largest magnitude of either; the down projection's own. None for
        the other schemes."""
        if self.s.scheme.fp4 != "nvfp4":
            return None
        w13 = ("gate_proj", "up_proj")
        fused = w13 if leaf in w13 and set(w13) <= set(self.targets[e]) else (leaf,)
        return fp4.set_global_scale(w[x] for x in fused)

    def _solve_stack(self, group: list[str], members: list[int], weights, hessians) -> None:
        """GPTQ of the same Linears of several experts as one stack; Linears fed the same input (gate and up)
        are one matrix (their rows are independent given H). A Hessian shared by two stacks is cloned."""
        sch, p = self.s.scheme, self.s.gptq
        leaves = group
        W = torch.stack([torch.cat([weights[e][leaf] for leaf in leaves]) for e in members])
        gscales = {(e, leaf): self._global_scale(e, weights[e], leaf) for e in members for leaf in leaves}
        if p.scales == "hessian":  # the whole stack's steps at once, from each expert's own Hessian
            blocks = torch.stack([self._scale_weights(e, hessians[e]) for e in members])
            params = {}
            for leaf in leaves:
                chosen = codec.searched(sch, [weights[e][leaf] for e in members], [gscales[e, leaf] for e in members],
                                        blocks, [self._lattice(e, leaf) for e in members])
                params |= {(e, leaf): q for e, q in zip(members, chosen, strict=True)}
        else:
            params = {(e, leaf): codec.params(sch, weights[e][leaf], gscales[e, leaf], self._lattice(e, leaf))
                      for e in members for leaf in leaves}
        step = torch.stack([torch.cat([params[e, leaf].step for leaf in leaves]) for e in members])
        zp = None
        if not sch.symmetric:
            zp = torch.stack([torch.cat([params[e, leaf].zero_point for leaf in leaves]) for e in members])
        H = torch.stack([hessians.pop(e) for e in members])  # gate/up and down use different Hessians
        damp = p.dampening_frac if p.dampening == "fixed" else [
            gptq.damping(p.dampening_frac, self._tokens(e), H.shape[-1]) for e in members]
        codes, fallback = gptq.gptq_quantize_batched(W, H, step, zp, sch.num_bits, p.block_size, damp,
                                                     actorder=p.actorder == "static", consume=True, fp4=bool(sch.fp4))
        del H
        for k, e in enumerate(members):
            row = 0
            for leaf in leaves:
                rows = slice(row, row + weights[e][leaf].shape[0])
                row = rows.stop
                self._keep(e, leaf, weights[e][leaf], codes[k, rows], params[e, leaf], bool(fallback[k]))

    def _round_stack(self, group: list[str], members: list[int], weights, squares) -> None:
        """Calibrated RTN of the same Linears of several experts: each group's step searched over the stack at
        once (quant/scales.py), weighted by each expert's own sums of x^2, then round to nearest."""
        sch = self.s.scheme
        diag = torch.stack([squares.pop(e).float().reshape(-1, sch.group_size) for e in members])
        for leaf in group:
            gscales = [self._global_scale(e, weights[e], leaf) for e in members]
            chosen = codec.searched(sch, [weights[e][leaf] for e in members], gscales, diag,
                                    [self._lattice(e, leaf) for e in members])
            for e, p in zip(members, chosen, strict=True):
                w = weights[e][leaf]
                self._keep(e, leaf, w, codec.rtn_codes(sch, w, p), p, False)

    def _lattice(self, e: int, leaf: str):
        """Expert e's INT4 source lattice under the target groups (quant/lattice.py), or None."""
        if self.s.scheme.fp4:
            return None
        return self.s.ckpt.lattice(self.s.ckpt.tensors[self.weight_name(e, leaf)], self.s.scheme.group_size,
                                   self.s.device)

    def _tokens(self, e: int) -> int:
        """The rows behind expert e's Hessians: its routed tokens, or every token with calibrate_all_experts."""
        return self.tokens if self.s.calibration.calibrate_all_experts else self.counts[e]

    def _scale_weights(self, e: int, H: torch.Tensor) -> torch.Tensor:
        """What expert e's scale search weighs each group's error by: the diagonal blocks of its Hessian, or of
        its diagonal alone when fewer tokens than inputs built it (then the off-diagonal terms are mostly noise)."""
        g = self.s.scheme.group_size
        if self._tokens(e) < H.shape[-1]:
            return torch.diag_embed(H.diagonal().float().reshape(-1, g))
        return scales.diagonal_blocks(gptq.mirror_upper(H)[None], g)[0]

    def _keep(self, e: int, leaf: str, w: torch.Tensor, codes, p: "codec.Params", fallback: bool) -> None:
        sch = self.s.scheme
        wq = codec.dequantize(sch, codes, p).to(w.dtype)
        error = float((w.float() - wq.float()).norm() / w.float().norm().clamp(min=1e-12))
        out = codec.outputs(sch, codes.contiguous(), p, tuple(w.shape), self.input_amax.get((e, leaf)))
        self.results[(e, leaf)] = Result([t.to("cpu", copy=True) for t in out], fallback, error)

    def _chunks(self, experts: list[int], workers: int = 1) -> Iterator[list[int]]:
        """Consecutive experts of one group at a time, in stacks whose working memory fits CHUNK_BYTES (shared by
        the `workers` chunks solved at once).

        The stacks depend only on the groups and the shapes, never on free memory or the number of ranks (a
        rank owns whole groups), so every expert is solved in the same stack in any run: on the CPU each
        expert's codes are those of solving it alone anyway (tests/test_gptq.py), but batched GPU kernels
        (cuSOLVER, cuBLAS) may pick another algorithm for another batch size."""
        if not experts:
            return
        size = stack_size(*self._shape(experts[0]), self.s.dtype, self.s.device, workers)
        for g in range(GROUPS):
            members = [e for e in experts if e in group_members(g, self.n)]
            for i in range(0, len(members), size):
                yield members[i:i + size]

    # -- after the quantized layer's pass ------------------------------------------------------------------
    def routed_output(self) -> torch.Tensor | None:
        """The routed experts' share of every token's layer output, [tokens, hidden] on rank 0 where Setting.sums
        says (None on the others, which send their groups' sums to it).

        Each group's sum covers only the rows its experts were routed (Kimi K2, top 8 of 384: a group of 24
        experts touches about 40% of the tokens), so that is what crosses to rank 0: the rows' indices, then
        their sums. Rank 0 adds each group's rows into the total in group order, one add per element, on any
        number of ranks alike."""
        s = self.s
        routing = route(self.idx_adv, self.n)
        w_flat = self.w_adv.reshape(-1)
        y = torch.zeros(self.tokens, self.hidden, dtype=s.compute, device=s.sums) if s.rank == 0 else None
        self.routed_bytes = 0
        for g in range(GROUPS):
            owner = g % s.world
            if g in self.groups:
                rows, part = self._group_output(group_members(g, self.n), routing, w_flat)
                if s.rank != 0:
                    send_any(rows, 0)
                    if rows.numel():
                        send(part, 0)
                    self.routed_bytes += rows.numel() * (rows.element_size() + self.hidden * part.element_size())
                    continue
            elif s.rank == 0:
                rows = recv_any(owner, torch.device("cpu"))
                part = torch.empty(rows.numel(), self.hidden, dtype=s.compute, device=s.sums)
                if rows.numel():
                    recv(part, owner)
                self.routed_bytes += rows.numel() * (rows.element_size() + self.hidden * part.element_size())
            else:
                continue
            if rows.numel():
                y.index_add_(0, rows.to(s.sums), part)
        self.x_adv.close()
        return y

    def _group_output(self, experts: range, routing: "Routing", w_flat: torch.Tensor):
        """(rows, sums): the sorted tokens that a group's experts were routed, and their weighted outputs summed
        expert by expert in order, [rows, hidden] where Setting.sums says."""
        s = self.s
        used = [e for e in experts if routing.counts[e]]
        rows = torch.unique(torch.cat([routing.tokens(e) for e in used])) if used else torch.empty(0, dtype=torch.int64)
        part = torch.zeros(rows.numel(), self.hidden, dtype=s.compute, device=s.sums)
        outs = each(lambda e: self._expert_output(e, routing, w_flat), used, chunk_workers(s.device))
        for tokens, out in outs:  # in expert order: the sum's order is fixed (one add per element: the same
            local = torch.searchsorted(rows, tokens.to("cpu"))  # bits on the host as on the GPU)
            part.index_add_(0, local.to(s.sums), out.to(s.sums))
        return rows, part

    def _expert_output(self, e: int, routing: "Routing", w_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's weighted output for the tokens routed to it, and their rows."""
        s = self.s
        positions = routing.positions(e)
        w = self._quantized(e)
        tokens = positions // routing.top_k
        x = self.x_adv.rows(tokens)
        out = F.linear(self.act_fn(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
        out = out * w_flat[positions].to(s.device)[:, None]  # float32 weights, as transformers does
        return tokens.to(s.device), out.to(s.compute)

    def _quantized(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e's Linears as the quantized model computes them (dequantized codes), in the compute dtype."""
        out = {}
        source = None
        for leaf in LEAVES:
            r = self.results.get((e, leaf))
            if r is None:
                source = source or self._source(e)
                out[leaf] = source[leaf].to(self.s.compute)
                continue
            if not r.quantized:
                out[leaf] = r.tensors[0].to(self.s.device, self.s.compute)
                continue
            w = codec.from_outputs(self.s.scheme, [t.to(self.s.device) for t in r.tensors])
            out[leaf] = w.to(self.s.dtype).to(self.s.compute)
        return out

    # -- the exchange of results ---------------------------------------------------------------------------
    def collect(self) -> dict[tuple[int, str], tuple[bool, float]]:
        """Rank 0: (fallback, error) of every expert's Linears, its own and one small message from each other rank;
        the tensors stay with the rank that solved them, whose writers write them (engine/writers.py)."""
        s = self.s
        mine = {k: (r.fallback, r.error) for k, r in self.results.items()}
        if s.world == 1:
            return mine
        if s.rank != 0:
            keys = self._keys(self.owned)
            send(torch.tensor([[float(mine[k][0]), mine[k][1]] for k in keys], dtype=torch.float64).reshape(-1, 2), 0)
            return {}
        for rank in range(1, s.world):
            keys = self._keys([e for g in expert_groups(rank, s.world) for e in group_members(g, self.n)])
            meta = recv(torch.empty(len(keys), 2, dtype=torch.float64), rank)
            mine |= {k: (bool(f), err) for k, (f, err) in zip(keys, meta.tolist(), strict=True)}
        return mine

    def _keys(self, experts: list[int]) -> list[tuple[int, str]]:
        return [(e, leaf) for e in experts for leaf in LEAVES if leaf in self.targets.get(e, {})]
