"""Ranks that cannot diverge. Under NCCL a rank that decides alone, or a message split on one side only, hangs;
gloo raises instead, and CPU ranks of one machine all see the same memory and thread counts, so nothing diverges
unless it is forced. Each test forces one condition on gloo CPU ranks, through a sitecustomize.py that every
process of the run imports (spawned ranks inherit PYTHONPATH): a rank short of memory, a leave that would block
as NCCL's destroy_process_group can, an error on one rank with work pending, a GEMM whose bits follow the thread
count, trailing layers with nothing to quantize, and a sender that stages where its receiver does not. Every
test ends within its timeout; each of these seven hung or failed on the code before engine/agreement.py (the
last test, a prefill pair on two ranks, pins the writers' second output)."""

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import RECIPES
from test_gptq import calibration_samples

SITE = textwrap.dedent('''
    import os
    import time

    for force in filter(None, os.environ.get("QUANTIZE_TEST_FORCE", "").split(",")):
        if force == "hang-destroy":  # leaving the group blocks, as NCCL's destroy does with work pending
            import torch.distributed as dist

            dist.destroy_process_group = lambda *a, **k: time.sleep(3600)
        elif force == "lowmem":  # a spawned rank (rank 1..) reads 1 MiB of free host memory
            import multiprocessing

            import psutil

            real = psutil.virtual_memory

            def virtual_memory():
                v = real()
                return v._replace(available=1 << 20) if multiprocessing.parent_process() is not None else v

            psutil.virtual_memory = virtual_memory
        elif force.startswith("raise@"):  # raise@RANK:LAYER, in the middle of the layer loop
            rank, layer = map(int, force[len("raise@"):].split(":"))
            from quantize.engine import layerwise

            build = layerwise.LayerwiseQuantizer._build_layer

            def failing(self, i, rank=rank, layer=layer, build=build):
                if i == layer and self.rank == rank:
                    raise RuntimeError(f"forced failure on rank {rank} at layer {i}")
                return build(self, i)

            layerwise.LayerwiseQuantizer._build_layer = failing
        elif force.startswith("awq-raise@"):  # awq-raise@RANK: in the norm's search, between its two exchanges
            rank = int(force[len("awq-raise@"):])
            from quantize.engine import awq_experts

            per_group = awq_experts.AWQExperts._per_group
            calls = []

            def failing_search(self, fn, zero, rank=rank, per_group=per_group, calls=calls):
                calls.append(1)
                if self.s.rank == rank and len(calls) == 2:  # the candidates' errors, after w_mean's exchange
                    raise RuntimeError(f"forced AWQ failure on rank {rank}")
                return per_group(self, fn, zero)

            awq_experts.AWQExperts._per_group = failing_search
        elif force == "gemm-threads":  # a GEMM whose result depends on the thread count (oneDNN on AMX did)
            import torch

            linear = torch.nn.functional.linear

            def by_threads(x, w, b=None, linear=linear):
                return linear(x, w, b) * (1 + 1e-2 * torch.get_num_threads())

            torch.nn.functional.linear = by_threads
''')


def forced(tmp_path, force: str) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    import os

    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "QUANTIZE_TEST_FORCE": force}


def convert(args: list[str], env: dict | None = None, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "quantize", "convert", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p, time.monotonic() - t0


def gptq_args(fixtures_dir, tmp_path, kind: str, out, *extra) -> list[str]:
    return [str(fixtures_dir / kind), str(out), "--method", "gptq", "--calib", str(calibration_samples(tmp_path, 16)),
            "--num-samples", "8", "--seq-len", "48", "--max-shard-size", "300KB", "--device", "cpu", *extra]


def shard_bytes(out) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(out.glob("*.safetensors"))}


def test_a_rank_short_of_memory_is_refused_by_every_rank_in_one_line(fixtures_dir, tmp_path):
    """Rank 1 sees too little free memory for the layer. Each rank used to choose its account alone and only
    rank 0's was checked: the run went on, and under NCCL ranks on different offloads exchange different
    messages. Now rank 0 decides over every rank's reading and says one line naming rank 1; nothing is left."""
    out = tmp_path / "out"
    p, took = convert(gptq_args(fixtures_dir, tmp_path, "llama-bf16", out, "--scheme", "w4a16", "--group-size", "32",
                                "--devices", "cpu,cpu"), forced(tmp_path, "lowmem"), timeout=180)
    assert p.returncode == 1, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (cpu): layer "), p.stderr[-2000:]
    assert "free" in errors[0] and "Traceback" not in p.stderr and "failed" not in p.stderr
    assert not out.exists() and not out.with_name("out.partial").exists()


@pytest.mark.parametrize("rank", [1, 0])
def test_an_error_with_work_pending_ends_every_rank_though_leaving_the_group_would_block(rank, fixtures_dir,
                                                                                         tmp_path):
    """An exception on one rank in layer 1 while leaving the process group blocks (as NCCL's
    destroy_process_group does with work pending). Rank 1 used to destroy the group in its finally and never
    exit, so rank 0's watch never saw it die; rank 0, failing, destroyed its group and waited the same way.
    A failure now never leaves through destroy: it prints and ends the process (or aborts the group)."""
    out = tmp_path / "out"
    p, took = convert(gptq_args(fixtures_dir, tmp_path, "llama-bf16", out, "--scheme", "w4a16", "--group-size", "32",
                                "--devices", "cpu,cpu", "--rank-timeout", "1"),
                      forced(tmp_path, f"hang-destroy,raise@{rank}:1"), timeout=240)
    assert p.returncode == 1, p.stderr[-2000:]
    assert f"forced failure on rank {rank} at layer 1" in p.stderr
    if rank == 1:
        assert "rank 1 (cpu) failed:" in p.stderr and "rank 1 (cpu) died (exit 1) during layer 1" in p.stderr
    assert took < 60, took  # not the rank timeout (60 s): nobody waited on anybody
    assert not out.exists() and out.with_name("out.partial").is_dir()  # what was finished stays, to resume


def test_trailing_layers_with_no_targets_run_nowhere_and_each_rank_writes_its_share(fixtures_dir, tmp_path):
    """A recipe that keeps the last two layers of the MoE fixture in bf16. Rank 0 ran a layer only when a writer
    asked for one of its targets, while rank 1 looped over every layer: it waited in its first exchange of layer
    1 for a rank 0 that never came (gloo: `rank 1 (cpu) failed: ... Connection closed by peer`, then exit 0;
    NCCL: a hang). Now every rank runs the layers rank 0 planned (agreement.run_terms), and each writes the
    shards of the experts it solved (one layer here: layer 0 is dense, so rank 1 writes nothing)."""
    text = (RECIPES / "glm-w4a16.yaml").read_text().replace("  - lm_head\n", "  - lm_head\n  - 're:model\\.layers\\.[12]\\..*'\n")
    rec = tmp_path / "trailing.yaml"
    rec.write_text(text.replace("method: rtn", "method: gptq").replace("  - 're:.*mlp\\.(gate|up|gate_up|down)_proj.*'\n", ""))
    outs = {}
    for name, extra in (("one", []), ("two", ["--devices", "cpu,cpu"])):
        outs[name] = tmp_path / name
        p, _ = convert(gptq_args(fixtures_dir, tmp_path, "glm4-moe-bf16", outs[name], "--recipe", str(rec), "--json",
                                 *extra), timeout=300)
        assert p.returncode == 0 and "failed" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        report = json.loads(p.stdout)
        assert report["calibration"]["layers"] == 1  # layers 1 and 2 hold nothing to quantize: nobody runs them
    assert shard_bytes(outs["one"]) == shard_bytes(outs["two"])


def test_each_rank_writes_the_shards_of_the_experts_it_solved(fixtures_dir, tmp_path):
    """Kimi K2's routed experts on 2 ranks: rank 1's writers write and hash its groups' shards (none of their
    codes go to rank 0), rank 0 merges the index and manifest; --json gives each rank's seconds per phase and
    its writers' (busy, and waiting for layers). The bytes are one rank's."""
    outs = {}
    for name, extra in (("one", []), ("two", ["--devices", "cpu,cpu"])):
        outs[name] = tmp_path / name
        p, _ = convert(gptq_args(fixtures_dir, tmp_path, "kimi-k2-fp8", outs[name], "--recipe",
                                 str(RECIPES / "kimi-k2-w4a16.yaml"), "--json", *extra), timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        outs[name, "report"] = json.loads(p.stdout)
    assert shard_bytes(outs["one"]) == shard_bytes(outs["two"])
    ranks = outs["two", "report"]["calibration"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    shards = outs["two", "report"]["shards"]
    written = {r["rank"]: sum(w["shards"] for w in r["writers"]) for r in ranks}
    assert written[0] > 0 and written[1] > 0 and sum(written.values()) == shards, ranks
    streams = {r["rank"]: {w["stream"] for w in r["writers"]} for r in ranks}
    assert 0 in streams[0] and 0 not in streams[1]  # rank 0 writes all but the routed experts
    for r in ranks:
        assert r["phases"]["forward"] > 0 and r["phases"]["experts"] > 0 and r["phases"]["routed_output_and_exchange"] > 0
        assert all(w["busy"] >= 0 and w["waiting_for_layers"] >= 0 and w["bytes"] > 0 for w in r["writers"])
        assert r["routed_bytes"] > 0  # the rows each group touched, counted on both sides
    one = outs["one", "report"]["calibration"]["ranks"]
    assert len(one) == 1 and one[0]["routed_bytes"] == 0  # one rank exchanges nothing


def test_the_bytes_do_not_follow_the_thread_count_of_a_rank(fixtures_dir, tmp_path):
    """A GEMM whose bits depend on its thread count (oneDNN on an Intel AMX CPU: one rank and two gave other
    bytes, 137 of 362 tensors identical) forced on every CPU: each CPU rank used to take cores // ranks threads,
    so 1 and 2 ranks computed with other counts. The count is now the machine's, whatever the ranks."""
    env = forced(tmp_path, "gemm-threads")
    outs = {}
    for name, extra in (("one", []), ("two", ["--devices", "cpu,cpu"])):
        outs[name] = tmp_path / name
        p, _ = convert(gptq_args(fixtures_dir, tmp_path, "llama-bf16", outs[name], "--scheme", "w4a16",
                                 "--group-size", "32", *extra), env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    assert shard_bytes(outs["one"]) == shard_bytes(outs["two"])


def _stage_rank(rank: int, init: str, result) -> None:
    from quantize.engine import distributed

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    distributed.STAGE_BYTES = 64  # a message of 1,000 bytes crosses in 16 pieces
    # rank 0 stages each piece through "its GPU" (a copy, as under NCCL from the host); rank 1 receives in place
    distributed._staged = lambda piece: rank == 0
    x = torch.arange(250, dtype=torch.float32)
    if rank == 0:
        distributed.send(x, 1)
        distributed.send_any(x.to(torch.bfloat16).reshape(10, 25), 1)
        distributed.broadcast(x * 2, 0)
        work, _ = distributed.broadcast(x * 3, 0, async_op=True)
        work.wait()
        result.put(("ok", 0))
    else:
        got = [distributed.recv(torch.empty(250), 0), distributed.recv_any(0, torch.device("cpu")),
               distributed.broadcast(y := torch.empty(250), 0) or y, distributed.broadcast(z := torch.empty(250), 0) or z]
        result.put(("ok" if torch.equal(got[0], x) and torch.equal(got[1].float().reshape(-1), x)
                    and torch.equal(got[2], x * 2) and torch.equal(got[3], x * 3) else "wrong", 1))
    torch.distributed.destroy_process_group()


def test_a_message_is_split_the_same_way_on_both_sides_whatever_either_stages(tmp_path):
    """The CPU stand-in for a GPU rank sending from host memory (GLM-5's top-k carry under cpu offload) to a rank
    receiving into its GPU: the sender staged in STAGE_BYTES pieces, the receiver took the message whole, and
    under NCCL they hang once a sample reaches 16,384 tokens. The pieces now follow the size alone."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_stage_rank, args=(r, init, result)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert sorted(result.get(timeout=5) for _ in procs) == [("ok", 0), ("ok", 1)]


def test_a_prefill_pair_on_two_ranks_gives_both_outputs_of_one(fixtures_dir, tmp_path):
    """`--prefill-out` with `--devices cpu,cpu`: rank 1 writes both sides of its expert shards (the INT4 codes it
    solved, and their FP8 prefill twins from the source), rank 0 the rest; both outputs are one rank's bytes."""
    import yaml

    from quantize import recipe

    fp8 = tmp_path / "fp8.yaml"
    fp8.write_text(yaml.safe_dump(recipe.preset("fp8-block", 128).to_dict()))
    outs = {}
    for name, extra in (("one", []), ("two", ["--devices", "cpu,cpu"])):
        outs[name] = tmp_path / name
        p, _ = convert(gptq_args(fixtures_dir, tmp_path, "kimi-k2-fp8", outs[name], "--recipe",
                                 str(RECIPES / "kimi-k2-w4a16.yaml"), "--prefill-out", str(tmp_path / f"{name}-fp8"),
                                 "--prefill-recipe", str(fp8), *extra), timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    for side in ("", "-fp8"):
        one, two = shard_bytes(tmp_path / f"one{side}"), shard_bytes(tmp_path / f"two{side}")
        assert one and one == two, side


@pytest.mark.parametrize("rank", [1, 0])
def test_an_awq_rank_failing_between_the_norms_exchanges_ends_every_rank(rank, fixtures_dir, tmp_path):
    """AWQ's norm before the experts is searched by every rank: w_mean's sums to rank 0 and back, then the
    candidates' errors. A rank that fails between the two leaves the others in an exchange it never joins
    (under NCCL: forever). The failure ends every rank within seconds, says what failed, and keeps OUT.partial."""
    out = tmp_path / "out"
    p, took = convert([str(fixtures_dir / "kimi-k2-fp8"), str(out), "--recipe", str(RECIPES / "kimi-k2-w4a16.yaml"),
                       "--method", "awq", "--calib", str(calibration_samples(tmp_path, 16)), "--num-samples", "4",
                       "--seq-len", "32", "--max-shard-size", "300KB", "--device", "cpu", "--devices", "cpu,cpu",
                       "--rank-timeout", "1"], forced(tmp_path, f"hang-destroy,awq-raise@{rank}"), timeout=240)
    assert p.returncode == 1, p.stderr[-2000:]
    assert f"forced AWQ failure on rank {rank}" in p.stderr
    assert took < 60, took  # not the rank timeout (60 s): nobody waited on anybody
    assert not out.exists() and out.with_name("out.partial").is_dir()
