"""A MoE layer's routed experts under AWQ, streamed and split across ranks as under GPTQ (engine/experts.py).

AWQ smooths the norm before a MoE block with one scale vector for everything that reads it: the router, the
shared experts and every routed expert's gate and up projections. Built whole, Kimi K2's routed experts are
34 GB a layer. Here each rank decodes only its own groups' experts (expert_groups), a chunk at a time, in three
passes per layer:

1. `search_norm`, first pass: each expert's |W| normalized per group, summed per input channel (AWQ's w_mean),
   a float64 sum per group of experts;
2. `search_norm`, second pass: for each of n_grid candidate scales, each expert's squared error at its own
   weighted output over the tokens routed to it (quant/awq.expert_errors), a float64 sum per group. Rank 0
   adds the shared experts' error and the groups in group order, picks the scales and sends them to all.
   The block's error is taken as the sum of the experts' errors, without the cross terms of two experts' errors
   on one token: that is what lets the search split by expert, with n_grid numbers per group crossing ranks
   instead of the block's whole output per candidate;
3. `solve`: the chosen scales into each expert's gate and up columns, the expert's own up -> down search on
   the inputs its down projection sees, then round to nearest. The results stay with the rank, as GPTQ's do,
   and the routed output of the pass through the quantized layer comes from them (`routed_output`).

Every sum has a fixed order (experts within a group, then groups), so the bytes do not depend on the ranks.
"""

import torch
from torch.nn import functional as F

from quantize.engine.activations import release_freed_memory
from quantize.engine.distributed import GROUPS, broadcast, cpu_threads, group_of, recv_any, send_any
from quantize.engine.experts import LayerExperts, Result, expert_bytes, route
from quantize.engine.ordered import in_order, single_threaded
from quantize.quant import awq, codec

GATE_UP = ("gate_proj", "up_proj")


def to_rank0(parts: dict[int, torch.Tensor], rank: int, world: int) -> list[torch.Tensor] | None:
    """Each rank's tensors, one per group it owns, to rank 0, where they come back in group order (None on the
    other ranks)."""
    if world == 1:
        return [parts[g] for g in range(GROUPS)]
    if rank != 0:
        for g in sorted(parts):
            send_any(parts[g], 0)
        return None
    have = dict(parts)
    for g in range(GROUPS):  # each rank sends its groups in order; rank 0 takes them in the same order
        if g not in have:
            have[g] = recv_any(g % world, torch.device("cpu"))
    return [have[g] for g in range(GROUPS)]


def _first_least(values: list[float]) -> int:
    """The index awq.pick chooses: the first of least value (NaN never chosen, the identity at worst)."""
    k, best = 0, float("inf")
    for i, v in enumerate(values):
        if v < best:
            k, best = i, v
    return k


def sample_rows(bounds: list[tuple[int, int]], tokens: torch.Tensor, max_rows: int) -> torch.Tensor:
    """The positions (into `tokens`, sorted token indices) that AWQ's recorder keeps of each sample's: an even
    stride through them, at most max_rows // samples a sample (engine/awq_layer._AWQRecorder._keep)."""
    per_sample = max(1, max_rows // max(len(bounds), 1))
    keep = []
    for a, b in bounds:
        lo, hi = torch.searchsorted(tokens, torch.tensor([a, b])).tolist()
        stride = max(1, (hi - lo) // per_sample)
        keep.append(torch.arange(lo, hi, stride)[:per_sample])
    return torch.cat(keep) if keep else torch.empty(0, dtype=torch.int64)


class AWQExperts(LayerExperts):
    """One MoE layer's routed experts under AWQ on one rank. `bounds`: each calibration sample's token rows;
    `awq`: the recipe's AWQ section."""

    def __init__(self, *args, awq_params, bounds: list[tuple[int, int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.awq, self.bounds = awq_params, bounds
        self.w_cal = torch.empty(self.tokens, self.top_k, dtype=torch.float32)
        self.norm_scales: torch.Tensor | None = None
        # whether the norm before the experts is smoothed, from the plan alone, so every rank knows it without a
        # message: set by the loop (layerwise._layer_experts); rank 0's mappings must agree (awq_layer)
        self.norm_applies = False
        self.searches: dict[int, list[float]] = {}  # this rank's up -> down searches: (ratio, identity, best)
        self.routing = None

    def record_calibration(self, x: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor) -> None:
        self.w_cal[self._filled:self._filled + x.shape[0]] = weights.to("cpu", torch.float32)
        super().record_calibration(x, top_k_index, weights)

    def share_calibration(self) -> None:
        self._share(self.x_cal.t, self.idx_cal, self.w_cal)
        self.routing = route(self.idx_cal, self.n)
        self.counts = self.routing.counts

    def rtn_only(self, e: int) -> bool:
        return self.counts[e] == 0  # never routed: no inputs to search its down projection's scales on

    def linear_names(self) -> list[str]:
        """The routed experts' Linears as AWQ's mappings name them (in the layer, `mlp.experts` is Deferred)."""
        return [f"mlp.experts.{e}.{leaf}" for e in range(self.n) for leaf in ("gate_proj", "up_proj", "down_proj")]

    def _work(self) -> list[int]:
        """The experts this rank changes: all of its own once the norm's scales are in their gate and up (a
        Linear the recipe leaves float is rescaled all the same), else those with something to quantize."""
        if self.norm_scales is not None:
            return list(self.owned)
        return [e for e in self.owned if self.targets.get(e)]

    def _in_compute(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e's weights as the layer computes with them (the compute dtype), as AWQ searches them."""
        return {leaf: w.to(self.s.compute) for leaf, w in self._source(e).items()}

    def _workers(self) -> int:
        """Chunks at once: one on a GPU; on the CPU this rank's share of the machine's cores. Each chunk runs on
        one thread (`_each`) and an expert's numbers never depend on its chunk, so the bytes do not follow the
        number of ranks, and CPU ranks on one machine split its cores instead of oversubscribing them."""
        return 1 if self.s.device.type == "cuda" else max(1, cpu_threads() // self.s.world)

    def _each(self, fn, chunks: list[list[int]]):
        """fn of each chunk, in order: on the CPU on `_workers` threads of one torch thread each, even one."""
        if self.s.device.type == "cuda":
            yield from map(fn, chunks)
            return
        workers = self._workers()
        with single_threaded(workers) as pool:
            yield from in_order(pool, fn, chunks, workers + 1)

    def _per_group(self, fn, zero: torch.Tensor) -> dict[int, torch.Tensor]:
        """fn(e, weights) of each expert of this rank with a target, added up per group in expert order (float64)."""
        parts = {g: zero.clone() for g in self.groups}
        workers = self._workers()

        def chunk(c: list[int]) -> list[torch.Tensor]:
            # the sums stay on the host whatever the device (a GPU's values were added to host zeros: the first
            # CUDA run of AWQ on a MoE raised there)
            out = [fn(e, self._in_compute(e)).to("cpu") for e in c]
            self._release(len(c) * expert_bytes(*self._shape(c[0]), self.s.dtype))
            return out
        chunks = list(self._chunks([e for e in self.owned if self.targets.get(e)], workers))
        for c, values in zip(chunks, self._each(chunk, chunks), strict=True):
            for v in values:  # in expert order: chunks come in order, each of one group
                parts[group_of(c[0], self.n)] += v
        return parts

    def _norm_rows(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, router weights) of expert e among the rows the norm's search runs on (the recorder's)."""
        positions = self.routing.positions(e)
        tokens = positions // self.top_k
        kept = torch.isin(tokens, self._kept)
        return tokens[kept], self.w_cal.reshape(-1)[positions[kept]]

    # -- the norm's search, on every rank at once --------------------------------------------------------------
    def search_norm(self, x_mean: torch.Tensor | None = None, dense: tuple | None = None):
        """The norm's scales, on every rank; rank 0 gives x_mean [in] and `dense` = (the weight sums of its
        quantized balance Linears, their rows, the shared experts' loss of scales or None, the elements it is a
        mean over). Returns (scales, ratio, loss with identity scales, best loss) on rank 0, None elsewhere."""
        s, rank, world = self.s, self.s.rank, self.s.world
        g = s.scheme.group_size
        self._kept = sample_rows(self.bounds, torch.arange(self.tokens), self.awq.max_tokens)

        def weight_sums(e: int, w: dict) -> torch.Tensor:
            leaves = [w[leaf] for leaf in GATE_UP if leaf in self.targets[e]]
            total, rows = awq.weight_sums(leaves, g)
            return torch.cat([total.to("cpu") if rows else torch.zeros(self.hidden, dtype=torch.float64),
                              torch.tensor([float(rows)], dtype=torch.float64)])
        sums = to_rank0(self._per_group(weight_sums, torch.zeros(self.hidden + 1, dtype=torch.float64)), rank, world)
        means = torch.empty(2, self.hidden, dtype=torch.float32, device=s.device)
        if rank == 0:
            dense_total, dense_rows, shared_loss, elements = dense
            total = sum(sums[1:], sums[0])
            # the groups' sums come over the ranks' CPU exchange; the shared experts' are on rank 0's device
            total = total[:-1] + dense_total.to("cpu") if dense_rows else total[:-1]
            rows = int(sum(float(p[-1]) for p in sums)) + dense_rows
            means[0], means[1] = x_mean.to(s.device), (total / rows).float().to(s.device)
        if world > 1:
            broadcast(means, 0)
        cands = awq.candidates(means[0], means[1], self.awq.n_grid)
        scales = [c for _, c in cands]

        def errors(e: int, w: dict) -> torch.Tensor:
            tokens, weights = self._norm_rows(e)
            if not tokens.numel():
                return torch.zeros(len(scales), dtype=torch.float64)
            quantized = tuple(leaf in self.targets[e] for leaf in GATE_UP)
            return awq.expert_errors(self.x_cal.rows(tokens), weights.to(s.device), w["gate_proj"], w["up_proj"],
                                     w["down_proj"], self.act_fn, scales, g, s.scheme.symmetric, quantized)
        parts = to_rank0(self._per_group(errors, torch.zeros(len(scales), dtype=torch.float64)), rank, world)
        chosen = torch.zeros(1, dtype=torch.int64, device=s.device)
        result = None
        if rank == 0:
            routed = sum(parts[1:], parts[0])
            losses = [(float(shared_loss(c)) * elements if shared_loss is not None else 0.0) + float(routed[k])
                      for k, c in enumerate(scales)]
            losses = [x / max(elements, 1) for x in losses]
            result = awq.pick(cands, losses)
            chosen[0] = _first_least(losses)
        if world > 1:
            broadcast(chosen, 0)
        self.norm_scales = scales[int(chosen[0])].to(s.device)
        return result

    # -- each expert: the norm's scales in, its own up -> down search, RTN -----------------------------------------
    def solve(self) -> None:
        """This rank's experts, a chunk at a time (a chunk per core on the CPU), after search_norm."""
        for _ in self._each(self._solve_chunk, list(self._chunks(self._work(), self._workers()))):
            pass
        release_freed_memory()

    def _solve_chunk(self, chunk: list[int]) -> None:
        for e in chunk:
            self._solve_expert(e, self._in_compute(e))
        self._release(len(chunk) * expert_bytes(*self._shape(chunk[0]), self.s.dtype))
        if self.on_expert is not None and self.s.rank == 0:
            with self._lock:
                self._progress = max(self._progress, chunk[-1])
                self.on_expert(self._progress, self.n)

    def _solve_expert(self, e: int, w: dict[str, torch.Tensor]) -> None:
        s, sch = self.s, self.s.scheme
        g = sch.group_size
        targets = self.targets.get(e, {})
        tokens = self.routing.tokens(e)
        search = tokens.numel() and "down_proj" in targets
        if search:
            x = self.x_cal.rows(tokens)
            with torch.no_grad():  # what the down projection sees: the source's gate and up, as recorded
                h = self.act_fn(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"])
        if self.norm_scales is not None:
            for leaf in GATE_UP:  # the norm's scales: its output / s, these input columns * s
                w[leaf] = (w[leaf].float() * self.norm_scales.view(1, -1)).to(w[leaf].dtype)
        if search:
            x_mean = (h.abs().sum(0, dtype=torch.float64) / h.shape[0]).float()
            rows = h[sample_rows(self.bounds, tokens, self.awq.max_tokens)]
            loss = awq.linear_loss([(w["down_proj"], rows)], g, sch.symmetric)
            scales, ratio, initial, best = awq.search(x_mean.to(s.device), [w["down_proj"]], loss, g, self.awq.n_grid)
            scales = scales.to(s.device)
            w["up_proj"] = (w["up_proj"].float() / scales.view(-1, 1)).to(w["up_proj"].dtype)
            w["down_proj"] = (w["down_proj"].float() * scales.view(1, -1)).to(w["down_proj"].dtype)
            self.searches[e] = [ratio, initial, best]
        for leaf, weight in w.items():
            if leaf in targets:
                ws = weight.to(s.dtype)
                p = codec.params(sch, ws, None, self._lattice(e, leaf))
                self._keep(e, leaf, weight, codec.rtn_codes(sch, ws, p), p, False)
            elif self.norm_scales is not None and leaf in GATE_UP or e in self.searches:  # rescaled, kept float
                self.results[(e, leaf)] = Result([weight.to("cpu", s.dtype, copy=True)], False, 0.0, quantized=False)

    def collect_searches(self) -> dict[int, list[float]]:
        """Rank 0: every expert's up -> down search (ratio, identity loss, best loss), in expert order."""
        s = self.s
        if s.world == 1:
            return dict(sorted(self.searches.items()))
        mine = {g: self._searches_of(g) for g in self.groups}
        parts = to_rank0(mine, s.rank, s.world)
        if parts is None:
            return {}
        out = {}
        for p in parts:
            out |= {int(row[0]): row[1:].tolist() for row in p}
        return dict(sorted(out.items()))

    def _searches_of(self, g: int) -> torch.Tensor:
        rows = [[float(e), *v] for e, v in sorted(self.searches.items()) if group_of(e, self.n) == g]
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 4)
