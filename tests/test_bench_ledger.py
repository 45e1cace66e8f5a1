"""scripts/bench.py's ledger: a comparison longer than a session, finished in parts (`--resume`), takes a run from
an earlier invocation only where the same command ran on the same machine (and, for ours, the same quantize
sources) and its output is still whole; anything else runs again."""

import json
import sys

import bench

# a reference tool stand-in: writes OUT/config.json and counts its runs in OUT/../runs
TOOL = r"""
import pathlib, sys
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True)
(out / "config.json").write_text("{}")
runs = out.parent / "runs"
runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
"""


def runs(tmp_path) -> int:
    return int((tmp_path / "runs").read_text())


def test_a_reference_run_is_taken_from_the_ledger_only_where_it_still_holds(tmp_path, monkeypatch):
    out, cmd = tmp_path / "ref", [sys.executable, "-c", TOOL, str(tmp_path / "ref")]
    first = bench.Ledger(tmp_path / "ledger.json", resume=False).run("ref", cmd, out)
    assert runs(tmp_path) == 1 and first["seconds"] > 0 and "load_before" in first
    record = json.loads((tmp_path / "ledger.json").read_text())["ref"]
    assert record["machine"] == bench.machine() and record["run"] == first

    again = bench.Ledger(tmp_path / "ledger.json", resume=True)
    assert again.run("ref", cmd, out) == first and runs(tmp_path) == 1 and again.reused == ["ref"]
    # our code changed: a reference tool's run does not depend on it
    monkeypatch.setattr(bench, "package_digest", lambda: "other sources")
    assert bench.Ledger(tmp_path / "ledger.json", resume=True).run("ref", cmd, out) == first and runs(tmp_path) == 1

    bench.Ledger(tmp_path / "ledger.json", resume=False).run("ref", cmd, out)  # without --resume: run again
    assert runs(tmp_path) == 2
    bench.Ledger(tmp_path / "ledger.json", resume=True).run("ref", [*cmd, "--iters", "50"], out)  # another command
    assert runs(tmp_path) == 3
    monkeypatch.setattr(bench, "machine", lambda: {"cpu": "another CPU"})  # another machine: its own figures
    bench.Ledger(tmp_path / "ledger.json", resume=True).run("ref", [*cmd, "--iters", "50"], out)
    assert runs(tmp_path) == 4
    (out / "config.json").unlink()  # its output gone (or never whole): run again
    bench.Ledger(tmp_path / "ledger.json", resume=True).run("ref", [*cmd, "--iters", "50"], out)
    assert runs(tmp_path) == 5


def test_a_run_of_ours_is_run_again_when_the_quantize_sources_change(fixtures_dir, tmp_path, monkeypatch):
    out = tmp_path / "ours"
    cmd = [sys.executable, "-m", "quantize", "convert", str(fixtures_dir / "llama-bf16"), str(out), "--json"]
    bench.Ledger(tmp_path / "ledger.json", resume=True).run("ours", cmd, out)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert bench.Ledger(tmp_path / "ledger.json", resume=True).run("ours", cmd, out)
    assert (out / "config.json").stat().st_mtime_ns == stamp  # the same sources: taken, not run
    monkeypatch.setattr(bench, "package_digest", lambda: "other sources")
    ledger = bench.Ledger(tmp_path / "ledger.json", resume=True)
    ledger.run("ours", cmd, out)
    assert ledger.reused == [] and (out / "config.json").stat().st_mtime_ns != stamp


def test_a_perplexity_is_measured_once_per_run(tmp_path):
    out, cmd = tmp_path / "ref", [sys.executable, "-c", TOOL, str(tmp_path / "ref")]
    ledger = bench.Ledger(tmp_path / "ledger.json", resume=True)
    ledger.run("ref", cmd, out)
    measured = []
    measure = lambda: measured.append(1) or 20.5  # noqa: E731
    assert ledger.perplexity("ref", out, measure) == 20.5
    assert bench.Ledger(tmp_path / "ledger.json", resume=True).perplexity("ref", out, measure) == 20.5
    assert len(measured) == 1
    bench.Ledger(tmp_path / "ledger.json", resume=False).run("ref", cmd, out)  # a new run: its own perplexity
    assert bench.Ledger(tmp_path / "ledger.json", resume=True).perplexity("ref", out, lambda: 21.0) == 21.0


def test_the_code_digest_sees_code_not_docstrings_or_comments(tmp_path, monkeypatch):
    """A measurement written into a docstring or a comment leaves the runs of ours valid; a changed line of code
    does not."""
    root = tmp_path / "repo"
    (root / "quantize").mkdir(parents=True)
    (root / "scripts").mkdir()
    monkeypatch.setattr(bench, "__file__", str(root / "scripts" / "bench.py"))
    mod = root / "quantize" / "m.py"
    mod.write_text('"""A module."""\n\n\ndef f():\n    """Its doc."""\n    return 1  # why\n')
    first = bench.package_digest()
    mod.write_text('"""A module: measured 31.25."""\n\n\ndef f():\n    """Its doc, longer."""\n    return 1  # why not\n')
    assert bench.package_digest() == first
    mod.write_text('"""A module."""\n\n\ndef f():\n    """Its doc."""\n    return 2  # why\n')
    assert bench.package_digest() != first


def test_the_machine_counts_the_cores_this_process_may_use_not_the_hosts(monkeypatch):
    # a container's cpuset (or taskset) below the host's count: its runs are slower, so they are another machine
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert bench.machine()["cores"] == 1
