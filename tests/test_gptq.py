"""GPTQ math and the layerwise engine: error vs RTN, parity with llm-compressor's GPTQ, determinism,
expert fallback, activation offload, and that the output loads."""

import json

import pytest
import torch
from conftest import RECIPES, ROOT, read_all

from quantize import calib, recipe
from quantize.checkpoint import Checkpoint
from quantize.engine import shard as engine_shard
from quantize.engine import stream
from quantize.engine.layerwise import Calibrated
from quantize.errors import QuantizeError, UsageError
from quantize.quant import gptq, rtn
from quantize.tensor_plan import build


def calibration_samples(tmp_path, n=64):
    """Calibration text that ships with Python (never an evaluation set)."""
    import pydoc_data.topics

    path = tmp_path / "calib.jsonl"
    with open(path, "w") as f:
        for text in list(pydoc_data.topics.topics.values())[:n]:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim**0.5 + torch.eye(dim)
    return torch.randn(n, dim, generator=g) @ mix * torch.linspace(0.2, 3, dim)


def test_gptq_reduces_output_error_versus_rtn_on_its_calibration_inputs():
    W = torch.randn(64, 256) * 0.05
    X = correlated_inputs(2048, 256)
    H = torch.zeros(256, 256, dtype=torch.float32)
    gptq.add_batch(H, X)
    scale, _ = rtn.group_qparams(W, 64)
    codes, fallback = gptq.gptq_quantize(W, H, scale)
    assert not fallback and codes.dtype == torch.int8 and codes.min() >= -8 and codes.max() <= 7
    err_gptq = (X @ (W - rtn.dequantize_groups(codes, scale)).t()).norm()
    err_rtn = (X @ (W - rtn.fake_quantize(W, 64)).t()).norm()
    assert err_gptq < 0.8 * err_rtn


@pytest.mark.parametrize("actorder", [None, "static"])
def test_gptq_matches_llm_compressor_quantize_weight(actorder):
    """Same weight, Hessian and observer scales into llm-compressor's own GPTQ: the same codes."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    W = torch.randn(32, 256) * 0.05
    X = correlated_inputs(1024, 256, seed=1)
    H = torch.zeros(256, 256, dtype=torch.float32)
    gptq.add_batch(H, X)
    scale, _ = rtn.group_qparams(W, 32)
    codes, _ = gptq.gptq_quantize(W, H, scale, actorder=actorder == "static")
    args = QuantizationArgs(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int", actorder=actorder)
    theirs, _, _ = quantize_weight(W[None], (2 * H / X.shape[0]).float()[None], scale[None],
                                   torch.zeros_like(scale)[None], None, args)
    ours = rtn.dequantize_groups(codes, scale)
    agree = (ours == theirs[0]).float().mean()
    assert agree > 0.999, agree  # float summation order may flip a rare rounding tie


@pytest.mark.parametrize("width", [320, 1536])  # one product; upper row blocks mirrored
def test_bf16_inputs_give_the_float32_hessian_of_the_same_numbers(width):
    """The bf16 fast path must keep float32 sums and outputs: a bf16-rounded H (relative error ~4e-3) breaks
    positive definiteness of low-rank expert Hessians. Wide inputs accumulate the upper blocks only, and
    mirror_upper (gptq_quantize's first step) completes the matrix."""
    X = correlated_inputs(512, width, seed=2).bfloat16()
    exact = X.double().t() @ X.double()
    H = torch.zeros(width, width, dtype=torch.float32)
    gptq.add_batch(H, X)
    gptq.add_batch(H, X)
    gptq.mirror_upper(H)
    assert H.dtype == torch.float32 and torch.equal(H, H.t())
    # float32 sums of 1024 products carry ~sqrt(1024) x 6e-8 = 2e-6 of rounding that depends on the kernel's
    # blocking (2.6e-6 on an AVX512-BF16 EPYC); a bf16-rounded H is off by ~4e-3
    assert ((H.double() - 2 * exact).abs().max() / exact.abs().max()) < 1e-5
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # the fast mode does not leak out


def test_gptq_visits_columns_in_activation_order_with_their_own_groups():
    """With static actorder every column keeps its group's scale: codes dequantize with the plain layout."""
    W = torch.randn(48, 256) * 0.05
    X = correlated_inputs(1024, 256, seed=3)
    H = torch.zeros(256, 256, dtype=torch.float32)
    gptq.add_batch(H, X)
    scale, zp = rtn.group_qparams(W, 64, symmetric=False)
    codes, _ = gptq.gptq_quantize(W, H, scale, zp, actorder=True)
    assert codes.is_contiguous() and codes.shape == W.shape and codes.min() >= -8 and codes.max() <= 7
    err_gptq = (X @ (W - rtn.dequantize_groups(codes, scale, zp)).t()).norm()
    err_rtn = (X @ (W - rtn.dequantize_groups(rtn.quantize_groups(W, scale, zp), scale, zp)).t()).norm()
    assert err_gptq < 0.8 * err_rtn


def test_singular_hessian_falls_back_to_rtn():
    W = torch.randn(8, 64)
    H = -torch.eye(64, dtype=torch.float32)
    scale, _ = rtn.group_qparams(W, 32)
    codes, fallback = gptq.gptq_quantize(W, H, scale, actorder=False)
    assert fallback and torch.equal(codes, rtn.quantize_groups(W, scale))


def convert_gptq(src, out, data, offload="auto", **cal):
    r = recipe.load(RECIPES / ("dense-w4a16.yaml" if "llama" in str(src) else "kimi-k2-w4a16.yaml"))
    import dataclasses

    r = dataclasses.replace(r, method="gptq", calibration=dataclasses.replace(
        r.calibration, data=str(data), num_samples=cal.pop("num_samples", 12), seq_len=64, **cal))
    plan = build(Checkpoint(src), r, 2**20)
    samples = calib.load_samples(r.calibration.data, calib.load_tokenizer(src), r.calibration.num_samples,
                                 r.calibration.seq_len, r.calibration.seed)
    hook = Calibrated(plan, samples, torch.device("cpu"), offload)
    try:
        stream.run(plan, out, calibrated=hook)
    finally:
        hook.close()
    return hook.quantizer.stats


def test_gptq_conversion_is_deterministic_and_offload_does_not_change_bytes(fixtures_dir, tmp_path):
    data = calibration_samples(tmp_path)
    convert_gptq(fixtures_dir / "kimi-k2-fp8", tmp_path / "a", data, offload="cpu")
    stats = convert_gptq(fixtures_dir / "kimi-k2-fp8", tmp_path / "b", data, offload="disk")
    assert stats.offload == "disk"
    for f in sorted((tmp_path / "a").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_gptq_moe_counts_tokens_per_expert_and_falls_back_below_the_minimum(fixtures_dir, tmp_path, converted):
    data = calibration_samples(tmp_path)
    stats = convert_gptq(fixtures_dir / "kimi-k2-fp8", tmp_path / "all-rtn", data, min_expert_tokens=10**9)
    assert sum(x.experts_calibrated for x in stats.layers) == 0
    assert sum(len(x.fallbacks) for x in stats.layers) == 16  # 2 MoE layers x 8 experts
    # every expert fell back: the bytes are exactly the RTN conversion's
    ours, rtn_out = read_all(tmp_path / "all-rtn"), read_all(converted["kimi-k2-fp8"])
    for k in ours:
        assert torch.equal(ours[k], rtn_out[k]), k
    stats = convert_gptq(fixtures_dir / "kimi-k2-fp8", tmp_path / "gptq", data, min_expert_tokens=1)
    routed = {x.layer: x.tokens_per_expert for x in stats.layers if x.tokens_per_expert}
    assert set(routed) == {1, 2} and all(len(v) == 8 for v in routed.values())
    tokens = sum(s.numel() for s in calib.load_samples(str(data), calib.load_tokenizer(fixtures_dir / "kimi-k2-fp8"),
                                                        12, 64))
    assert all(sum(v.values()) == tokens * 2 for v in routed.values())  # top-2 routing
    calibrated = sum(x.experts_calibrated for x in stats.layers)
    assert calibrated + sum(len(x.fallbacks) for x in stats.layers) == 16 and calibrated > 0
    out = read_all(tmp_path / "gptq")
    assert any(not torch.equal(out[k], rtn_out[k]) for k in out if k.endswith("weight_packed"))
    assert all(torch.isfinite(out[k].float()).all() and (out[k] > 0).all() for k in out if k.endswith("weight_scale"))


def test_calibrate_all_experts_calibrates_every_expert(fixtures_dir, tmp_path):
    stats = convert_gptq(fixtures_dir / "kimi-k2-fp8", tmp_path / "o",
                         calibration_samples(tmp_path), num_samples=2, calibrate_all_experts=True, min_expert_tokens=10**6)
    assert sum(x.experts_calibrated for x in stats.layers) == 16
    assert not any(x.fallbacks for x in stats.layers)


@pytest.mark.parametrize("kind", ["llama-bf16", "glm5-bf16", "glm4-moe-fp8"])
def test_gptq_output_loads_in_transformers_with_every_key(kind, fixtures_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    data = calibration_samples(tmp_path)
    r = {"llama-bf16": "dense-w4a16", "glm5-bf16": "glm-w4a16", "glm4-moe-fp8": "glm-w4a16"}[kind]
    import dataclasses

    rec = recipe.load(RECIPES / f"{r}.yaml")
    rec = dataclasses.replace(rec, method="gptq", calibration=dataclasses.replace(rec.calibration, data=str(data),
                                                                                  num_samples=8, seq_len=64))
    plan = build(Checkpoint(fixtures_dir / kind), rec, 2**30)
    samples = calib.load_samples(str(data), calib.load_tokenizer(fixtures_dir / kind), 8, 64)
    stream.run(plan, tmp_path / "out", calibrated=Calibrated(plan, samples, torch.device("cpu")))
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True, dtype=torch.bfloat16)
    n = json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"]
    assert info["missing_keys"] == set() and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    with torch.no_grad():
        assert torch.isfinite(model(samples[0]).logits).all()


# (fixture, options, how the ranks start): the routed experts of Kimi K2 (recipe: experts only); GLM-5 with
# every Linear (MLA and DSA attention, shared experts: dense Hessians), DSA's carried top-k indices and FP8 KV
# scales, on 3 ranks (a tree of Hessian sums split unevenly); a dense Llama under torchrun; Kimi K2 in NVFP4
RANK_CASES = {
    "kimi experts, 2 ranks": ("kimi-k2-fp8", ["--recipe", str(RECIPES / "kimi-k2-w4a16.yaml")], "cpu,cpu"),
    "glm5 all Linears + kv, 3 ranks": ("glm5-bf16", ["--scheme", "w4a16", "--group-size", "32", "--kv-cache", "fp8"],
                                       "cpu,cpu,cpu"),
    "llama + kv, torchrun": ("llama-bf16", ["--scheme", "w4a16", "--group-size", "32", "--kv-cache", "fp8"], "torchrun"),
    # FP4 codes and NVFP4 activations: the experts' results (codes, e4m3 and global scales) travel between ranks as
    # INT4's do, and the dense inputs' amax is the max over the ranks' samples
    "kimi nvfp4 (w4a4), 2 ranks": ("kimi-k2-fp8", ["--scheme", "nvfp4"], "cpu,cpu"),
    # Mixtral's names (block_sparse_moe.experts.E.w1/w3/w2): each rank decodes and writes its experts under them
    "mixtral experts, 2 ranks": ("mixtral-bf16", ["--recipe", str(RECIPES / "moe-w4a16.yaml")], "cpu,cpu"),
    # a MoE layer with no routed target (layer 2): its experts only run, streamed, on every rank, and no rank waits
    # for a calibration exchange the others skip
    "kimi, a MoE layer with no work, 2 ranks": ("kimi-k2-fp8", ["--recipe", str(ROOT / "tests" / "data" /
                                                                 "kimi-layer-1-experts.yaml")], "cpu,cpu"),
}


@pytest.mark.parametrize("case", list(RANK_CASES))
def test_several_ranks_split_samples_and_experts_and_give_the_bytes_of_one(case, fixtures_dir, tmp_path):
    """The CPU twin of --devices cuda:0,cuda:1,...: gloo ranks run their own samples' forwards and solve their
    own experts; rank 0 adds the Hessians along the fixed tree and writes. The bytes are those of one rank."""
    import pydoc_data.topics
    import socket
    import subprocess
    import sys

    kind, opts, ranks = RANK_CASES[case]
    data = tmp_path / "calib.txt"
    data.write_text("\n\n".join(pydoc_data.topics.topics.values()))
    outs = {}
    for name in ("one", "several"):
        outs[name] = tmp_path / name
        args = ["-m", "quantize", "convert", str(fixtures_dir / kind), str(outs[name]), *opts, "--method", "gptq",
                "--calib", str(data), "--num-samples", "8", "--seq-len", "64", "--max-shard-size", "1MB",
                "--device", "cpu"]
        if name == "one":  # in this process (the CLI's library path): one interpreter start less
            from click.testing import CliRunner

            from quantize.cli import main

            r = CliRunner().invoke(main, args[2:])
            assert r.exit_code == 0, r.output[-2000:]
            continue
        if ranks == "torchrun":
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                   *args]
        else:
            cmd = [sys.executable, *args, "--devices", ranks]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        if ranks != "torchrun":
            assert f"ranks: {ranks.replace(',', ', ')}" in p.stderr
    files = sorted(f.name for f in outs["one"].glob("*.safetensors"))
    assert files and files == sorted(f.name for f in outs["several"].glob("*.safetensors"))
    for f in files:
        assert (outs["one"] / f).read_bytes() == (outs["several"] / f).read_bytes(), f


def test_a_layer_that_cannot_fit_is_refused_up_front(fixtures_dir, tmp_path, monkeypatch):
    """The account (engine/memory.py) of a Kimi fixture layer under GPTQ: its weights but the routed experts, which
    come a stack at a time, and the stack; one byte less memory than it needs is refused with the numbers."""
    import psutil

    from quantize.engine import experts, layerwise
    from quantize.errors import QuantizeError

    plan = build(Checkpoint(fixtures_dir / "kimi-k2-fp8"), recipe.preset("w4a16", 32, "gptq"), 2**30)
    samples = [torch.zeros(1, 64, dtype=torch.int64)] * 4
    a = layerwise.device_account(plan, samples, torch.device("cpu"), torch.bfloat16)
    dense = max(sum(t.numel() for n, t in layer.items() if ".experts." not in n) * 2 for layer in _layers(plan).values()
                if any(".experts." in n for n in layer))
    assert a.parts["layer weights"] == dense  # GPTQ decodes routed experts by stacks
    workers = experts.chunk_workers(torch.device("cpu"))
    assert a.parts["expert stack"] == workers * experts.stack_size(128, 256, torch.bfloat16, torch.device("cpu"),
                                                                   workers) * experts.expert_bytes(128, 256, torch.bfloat16)
    assert a.offload == "cpu" and a.parts["hidden states"] == 4 * 64 * 256 * 2  # a CPU's memory is the host's

    class Tight:
        available = int(a.total / 0.9) - 4096

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight)
    with pytest.raises(QuantizeError, match=r"layer 1 needs .* on cpu .*expert stack"):
        layerwise.check_layer_memory(layerwise.device_account(plan, samples, torch.device("cpu"), torch.bfloat16,
                                                              "cpu"))


def _layers(plan):
    layers = {}
    for e in plan.entries:
        if e.role.layer is not None and e.role.kind != "mtp":
            layers.setdefault(e.role.layer, {})[e.tensor.name] = torch.empty(e.tensor.shape, device="meta")
    return layers


def calibrated_plan(src, recipe_name: str, tmp_path, num_samples: int, seq_len: int, shard_size: int = 2**18):
    """A GPTQ plan of `src` with small output shards, and its calibration samples."""
    import dataclasses

    data = calibration_samples(tmp_path)
    r = recipe.load(RECIPES / f"{recipe_name}.yaml")
    r = dataclasses.replace(r, method="gptq", calibration=dataclasses.replace(
        r.calibration, data=str(data), num_samples=num_samples, seq_len=seq_len))
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), num_samples, seq_len)
    return build(Checkpoint(src), r, shard_size), samples


def interrupted_run(plan, samples, out, monkeypatch, dies_when) -> None:
    """stream.run into `out` whose shard writing fails (an I/O error) as soon as `dies_when()` holds; the hook
    is then closed as the CLI does, which waits for a layer checkpoint still being written."""
    real = engine_shard.write_shard_pair

    def write_shard_pair(*a, **k):
        if dies_when():
            raise OSError(5, "I/O error")
        return real(*a, **k)

    monkeypatch.setattr(engine_shard, "write_shard_pair", write_shard_pair)
    failing = Calibrated(plan, samples, torch.device("cpu"))
    with pytest.raises(OSError):
        stream.run(plan, out, calibrated=failing)
    failing.close(ok=False)
    monkeypatch.setattr(engine_shard, "write_shard_pair", real)


def test_gptq_resume_after_a_failure_gives_the_uninterrupted_bytes(fixtures_dir, tmp_path, monkeypatch):
    """Finished shards are kept and finished layers come from their checkpoint (results and the activations
    entering the next layer): the resumed run writes only what is missing, byte-identical to one that never
    stopped."""
    plan, samples = calibrated_plan(fixtures_dir / "kimi-k2-fp8", "kimi-k2-w4a16", tmp_path, 6, 48)
    assert len(plan.shards) >= 4
    stream.run(plan, tmp_path / "clean", calibrated=Calibrated(plan, samples, torch.device("cpu")))
    calls = []
    partial = tmp_path / "out.partial"
    # the writers die past the 8th shard, once a layer checkpoint is committed: when that happens depends on how
    # far the loop is ahead of the writers (under a loaded CI machine the 8th shard could come first)
    interrupted_run(plan, samples, tmp_path / "out", monkeypatch,
                    lambda: calls.append(1) or (len(calls) >= 8 and (partial / "calib" / "layers.json").exists()))
    saved = json.loads((partial / "calib" / "layers.json").read_text())
    assert saved["next_layer"] >= 1
    # a checkpoint enters a segment (tensor_plan.calibrated_keys) and is committed once every shard before it is
    # finished: a resume needs the activations and nothing else
    done = json.loads((partial / "state.json").read_text())["done"]
    before = [n for i, n in enumerate(plan.shard_names)
              if plan.segment_of(i) is not None and plan.segments[plan.segment_of(i)][1] <= saved["next_layer"]]
    assert saved["next_layer"] in {lo for lo, _ in plan.segments} and before and set(before) <= set(done)
    assert set(saved) == {"samples", "next_layer", "activations", "stats"}

    other = [s[:, :-1] for s in samples]  # other calibration tokens: their activations would not match
    with pytest.raises(UsageError, match="other samples"):
        stream.run(plan, tmp_path / "out", resume=True, calibrated=Calibrated(plan, other, torch.device("cpu")))

    hook = Calibrated(plan, samples, torch.device("cpu"))
    result = stream.run(plan, tmp_path / "out", resume=True, calibrated=hook)
    assert result.resumed_shards == len(done) >= len(before)
    stats = hook.quantizer.stats
    assert stats.resumed_layers == saved["next_layer"]  # taken from the checkpoint, not calibrated again
    assert [x.layer for x in stats.layers] == list(range(plan.model.num_hidden_layers))
    for f in sorted((tmp_path / "clean").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "out" / f.name).read_bytes(), f.name
    assert not partial.exists() and not (tmp_path / "out" / "calib").exists()


def test_a_damaged_layer_checkpoint_is_refused_not_used(fixtures_dir, tmp_path, monkeypatch):
    plan, samples = calibrated_plan(fixtures_dir / "llama-bf16", "dense-w4a16", tmp_path, 4, 32)
    interrupted_run(plan, samples, tmp_path / "out", monkeypatch,
                    lambda: (tmp_path / "out.partial" / "calib" / "layers.json").exists())
    act = next((tmp_path / "out.partial" / "calib").glob("activations-*.safetensors"))
    data_ = bytearray(act.read_bytes())
    data_[-3] ^= 0x10  # one bit of the last sample's activations
    act.write_bytes(bytes(data_))
    with pytest.raises(QuantizeError, match="does not match its checksum"):
        stream.run(plan, tmp_path / "out", resume=True, calibrated=Calibrated(plan, samples, torch.device("cpu")))
    assert not (tmp_path / "out").exists()


def test_linears_sharing_a_hessian_solve_as_one_stacked_matrix():
    """The engine solves q/k/v (and gate/up) as one matrix: GPTQ's rows are independent given H, so the codes
    must be the very bytes of solving each weight alone."""
    X = correlated_inputs(1024, 256, seed=4)
    H = torch.zeros(256, 256)
    gptq.add_batch(H, X)
    Ws = [torch.randn(rows, 256) * 0.05 for rows in (64, 16, 16)]

    def solve(W):
        scale, zp = rtn.group_qparams(W, 64, symmetric=False)
        return gptq.gptq_quantize(W, H.clone(), scale, zp, actorder=True)[0]

    assert torch.equal(solve(torch.cat(Ws)), torch.cat([solve(W) for W in Ws]))


@pytest.mark.parametrize("actorder,symmetric,shape", [(True, True, (48, 256)), (False, False, (40, 192)),
                                                       (True, False, (33, 320))])
def test_a_batched_solve_of_experts_gives_each_experts_solo_codes(actorder, symmetric, shape):
    """Routed experts are solved as a stack (one column loop, one Cholesky call): each expert's codes must be the
    very bytes of solving it alone, whatever stack it lands in: including a singular Hessian (RTN fallback),
    a Hessian with dead columns, and partial blocks (320 = 2.5 blocks of 128)."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(5)
    Ws, Hs = [], []
    for e in range(6):
        W = torch.randn(out_f, in_f, generator=g) * 0.05
        X = correlated_inputs(4 if e == 3 else 600, in_f, seed=10 + e)  # expert 3: 4 tokens, low rank
        if e == 2:
            X[:, :7] = 0  # dead input columns
        H = torch.zeros(in_f, in_f)
        gptq.add_batch(H, X)
        if e == 1:
            H = -torch.eye(in_f)  # not positive definite even when damped: RTN
        Ws.append(W)
        Hs.append(H)

    def qparams(W):
        return rtn.group_qparams(W, 64 if in_f % 64 == 0 else 32 if in_f % 32 == 0 else in_f, symmetric=symmetric)

    solo = [gptq.gptq_quantize(W, H.clone(), *qparams(W), actorder=actorder) for W, H in zip(Ws, Hs, strict=True)]
    assert [f for _, f in solo] == [False, True, False, False, False, False]
    for members in ([0, 1, 2, 3, 4, 5], [5, 2, 1], [3]):
        W = torch.stack([Ws[e] for e in members])
        scale = torch.stack([qparams(Ws[e])[0] for e in members])
        zp = None if symmetric else torch.stack([qparams(Ws[e])[1] for e in members])
        codes, fallback = gptq.gptq_quantize_batched(W, torch.stack([Hs[e] for e in members]), scale, zp,
                                                     actorder=actorder)
        for k, e in enumerate(members):
            assert torch.equal(codes[k], solo[e][0]), (members, e)
            assert bool(fallback[k]) == solo[e][1]


@pytest.mark.parametrize("solver", ["lapack", "cusolver-like"])
def test_a_hessian_with_nan_or_inf_gives_rtn_codes_whatever_the_solver_reports(solver, monkeypatch):
    """Calibration inputs that overflowed leave NaN or an infinity in a Hessian. cuSOLVER's Cholesky reports
    info == 0 for such a matrix (pytorch #64818; LAPACK flags it), and `d == 0` misses NaN, so the codes came
    from NaN cast to int8. The CPU twin of the GPU: `cusolver-like` is a Cholesky that never flags anything.
    The broken experts of a stack fall back to RTN's codes; the good one keeps its solo codes."""
    real = torch.linalg.cholesky_ex
    if solver == "cusolver-like":
        def never_flags(A, *, upper=False, check_errors=False, out=None):
            L, info = real(A, upper=upper, check_errors=check_errors, out=out)
            info.zero_()
            return L, info
        monkeypatch.setattr(torch.linalg, "cholesky_ex", never_flags)
    g = torch.Generator().manual_seed(3)
    W = torch.randn(3, 64, 256, generator=g) * 0.05
    H = torch.zeros(3, 256, 256)
    for e in range(3):
        gptq.add_batch(H[e], correlated_inputs(800, 256, seed=20 + e))
    H[1, 3, 5] = float("nan")
    H[2, 7, 7] = float("inf")
    scale = torch.stack([rtn.group_qparams(w, 32)[0] for w in W])
    solo, flag = gptq.gptq_quantize(W[0], H[0].clone(), scale[0])
    codes, fallback = gptq.gptq_quantize_batched(W, H.clone(), scale)
    assert fallback.tolist() == [False, True, True] and not flag
    assert torch.equal(codes[0], solo)
    for e in (1, 2):
        assert torch.equal(codes[e], rtn.quantize_groups(W[e], scale[e])), e
    for e in (1, 2):  # the dense path (a stack of one) flags it too
        alone, flag = gptq.gptq_quantize(W[e], H[e].clone(), scale[e])
        assert flag and torch.equal(alone, codes[e])


def test_the_solve_gives_the_same_bytes_on_any_number_of_cpu_threads():
    """The solve's results must not depend on its thread count (the forwards' GEMMs may: a CPU rank computes on
    the machine's count, distributed.cpu_threads). LAPACK's Cholesky rounds differently on two threads, so the
    solve factors on one; the triangular solve and the rest are the same bytes on any count."""
    X = correlated_inputs(3000, 1024, seed=7)
    H = torch.zeros(1024, 1024)
    gptq.add_batch(H, X)
    H = gptq.mirror_upper(H).expand(3, -1, -1).clone()
    H.diagonal(dim1=-2, dim2=-1).add_(0.01 * H.diagonal(dim1=-2, dim2=-1).mean())
    before = torch.get_num_threads()
    try:
        factors = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            factors.append(gptq.inverse_factor(H.clone())[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*factors)
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H[0])), upper=True)
    torch.testing.assert_close(factors[0][0], ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_codes_do_not_follow_the_process_wide_matmul_precision(method, fixtures_dir, tmp_path):
    """Another library's torch.set_float32_matmul_precision("medium") (oneDNN's float32 GEMMs on bf16 inputs, on
    CPUs with bf16 units; TF32 in cuBLAS on a GPU) must not move the codes: the engine computes each layer at the
    precision it sets (quant/precision.py) and restores the process's own afterwards. Float32 forwards, the path
    the setting reaches on CPU (on AVX2 CPUs, which have no bf16 units, it changes nothing either way)."""
    import dataclasses

    src = fixtures_dir / "llama-bf16"
    data = calibration_samples(tmp_path)
    r = recipe.load(RECIPES / "dense-w4a16.yaml")
    r = dataclasses.replace(r, method=method, calibration=dataclasses.replace(r.calibration, data=str(data),
                                                                              num_samples=8, seq_len=64))
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), 8, 64)
    outs = {}
    for setting in ("highest", "medium"):
        torch.set_float32_matmul_precision(setting)
        try:
            plan = build(Checkpoint(src), r, 2**20)
            hook = Calibrated(plan, samples, torch.device("cpu"), compute_dtype="float32")
            stream.run(plan, tmp_path / setting, calibrated=hook)
            hook.close()
            assert torch.get_float32_matmul_precision() == setting  # the process's own, restored
        finally:
            torch.set_float32_matmul_precision("highest")
        outs[setting] = {p.name: p.read_bytes() for p in (tmp_path / setting).glob("*.safetensors")}
    assert outs["medium"] == outs["highest"]
