"""SIGKILL a real `quantize convert` at several points, then `--resume`: the output is byte-identical to an
uninterrupted run, in the streaming (RTN) and the layerwise (GPTQ) engine. The killed job's hold on its output
dies with it: the resume starts at once, past the record the killed job left."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RECIPES
from test_gptq import calibration_samples

from quantize import lock


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def done_shards(partial: Path) -> int:
    try:
        return len(json.loads((partial / "state.json").read_text())["done"])
    except (OSError, ValueError, KeyError):
        return 0


POINTS = {
    "state written, nothing else": lambda p: (p / "state.json").exists(),
    "first shard half written": lambda p: any(p.glob("*.safetensors.tmp")),
    "one shard done": lambda p: done_shards(p) >= 1,
    "three shards done": lambda p: done_shards(p) >= 3,
    "the last shards": lambda p: done_shards(p) >= 6,
    "index written, manifest not": lambda p: (p / "model.safetensors.index.json").exists(),
}


def kill_at(cmd: list[str], partial: Path, point, timeout: float = 120) -> bool:
    """Run cmd and SIGKILL it as soon as `point(partial)` holds; False if it finished first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if partial.exists() and point(partial):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    return False


def next_layer(partial: Path) -> int:
    try:
        return json.loads((partial / "calib" / "layers.json").read_text())["next_layer"]
    except (OSError, ValueError, KeyError):
        return 0


# the layerwise engine's own units: killed after a layer checkpoint (one enters each segment of layers but the
# first; none is taken after the last layer), the resume must start from it
LAYER_POINTS = {
    "first layer checkpointed": lambda p: next_layer(p) >= 1,
    "checkpointed, the next segment's shards under way": lambda p: next_layer(p) >= 1 and done_shards(p) >= 5,
}


def run(cmd: list[str]) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout) if "--json" in cmd else {}


def run_here(cmd: list[str]) -> None:
    """An uninterrupted reference run of `python -m quantize ARGS`, in this process (the CLI's library path):
    one interpreter start less than `run`."""
    from click.testing import CliRunner

    from quantize.cli import main

    assert cmd[1:3] == ["-m", "quantize"]
    r = CliRunner().invoke(main, cmd[3:])
    assert r.exit_code == 0, r.output[-2000:]


@pytest.mark.parametrize("engine", ["rtn", "gptq"])
def test_sigkill_anywhere_then_resume_gives_the_uninterrupted_bytes(engine, fixtures_dir, tmp_path):
    """Each point is its own run, killed there and resumed; two at a time (each run is mostly one thread
    importing torch and transformers, so two share the machine's cores at little cost to either)."""
    from concurrent.futures import ThreadPoolExecutor

    if engine == "rtn":
        src, extra = fixtures_dir / "kimi-k2-fp8", ["--recipe", str(RECIPES / "kimi-k2-w4a16.yaml")]
    else:
        src = fixtures_dir / "llama-bf16"
        extra = ["--recipe", str(RECIPES / "dense-w4a16.yaml"), "--method", "gptq", "--calib",
                 str(calibration_samples(tmp_path, n=16)), "--num-samples", "8", "--seq-len", "64"]
    base = [sys.executable, "-m", "quantize", "convert", str(src)]
    opts = [*extra, "--max-shard-size", "200KB", "--workers", "1", "--device", "cpu"]
    reference = tmp_path / "reference"
    run_here([*base, str(reference), *opts])
    want = files_of(reference)
    assert sum(n.endswith(".safetensors") for n in want) >= 7

    def kill_and_resume(k: int, label: str, point) -> tuple[int, dict] | None:
        out = tmp_path / f"out{k}"
        partial = out.with_name(out.name + ".partial")
        if not kill_at([*base, str(out), *opts], partial, point):
            return None  # finished before reaching the point: nothing to resume
        assert not out.exists(), label
        assert lock.lock_path(out).exists()  # the killed job's record stays; its flock died with it
        saved = next_layer(partial)
        report = run([*base, str(out), *opts, "--resume", "--json"])
        assert files_of(out) == want, label
        assert not partial.exists() and not lock.lock_path(out).exists()
        return saved, report

    # the writer's states, and for the layerwise engine its layer checkpoints too (for GPTQ, the shard states
    # that differ from RTN's only in how many shards are done are left to RTN's run)
    points = POINTS | (LAYER_POINTS if engine == "gptq" else {})
    if engine == "gptq":
        points = {k: v for k, v in points.items() if k not in ("one shard done", "the last shards")}
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(kill_and_resume, range(len(points)), points, points.values()))
    killed = [(label, r) for label, r in zip(points, done, strict=True) if r is not None]
    assert len(killed) >= 4, killed
    if engine == "gptq":  # the resume took every checkpointed layer instead of calibrating it again
        for label, (saved, report) in killed:
            # every layer from the checkpoint, or none to run at all once every layer's shards were finished
            n = json.loads((reference / "config.json").read_text())["num_hidden_layers"]
            assert report["calibration"]["resumed_layers"] in (saved, n), label
        assert sum(saved > 0 for _, (saved, _) in killed) >= 2, killed


@pytest.fixture(scope="module")
def glm5_gptq_reference(fixtures_dir, tmp_path_factory) -> tuple[list[str], list[str], Path]:
    """The command and options of a GPTQ run of the GLM-5 fixture, and its output from one uninterrupted rank
    (one run for the tests that kill ranks of the same command)."""
    tmp_path = tmp_path_factory.mktemp("glm5-reference")
    base = [sys.executable, "-m", "quantize", "convert", str(fixtures_dir / "glm5-bf16")]
    opts = ["--scheme", "w4a16", "--group-size", "32", "--method", "gptq", "--calib",
            str(calibration_samples(tmp_path, n=16)), "--num-samples", "8", "--seq-len", "64",
            "--max-shard-size", "200KB", "--workers", "1", "--device", "cpu"]
    reference = tmp_path / "reference"
    run_here([*base, str(reference), *opts])
    return base, opts, reference


def test_several_ranks_killed_after_a_layer_resume_from_it_with_the_bytes_of_one(glm5_gptq_reference, tmp_path):
    """Rank 0 SIGKILLed once a layer is checkpointed (its spawned rank loses the connection and ends); the
    resume on two ranks starts from rank 0's checkpoint, the other rank told where by rank 0."""
    base, opts, reference = glm5_gptq_reference
    out = tmp_path / "out"
    partial = out.with_name(out.name + ".partial")
    ranks = [*opts, "--devices", "cpu,cpu"]
    assert kill_at([*base, str(out), *ranks], partial, LAYER_POINTS["first layer checkpointed"])
    saved = next_layer(partial)
    assert saved >= 1
    report = run([*base, str(out), *ranks, "--resume", "--json"])
    assert report["calibration"]["resumed_layers"] == saved
    assert files_of(out) == files_of(reference)


def _ranks_of(pid: int) -> list:
    import psutil

    return [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


@pytest.mark.parametrize("victim", ["rank 1", "rank 0"])
def test_a_dead_rank_ends_every_rank_in_seconds_naming_it_and_resume_gives_the_bytes(victim, glm5_gptq_reference,
                                                                                      tmp_path):
    """SIGKILL one rank of a `--devices cpu,cpu` GPTQ run once a layer is done: every other rank exits within a
    minute with one line naming the dead rank and the layer, no process is left, and --resume gives the bytes
    of an uninterrupted run. Under NCCL no collective notices a dead peer, so rank 0 watches the ranks it
    started and each rank watches rank 0 (engine/distributed.py); test_the_watch_names_... pins that path."""
    import psutil

    base, opts, reference = glm5_gptq_reference
    out = tmp_path / "out"
    partial = out.with_name("out.partial")
    proc = subprocess.Popen([*base, str(out), *opts, "--devices", "cpu,cpu"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (next_layer(partial) >= 1 and _ranks_of(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run never reached its first layer"
        time.sleep(0.002)
    rank1 = _ranks_of(proc.pid)[0]
    t0 = time.monotonic()
    if victim == "rank 1":
        rank1.kill()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("error: rank 1 (cpu) died (killed by SIGKILL") and "during layer" in line, err
    else:
        proc.kill()
        gone, alive = psutil.wait_procs([rank1], timeout=60)
        assert not alive, "rank 1 outlived rank 0"
        _, err = proc.communicate(timeout=10)
        assert f"rank 1: rank 0 (PID {proc.pid}) is gone during layer" in err, err
        assert "Traceback" not in err, err
    assert time.monotonic() - t0 < 60
    assert not psutil.pid_exists(rank1.pid) or rank1.status() == psutil.STATUS_ZOMBIE
    run([*base, str(out), *opts, "--devices", "cpu,cpu", "--resume"])
    assert files_of(out) == files_of(reference)


def test_the_watch_names_a_dead_rank_while_rank_0_is_busy_elsewhere():
    """The path that ends an NCCL job: rank 0 is in no collective that would fail (under NCCL it waits in one
    that never does), and the watch alone sees the rank's death, within a second."""
    import multiprocessing
    import threading

    from quantize.engine import distributed

    p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    p.start()
    lines, stopped = [], threading.Event()
    distributed.layer[0] = 7
    t = threading.Thread(target=distributed.watch, args=([p], ["cuda:0", "cuda:1"], lines.append, stopped))
    t.start()
    time.sleep(0.2)
    assert lines == []  # alive: nothing said
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    t.join(timeout=10)
    assert time.monotonic() - t0 < 2
    assert lines == ["rank 1 (cuda:1) died (killed by SIGKILL (the OOM killer sends it too)) during layer 7; every "
                     "rank stops: rerun with --resume to continue from the last finished layer"]
    distributed.layer[0] = None
