"""The dense Hessians of data-parallel forwards: the same bytes on any number of ranks (engine/hessians.py)."""

from collections import defaultdict

import torch

from quantize.engine import distributed, hessians


def test_hessians_are_the_same_bytes_on_any_number_of_ranks(monkeypatch):
    """Each rank fills the Hessians of its own samples and rank 0 adds them along the fixed tree; the wire is
    replaced by queues, so ranks run one after the other in this process, the others before rank 0."""
    g = torch.Generator().manual_seed(0)
    n = 13  # fewer samples than groups: some groups are empty, and so are some ranks' shares
    samples = [torch.randn(1, 40 + 17 * s, 48, generator=g).bfloat16() for s in range(n)]
    wide = [torch.randn(1, x.shape[1], 96, generator=g).bfloat16() for x in samples]
    wire: dict[int, list] = defaultdict(list)
    monkeypatch.setattr(hessians, "send", lambda t, dst: wire[dst].append(t.clone()))
    monkeypatch.setattr(hessians, "send_text", lambda text, dst: wire[dst].append(text))
    monkeypatch.setattr(hessians, "recv", lambda t, src: t.copy_(wire[0].pop(0)))
    monkeypatch.setattr(hessians, "recv_text", lambda src: wire[0].pop(0))

    def run(world: int) -> dict[str, torch.Tensor]:
        ranks = {}
        for r in [*range(1, world), 0]:
            h = hessians.Hessians(torch.device("cpu"), n, r, world)
            for s in distributed.share(r, world, n):
                h.start_sample(s)
                h.hook("q_proj", None, (samples[s],))
                h.hook("k_proj", None, (samples[s],))  # the same input: one Hessian for both
                h.hook("o_proj", None, (wide[s],))
            h.finish()
            ranks[r] = h
        assert not wire[0]
        return ranks[0].by_module()

    one = run(1)
    assert one["q_proj"] is one["k_proj"] and one["o_proj"].shape == (96, 96)
    x = torch.cat([s.reshape(-1, 48) for s in samples]).float()
    torch.testing.assert_close(one["q_proj"].triu(), (x.t() @ x).triu(), rtol=1e-4, atol=1e-3)
    for world in (2, 3, 5, 8, 16):
        got = run(world)
        assert got.keys() == one.keys()
        for m in one:
            assert torch.equal(got[m], one[m]), (world, m)


def test_the_tree_holds_few_nodes_and_adds_halves_only():
    stack: list[hessians.Node] = []
    depth = 0
    for gr in range(distributed.GROUPS):
        hessians.push(stack, hessians.Node(gr, gr + 1, {"h": torch.full((1,), float(gr))}))
        depth = max(depth, len(stack))
    (root,) = stack
    assert (root.lo, root.hi, float(root.sums["h"])) == (0, 16, sum(range(16)))
    assert depth <= 5  # log2(GROUPS) + 1


def test_every_sample_has_one_rank_and_shares_are_contiguous():
    for n in (1, 7, 16, 100):
        for world in range(1, distributed.GROUPS + 1):
            shares = [distributed.share(r, world, n) for r in range(world)]
            assert [s for sh in shares for s in sh] == list(range(n))
