"""`quantize release`: the CI job that turns a checkpoint into a gated, documented Hub release.

Steps, in order, each recorded in the report: convert (resumable), verify, plan, eval gate, model card, upload.
Nothing is uploaded unless every step before it passed; the report (JSON + Markdown) is written to the work
dir whatever happens, for CI to keep as an artifact. Uploading goes through huggingface_hub: one commit holding
every file (LFS uploads the Hub already has are skipped, so a re-run after a broken upload resumes), then a tag
when asked. The token comes from HF_TOKEN or the HF cache and is never printed or written.
"""

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from quantize import cache_root, lock
from quantize.errors import QuantizeError, UsageError
from quantize.plan import size_label
from quantize.writer import MANIFEST_NAME

REPORT_JSON = "release-report.json"
REPORT_MD = "release-report.md"
CARD_DIR = "card"
MODEL_DIR = "model"

EXIT_RELEASED, EXIT_GATE_FAILED, EXIT_ERROR = 0, 1, 2


@dataclass
class Step:
    name: str
    status: str  # done | reused | resumed | passed | failed | skipped | dry-run
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


@dataclass
class Report:
    src: str
    repo_id: str
    recipe: str
    work_dir: str
    dry_run: bool
    steps: list[Step] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)  # what is (or would be) committed: path_in_repo, size, sha256
    commit: dict | None = None
    exit_code: int | None = None
    error: str | None = None
    saved: bool = False  # written to the work dir (never when the work dir overlaps the source)

    def step(self, name: str) -> Step | None:
        return next((s for s in self.steps if s.name == name), None)

    def to_dict(self) -> dict:
        return asdict(self) | {"released": self.exit_code == EXIT_RELEASED and not self.dry_run}

    def markdown(self) -> str:
        gate_step = self.step("eval")
        undecided = gate_step is not None and gate_step.status == "inconclusive"
        verdict = {EXIT_RELEASED: "dry run passed (nothing uploaded)" if self.dry_run else "released",
                   EXIT_GATE_FAILED: "gate inconclusive (a sample too small to decide): nothing uploaded" if undecided
                   else "gate failed: nothing uploaded", EXIT_ERROR: "error: nothing uploaded"}
        lines = [f"# Release of {self.src} as {self.repo_id}", "",
                 f"Outcome: **{verdict.get(self.exit_code, 'unfinished')}**" + (f": {self.error}" if self.error else ""),
                 "", "| step | status | seconds |", "|---|---|---|"]
        lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} |" for s in self.steps]
        if self.files:
            lines += ["", f"Files ({len(self.files)}, {sum(f['size'] for f in self.files) / 2**30:.2f} GiB):", ""]
            lines += [f"- `{f['path_in_repo']}` ({f['size']:,} B, sha256 {f['sha256'][:12]})" for f in self.files]
        if self.commit:
            lines += ["", f"Commit: {self.commit.get('url') or self.commit.get('oid')}" +
                      (f", tag `{self.commit['tag']}`" if self.commit.get("tag") else "")]
        gate = self.step("eval")
        if gate and gate.detail.get("markdown"):
            lines += ["", gate.detail["markdown"]]
        return "\n".join(lines) + "\n"

    def write(self, work_dir: Path) -> None:
        self.saved = True
        work_dir.mkdir(parents=True, exist_ok=True)
        for name, text in ((REPORT_JSON, json.dumps(self.to_dict(), indent=1, default=str)), (REPORT_MD, self.markdown())):
            tmp = work_dir / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(work_dir / name)


class Timer:
    def __init__(self, report: Report, name: str):
        self.step = Step(name, "running")
        report.steps.append(self.step)
        self.t0 = time.perf_counter()

    def done(self, status: str, **detail) -> Step:
        self.step.status, self.step.seconds = status, time.perf_counter() - self.t0
        self.step.detail.update(detail)
        return self.step


# ---- the model card ---------------------------------------------------------------------------------------


def base_model_id(src: str, folder: Path) -> str | None:
    """The Hub id of the source: SRC itself, or the repo an HF-cache snapshot folder belongs to."""
    from quantize import hub

    if hub.is_repo_id(src) and not Path(src).expanduser().exists():
        return hub.split_revision(src)[0]
    parts = Path(folder).resolve().parts
    for i, p in enumerate(parts):
        if p.startswith("models--") and i + 2 < len(parts) and parts[i + 1] == "snapshots":
            return p[len("models--"):].replace("--", "/", 1)
    return None


def source_license(folder: Path) -> str | None:
    """The licence in the source's model card front matter (what the Hub shows), if it has one."""
    from huggingface_hub import ModelCard

    readme = Path(folder) / "README.md"
    if not readme.is_file():
        return None
    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a card the Hub's own parser rejects carries no licence we can trust
        return None


def serving_commands(repo_id: str, tp: int, tp_sizes: list[int], rows, remote_code: bool) -> str:
    """vllm serve / sglang.launch_server with every flag the serving matrix says the output needs."""
    from quantize import serving

    remote = " --trust-remote-code" if remote_code else ""
    flags = {e: "".join(f" {f}" for f in serving.launch_flags(rows, e)) + remote for e in (serving.VLLM, serving.SGLANG)}
    return "\n".join([
        "```bash",
        f"# vLLM (tensor parallel {tp}; the output serves at TP {', '.join(map(str, tp_sizes)) or 'none'})",
        f"vllm serve {repo_id} --tensor-parallel-size {tp}{flags[serving.VLLM]}",
        "",
        "# SGLang",
        f"python -m sglang.launch_server --model-path {repo_id} --tp {tp}{flags[serving.SGLANG]}",
        "```",
    ])


def model_card(*, repo_id: str, base_model: str | None, license: str | None, recipe, plan_summary: dict,
               src_bytes: int, out_bytes: int, capacity, setup, gate_markdown: str | None, tp_sizes: list[int],
               remote_code: bool, architecture: str, serving_rows=()) -> str:
    """README.md for the release: Hub front matter (base_model, base_model_relation quantized, licence, tags)
    and what a serving engineer needs: how it was made, sizes, what fits, accuracy, commands."""
    from huggingface_hub import ModelCard, ModelCardData

    s = recipe.scheme
    fmt, tag, what = ("fp8", "fp8-block", "FP8 block") if s.fp8_block else \
        ("fp4", "nvfp4", "FP4 weights and activations (NVFP4, W4A4)") if s.w4a4 else \
        ("fp4", f"{s.fp4}a16", f"FP4 ({s.fp4.upper()}A16)") if s.fp4 else \
        ("int4", "w4afp8", "INT4 with FP8 activations (W4AFP8)") if s.w4afp8 else ("int4", "w4a16", "INT4 (W4A16)")
    data = ModelCardData(
        base_model=base_model, base_model_relation="quantized" if base_model else None, license=license,
        library_name="transformers", pipeline_tag="text-generation",
        tags=["compressed-tensors", fmt, tag, recipe.method, "vllm", "sglang", "quantize", architecture],
    )
    lines = [f"# {repo_id}", ""]
    lines.append(f"{what} quantization of "
                 f"{('[' + base_model + '](https://huggingface.co/' + base_model + ')') if base_model else 'its source'}"
                 f" in the compressed-tensors `{s.format}` layout, which the engines below load as-is. Made with "
                 "`quantize release`.")
    lines += ["", "## How it was quantized", "", "| | |", "|---|---|",
              f"| recipe | `{recipe.name}` |", f"| method | {recipe.method} |", f"| scheme | {s.label} |",
              f"| targets | {', '.join(f'`{t}`' for t in recipe.targets)} |",
              f"| ignored | {', '.join(f'`{t}`' for t in recipe.ignore)} |"]
    if recipe.calibrated:
        c = recipe.calibration
        lines.append(f"| calibration | {c.num_samples} samples x {c.seq_len} tokens of `{c.data}`, seed {c.seed} |")
    if recipe.method == "rtn" and recipe.calibrated:
        lines.append("| scales | round to nearest, each group's clip chosen by its error weighted by the calibration "
                     "inputs' E[x^2] |")
    if recipe.method == "gptq":
        g = recipe.gptq
        scale_rule = "chosen by the Hessian" if g.scales == "hessian" else "min/max"
        held = f" on {g.tune_holdout} held-out samples)" if g.tune_holdout else ")"
        from quantize.engine.tune import tunes_attention
        from quantize.quant.signround import offset_rate

        attention = "" if tunes_attention(g.tune_attention) else \
            ", the attention's inputs kept as GPTQ solved them"
        lines.append(f"| GPTQ | scales {scale_rule}; dampening {g.dampening_frac} of the mean diagonal"
                     + (", more for experts routed fewer tokens than their width" if g.dampening == "tokens" else "")
                     + f"; blocks of {g.block_size}; activation order {g.actorder or 'none'}"
                     + (f"; then each dense layer tuned towards the float model's output ({g.iters} signed steps "
                        f"of {offset_rate(recipe.scheme.grid, g.tune_rate)} over {g.samples(recipe.scheme.grid)} "
                        f"samples{attention}, kept where its error dropped{held}"
                        if g.iters else "") + " |")
    if recipe.kv_cache:
        lines.append("| KV cache | FP8 e4m3 scales per layer (`k_scale` / `v_scale`) |")
    counts = plan_summary.get("quantized_modules_by_kind", {})
    lines.append(f"| quantized Linears | {plan_summary.get('quantized_modules', 0):,} "
                 f"({', '.join(f'{k} {v:,}' for k, v in counts.items())}) |")
    lines += ["", "## Size", "", "| | weights on disk | bytes |", "|---|---|---|",
              f"| source | {size_label(src_bytes)} | {src_bytes:,} |",
              f"| this release | {size_label(out_bytes)} | {out_bytes:,} |",
              f"| ratio | {out_bytes / max(src_bytes, 1):.3f} | |"]
    if capacity is not None:
        lines += ["", f"## What fits: {setup.gpus} GPU(s) of {setup.gpu_mem_gib:.1f} GiB, TP {setup.tp}, "
                  f"memory fraction {setup.mem_fraction}", "",
                  "| weights | KV cache | weights per GPU (GiB) | KV bytes per token per GPU | tokens that fit | "
                  f"requests at {setup.context_len:,} |", "|---|---|---|---|---|---|"]
        for sc in capacity.scenarios:
            lines.append(f"| {sc.weights} | {sc.kv_dtype.upper()} | {sc.weights_per_gpu / 2**30:,.2f} | "
                         f"{sc.kv.bytes_per_token:,} | {sc.total_tokens:,} | {sc.max_requests:,} |")
        lines += ["", "From `quantize plan` (KV bytes per token as SGLang's memory pools count them)."]
    if gate_markdown:
        lines += ["", gate_markdown]
    from quantize import serving

    lines += ["", "## Serve it", "", serving_commands(repo_id, setup.tp, tp_sizes, serving_rows, remote_code)]
    if serving_rows:
        lines += ["", "What each engine loads, read from its loader code (`quantize inspect` shows the same):", "",
                  serving.markdown(list(serving_rows))]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


# ---- what gets committed ----------------------------------------------------------------------------------


def upload_files(model_dir: Path, card: Path) -> list[dict]:
    """Every file of the converted folder (the source's README replaced by the release card), sorted. Sizes and
    sha256 come from the manifest, which `verify` has just checked against the bytes (a Kimi-sized output is
    ~600 GB: hashing it again would cost as much as the verify); only the card and the manifest are hashed."""
    from quantize.writer import sha256_file

    recorded = json.loads((model_dir / MANIFEST_NAME).read_text())["files"]
    files = [(p.name, p) for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != "README.md"]
    files.append(("README.md", card))
    out = []
    for name, p in sorted(files):
        rec = recorded.get(name) if p.parent == model_dir else None
        out.append({"path_in_repo": name, "local": str(p), "size": rec["size"] if rec else p.stat().st_size,
                    "sha256": rec["sha256"] if rec else sha256_file(p)})
    return out


def commit_message(report: Report, recipe) -> str:
    return f"quantize release: {report.src} -> {recipe.scheme.label} ({recipe.method}, recipe {recipe.name})"


def work_dir_for(work_dir: str | None, repo_id: str) -> Path:
    return Path(work_dir) if work_dir else Path("release") / repo_id.replace("/", "--")


def reuse_refusal(model_dir: Path, planned) -> str | None:
    """None when the finished conversion in the work dir is the one this release would make (the fingerprint
    `--resume` checks: source files, recipe, calibration, layout, tool version), else why it is not."""
    from quantize.engine.state import changed
    from quantize.engine.stream import plan_fingerprint

    try:
        saved = json.loads((model_dir / MANIFEST_NAME).read_text()).get("fingerprint")
    except (OSError, ValueError):
        return f"{model_dir} holds no readable {MANIFEST_NAME}"
    now = plan_fingerprint(planned)
    return None if saved == now else f"{model_dir} was converted with another {changed(saved, now)}"


# ---- the job --------------------------------------------------------------------------------------------


@dataclass
class Options:
    src: str
    recipe_path: Path
    repo_id: str
    work_dir: Path
    gate_path: Path | None = None
    tasks: tuple[str, ...] = ("gsm8k", "mmlu", "arc_challenge")
    backend: str = "hf"
    eval_tp: int = 1
    device: str = "cpu"
    calib: str | None = None
    data_dir: Path | None = None
    limit: int | None = None
    gpus: int = 8
    gpu_mem_gib: float = 143771 / 1024  # an H200 as nvidia-smi counts it (plan.GPUS)
    private: bool = False
    tag: str | None = None
    dry_run: bool = False
    max_shard_size: int = 5 * 10**9
    verbose: bool = False
    ppl_text: Path | None = None
    allow_inconclusive: bool = False


def run(o: Options, events=None, status=lambda msg: None, on_gate=lambda run: None,
        on_convert=lambda result: None) -> tuple[Report, list[dict]]:
    """Every step in order; returns the report (its exit_code set) and the files committed or, in a dry run,
    that would be. The conversion is the library's (quantize/convert.py), shown through `events` and then
    `on_convert(its Result)`. Nothing is uploaded unless every earlier step passed; the report is written in all
    cases."""
    from quantize import convert, gate, hub, plan, serving, tensor_plan
    from quantize import recipe as recipes
    from quantize.checkpoint import Checkpoint
    from quantize.destination import Overlap, check_apart, partial_dir
    from quantize.verify import verify

    report = Report(src=o.src, repo_id=o.repo_id, recipe=str(o.recipe_path), work_dir=str(o.work_dir), dry_run=o.dry_run)
    files: list[dict] = []
    holds: list[lock.Hold] = []
    parent = None
    try:
        if not hub.REPO_ID.match(o.repo_id) or "@" in o.repo_id:
            raise UsageError(f"--repo-id {o.repo_id!r}: expected ORG/NAME")
        if not o.dry_run:
            hub.check_token()
        r = recipes.load(o.recipe_path)
        if o.calib:
            r = replace(r, calibration=replace(r.calibration, data=o.calib))
        gate.load_gate(o.gate_path, list(o.tasks))  # a bad gate file fails now, not after the conversion
        folder, _ = hub.resolve(o.src)
        check_apart(folder, {"--work-dir": o.work_dir})
        # one release per work dir and per Hub repo on this machine; across machines the Hub itself refuses a
        # commit whose parent is no longer main (hub.upload_release)
        holds.append(lock.hold(o.work_dir, "used by a release"))
        if not o.dry_run:
            holds.append(lock.hold(cache_root() / "releases" / o.repo_id.replace("/", "--"), "being released",
                                   shown=Path(o.repo_id)))
            parent = hub.release_target(o.repo_id, o.tag)
        ckpt = Checkpoint(folder)
        planned = tensor_plan.build(ckpt, r, o.max_shard_size, device=o.device)  # a recipe that cannot apply fails now
        model_dir = o.work_dir / MODEL_DIR
        o.work_dir.mkdir(parents=True, exist_ok=True)

        step = Timer(report, "convert")
        if model_dir.is_dir():
            why = reuse_refusal(model_dir, planned)
            if why:
                raise UsageError(f"{why}; it cannot be reused for this release: delete it or choose another --work-dir")
            step.done("reused", out=str(model_dir))
        else:
            resume = partial_dir(model_dir).is_dir()
            try:
                converted = convert.convert(o.src, model_dir, convert.Options(
                    recipe_path=str(o.recipe_path), calib=o.calib, device=o.device, resume=resume,
                    overwrite=not resume, max_shard_size=o.max_shard_size, verbose=o.verbose), events)
            except QuantizeError as e:  # the same error (its type decides the exit), with the way on
                e.args = (f"convert: {e.args[0] if e.args else e}; rerun the release to resume it", *e.args[1:])
                raise
            on_convert(converted)
            step.done("resumed" if resume else "done", out=str(model_dir))

        step = Timer(report, "verify")
        checked = verify(model_dir)
        if not checked.clean:
            step.done("failed", findings=[f.line() for f in checked.findings[:20]])
            raise QuantizeError(f"verify found {len(checked.findings)} problem(s) in {model_dir}, e.g. "
                                f"{checked.findings[0].line()}; delete it and rerun")
        step.done("passed", files=checked.files, tensors=checked.tensors, quantized_modules=checked.quantized_modules)

        step = Timer(report, "plan")
        tp = max((t for t in planned.tp_served if t <= o.gpus), default=1)
        setup = plan.Setup(gpus=o.gpus // tp * tp, tp=tp, dp=o.gpus // tp, gpu_mem_gib=o.gpu_mem_gib)
        capacity = plan.capacity(folder, setup, ["bf16", "fp8"], r)
        step.done("done", setup={k: v for k, v in vars(setup).items() if k != "notes"},
                  scenarios=[sc.to_dict() for sc in capacity.scenarios], tp_served=planned.tp_served)

        step = Timer(report, "eval")
        gate_run = gate.run_gate(str(model_dir), baseline=o.src, tasks=list(o.tasks), gate_path=o.gate_path,
                                 backend=o.backend, device=o.device if o.backend == "hf" else "auto", limit=o.limit,
                                 tp=o.eval_tp, data_dir=o.data_dir, verbose=o.verbose, ppl_text=o.ppl_text,
                                 allow_inconclusive=o.allow_inconclusive, status=status)
        md = gate.markdown(gate_run.verdicts, o.src, o.repo_id,
                           {k: gate_run.meta.get(k) for k in ("backend", "limit", "num_fewshot", "lm_eval")},
                           o.allow_inconclusive)
        step.done("passed" if gate_run.passed else "inconclusive" if gate_run.outcome == "INCONCLUSIVE" else "failed",
                  markdown=md,
                  verdicts=[v.to_dict() for v in gate_run.verdicts])
        on_gate(gate_run)
        if not gate_run.passed:
            return _finish(report, o.work_dir, EXIT_GATE_FAILED), files

        step = Timer(report, "card")
        card = o.work_dir / CARD_DIR / "README.md"
        card.parent.mkdir(parents=True, exist_ok=True)
        card.write_text(model_card(
            repo_id=o.repo_id, base_model=base_model_id(o.src, folder), license=source_license(folder), recipe=r,
            plan_summary=tensor_plan.summary(planned), src_bytes=ckpt.total_bytes,
            out_bytes=sum(p.stat().st_size for p in model_dir.glob("*.safetensors")), capacity=capacity, setup=setup,
            gate_markdown=md, tp_sizes=planned.tp_served, remote_code=bool(ckpt.config.get("auto_map")),
            architecture=planned.model.model_type, serving_rows=serving.matrix_of(model_dir)))
        step.done("done", path=str(card))

        step = Timer(report, "upload")
        files = upload_files(model_dir, card)
        report.files = [{k: v for k, v in f.items() if k != "local"} for f in files]
        message = commit_message(report, r)
        if o.dry_run:
            step.done("dry-run", commit_message=message, tag=o.tag)
        else:
            report.commit = hub.upload_release(o.repo_id, files, message, f"Report: {REPORT_MD} of the release job.",
                                               private=o.private, tag=o.tag, parent=parent)
            step.done("done", commit=report.commit)
        return _finish(report, o.work_dir, EXIT_RELEASED), files
    except (Overlap, lock.Held) as e:  # the work dir is the source's, or another live job's: no report goes there
        return _finish(report, None, EXIT_ERROR, str(e)), files
    except QuantizeError as e:
        return _finish(report, o.work_dir, EXIT_ERROR, str(e)), files
    finally:
        for h in holds:
            h.release()


def _finish(report: Report, work_dir: Path | None, code: int, error: str | None = None) -> Report:
    report.exit_code, report.error = code, error
    for s in report.steps:
        if s.status == "running":
            s.status = "failed"
    if work_dir is not None:
        report.write(work_dir)
    return report
