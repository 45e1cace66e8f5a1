"""The accuracy gate: compare a candidate's lm-eval results with its baseline's, metric by metric, and decide.

Pure logic over lm-eval's result dicts (`results[task]["acc,none"]`, `results[task]["acc_stderr,none"]`,
`n-samples[task]["effective"]`); running lm-eval is `lmeval.py`'s job. A metric passes when the drop
(baseline - candidate, in points) is at most `max_drop` and the recovery (candidate / baseline) is at least
`min_recovery`. It fails closed: a missing task or metric, no samples, or a NaN is an `error`, never a pass.
"""

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from quantize.errors import UsageError

DEFAULT_GATE = Path(__file__).resolve().parents[1] / "eval" / "gate.yaml"
Z95 = 1.96  # two-sided 95% normal quantile: a delta inside Z95 * its stderr is noise at this sample size


@dataclass(frozen=True)
class Threshold:
    task: str
    metric: str  # lm-eval's key: "acc,none", "exact_match,strict-match"
    max_drop: float = 1.0  # points
    min_recovery: float = 0.95


@dataclass
class Verdict:
    task: str
    metric: str
    baseline: float | None
    candidate: float | None
    baseline_stderr: float | None
    candidate_stderr: float | None
    samples: int | None
    delta: float | None  # candidate - baseline, points
    recovery: float | None
    within_noise: bool | None
    verdict: str  # pass | fail | error
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def load_gate(path: Path | str | None, tasks: list[str]) -> list[Threshold]:
    """Thresholds for `tasks` from a gate YAML: `defaults: {max_drop, min_recovery}` and per task a `metrics`
    list of lm-eval metric keys, each a string or `{name, max_drop, min_recovery}`."""
    path = Path(path) if path is not None else DEFAULT_GATE
    if not path.is_file():
        raise UsageError(f"no gate file at {path}: pass --gate FILE (see eval/gate.yaml in the source tree)")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"--gate {path}: cannot read it ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), dict):
        raise UsageError(f"--gate {path}: expected a mapping with `tasks:` (see eval/gate.yaml)")
    unknown = set(doc) - {"defaults", "tasks"}
    if unknown:
        raise UsageError(f"--gate {path}: unknown key(s) {', '.join(sorted(unknown))}")
    defaults = _limits(doc.get("defaults") or {}, Threshold.max_drop, Threshold.min_recovery, f"{path} defaults")
    out = []
    for task in tasks:
        spec = doc["tasks"].get(task)
        if spec is None:
            raise UsageError(f"--gate {path} has no thresholds for task {task}; add it under `tasks:`")
        task_limits = _limits(spec, *defaults, f"{path} {task}")
        for m in spec.get("metrics") or []:
            if isinstance(m, str):
                out.append(Threshold(task, m, *task_limits))
            elif isinstance(m, dict) and isinstance(m.get("name"), str):
                out.append(Threshold(task, m["name"], *_limits(m, *task_limits, f"{path} {task} {m['name']}")))
            else:
                raise UsageError(f"--gate {path} {task}: a metric is a name or {{name, max_drop, min_recovery}}")
        if not spec.get("metrics"):
            raise UsageError(f"--gate {path} {task}: list the metrics to gate on")
    return out


def _limits(spec: dict, max_drop: float, min_recovery: float, where: str) -> tuple[float, float]:
    try:
        return float(spec.get("max_drop", max_drop)), float(spec.get("min_recovery", min_recovery))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: max_drop and min_recovery are numbers") from e


def metric_value(results: dict, task: str, metric: str) -> tuple[float | None, float | None, int | None]:
    """(value, stderr, effective samples) of one metric in an lm-eval result dict; None where absent."""
    row = (results.get("results") or {}).get(task)
    if not isinstance(row, dict):
        return None, None, None
    value = _number(row.get(metric))
    name, _, flt = metric.partition(",")
    stderr = _number(row.get(f"{name}_stderr,{flt}" if flt else f"{name}_stderr"))
    return value, stderr, _samples(results, task)


def _samples(results: dict, task: str) -> int | None:
    """Samples scored for a task; for a group (mmlu), the sum over its subtasks."""
    counts, groups = results.get("n-samples") or {}, results.get("group_subtasks") or {}
    if task in counts:
        n = counts[task].get("effective") if isinstance(counts[task], dict) else None
        return int(n) if isinstance(n, int) and not isinstance(n, bool) else None
    if groups.get(task):
        parts = [_samples(results, t) for t in groups[task]]
        return None if any(p is None for p in parts) else sum(parts)
    return None


def _number(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None  # lm-eval writes "N/A" for a stderr it could not compute
    return float(v)


def judge(t: Threshold, baseline: dict, candidate: dict) -> Verdict:
    b, b_se, _ = metric_value(baseline, t.task, t.metric)
    c, c_se, n = metric_value(candidate, t.task, t.metric)
    v = Verdict(t.task, t.metric, b, c, b_se, c_se, n, None, None, None, "error", "")
    for who, value in (("baseline", b), ("candidate", c)):
        if value is None:
            v.reason = f"{who} has no {t.metric} for {t.task}"
            return v
        if math.isnan(value):
            v.reason = f"{who} {t.metric} is NaN"
            return v
    if n is not None and n == 0:
        v.reason = "the candidate was scored on no samples"
        return v
    v.delta = (c - b) * 100
    v.recovery = c / b if b > 0 else (1.0 if c >= b else 0.0)
    if b_se is not None and c_se is not None:
        v.within_noise = abs(v.delta) <= Z95 * math.hypot(b_se, c_se) * 100
    problems = []
    if -v.delta > t.max_drop + 1e-9:
        problems.append(f"drop {-v.delta:.2f} > {t.max_drop:g} points")
    if v.recovery < t.min_recovery - 1e-12:
        problems.append(f"recovery {v.recovery:.3f} < {t.min_recovery:g}")
    v.verdict = "fail" if problems else "pass"
    v.reason = "; ".join(problems) or f"drop <= {t.max_drop:g} points, recovery >= {t.min_recovery:g}"
    return v


def judge_all(thresholds: list[Threshold], baseline: dict, candidate: dict) -> list[Verdict]:
    return [judge(t, baseline, candidate) for t in thresholds]


def passed(verdicts: list[Verdict]) -> bool:
    return bool(verdicts) and all(v.verdict == "pass" for v in verdicts)


def _fmt(x: float | None, digits: int = 2, scale: float = 100) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def rows(verdicts: list[Verdict]) -> list[list[str]]:
    """Table rows shared by the terminal and the Markdown report."""
    out = []
    for v in verdicts:
        noise = {True: "yes", False: "no", None: "n/a"}[v.within_noise]
        out.append([v.task, v.metric, _fmt(v.baseline), _fmt(v.candidate),
                    "n/a" if v.delta is None else f"{v.delta:+.2f}",
                    "n/a" if v.recovery is None else f"{v.recovery:.3f}",
                    f"{_fmt(v.baseline_stderr)} / {_fmt(v.candidate_stderr)}",
                    "n/a" if v.samples is None else str(v.samples), noise, v.verdict.upper(), v.reason])
    return out


HEADER = ["task", "metric", "baseline", "candidate", "delta", "recovery", "stderr b / c", "n", "noise", "verdict",
          "why"]


def markdown(verdicts: list[Verdict], baseline_name: str, candidate_name: str, meta: dict) -> str:
    """A Markdown table ready for a model card."""
    lines = [f"## Accuracy: {candidate_name} vs {baseline_name}", ""]
    lines.append(f"Gate: **{'PASS' if passed(verdicts) else 'FAIL'}**. " + ", ".join(f"{k}: {v}" for k, v in meta.items()))
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows(verdicts):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    lines += ["", "Scores in points (percent). Within noise: |delta| <= 1.96 x the combined standard error at this "
              "sample size."]
    return "\n".join(lines) + "\n"


@dataclass
class GateRun:
    verdicts: list[Verdict]
    candidate: dict
    baseline: dict | None
    baseline_from: str  # evaluated, cache FILE, file FILE, or none
    meta: dict

    @property
    def passed(self) -> bool:
        return passed(self.verdicts)

    def to_dict(self) -> dict:
        return {"passed": self.passed if self.baseline is not None else None, "meta": self.meta,
                "baseline_from": self.baseline_from, "verdicts": [v.to_dict() for v in self.verdicts],
                "baseline": self.baseline, "candidate": self.candidate}


def run_gate(candidate: str, baseline: str | None = None, baseline_results: Path | None = None,
             tasks: list[str] | None = None, gate_path: Path | None = None, backend: str = "hf", device: str = "cpu",
             batch_size: int | str = 8, limit: int | None = None, num_fewshot: int | None = None, tp: int = 1,
             data_dir: Path | None = None, log_samples: Path | None = None, cache_dir: Path | None = None,
             use_cache: bool = True, trust_remote_code: bool = False, compute_dtype: str = "auto",
             verbose: bool = False, status=lambda msg: None) -> GateRun:
    """Evaluate the candidate (and the baseline, unless its results are cached or given), then judge."""
    import json
    import tempfile

    from quantize import hub, lmeval

    tasks = list(tasks or lmeval.TASKS)
    unknown = [t for t in tasks if t not in lmeval.TASKS]
    if unknown:
        raise UsageError(f"--tasks: {', '.join(unknown)} unknown; choose from {', '.join(lmeval.TASKS)}")
    if backend not in lmeval.BACKENDS:
        raise UsageError(f"--backend {backend}: choose from {', '.join(lmeval.BACKENDS)}")
    thresholds = load_gate(gate_path, tasks)  # a bad gate file fails now, not after hours of evaluation
    lmeval.check_backend(backend)
    given = _read_results(Path(baseline_results)) if baseline_results is not None else None  # a bad file: now
    if data_dir is None:
        lmeval.check_hub_data(tasks)
    # both models compute in the same dtype: the candidate's (a quantized checkpoint keeps its source's dtype)
    dtype = lmeval.eval_dtype(hub.resolve(candidate)[0], backend, device, compute_dtype)
    settings = {"backend": backend, "device": device, "batch_size": str(batch_size), "limit": limit,
                "num_fewshot": num_fewshot, "tp": tp, "dtype": dtype}
    with tempfile.TemporaryDirectory(prefix="quantize-tasks-") as tmp:
        include = lmeval.write_local_tasks(data_dir, tasks, Path(tmp)) if data_dir else None

        def evaluate(src: str, who: str, which: list[str]) -> dict:
            folder, _ = hub.resolve(src)
            status(f"evaluating the {who} {src} on {', '.join(which)} ({backend}, {device}"
                   + (f", {dtype}: the checkpoint's dtype is slow on this CPU" if dtype != "auto" else "") + ")")
            samples = log_samples / who if log_samples else None
            out = lmeval.evaluate(folder, which, backend=backend, device=device, batch_size=batch_size, limit=limit,
                                  num_fewshot=num_fewshot, tp=tp, include_path=include, log_samples=samples,
                                  trust_remote_code=trust_remote_code, dtype=dtype, verbose=verbose)
            cut = out["meta"]["truncated"]
            if cut["prompts"] and not verbose:
                status(f"{cut['prompts']} prompt(s) of the {who} were longer than its context"
                       + (f" ({cut['max_length']} tokens)" if cut["max_length"] else "")
                       + " and lm-eval cut them from the left (--verbose lists each)")
            return out

        base, base_from = None, "none"
        if given is not None:
            base = given
            base_from = f"file {baseline_results}"
        elif baseline is not None:
            folder, info = hub.resolve(baseline)
            identity = lmeval.model_identity(folder, info)
            cache = Path(cache_dir or lmeval.default_cache_dir())
            files = {t: cache / f"{lmeval.cache_key(identity, t, lmeval.task_fingerprint(t, data_dir), settings)}.json"
                     for t in tasks}
            parts = {t: _read_results(f) for t, f in files.items() if use_cache and f.is_file()}
            todo = [t for t in tasks if t not in parts]
            if parts:
                status(f"baseline results of {', '.join(parts)} from the cache in {cache}")
                base_from = f"cache {cache}" + (f", evaluated {', '.join(todo)}" if todo else "")
            else:
                base_from = "evaluated"
            if todo:
                fresh = evaluate(baseline, "baseline", todo)
                cache.mkdir(parents=True, exist_ok=True)
                for t in todo:
                    parts[t] = lmeval.task_part(fresh, t)
                    tmp_file = files[t].with_suffix(".tmp")
                    tmp_file.write_text(json.dumps(parts[t]))
                    tmp_file.replace(files[t])  # whole or absent: a killed run never leaves half a result
            base = lmeval.merge([parts[t] for t in tasks])
        cand = evaluate(candidate, "candidate", tasks)
    verdicts = judge_all(thresholds, base, cand) if base is not None else []
    meta = {"candidate": candidate, "baseline": baseline or (str(baseline_results) if baseline_results else None),
            "tasks": tasks, **settings, "data": str(data_dir) if data_dir else "lm-eval's Hub datasets",
            "lm_eval": cand.get("meta", {}).get("lm_eval"), "cpu_capability": _cpu_capability(device, backend)}
    return GateRun(verdicts, cand, base, base_from, meta)


def _cpu_capability(device: str, backend: str) -> str | None:
    from quantize.compute import cpu_capability

    return cpu_capability() if backend == "hf" and device == "cpu" else None


def _read_results(path: Path) -> dict:
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a results JSON ({e})") from e
    if isinstance(doc, dict) and isinstance(doc.get("baseline"), dict) and "verdicts" in doc:
        doc = doc["baseline"]  # the JSON of a previous `quantize eval`
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        raise UsageError(f"{path}: no lm-eval `results` in it")
    return doc
