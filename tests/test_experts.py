"""The routed experts' engine (engine/experts.py): what replaces the experts in the layer, the routing, and the
routed output that is added afterwards."""

from types import SimpleNamespace

import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from quantize.engine import activations, distributed, experts
from quantize.recipe import Calibration


def _moe(seed: int = 0):
    config = ds.DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=40,
                                 num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
                                 num_hidden_layers=1, first_k_dense_replace=0)
    torch.manual_seed(seed)
    moe = ds.DeepseekV3MoE(config).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
    return config, moe


class _Source:
    """The expert weights as a checkpoint's decoder gives them (engine/experts.py reads only these two)."""

    def __init__(self, moe, prefix: str):
        self.tensors = {}
        for e in range(moe.experts.num_experts):
            gate, up = moe.experts.gate_up_proj[e].detach().chunk(2)
            for leaf, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", moe.experts.down_proj[e].detach())):
                self.tensors[f"{prefix}{e}.{leaf}.weight"] = w.contiguous()

    def decode(self, t, device):
        return t.to(device)


def test_deferred_experts_plus_the_routed_output_are_the_moe_block():
    """The layer runs with its routed experts deferred (zeros out, inputs recorded); the routed output added
    afterwards must give the block's own output: the DeepSeek-V3 / Kimi MoE of transformers, whose routed
    output is only ever added (DeepseekV3MoE.forward: experts(...) + shared_experts(residuals))."""
    config, moe = _moe()
    h = torch.randn(3, 50, 64)
    with torch.no_grad():
        want = moe(h)
    prefix = "model.layers.1.mlp.experts."
    setting = experts.Setting(_Source(moe, prefix), torch.device("cpu"), torch.float32, torch.float32,
                              SimpleNamespace(group_size=32), None, Calibration())
    work = experts.LayerExperts(setting, lambda e, leaf: f"{prefix}{e}.{leaf}.weight", config.n_routed_experts, {},
                                h.shape[0] * h.shape[1], 64,
                                config.num_experts_per_tok, moe.experts.act_fn,
                                lambda rows, width, dtype: activations.TokenBuffer("cpu", torch.device("cpu"), None,
                                                                                   rows, width, dtype))
    moe.experts = experts.Deferred(moe.experts.act_fn)
    work.start_advance()
    moe.experts.record = work.record_advance
    with torch.no_grad():
        partial = moe(h)
    got = partial + work.routed_output().view_as(h)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(partial, want, atol=1e-3)  # the routed share is there, and it is not small


def test_routing_gives_each_expert_its_tokens_in_order():
    g = torch.Generator().manual_seed(3)
    top_k = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(200)])
    r = experts.route(top_k, 16)
    assert sum(r.counts) == 800
    for e in range(16):
        tokens, slots = torch.where(top_k == e)
        assert torch.equal(r.tokens(e), tokens)
        assert torch.equal(r.positions(e) % 4, slots)


def test_every_expert_has_one_owner_and_groups_do_not_depend_on_the_ranks():
    n = 384
    for world in (1, 2, 3, 8, 16):
        owned = [e for r in range(world) for g in distributed.expert_groups(r, world)
                 for e in distributed.group_members(g, n)]
        assert sorted(owned) == list(range(n))  # each expert once
    assert [len(distributed.group_members(g, n)) for g in range(distributed.GROUPS)] == [24] * 16


def test_every_expert_is_solved_in_the_same_stack_on_any_number_of_ranks(monkeypatch):
    """Batched GPU kernels may round by batch size, so the stacks must not depend on the ranks or on free
    memory: stacks never cross a group (a rank owns whole groups), and their size comes from the shapes."""
    import psutil

    config, moe = _moe()
    prefix = "model.layers.1.mlp.experts."
    monkeypatch.setattr(experts, "CHUNK_BYTES", {False: 3 * experts.expert_bytes(32, 64, torch.float32), True: 0})

    def stacks(rank: int, world: int) -> list[list[int]]:
        setting = experts.Setting(_Source(moe, prefix), torch.device("cpu"), torch.float32, torch.float32,
                                  SimpleNamespace(group_size=32), None, Calibration(), world, rank)
        work = experts.LayerExperts(setting, lambda e, leaf: f"{prefix}{e}.{leaf}.weight", 40, {}, 8, 64, 4, moe.experts.act_fn,
                                    lambda rows, width, dtype: activations.TokenBuffer("cpu", torch.device("cpu"),
                                                                                       None, rows, width, dtype))
        return list(work._chunks(work.owned))

    one = stacks(0, 1)
    assert one == sorted(s for r in range(4) for s in stacks(r, 4)) == sorted(s for r in range(2) for s in stacks(r, 2))
    assert all(len(s) <= 3 for s in one) and max(len(s) for s in one) == 3
    for s in one:
        assert len({next(g for g in range(16) if e in distributed.group_members(g, 40)) for e in s}) == 1

    class Tight:
        available = 1

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight)
    assert stacks(0, 1) == one


def test_each_keeps_the_order_bounds_the_work_ahead_and_runs_each_worker_on_one_thread():
    """Chunks of experts are solved on several threads at once on the CPU (experts.chunk_workers): the results
    must come back in order (the routed output is summed expert by expert), at most `workers` ahead of the one
    the caller waits for (memory), each worker on one torch thread, and the caller's thread count restored."""
    import random
    import threading
    import time

    threads_before = torch.get_num_threads()
    lock, started, consumed, ahead, inner = threading.Lock(), [0], [0], [], set()

    def fn(x):
        with lock:
            started[0] += 1
            ahead.append(started[0] - consumed[0])
        inner.add(torch.get_num_threads())
        time.sleep(random.random() / 200)
        return x * x

    out = []
    for y in experts.each(fn, range(20), 2):
        with lock:
            consumed[0] += 1
        out.append(y)
    assert out == [x * x for x in range(20)]
    assert max(ahead) <= 3  # the one waited for, and `workers` more
    assert inner == {1} and torch.get_num_threads() == threads_before
    assert list(experts.each(fn, range(5), 1)) == [0, 1, 4, 9, 16]

    def fails(x):
        if x == 3:
            raise ValueError("expert 3")
        return x

    import pytest

    with pytest.raises(ValueError, match="expert 3"):
        list(experts.each(fails, range(10), 2))
    assert torch.get_num_threads() == threads_before
