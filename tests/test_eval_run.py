"""`quantize eval` for real: SmolLM2-135M bf16 as baseline, its RTN conversion as candidate, lm-eval's hf backend
on CPU, a small slice of the real GSM8K / MMLU / ARC-Challenge data in ../shared/data."""

import json

import yaml
from click.testing import CliRunner
from test_gate import DATA

from quantize import recipe
from quantize.checkpoint import Checkpoint
from quantize.cli import main
from quantize.engine import stream
from quantize.tensor_plan import build


def test_eval_gates_an_rtn_candidate_against_its_baseline(smollm2, tmp_path):
    cand = tmp_path / "smol-rtn"
    stream.run(build(Checkpoint(smollm2), recipe.preset("w4a16", 64, "rtn"), max_shard_size=2**30), cand)
    lenient = tmp_path / "lenient.yaml"
    tasks = {"gsm8k": ["exact_match,strict-match", "exact_match,flexible-extract"], "mmlu": ["acc,none"],
             "arc_challenge": ["acc,none", "acc_norm,none"]}
    lenient.write_text(yaml.safe_dump({"defaults": {"max_drop": 100, "min_recovery": 0},
                                       "tasks": {t: {"metrics": m} for t, m in tasks.items()}}))
    common = [str(cand), "--baseline", str(smollm2), "--data-dir", str(DATA), "--limit", "3", "--batch-size", "16",
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
    assert again["verdicts"][0]["verdict"] == "fail"
