"""The accuracy gate: compare a candidate's lm-eval results with its baseline's, metric by metric, and decide.

Pure logic over lm-eval's result dicts (`results[task]["acc,none"]`, `n-samples`, and `items`: every item's
metric values); running lm-eval is `lmeval.py`'s job. An accuracy metric may drop (baseline - candidate, in
points) at most `limit` = min(max_drop, (1 - min_recovery) x baseline), which is both of the YAML's rules at once;
perplexity may rise by at most `max_rise` (relative), judged as log(candidate / baseline) <= log(1 + max_rise).

Every verdict first asks whether the sample can resolve its limit. Baseline and candidate answer the same items,
so the noise of the delta is the standard error of the paired per-item differences (se); the sample resolves
the limit when 1.96 se <= limit. Then the measured drop decides: PASS at or under the limit, else FAIL. When it
cannot, a drop beyond the limit that is also beyond the noise is still a FAIL; anything else is INCONCLUSIVE,
with the number of items that would resolve the limit. It fails closed: a missing task or metric, no samples,
items that do not pair, or a NaN is an `error`, never a pass.
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
    metric: str  # lm-eval's key: "acc,none", "exact_match,strict-match", "word_perplexity,none"
    max_drop: float = 1.0  # points
    min_recovery: float = 0.95
    max_rise: float | None = None  # perplexity: relative rise, e.g. 0.05


@dataclass
class Verdict:
    task: str
    metric: str
    baseline: float | None
    candidate: float | None
    baseline_stderr: float | None
    candidate_stderr: float | None
    samples: int | None
    delta: float | None  # candidate - baseline, points (perplexity: the relative rise, percent)
    recovery: float | None
    within_noise: bool | None
    verdict: str  # pass | fail | inconclusive | error
    reason: str
    paired_se: float | None = None  # of the delta, points (perplexity: of log(candidate / baseline))
    paired: bool = False  # se from per-item differences (else from the two lm-eval stderrs, unpaired)
    limit: float | None = None  # the drop allowed, points (perplexity: log(1 + max_rise))
    needs_items: int | None = None  # items that would resolve the limit, when this sample cannot

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
    defaults = _limits(doc.get("defaults") or {}, Threshold.max_drop, Threshold.min_recovery, None, f"{path} defaults")
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
                raise UsageError(f"--gate {path} {task}: a metric is a name or {{name, max_drop, min_recovery, max_rise}}")
        if not spec.get("metrics"):
            raise UsageError(f"--gate {path} {task}: list the metrics to gate on")
        if task == "perplexity" and any(x.max_rise is None for x in out if x.task == task):
            raise UsageError(f"--gate {path} perplexity: give max_rise (lower is better: a relative rise, e.g. 0.05)")
    return out


def _limits(spec: dict, max_drop: float, min_recovery: float, max_rise: float | None,
            where: str) -> tuple[float, float, float | None]:
    try:
        rise = spec.get("max_rise", max_rise)
        return (float(spec.get("max_drop", max_drop)), float(spec.get("min_recovery", min_recovery)),
                None if rise is None else float(rise))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: max_drop, min_recovery and max_rise are numbers") from e


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


def items_of(results: dict, task: str, metric: str) -> dict[str, object]:
    """Every item's value of `metric` in `task` ({doc_id: value}); a group's items are its subtasks', keyed
    subtask/doc_id (MMLU's `acc` is the mean over all of them)."""
    groups, items, out = results.get("group_subtasks") or {}, results.get("items") or {}, {}
    todo = [task]
    while todo:
        t = todo.pop()
        if groups.get(t):
            todo += groups[t]
        for doc, v in ((items.get(t) or {}).get(metric) or {}).items():
            out[f"{t}/{doc}"] = v
    return out


def paired_se(base: dict[str, float], cand: dict[str, float]) -> tuple[int, float, float]:
    """(n, mean, standard error) of the per-item differences candidate - baseline, in points (values in 0..1)."""
    d = [(float(cand[i]) - float(base[i])) * 100 for i in sorted(base)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    return n, mean, math.sqrt(var / n)


def paired_log_ratio(base: dict[str, list], cand: dict[str, list]) -> tuple[int, float, float]:
    """(n, log(ppl_c / ppl_b), its standard error) from per-document (loglikelihood, words) pairs: perplexity is
    exp(-sum ll / sum words), so the log ratio is sum(ll_b - ll_c) / sum words, a ratio estimator whose error
    comes from each document's residual."""
    ids = sorted(base)
    words = [float(base[i][1]) for i in ids]
    diff = [float(base[i][0]) - float(cand[i][0]) for i in ids]
    total, n = sum(words), len(ids)
    r = sum(diff) / total
    resid = sum((x - r * w) ** 2 for x, w in zip(diff, words, strict=True))
    return n, r, math.sqrt(resid * n / max(n - 1, 1)) / total


def decide(drop: float, se: float, n: int, limit: float) -> tuple[str, int | None]:
    """(verdict, items that would resolve the limit) for a drop (a rise, for perplexity) measured with noise se."""
    margin = Z95 * se
    if margin <= max(limit, 0.0):  # the sample resolves the limit (or there is no noise at all)
        return ("pass" if drop <= limit + 1e-9 else "fail"), None
    if drop > limit + 1e-9 and drop > margin:  # beyond the limit and beyond the noise: fails at any size
        return "fail", None
    return "inconclusive", (math.ceil(n * (margin / limit) ** 2) if limit > 0 else None)


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
    bi, ci = items_of(baseline, t.task, t.metric), items_of(candidate, t.task, t.metric)
    if bi and ci and set(bi) != set(ci):
        v.reason = f"baseline and candidate were scored on different items ({len(bi)} vs {len(ci)}): no pairing"
        return v
    if t.max_rise is not None:
        return _judge_perplexity(t, v, bi, ci)
    v.delta = (c - b) * 100
    v.recovery = c / b if b > 0 else (1.0 if c >= b else 0.0)
    # recovery as a drop limit: c / b >= r  <=>  b - c <= (1 - r) b; at b = 0 it is a rule of its own (below)
    v.limit = min(t.max_drop, (1 - t.min_recovery) * b * 100) if b > 0 else t.max_drop
    if bi and ci:
        n, _, v.paired_se = paired_se(bi, ci)
        v.paired, v.samples = True, n
    elif b_se is not None and c_se is not None:
        v.paired_se = math.hypot(b_se, c_se) * 100  # no per-item results (a results file): two independent errors
    else:
        v.verdict, v.reason = "inconclusive", "no per-item results and no stderr: the sample size cannot be checked"
        return v
    v.within_noise = abs(v.delta) <= Z95 * v.paired_se
    if b == 0 and v.recovery < t.min_recovery:
        v.verdict, v.reason = "fail", f"baseline 0: recovery {v.recovery:.3f} < {t.min_recovery:g}"
        return v
    if v.limit >= b * 100 - 1e-9:  # a score cannot fall below 0: the limit lets any candidate through
        v.verdict = "pass"
        v.reason = f"delta {v.delta:+.2f} points: the {v.limit:.3g}-point limit allows any score (baseline {b * 100:.2f})"
        return v
    v.verdict, v.needs_items = decide(-v.delta, v.paired_se, v.samples or 1, v.limit)
    v.reason = _reason(v, f"the {v.limit:.3g}-point limit", f"delta {v.delta:+.2f} points",
                       f"{Z95 * v.paired_se:.2f} points")
    return v


def _judge_perplexity(t: Threshold, v: Verdict, bi: dict, ci: dict) -> Verdict:
    v.recovery = v.baseline / v.candidate if v.candidate else None
    v.limit = math.log1p(t.max_rise)
    if not (bi and ci):
        v.reason = "perplexity is judged from per-document loglikelihoods, which these results do not hold"
        return v
    n, log_ratio, se = paired_log_ratio(bi, ci)
    v.samples, v.paired, v.paired_se = n, True, se
    v.delta = math.expm1(log_ratio) * 100
    v.within_noise = abs(log_ratio) <= Z95 * se
    v.verdict, v.needs_items = decide(log_ratio, se, n, v.limit)
    v.reason = _reason(v, f"the {t.max_rise:.0%} limit", f"rise {v.delta:+.1f}%", f"{math.expm1(Z95 * se):.1%}",
                       unit="documents")
    return v


def _reason(v: Verdict, limit: str, measured: str, noise: str, unit: str = "items") -> str:
    if v.verdict == "pass":
        return f"{measured}, within {limit}; the sample resolves it (noise ±{noise})"
    if v.verdict == "fail":
        return f"{measured}: beyond {limit}" + ("" if Z95 * v.paired_se <= max(v.limit, 0) else
                                                f", and beyond the noise (±{noise})")
    need = f"needs about {v.needs_items:,} {unit}" if v.needs_items else "no sample size resolves a limit of no drop"
    return f"{measured}: the noise at n={v.samples} (±{noise}) is wider than {limit}; {need}"


def judge_all(thresholds: list[Threshold], baseline: dict, candidate: dict) -> list[Verdict]:
    return [judge(t, baseline, candidate) for t in thresholds]


def passed(verdicts: list[Verdict], allow_inconclusive: bool = False) -> bool:
    ok = ("pass", "inconclusive") if allow_inconclusive else ("pass",)
    return bool(verdicts) and all(v.verdict in ok for v in verdicts)


def _fmt(x: float | None, digits: int = 2, scale: float = 100) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}"


def rows(verdicts: list[Verdict]) -> list[list[str]]:
    """Table rows shared by the terminal and the Markdown report (accuracy in points, perplexity as is)."""
    out = []
    for v in verdicts:
        ppl = v.limit is not None and v.metric.startswith(("word_perplexity", "byte_perplexity"))
        if ppl:
            base, cand = _fmt(v.baseline, scale=1), _fmt(v.candidate, scale=1)
            delta = "n/a" if v.delta is None else f"{v.delta:+.1f}%"
            noise = "n/a" if v.paired_se is None else f"±{math.expm1(Z95 * v.paired_se):.1%}"
        else:
            base, cand = _fmt(v.baseline), _fmt(v.candidate)
            delta = "n/a" if v.delta is None else f"{v.delta:+.2f}"
            noise = "n/a" if v.paired_se is None else f"±{Z95 * v.paired_se:.2f}" + ("" if v.paired else " unpaired")
        out.append([v.task, v.metric, base, cand, delta, "n/a" if v.recovery is None else f"{v.recovery:.3f}", noise,
                     "n/a" if v.samples is None else str(v.samples), v.verdict.upper(), v.reason])
    return out


HEADER = ["task", "metric", "baseline", "candidate", "delta", "recovery", "noise (95%)", "n", "verdict", "why"]


def markdown(verdicts: list[Verdict], baseline_name: str, candidate_name: str, meta: dict,
             allow_inconclusive: bool = False) -> str:
    """A Markdown table ready for a model card."""
    lines = [f"## Accuracy: {candidate_name} vs {baseline_name}", ""]
    lines.append(f"Gate: **{overall(verdicts, allow_inconclusive)}**. " + ", ".join(f"{k}: {v}" for k, v in meta.items()))
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows(verdicts):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    lines += ["", "Accuracy in points (percent), perplexity as measured. Noise: 1.96 x the standard error of the paired "
              "per-item differences (the two models answer the same items). A verdict is INCONCLUSIVE when that noise "
              "is wider than the limit, and then says how many items would resolve it."]
    return "\n".join(lines) + "\n"


def overall(verdicts: list[Verdict], allow_inconclusive: bool = False) -> str:
    """PASS, FAIL (a failure or an error) or INCONCLUSIVE (nothing failed, something could not be decided)."""
    if passed(verdicts):
        return "PASS"
    if verdicts and all(v.verdict in ("pass", "inconclusive") for v in verdicts):
        return "INCONCLUSIVE (allowed)" if allow_inconclusive else "INCONCLUSIVE"
    return "FAIL"


@dataclass
class GateRun:
    verdicts: list[Verdict]
    candidate: dict
    baseline: dict | None
    baseline_from: str  # evaluated, cache FILE, file FILE, or none
    meta: dict
    allow_inconclusive: bool = False
    candidate_from: str = "evaluated"  # or cache FILE

    @property
    def passed(self) -> bool:
        return passed(self.verdicts, self.allow_inconclusive)

    @property
    def outcome(self) -> str:
        return overall(self.verdicts, self.allow_inconclusive)

    def to_dict(self) -> dict:
        return {"passed": self.passed if self.baseline is not None else None, "outcome": self.outcome, "meta": self.meta,
                "baseline_from": self.baseline_from, "candidate_from": self.candidate_from,
                "verdicts": [v.to_dict() for v in self.verdicts],
                "baseline": self.baseline, "candidate": self.candidate}


def run_gate(candidate: str, baseline: str | None = None, baseline_results: Path | None = None,
             tasks: list[str] | None = None, gate_path: Path | None = None, backend: str = "hf", device: str = "cpu",
             batch_size: int | str = 8, limit: int | None = None, num_fewshot: int | None = None, tp: int = 1,
             data_dir: Path | None = None, log_samples: Path | None = None, cache_dir: Path | None = None,
             use_cache: bool = True, trust_remote_code: bool = False, compute_dtype: str = "auto",
             verbose: bool = False, ppl_text: Path | None = None, allow_inconclusive: bool = False,
             status=lambda msg: None) -> GateRun:
    """Evaluate the candidate (and the baseline, unless its results are cached or given), then judge.
    `ppl_text`: a held-out text for the `perplexity` task (added to the tasks when given)."""
    import json
    import tempfile

    from quantize import hub, lmeval

    tasks = list(tasks or lmeval.DEFAULT_TASKS)
    if ppl_text is not None and lmeval.PERPLEXITY not in tasks:
        tasks.append(lmeval.PERPLEXITY)
    if lmeval.PERPLEXITY in tasks:
        ppl_text = _check_ppl_text(ppl_text, candidate)
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
        include = None
        if data_dir:
            include = lmeval.write_local_tasks(data_dir, [t for t in tasks if t != lmeval.PERPLEXITY], Path(tmp))
        if ppl_text is not None:
            include = lmeval.write_perplexity_task(ppl_text, Path(tmp))

        def evaluate(src: str, who: str, which: list[str]) -> dict:
            folder, _ = hub.resolve(src)
            status(f"evaluating the {who} {src} on {', '.join(which)} ({backend}, {device}"
                   + (f", {dtype}: the checkpoint's dtype is slow on this CPU" if dtype != "auto" else "") + ")")
            samples = log_samples / who if log_samples else None
            out = lmeval.evaluate(folder, which, backend=backend, device=device, batch_size=batch_size, limit=limit,
                                  num_fewshot=num_fewshot, tp=tp, include_path=include, log_samples=samples,
                                  trust_remote_code=trust_remote_code, dtype=dtype, verbose=verbose,
                                  include_defaults=data_dir is None)
            cut = out["meta"]["truncated"]
            if cut["prompts"] and not verbose:
                status(f"{cut['prompts']} prompt(s) of the {who} were longer than its context"
                       + (f" ({cut['max_length']} tokens)" if cut["max_length"] else "")
                       + " and lm-eval cut them from the left (--verbose lists each)")
            return out

        cache = Path(cache_dir or lmeval.default_cache_dir())

        def results(src: str, who: str, reuse: bool) -> tuple[dict, str]:
            """The model's results per task from the cache where they are (keyed by its content, the task's
            definition and every setting), else evaluated and cached; and where they came from."""
            folder, info = hub.resolve(src)
            identity = lmeval.model_identity(folder, info)
            files = {t: cache / f"{lmeval.cache_key(identity, t, lmeval.task_fingerprint(t, data_dir, ppl_text), settings)}"
                     ".json" for t in tasks}
            parts = {t: _read_results(f) for t, f in files.items() if reuse and f.is_file()}
            todo = [t for t in tasks if t not in parts]
            if parts:
                status(f"{who} results of {', '.join(parts)} from the cache in {cache}")
            came = (f"cache {cache}" + (f", evaluated {', '.join(todo)}" if todo else "")) if parts else "evaluated"
            if todo:
                fresh = evaluate(src, who, todo)
                cache.mkdir(parents=True, exist_ok=True)
                for t in todo:
                    parts[t] = lmeval.task_part(fresh, t)
                    tmp_file = files[t].with_suffix(".tmp")
                    tmp_file.write_text(json.dumps(parts[t]))
                    tmp_file.replace(files[t])  # whole or absent: a killed run never leaves half a result
            return lmeval.merge([parts[t] for t in tasks]), came

        base, base_from = None, "none"
        if given is not None:
            base = given
            base_from = f"file {baseline_results}"
        elif baseline is not None:
            base, base_from = results(baseline, "baseline", use_cache)
        # the candidate too: gating it again (another gate file, a rerun of release) costs no evaluation; with
        # --log-samples it is evaluated, for its per-sample outputs
        cand, cand_from = results(candidate, "candidate", use_cache and log_samples is None)
    verdicts = judge_all(thresholds, base, cand) if base is not None else []
    meta = {"candidate": candidate, "baseline": baseline or (str(baseline_results) if baseline_results else None),
            "ppl_text": str(ppl_text) if ppl_text else None, "allow_inconclusive": allow_inconclusive,
            "tasks": tasks, **settings, "data": str(data_dir) if data_dir else "lm-eval's Hub datasets",
            "lm_eval": cand.get("meta", {}).get("lm_eval"), "cpu_capability": _cpu_capability(device, backend)}
    return GateRun(verdicts, cand, base, base_from, meta, allow_inconclusive, cand_from)


def _check_ppl_text(ppl_text: Path | None, candidate: str) -> Path:
    """The held-out text must exist and must not be the candidate's calibration data (its manifest's recipe)."""
    import json

    from quantize import hub
    from quantize.writer import MANIFEST_NAME, sha256_file

    if ppl_text is None:
        raise UsageError("the perplexity task needs --ppl-text FILE: a text that is neither calibration nor evaluation "
                         "data (e.g. /usr/share/common-licenses/GPL-3)")
    ppl_text = Path(ppl_text)
    if not ppl_text.is_file():
        raise UsageError(f"--ppl-text {ppl_text}: no such file")
    folder = hub.check_local(candidate)
    manifest = folder / MANIFEST_NAME if folder is not None else None
    if manifest is not None and manifest.is_file():
        calib = ((json.loads(manifest.read_text()).get("recipe") or {}).get("calibration") or {}).get("data")
        if calib and Path(calib).is_file() and sha256_file(Path(calib)) == sha256_file(ppl_text):
            raise UsageError(f"--ppl-text {ppl_text} is the calibration data of {candidate} ({calib}): its perplexity "
                             "says nothing about held-out text; give another text")
    return ppl_text


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
