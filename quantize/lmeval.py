"""Run lm-eval as a library on one checkpoint: its standard task definitions, or the very same definitions
pointed at local copies of the data; baseline results cached by what determines them.

Local data (`--data-dir DIR`, the layout of ../shared/data): `DIR/gsm8k/{train,test}.jsonl`,
`DIR/arc_challenge/test.jsonl`, `DIR/mmlu/{dev,test}.jsonl` (with a `subject` field). The task files written
for it `include:` lm-eval's own YAML by absolute path and override only `dataset_path`, `dataset_name` and
`dataset_kwargs.data_files` (and, for ARC, the train/validation splits that are not there), so prompts, few-shot
selection, filters and metrics are lm-eval's. MMLU becomes 57 subject tasks and a group `mmlu` whose `acc` is
the size-weighted mean, as lm-eval's own group reports it.
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

from quantize import cache_root
from quantize.errors import QuantizeError, UsageError
from quantize.writer import MANIFEST_NAME, sha256_file

DEFAULT_TASKS = ("gsm8k", "mmlu", "arc_challenge")
TASKS = (*DEFAULT_TASKS, "perplexity")
PERPLEXITY = "perplexity"  # held-out word perplexity of --ppl-text, through lm-eval's own wikitext definition
BACKENDS = ("hf", "vllm", "sglang")
LOCAL_FILES = {
    "gsm8k": {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"},
    "arc_challenge": {"test": "arc_challenge/test.jsonl"},
    "mmlu": {"dev": "mmlu/dev.jsonl", "test": "mmlu/test.jsonl"},
}


class EvalError(QuantizeError):
    """The evaluation itself could not run (exit 2): no verdict can be given."""

    exit_code = 2


def _lm_eval():
    try:
        import lm_eval
        import lm_eval.tasks
    except ImportError as e:
        raise EvalError("`quantize eval` needs lm-eval: pip install 'quantize[eval]'") from e
    return lm_eval


# where lm-eval's own definition of each task names its Hub dataset (dataset_path)
HUB_TASK_FILES = {"gsm8k": "gsm8k/gsm8k.yaml", "arc_challenge": "arc/arc_easy.yaml",
                  "mmlu": "mmlu/default/_default_template_yaml"}


def check_hub_data(tasks: list[str], probe_seconds: float = 3.0) -> None:
    """Without --data-dir, lm-eval reads each task's Hub dataset: fail now, in seconds, when a dataset is neither
    in the HF cache nor reachable, instead of after lm-eval's retries (77-98 s measured) with a message that
    never says --data-dir."""
    import re

    missing = []
    for task in (t for t in tasks if t != PERPLEXITY):
        m = re.search(r"^dataset_path:\s*(\S+)", (_builtin_tasks() / HUB_TASK_FILES[task]).read_text(), re.M)
        if m and not _dataset_cached(m[1]):
            missing.append(f"{task} ({m[1]})")
    if not missing:
        return
    why = _hub_unreachable(probe_seconds)
    if why:
        raise EvalError(f"lm-eval would read {', '.join(missing)} from the Hub, which {why}, and the HF cache does not "
                        "hold them: pass --data-dir DIR with local copies (the layout of ../shared/data)")


def _dataset_cached(repo: str) -> bool:
    from huggingface_hub import constants

    hub = Path(constants.HF_HUB_CACHE) / "--".join(["datasets", *repo.split("/")])
    processed = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
    return (hub / "snapshots").is_dir() or (processed / repo.replace("/", "___")).is_dir()


def _hub_unreachable(seconds: float) -> str | None:
    """Why the Hub cannot be reached (offline mode, no connection), or None when it answers or a proxy decides."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "is switched off here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the proxy knows; let lm-eval try
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=seconds).close()
    except OSError as e:
        return f"cannot be reached from here ({url.hostname}: {e.strerror or type(e).__name__})"
    return None


def _builtin_tasks() -> Path:
    return Path(_lm_eval().tasks.__file__).parent


def write_local_tasks(data_dir: Path, tasks: list[str], out: Path) -> Path:
    """Task YAMLs for `tasks` reading `data_dir`, written into `out` (a TaskManager include_path)."""
    data_dir = Path(data_dir).resolve()
    builtin = _builtin_tasks()
    out.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        files = {split: data_dir / rel for split, rel in LOCAL_FILES[task].items()}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise UsageError(f"--data-dir {data_dir}: {missing[0]} is missing (layout: see ../shared/README.md)")
        if task == "gsm8k":
            _write_task(out / "gsm8k.yaml", builtin / "gsm8k" / "gsm8k.yaml", files)
        elif task == "arc_challenge":
            _write_task(out / "arc_challenge.yaml", builtin / "arc" / "arc_challenge.yaml", files,
                        training_split=None, validation_split=None)
        else:
            _write_mmlu(out, builtin / "mmlu" / "default", files)
    return out


def _write_task(path: Path, include: Path, files: dict[str, Path], **extra) -> None:
    import yaml

    if not include.is_file():
        raise EvalError(f"lm-eval {_lm_eval().__version__} has no {include}; use lm-eval 0.4.13")
    doc = {"include": str(include), "dataset_path": "json", "dataset_name": None,
           "dataset_kwargs": {"data_files": {k: str(v) for k, v in files.items()}}, **extra}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _write_mmlu(out: Path, builtin: Path, files: dict[str, Path]) -> None:
    import yaml

    by_subject: dict[str, dict[str, list[str]]] = {}
    for split, path in files.items():
        with open(path) as f:
            for line in f:
                if line.strip():
                    subject = json.loads(line).get("subject")
                    if not isinstance(subject, str):
                        raise UsageError(f"{path}: every MMLU row needs a `subject` field")
                    by_subject.setdefault(subject, {}).setdefault(split, []).append(line if line.endswith("\n") else line + "\n")
    names = []
    for spec in sorted(builtin.glob("mmlu_*.yaml")):
        subject = yaml.safe_load(spec.read_text()).get("dataset_name")
        rows = by_subject.get(subject)
        if not rows or "test" not in rows:
            continue
        folder = out / "mmlu" / subject
        folder.mkdir(parents=True, exist_ok=True)
        split_files = {}
        for split, lines in rows.items():
            (folder / f"{split}.jsonl").write_text("".join(lines))
            split_files[split] = folder / f"{split}.jsonl"
        _write_task(out / spec.name, spec, split_files)
        names.append(spec.stem)
    if not names:
        raise UsageError(f"{files['test']}: no MMLU subject matches lm-eval's subject names")
    group = {"group": "mmlu", "task": names, "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
             "metadata": {"version": 2.0}}
    (out / "_mmlu_local.yaml").write_text(yaml.safe_dump(group, sort_keys=False))


def write_perplexity_task(text: Path, out: Path) -> Path:
    """A `perplexity` task over a local text file: lm-eval's wikitext definition (rolling loglikelihood; word
    perplexity, byte perplexity, bits per byte) pointed at the text cut into documents of whole paragraphs, at
    least PPL_DOC_WORDS words each: every document is one item of the paired comparison."""
    docs, para = [], []
    for block in Path(text).read_text(encoding="utf-8", errors="replace").split("\n\n"):
        if block.strip():
            para.append(block.strip())
        if sum(len(p.split()) for p in para) >= PPL_DOC_WORDS:
            docs.append("\n\n".join(para))
            para = []
    if para:
        docs.append("\n\n".join(para))
    if len(docs) < 2:
        raise UsageError(f"--ppl-text {text}: {len(docs)} document(s) of {PPL_DOC_WORDS} words; give a longer text")
    out.mkdir(parents=True, exist_ok=True)
    data = out / "perplexity-docs.jsonl"
    data.write_text("".join(json.dumps({"page": d}) + "\n" for d in docs))
    _write_task(out / "perplexity.yaml", _builtin_tasks() / "wikitext" / "wikitext.yaml", {"test": data},
                task=PERPLEXITY, training_split=None, validation_split=None)
    return out


PPL_DOC_WORDS = 250
LOCAL_TASKS_VERSION = 1  # bump when write_local_tasks changes what it writes


def task_fingerprint(task: str, data_dir: Path | None, ppl_text: Path | None = None) -> str:
    """What a task's definition is: lm-eval's version (its YAML) and, for local data, the data's bytes and the
    way our task files point at it (for `perplexity`, the text's bytes). Absolute paths do not count, so caches
    survive a move."""
    h = hashlib.sha256(f"lm_eval {_lm_eval().__version__}\ntask {task}\n".encode())
    if task == PERPLEXITY:
        h.update(f"docs of {PPL_DOC_WORDS} words\n{sha256_file(Path(ppl_text))}\n".encode())
        return h.hexdigest()
    if data_dir is not None:
        h.update(f"local tasks v{LOCAL_TASKS_VERSION}\n".encode())
        for split, rel in sorted(LOCAL_FILES[task].items()):
            h.update(f"{split} {sha256_file(Path(data_dir) / rel)}\n".encode())
    return h.hexdigest()


def model_identity(folder: Path, source: dict) -> str:
    """What the model is: a Hub repo at its commit, else the content of its files (sha256 taken from our
    manifest where it records them and the size still matches, else computed)."""
    if source.get("repo_id") and source.get("revision"):
        return f"hub:{source['repo_id']}@{source['revision']}"
    known = {}
    manifest = folder / MANIFEST_NAME
    if manifest.is_file():
        try:
            known = json.loads(manifest.read_text()).get("files") or {}
        except (OSError, ValueError):
            known = {}
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file() and q.name != MANIFEST_NAME):
        rel = p.relative_to(folder).as_posix()
        rec = known.get(rel) or {}
        digest = rec["sha256"] if rec.get("size") == p.stat().st_size and rec.get("sha256") else sha256_file(p)
        h.update(f"{rel} {digest}\n".encode())
    return "sha256:" + h.hexdigest()


def cache_key(identity: str, task: str, fingerprint: str, settings: dict) -> str:
    """One baseline result per task: a later gate on a subset or superset of tasks reuses what it can."""
    doc = {"model": identity, "task": task, "task_definition": fingerprint, "settings": settings}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def task_part(results: dict, task: str) -> dict:
    """The slice of an lm-eval result dict that belongs to `task` (a group brings its subtasks)."""
    groups = results.get("group_subtasks") or {}
    names, todo = set(), [task]
    while todo:
        t = todo.pop()
        if t not in names:
            names.add(t)
            todo += groups.get(t, [])
    part = {k: {n: v for n, v in (results.get(k) or {}).items() if n in names}
            for k in ("results", "n-samples", "n-shot", "versions", "group_subtasks", "items")}
    part["meta"] = results.get("meta", {})
    return part


def merge(parts: list[dict]) -> dict:
    out = {k: {} for k in ("results", "n-samples", "n-shot", "versions", "group_subtasks", "items")}
    for p in parts:
        for k in out:
            out[k].update(p.get(k) or {})
    out["meta"] = parts[-1].get("meta", {}) if parts else {}
    return out


def default_cache_dir() -> Path:
    return cache_root() / "eval"


def eval_dtype(folder: Path, backend: str, device: str, request: str = "auto") -> str:
    """lm-eval's `dtype` for the hf backend: `auto` (the checkpoint's own) unless that dtype is slow on this CPU
    (compute.py), then float32. The engines choose their own."""
    if backend != "hf":
        return "auto"
    import torch

    from quantize import compute

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    model = getattr(torch, str(name), torch.bfloat16)
    model = model if isinstance(model, torch.dtype) else torch.bfloat16
    return "float32" if compute.choose(model, device.split(":")[0] if device != "auto" else "cpu", request) != model else "auto"


def model_args(backend: str, folder: Path, tp: int, trust_remote_code: bool, dtype: str = "auto") -> str:
    args = [f"pretrained={folder}", f"dtype={dtype}"]
    if backend == "vllm":
        args.append(f"tensor_parallel_size={tp}")
    elif backend == "sglang":
        args.append(f"tp_size={tp}")
    if trust_remote_code:
        args.append("trust_remote_code=True")
    return ",".join(args)


def check_backend(backend: str) -> None:
    if backend == "hf":
        return
    if importlib.util.find_spec(backend) is None:
        raise EvalError(f"--backend {backend} needs {backend} installed: pip install 'quantize[{backend}]'")


def evaluate(folder: Path, tasks: list[str], *, backend: str = "hf", device: str = "cpu", batch_size: int | str = 8,
             limit: int | None = None, num_fewshot: int | None = None, tp: int = 1, include_path: Path | None = None,
             log_samples: Path | None = None, trust_remote_code: bool = False, dtype: str = "auto",
             verbose: bool = False, include_defaults: bool = False) -> dict:
    """lm-eval's results for one model: {results, n-samples, n-shot, versions, group_subtasks, items, meta}.
    `items` holds every item's metric values (the gate pairs baseline and candidate item by item); meta's
    `truncated` counts the prompts cut to the model's context (said once by the caller, not once per item)."""
    from quantize import quiet

    lm_eval = _lm_eval()
    check_backend(backend)
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    with quiet.libraries(verbose) as dropped:
        out = _simple_evaluate(lm_eval, TaskManager, folder, tasks, backend, device, batch_size, limit, num_fewshot, tp,
                               include_path, include_defaults, trust_remote_code, dtype)
    if not out or not out.get("results"):
        raise EvalError(f"lm-eval returned no results for {folder}")
    if log_samples is not None:
        _write_samples(out.get("samples") or {}, log_samples)
    keep = {k: out.get(k) for k in ("results", "n-samples", "n-shot", "versions", "group_subtasks")}
    keep["items"] = per_item(out.get("samples") or {})
    keep["meta"] = {"model": str(folder), "backend": backend, "lm_eval": lm_eval.__version__, "limit": limit,
                    "num_fewshot": num_fewshot, "seconds": round(time.perf_counter() - t0, 1),
                    "truncated": {"prompts": dropped.truncated, "max_length": dropped.max_length}}
    return json.loads(json.dumps(keep, default=_jsonable))


def _simple_evaluate(lm_eval, TaskManager, folder, tasks, backend, device, batch_size, limit, num_fewshot, tp,
                     include_path, include_defaults, trust_remote_code, dtype) -> dict:
    manager = (TaskManager(include_path=str(include_path), include_defaults=include_defaults) if include_path
               else TaskManager())
    from quantize import compute

    widen = compute.widened_linears() if backend == "hf" and dtype == "float32" else contextlib.nullcontext()
    try:
        with widen:
            return lm_eval.simple_evaluate(
                model=backend, model_args=model_args(backend, folder, tp, trust_remote_code, dtype), tasks=list(tasks),
                num_fewshot=num_fewshot, batch_size=batch_size, device=device if backend == "hf" else None,
                limit=limit, task_manager=manager, log_samples=True, random_seed=0, numpy_random_seed=1234,
                torch_random_seed=1234, fewshot_random_seed=1234,
            )
    except Exception as e:  # lm-eval and the backends raise anything; the run cannot give a verdict
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise EvalError(f"lm-eval could not evaluate {folder}: {type(e).__name__}: {first}") from e


def per_item(samples: dict) -> dict[str, dict[str, dict[str, object]]]:
    """{task: {"metric,filter": {doc_id: value}}} from lm-eval's per-sample records; a perplexity item's value is
    its (loglikelihood, words or bytes) pair, as lm-eval aggregates it."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    for task, rows in samples.items():
        for row in rows:
            for metric in row.get("metrics") or []:
                v = row.get(metric)
                value = [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v)
                out.setdefault(task, {}).setdefault(f"{metric},{row.get('filter', 'none')}", {})[str(row["doc_id"])] = value
    return out


def _jsonable(o) -> str:
    return str(o)  # lm-eval's results hold a few non-JSON objects (dtypes, functions); NaN stays NaN for the gate


def _write_samples(samples: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for task, rows in samples.items():
        with open(folder / f"{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=_jsonable) + "\n")
