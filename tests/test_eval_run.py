"""`quantize eval` for real: a bf16 baseline, its RTN conversion as candidate, lm-eval's hf backend on CPU, a small
slice of the real GSM8K / MMLU / ARC-Challenge data in ../shared/data. All three tasks on the bundled tiny Llama
in the default run (the gate's plumbing: every task, metric, cache and verdict); on SmolLM2-135M behind `-m slow`
(real scale: GSM8K's generations alone took 20 minutes of a real AVX2 CPU); the gate deciding on SmolLM2's
perplexity and ARC in the default run."""

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_gate import DATA

from quantize import recipe
from quantize.checkpoint import Checkpoint
from quantize.cli import main
from quantize.engine import stream
from quantize.tensor_plan import build


def test_eval_gates_an_rtn_candidate_on_all_three_tasks(fixtures_dir, tmp_path):
    _gates_an_rtn_candidate(fixtures_dir / "llama-bf16", tmp_path)


@pytest.mark.slow
def test_eval_gates_an_rtn_candidate_of_smollm2_on_all_three_tasks(smollm2, tmp_path):
    _gates_an_rtn_candidate(smollm2, tmp_path)


def _gates_an_rtn_candidate(base: Path, tmp_path: Path) -> None:
    cand = tmp_path / "rtn"
    stream.run(build(Checkpoint(base), recipe.preset("w4a16", 64, "rtn"), max_shard_size=2**30), cand)
    lenient = tmp_path / "lenient.yaml"
    tasks = {"gsm8k": ["exact_match,strict-match", "exact_match,flexible-extract"], "mmlu": ["acc,none"],
             "arc_challenge": ["acc,none", "acc_norm,none"]}
    lenient.write_text(yaml.safe_dump({"defaults": {"max_drop": 100, "min_recovery": 0},
                                       "tasks": {t: {"metrics": m} for t, m in tasks.items()}}))
    common = [str(cand), "--baseline", str(base), "--data-dir", str(DATA), "--limit", "3", "--batch-size", "16",
              "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]
    first = CliRunner().invoke(main, ["eval", *common, "--gate", str(lenient), "--json", str(tmp_path / "a.json"),
                                      "--report", str(tmp_path / "a.md")])
    assert first.exit_code == 0, first.output
    run = json.loads((tmp_path / "a.json").read_text())
    assert run["passed"] is True and run["baseline_from"] == "evaluated"
    assert {(v["task"], v["metric"]) for v in run["verdicts"]} == {(t, m) for t, ms in tasks.items() for m in ms}
    for v in run["verdicts"]:
        assert v["verdict"] == "pass" and v["baseline"] is not None and v["candidate"] is not None
        assert v["samples"] == (57 * 3 if v["task"] == "mmlu" else 3)
    md = (tmp_path / "a.md").read_text()
    assert all(f"| {t} |" in md for t in tasks) and "Gate: **PASS**" in md

    # strict: no drop at all on the metric where the candidate scored lowest relative to the baseline, and a
    # recovery above 1 on every metric where it did not fall (a tie is not an improvement)
    worst = min(run["verdicts"], key=lambda v: v["delta"])
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump({"defaults": {"max_drop": 0, "min_recovery": 1.0001},
                                      "tasks": {worst["task"]: {"metrics": [worst["metric"]]}}}))
    second = CliRunner().invoke(main, ["eval", *common, "--tasks", worst["task"], "--gate", str(strict),
                                       "--json", str(tmp_path / "b.json")])
    assert second.exit_code == 1, second.output
    again = json.loads((tmp_path / "b.json").read_text())
    assert again["passed"] is False and again["baseline_from"].startswith("cache ")  # the baseline ran once
    assert run["candidate_from"] == "evaluated" and again["candidate_from"].startswith("cache ")  # and the candidate
    # no drop allowed at all: a FAIL, or INCONCLUSIVE where 3 items cannot resolve a limit of no drop; never a pass
    assert again["verdicts"][0]["verdict"] in ("fail", "inconclusive")


GPL = Path("/usr/share/common-licenses/GPL-3")  # neither calibration nor evaluation data


def eval_json(cand, base, tmp_path, cache, name, *extra, ppl=True):
    r = CliRunner().invoke(main, ["eval", str(cand), "--baseline", str(base), "--tasks", "arc_challenge",
                                  *(["--ppl-text", str(GPL)] if ppl else []), "--limit", "20", "--data-dir", str(DATA),
                                  "--device", "cpu", "--cache-dir", str(cache), "--json",
                                  str(tmp_path / f"{name}.json"), *extra])
    return r, json.loads((tmp_path / f"{name}.json").read_text())


def test_the_gate_decides_on_smollm2_pass_fail_and_inconclusive(smollm2, tmp_path, eval_cache):
    """The real SmolLM2-135M, ARC-Challenge at 20 items and held-out perplexity (GPL-3, in 250-word documents).
    Against an identical copy (the same content, so its results are the cached baseline's, as for any user):
    every paired difference is 0, PASS on every metric, exit 0. Against its RTN g64
    conversion: perplexity rises far beyond 5% and beyond its noise, a FAIL; ARC at 20 items cannot resolve a
    one-point limit (INCONCLUSIVE, naming the items that would); exit 1, and 0 with --allow-inconclusive only
    when nothing failed."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(smollm2, copy)
    r, same = eval_json(copy, smollm2, tmp_path, eval_cache, "same")
    assert r.exit_code == 0, r.output
    assert same["outcome"] == "PASS" and {v["task"] for v in same["verdicts"]} == {"arc_challenge", "perplexity"}
    assert all(v["verdict"] == "pass" and v["paired"] and v["paired_se"] == 0 for v in same["verdicts"])
    assert same["candidate_from"].startswith("cache ")
    cand = tmp_path / "smol-rtn"
    stream.run(build(Checkpoint(smollm2), recipe.preset("w4a16", 64, "rtn"), max_shard_size=2**30), cand)
    r, rtn = eval_json(cand, smollm2, tmp_path, eval_cache, "rtn", "--report", str(tmp_path / "rtn.md"))
    assert r.exit_code == 1, r.output
    by = {v["metric"]: v for v in rtn["verdicts"]}
    ppl = by["word_perplexity,none"]
    assert ppl["verdict"] == "fail" and ppl["delta"] > 20 and ppl["candidate"] > ppl["baseline"], ppl
    assert rtn["baseline_from"].startswith("cache ")  # the baseline's per-item results came from the cache
    assert rtn["candidate_from"] == "evaluated"  # other bytes, other key
    arc = [by["acc,none"], by["acc_norm,none"]]
    assert any(v["verdict"] == "inconclusive" and v["needs_items"] > 100 for v in arc), arc
    assert all(v["verdict"] in ("pass", "inconclusive") and v["samples"] == 20 for v in arc), arc
    md = (tmp_path / "rtn.md").read_text()
    assert "Gate: **FAIL**" in md and "INCONCLUSIVE" in md and f"rise {ppl['delta']:+.1f}%" in md
    r, only_arc = eval_json(cand, smollm2, tmp_path, eval_cache, "arc", "--allow-inconclusive", "--gate", str(ARC_ONLY),
                            ppl=False)
    assert r.exit_code == 0 and only_arc["outcome"] == "INCONCLUSIVE (allowed)", r.output


ARC_ONLY = Path(__file__).parent / "data" / "gate-arc.yaml"



@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_an_fp4_candidate_evaluates_in_float32(scheme, fixtures_dir, tmp_path):
    """compressed-tensors decompresses an FP4 checkpoint's weights in bf16 whatever dtype the model is loaded in,
    so a float32 evaluation (the hf backend's on an AVX2 CPU, forced here) stopped at its first GEMM with
    `float != BFloat16`, exit 2. Its weights now widen to the forward's dtype (compute.widened_linears): the
    gate runs and decides."""
    base = fixtures_dir / "llama-bf16"
    cand = tmp_path / scheme
    stream.run(build(Checkpoint(base), recipe.preset(scheme, 0), max_shard_size=2**30), cand)
    r = CliRunner().invoke(main, ["eval", str(cand), "--baseline", str(base), "--tasks", "arc_challenge", "--limit", "2",
                                  "--data-dir", str(DATA), "--device", "cpu", "--compute-dtype", "float32",
                                  "--cache-dir", str(tmp_path / "cache"), "--gate", str(ARC_ONLY),
                                  "--allow-inconclusive", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    run = json.loads((tmp_path / "r.json").read_text())
    assert run["candidate_from"] == "evaluated" and {v["samples"] for v in run["verdicts"]} == {2}
    assert all(v["candidate"] is not None for v in run["verdicts"])
