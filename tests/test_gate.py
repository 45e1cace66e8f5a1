"""The accuracy gate: verdict logic, thresholds file, cache key, Markdown, and the local task files lm-eval reads."""

import json
import math
from pathlib import Path

import pytest

from quantize import gate, lmeval
from quantize.errors import UsageError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def result(task: str, **metrics) -> dict:
    """An lm-eval result dict: metric=value or metric=(value, stderr); n-samples 100."""
    row = {}
    for key, v in metrics.items():
        name, _, flt = key.replace("__", ",").partition(",")
        value, se = v if isinstance(v, tuple) else (v, 0.01)
        row[f"{name},{flt or 'none'}"] = value
        row[f"{name}_stderr,{flt or 'none'}"] = se
    return {"results": {task: row}, "n-samples": {task: {"original": 1000, "effective": 100}}}


def test_drop_and_recovery_both_decide():
    t = gate.Threshold("arc_challenge", "acc,none", max_drop=1.0, min_recovery=0.95)
    ok = gate.judge(t, result("arc_challenge", acc=0.500), result("arc_challenge", acc=0.492))
    assert ok.verdict == "pass" and ok.delta == pytest.approx(-0.8) and ok.recovery == pytest.approx(0.984)
    too_far = gate.judge(t, result("arc_challenge", acc=0.500), result("arc_challenge", acc=0.488))
    assert too_far.verdict == "fail" and "drop 1.20 > 1 points" in too_far.reason
    # a low baseline: a 0.9-point drop is within max_drop but recovers only 0.91
    low = gate.judge(t, result("arc_challenge", acc=0.100), result("arc_challenge", acc=0.091))
    assert low.verdict == "fail" and "recovery 0.910 < 0.95" in low.reason
    better = gate.judge(t, result("arc_challenge", acc=0.5), result("arc_challenge", acc=0.6))
    assert better.verdict == "pass" and better.delta == pytest.approx(10.0)


def test_fails_closed_on_missing_nan_no_samples_and_errored_tasks():
    t = gate.Threshold("gsm8k", "exact_match,strict-match")
    base = result("gsm8k", exact_match__strict_match=0.3)
    base = {"results": {"gsm8k": {"exact_match,strict-match": 0.3}}, "n-samples": {"gsm8k": {"effective": 50}}}
    missing_metric = {"results": {"gsm8k": {"exact_match,flexible-extract": 0.3}}}
    assert gate.judge(t, base, missing_metric).verdict == "error"
    errored_task = {"results": {}}  # lm-eval dropped the task
    v = gate.judge(t, base, errored_task)
    assert v.verdict == "error" and "candidate has no" in v.reason
    nan = {"results": {"gsm8k": {"exact_match,strict-match": math.nan}}}
    assert gate.judge(t, base, nan).verdict == "error"
    no_samples = {"results": {"gsm8k": {"exact_match,strict-match": 0.3}}, "n-samples": {"gsm8k": {"effective": 0}}}
    assert gate.judge(t, base, no_samples).verdict == "error"
    string_value = {"results": {"gsm8k": {"exact_match,strict-match": "0.3"}}}
    assert gate.judge(t, base, string_value).verdict == "error"
    assert not gate.passed([gate.judge(t, base, base), gate.judge(t, base, nan)])
    assert not gate.passed([])  # nothing judged is not a pass


def test_noise_uses_both_stderrs():
    t = gate.Threshold("mmlu", "acc,none", max_drop=5)
    inside = gate.judge(t, result("mmlu", acc=(0.50, 0.02)), result("mmlu", acc=(0.47, 0.02)))
    assert inside.within_noise is True  # 3 points < 1.96 * 2.83
    outside = gate.judge(t, result("mmlu", acc=(0.50, 0.005)), result("mmlu", acc=(0.47, 0.005)))
    assert outside.within_noise is False
    na = {"results": {"mmlu": {"acc,none": 0.47, "acc_stderr,none": "N/A"}}}
    assert gate.judge(t, result("mmlu", acc=0.5), na).within_noise is None


def test_gate_file_defaults_overrides_and_errors(tmp_path):
    default = gate.load_gate(None, ["gsm8k", "mmlu", "arc_challenge"])
    assert {(t.task, t.metric) for t in default} == {
        ("gsm8k", "exact_match,strict-match"), ("gsm8k", "exact_match,flexible-extract"), ("mmlu", "acc,none"),
        ("arc_challenge", "acc,none"), ("arc_challenge", "acc_norm,none")}
    assert all(t.max_drop == 1.0 and t.min_recovery == 0.95 for t in default)
    f = tmp_path / "g.yaml"
    f.write_text("defaults: {max_drop: 2}\ntasks:\n  mmlu:\n    min_recovery: 0.9\n"
                 "    metrics: [{name: 'acc,none', max_drop: 0.5}]\n")
    (t,) = gate.load_gate(f, ["mmlu"])
    assert (t.max_drop, t.min_recovery) == (0.5, 0.9)
    with pytest.raises(UsageError, match="no thresholds for task gsm8k"):
        gate.load_gate(f, ["gsm8k"])
    f.write_text("tasks: {}\nthreshold: 1\n")
    with pytest.raises(UsageError, match="unknown key"):
        gate.load_gate(f, ["mmlu"])


def test_markdown_has_a_row_per_metric_and_the_verdict():
    t1, t2 = gate.Threshold("mmlu", "acc,none"), gate.Threshold("arc_challenge", "acc,none")
    verdicts = [gate.judge(t1, result("mmlu", acc=0.6), result("mmlu", acc=0.599)),
                gate.judge(t2, result("arc_challenge", acc=0.5), result("arc_challenge", acc=0.4))]
    md = gate.markdown(verdicts, "org/base", "out/int4", {"limit": 10})
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(lines) == 3 and "| delta |" in lines[0]  # header + 2 metrics
    assert "| mmlu | acc,none | 60.00 | 59.90 | -0.10 | 0.998 |" in md and "| PASS |" in md
    assert "| arc_challenge | acc,none | 50.00 | 40.00 | -10.00 | 0.800 |" in md and "| FAIL |" in md
    assert "Gate: **FAIL**" in md


def test_cache_key_changes_with_everything_that_changes_results():
    settings = {"backend": "hf", "limit": 10, "num_fewshot": None, "batch_size": "8", "device": "cpu", "tp": 1}
    key = lmeval.cache_key("hub:org/m@abc", "mmlu", "f1", settings)
    assert key == lmeval.cache_key("hub:org/m@abc", "mmlu", "f1", dict(reversed(settings.items())))
    assert key != lmeval.cache_key("hub:org/m@abd", "mmlu", "f1", settings)
    assert key != lmeval.cache_key("hub:org/m@abc", "gsm8k", "f1", settings)
    assert key != lmeval.cache_key("hub:org/m@abc", "mmlu", "f2", settings)
    for k, v in (("limit", 20), ("num_fewshot", 5), ("backend", "vllm"), ("device", "cuda")):
        assert key != lmeval.cache_key("hub:org/m@abc", "mmlu", "f1", settings | {k: v})


def test_task_fingerprint_follows_the_data_not_its_path(tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(DATA / "arc_challenge", copy / "arc_challenge")
    assert lmeval.task_fingerprint("arc_challenge", copy) == lmeval.task_fingerprint("arc_challenge", DATA)
    assert lmeval.task_fingerprint("arc_challenge", DATA) != lmeval.task_fingerprint("arc_challenge", None)
    with open(copy / "arc_challenge" / "test.jsonl", "a") as f:
        f.write("\n")
    assert lmeval.task_fingerprint("arc_challenge", copy) != lmeval.task_fingerprint("arc_challenge", DATA)


def test_a_group_keeps_its_subtasks_when_results_are_split_and_merged():
    res = {"results": {"mmlu": {"acc,none": 0.3}, "mmlu_anatomy": {"acc,none": 0.2}, "gsm8k": {"x": 1}},
           "n-samples": {"mmlu_anatomy": {"effective": 3}, "gsm8k": {"effective": 3}},
           "group_subtasks": {"mmlu": ["mmlu_anatomy"], "gsm8k": []}, "n-shot": {}, "versions": {}}
    mmlu = lmeval.task_part(res, "mmlu")
    assert set(mmlu["results"]) == {"mmlu", "mmlu_anatomy"} and set(mmlu["n-samples"]) == {"mmlu_anatomy"}
    merged = lmeval.merge([mmlu, lmeval.task_part(res, "gsm8k")])
    assert merged["results"] == res["results"] and merged["group_subtasks"] == res["group_subtasks"]


def test_model_identity_is_content_and_uses_the_manifest(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"abc")
    first = lmeval.model_identity(m, {"path": str(m)})
    assert first == lmeval.model_identity(m, {"path": "elsewhere"})
    (m / "model.safetensors").write_bytes(b"abd")
    assert lmeval.model_identity(m, {}) != first
    assert lmeval.model_identity(m, {"repo_id": "org/m", "revision": "c0ffee"}) == "hub:org/m@c0ffee"
    # a manifest's sha256 is trusted only while the size matches
    (m / "quantize-manifest.json").write_text(json.dumps({"files": {"model.safetensors": {"size": 3, "sha256": "x"}}}))
    with_manifest = lmeval.model_identity(m, {})
    (m / "model.safetensors").write_bytes(b"abde")
    assert lmeval.model_identity(m, {}) != with_manifest


def test_local_task_files_reuse_lm_evals_definitions_and_read_the_local_data(tmp_path):
    from lm_eval.tasks import TaskManager

    include = lmeval.write_local_tasks(DATA, ["gsm8k", "arc_challenge", "mmlu"], tmp_path / "tasks")
    loaded = TaskManager(include_path=str(include), include_defaults=False).load(["gsm8k", "arc_challenge", "mmlu"])
    flat = loaded["tasks"]
    assert len(loaded["group_map"]["mmlu"]) == 57
    gsm = flat["gsm8k"]
    assert len(list(gsm.test_docs())) == 660 and len(list(gsm.fewshot_docs())) == 7473
    assert gsm.config.num_fewshot == 5 and [f.name for f in gsm._filters] == ["strict-match", "flexible-extract"]
    arc = flat["arc_challenge"]
    assert len(list(arc.test_docs())) == 583 and arc.config.doc_to_choice == "{{choices.text}}"
    subjects = [k for k in flat if k.startswith("mmlu_")]
    assert len(subjects) == 57
    assert sum(len(list(flat[s].test_docs())) for s in subjects) == 7021
    anatomy = flat["mmlu_anatomy"]
    assert "about anatomy" in anatomy.config.description and anatomy.config.fewshot_split == "dev"
    assert len(list(anatomy.fewshot_docs())) == 5


def test_a_data_dir_without_the_files_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="gsm8k/train.jsonl is missing"):
        lmeval.write_local_tasks(tmp_path, ["gsm8k"], tmp_path / "tasks")


def test_an_evaluation_that_cannot_run_exits_2_and_bad_options_too(tmp_path, fixtures_dir):
    from click.testing import CliRunner

    from quantize.cli import main

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((fixtures_dir / "llama-bf16" / "config.json").read_text())  # no weights
    base = tmp_path / "base.json"
    base.write_text(json.dumps(result("arc_challenge", acc=0.3, acc_norm=0.3)))
    r = CliRunner().invoke(main, ["eval", str(broken), "--baseline-results", str(base), "--tasks", "arc_challenge",
                                  "--data-dir", str(DATA), "--limit", "1", "--device", "cpu"])
    assert r.exit_code == 2 and "lm-eval could not evaluate" in r.output, r.output
    r = CliRunner().invoke(main, ["eval", str(broken), "--baseline-results", str(base), "--tasks", "hellaswag"])
    assert r.exit_code == 2 and "hellaswag unknown" in r.output
    nothing = tmp_path / "empty.json"
    nothing.write_text("{}")
    r = CliRunner().invoke(main, ["eval", str(broken), "--baseline-results", str(nothing)])
    assert r.exit_code == 2 and "no lm-eval `results`" in r.output


def test_without_data_dir_unreachable_hub_data_fails_before_lm_eval_runs(tmp_path, fixtures_dir, monkeypatch):
    """Offline, or with no route to the Hub, and the datasets not in the HF cache: an error that names --data-dir,
    exit 2, before any model is loaded (lm-eval would retry for 77-98 s). Cached datasets need no Hub."""
    import socket

    from click.testing import CliRunner
    from huggingface_hub import constants

    from quantize.cli import main

    def no_route(*a, **k):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(socket, "create_connection", no_route)
    monkeypatch.setattr(lmeval, "evaluate", lambda *a, **k: pytest.fail("lm-eval ran"))
    llama = str(fixtures_dir / "llama-bf16")
    r = CliRunner().invoke(main, ["eval", llama, "--baseline", llama, "--tasks", "gsm8k,arc_challenge", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert "gsm8k (openai/gsm8k), arc_challenge (allenai/ai2_arc)" in r.stderr and "--data-dir" in r.stderr
    assert "cannot be reached" in r.stderr
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    r = CliRunner().invoke(main, ["eval", llama, "--baseline", llama, "--tasks", "mmlu", "--device", "cpu"])
    assert r.exit_code == 2 and "HF_HUB_OFFLINE" in r.stderr and "cais/mmlu" in r.stderr, r.output
    (tmp_path / "hub" / "datasets--cais--mmlu" / "snapshots").mkdir(parents=True)
    lmeval.check_hub_data(["mmlu"])  # in the HF cache: no Hub needed
    (tmp_path / "datasets" / "openai___gsm8k").mkdir(parents=True)
    lmeval.check_hub_data(["gsm8k"])  # datasets' own processed cache counts too
