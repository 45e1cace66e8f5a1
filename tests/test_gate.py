"""The accuracy gate: verdict logic, thresholds file, cache key, Markdown, and the local task files lm-eval reads."""

import json
import math
from pathlib import Path

import pytest

from quantize import gate, lmeval
from quantize.errors import UsageError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def result(task: str, **metrics) -> dict:
    """An lm-eval result dict: metric=value or metric=(value, stderr, default 0.001: a sample that resolves a
    one-point limit); n-samples 100; no per-item results (judged unpaired)."""
    row = {}
    for key, v in metrics.items():
        name, _, flt = key.replace("__", ",").partition(",")
        value, se = v if isinstance(v, tuple) else (v, 0.001)
        row[f"{name},{flt or 'none'}"] = value
        row[f"{name}_stderr,{flt or 'none'}"] = se
    return {"results": {task: row}, "n-samples": {task: {"original": 1000, "effective": 100}}}


def test_drop_and_recovery_both_decide():
    t = gate.Threshold("arc_challenge", "acc,none", max_drop=1.0, min_recovery=0.95)
    ok = gate.judge(t, result("arc_challenge", acc=0.500), result("arc_challenge", acc=0.492))
    assert ok.verdict == "pass" and ok.delta == pytest.approx(-0.8) and ok.recovery == pytest.approx(0.984)
    too_far = gate.judge(t, result("arc_challenge", acc=0.500), result("arc_challenge", acc=0.488))
    assert too_far.verdict == "fail" and "delta -1.20 points: beyond the 1-point limit" in too_far.reason
    # a low baseline: a 0.9-point drop is within max_drop but recovers only 0.91: the limit is 0.05 x 10 points
    low = gate.judge(t, result("arc_challenge", acc=0.100), result("arc_challenge", acc=0.091))
    assert low.verdict == "fail" and low.limit == pytest.approx(0.5) and "beyond the 0.5-point limit" in low.reason
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


def items(task: str, metric: str, values: list, **extra) -> dict:
    """Results holding per-item values (doc ids 0..n-1) and the mean as lm-eval reports it."""
    scored = [v[0] / v[1] for v in values] if values and isinstance(values[0], tuple) else values
    mean = sum(scored) / len(scored)
    return {"results": {task: {metric: mean, **extra}}, "n-samples": {task: {"effective": len(values)}},
            "items": {task: {metric: {str(i): (list(v) if isinstance(v, tuple) else v) for i, v in enumerate(values)}}}}


def test_paired_standard_error_worked_by_hand():
    """10 items, the candidate flips items 1 and 9 to wrong and item 7 to right: differences (points)
    0,-100,0,0,0,0,0,+100,0,-100; mean -10; sample variance (7 x 10^2 + 2 x 90^2 + 110^2) / 9 = 29000 / 9;
    se = sqrt(29000 / 90) = 17.95 points. Two independent binomial errors would say hypot(15.8, 16.3) = 22.7."""
    base = [1, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    cand = [1, 0, 0, 0, 1, 0, 1, 1, 1, 0]
    n, mean, se = gate.paired_se({str(i): v for i, v in enumerate(base)}, {str(i): v for i, v in enumerate(cand)})
    assert (n, mean) == (10, pytest.approx(-10.0)) and se == pytest.approx(math.sqrt(29000 / 90))
    t = gate.Threshold("arc_challenge", "acc,none")
    v = gate.judge(t, items("arc_challenge", "acc,none", base), items("arc_challenge", "acc,none", cand))
    assert v.paired and v.paired_se == pytest.approx(17.9505, abs=1e-4) and v.samples == 10


def test_inconclusive_fail_and_pass_by_sample_size():
    """ARC at 20 items, 40 -> 30 points (2 items flipped): se = sqrt((18 x 10^2 + 2 x 90^2) / 19 / 20) = 6.88,
    noise 1.96 x 6.88 = 13.49 points > the 1-point limit, and the 10-point drop is inside that noise:
    INCONCLUSIVE, resolved at 20 x (13.49 / 1)^2 = 3,640 items. 8 flips (40 points, noise 22.0): a FAIL even at
    20 items. The same model: se 0, PASS at any size. 10,000 items, 50 flips each way: se 0.10, noise 0.196 < 1,
    the drop (0) decides: PASS."""
    t = gate.Threshold("arc_challenge", "acc,none", max_drop=1.0, min_recovery=0.0)
    base = [1] * 8 + [0] * 12
    two = [0, 0] + [1] * 6 + [0] * 12
    v = gate.judge(t, items("arc_challenge", "acc,none", base), items("arc_challenge", "acc,none", two))
    assert v.delta == pytest.approx(-10.0) and v.paired_se == pytest.approx(math.sqrt(18000 / 19 / 20))
    assert v.verdict == "inconclusive" and v.needs_items == 3640, v
    assert "needs about 3,640 items" in v.reason and not gate.passed([v]) and gate.passed([v], allow_inconclusive=True)
    eight = [0] * 20
    f = gate.judge(t, items("arc_challenge", "acc,none", base), items("arc_challenge", "acc,none", eight))
    assert f.verdict == "fail" and "beyond the noise" in f.reason
    same = gate.judge(t, items("arc_challenge", "acc,none", base), items("arc_challenge", "acc,none", list(base)))
    assert same.verdict == "pass" and same.paired_se == 0
    big_base = [1] * 5000 + [0] * 5000
    big_cand = [0] * 50 + [1] * 4950 + [1] * 50 + [0] * 4950
    p = gate.judge(t, items("arc_challenge", "acc,none", big_base), items("arc_challenge", "acc,none", big_cand))
    assert p.verdict == "pass" and p.paired_se == pytest.approx(0.1, rel=1e-3)
    assert gate.overall([v, same]) == "INCONCLUSIVE" and gate.overall([v, f]) == "FAIL"


def test_perplexity_rise_from_per_document_loglikelihoods():
    """Documents (loglikelihood, words): baseline (-100, 50), (-200, 100), (-150, 50); candidate -110, -220, -160.
    log(ppl_c / ppl_b) = (10 + 20 + 10) / 200 = 0.2, a rise of e^0.2 - 1 = 22.1%; every document moved in
    proportion to its words, so the residuals and se are 0: a FAIL of a 5% limit. Documents that disagree in
    direction leave it INCONCLUSIVE."""
    t = gate.Threshold("perplexity", "word_perplexity,none", max_rise=0.05)
    base = items("perplexity", "word_perplexity,none", [(-100, 50), (-200, 100), (-150, 50)])
    worse = items("perplexity", "word_perplexity,none", [(-110, 50), (-220, 100), (-160, 50)])
    v = gate.judge(t, base, worse)
    assert v.verdict == "fail" and v.delta == pytest.approx(math.expm1(0.2) * 100) and v.paired_se == 0
    assert v.limit == pytest.approx(math.log(1.05)) and "rise +22.1%" in v.reason
    noisy = items("perplexity", "word_perplexity,none", [(-140, 50), (-190, 100), (-130, 50)])
    n = gate.judge(t, base, noisy)
    assert n.verdict == "inconclusive" and n.needs_items > 3
    assert gate.judge(t, base, base).verdict == "pass"
    with pytest.raises(UsageError, match="max_rise"):
        gate.load_gate(_gate_yaml({"perplexity": {"metrics": ["word_perplexity,none"]}}), ["perplexity"])


def _gate_yaml(tasks: dict):
    import tempfile

    import yaml

    path = Path(tempfile.mkdtemp()) / "gate.yaml"
    path.write_text(yaml.safe_dump({"tasks": tasks}))
    return path


def test_items_that_do_not_pair_are_an_error_and_a_group_pairs_its_subtasks():
    t = gate.Threshold("arc_challenge", "acc,none")
    a = items("arc_challenge", "acc,none", [1, 0, 1])
    b = items("arc_challenge", "acc,none", [1, 0])
    assert gate.judge(t, a, b).verdict == "error"
    group = {"results": {"mmlu": {"acc,none": 0.5}}, "group_subtasks": {"mmlu": ["mmlu_a", "mmlu_b"]},
             "items": {"mmlu_a": {"acc,none": {"0": 1, "1": 0}}, "mmlu_b": {"acc,none": {"0": 1, "1": 0}}}}
    assert set(gate.items_of(group, "mmlu", "acc,none")) == {"mmlu_a/0", "mmlu_a/1", "mmlu_b/0", "mmlu_b/1"}


def test_ppl_text_that_is_the_candidates_calibration_data_is_refused(fixtures_dir, tmp_path):
    """Perplexity on the text the candidate was calibrated on says nothing about held-out text: the candidate's
    manifest names its calibration file, and a --ppl-text with the same bytes (under any name) is refused, exit 2."""
    import json as _json
    import shutil

    from click.testing import CliRunner

    from quantize.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text("calibration text\n\n" * 400)
    cand = tmp_path / "cand"
    shutil.copytree(fixtures_dir / "llama-bf16", cand)
    (cand / "quantize-manifest.json").write_text(_json.dumps({"recipe": {"calibration": {"data": str(calib)}}}))
    same_bytes = tmp_path / "renamed.txt"
    shutil.copy(calib, same_bytes)
    r = CliRunner().invoke(main, ["eval", str(cand), "--baseline", str(fixtures_dir / "llama-bf16"), "--tasks",
                                  "arc_challenge", "--ppl-text", str(same_bytes), "--data-dir", str(DATA)])
    assert r.exit_code == 2 and "is the calibration data of" in r.stderr, r.output
    r = CliRunner().invoke(main, ["eval", str(cand), "--baseline", str(cand), "--tasks", "perplexity"])
    assert r.exit_code == 2 and "needs --ppl-text" in r.stderr, r.output
