"""What the commands print: progress on stderr, results on stdout, as rich tables and lines (or JSON)."""

import json

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from quantize.plan import size_label  # plan.py imports no torch: --help and usage errors stay fast


def console(stderr: bool = False) -> Console:
    """Rich's console; piped to a file or another program it would wrap at 80 columns and cut table cells, so
    there it gets room for every figure."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=240)


err = console(stderr=True)
out = console()


class BytesOnly(ProgressColumn):
    """A byte column (size, speed) shown only on tasks that count bytes; the layer task counts layers."""

    def __init__(self, inner: ProgressColumn):
        super().__init__()
        self.inner = inner

    def render(self, task) -> Text:
        return self.inner.render(task) if task.fields.get("bytes") else Text("")


def serving_table(rows, title: str = "serving (read from the engines' loaders)") -> None:
    t = Table(title=title, title_justify="left")
    for col in ("engine", "variant", "loads", "flags", "what the engine ignores or does"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.engine, r.variant, "[green]yes[/]" if r.loads else "[bold red]no[/]", " ".join(r.flags) or "-",
                  "; ".join(r.notes) or "-")
    out.print(t)


def calibration_table(stats, forwards: str) -> None:
    t = Table(title="calibration", title_justify="left")
    for col in ("layers", "experts calibrated", "fallbacks to RTN", "activations", "forwards in", "time"):
        t.add_column(col)
    resumed = f" ({stats.resumed_layers} from the checkpoint)" if stats.resumed_layers else ""
    t.add_row(f"{len(stats.layers)}{resumed}", str(sum(x.experts_calibrated for x in stats.layers)),
              str(sum(len(x.fallbacks) for x in stats.layers)), stats.offload, forwards,
              f"{sum(x.seconds for x in stats.layers):.1f} s")
    out.print(t)
    e = Table(title="mean relative weight error by module kind", title_justify="left")
    e.add_column("kind")
    e.add_column("||W - Q|| / ||W||")
    for kind, v in stats.mean_error().items():
        e.add_row(kind, f"{v:.4f}")
    out.print(e)
    for x in stats.layers:
        if x.tokens_per_expert:
            counts = sorted(x.tokens_per_expert.values())
            out.print(f"layer {x.layer}: tokens per expert min {counts[0]} median {counts[len(counts) // 2]} "
                      f"max {counts[-1]}", highlight=False)
    kv = [x.kv_scale for x in stats.layers if x.kv_scale]
    if kv:
        out.print(f"FP8 KV cache scales: k_scale {min(k for k, _ in kv):.4g}..{max(k for k, _ in kv):.4g}, "
                  f"v_scale {min(v for _, v in kv):.4g}..{max(v for _, v in kv):.4g} over {len(kv)} layers",
                  highlight=False)
    for f in (f for x in stats.layers for f in x.fallbacks):
        out.print(f"[yellow]fallback:[/] {f}", highlight=False)


def progress(transient: bool) -> Progress:
    """Bars on stderr, with bytes, speed and ETA on the tasks that count bytes; `transient`: gone when done."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), BytesOnly(DownloadColumn()),
                    BytesOnly(TransferSpeedColumn()), TimeRemainingColumn(), console=err, transient=transient)


def events(bar: Progress):
    """The library's events as lines on stderr and the progress bars (each task made when its work starts)."""
    from quantize.convert import Events

    tasks: dict[str, int] = {}

    def task(name: str, total: int, **fields) -> int:
        if name not in tasks:
            tasks[name] = bar.add_task(name, total=total, **fields)
        return tasks[name]

    def layer(report, total):
        fb = f", {len(report.fallbacks)} fallback(s)" if report.fallbacks else ""
        ex = f", {report.experts_calibrated} experts" if report.experts_calibrated else ""
        bar.update(task("layers", total), advance=1, description=f"layer {report.layer}: {report.modules} modules{ex}{fb}")

    def expert(e, total):
        bar.update(task("experts", total), completed=e + 1, total=total, description=f"expert {e + 1}/{total}")

    return Events(status=lambda msg: err.print(msg, highlight=False),
                  warning=lambda w: err.print(f"[yellow]warning:[/] {w}", highlight=False),
                  converted=lambda done, total: bar.update(task("converting", total, bytes=True), completed=done,
                                                           total=total),
                  layer=layer, expert=expert)


def convert_report(result, as_json: bool) -> None:
    report, res = result.report, result.stream
    if as_json:
        out.print_json(json.dumps(report))
        return
    if result.stats is not None:
        calibration_table(result.stats, report["calibration"]["compute_dtype"])
    t = Table(title=f"converted to {res.out}", title_justify="left")
    for col in ("tensors", "count"):
        t.add_column(col)
    for action, n in sorted(res.counts.items()):
        t.add_row(action, str(n))
    out.print(t)
    out.print(
        f"{size_label(result.src_bytes)} -> {size_label(res.out_bytes)} in {res.shards} shard(s)"
        f"{f' ({res.resumed_shards} resumed)' if res.resumed_shards else ''}, {res.seconds:.1f} s, "
        f"{res.gb_per_s:.2f} GB/s on {res.device}; serves at TP {', '.join(map(str, res.tp_served)) or 'none'}",
        highlight=False,
    )
    for where, rows in result.serving.items():
        serving_table(rows, f"serving {where} (read from the engines' loaders)")
    if res.prefill:
        pf = res.prefill
        out.print(f"prefill variant ({pf['scheme']}): {pf['out']}, {size_label(pf['output_bytes'])}, same pass; serves at TP "
                  f"{', '.join(map(str, pf['tp_served'])) or 'none'}", highlight=False)


def inspect_table(src: str, s: dict, rows) -> None:
    """`inspect`: the plan's summary, and the engines' loading matrix of a converted OUT."""
    t = Table(title=f"{src}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("architecture", f"{s['architecture']} (model_type {s['model_type']})")
    t.add_row("layers", f"{s['num_hidden_layers']} + MTP {s['mtp_layers'] or 'none'}")
    if s["n_routed_experts"]:
        t.add_row("experts", f"{s['n_routed_experts']} routed, moe_intermediate_size {s['moe_intermediate_size']}")
    t.add_row("source", f"{s['source_format']} ({s['dtype']}), {s['shards']} shard(s), {size_label(s['bytes_on_disk'])} on disk")
    t.add_row("parameters", f"{s['parameters'] / 1e9:.3f} B")
    for kind, n in s["parameters_by_kind"].items():
        t.add_row(f"  {kind}", f"{n / 1e6:,.2f} M")
    t.add_row("recipe", f"{s['recipe']}: {s['scheme']}")
    t.add_row("quantizes", ", ".join(f"{n} {k}" for k, n in s["quantized_modules_by_kind"].items()) or "nothing")
    t.add_row("output", f"{size_label(s['output_bytes'])} in {s['output_shards']} shard(s)")
    t.add_row("serves at TP", ", ".join(map(str, s["tp_served"])) or "none (Marlin rules)")
    out.print(t)
    if rows:
        serving_table(rows)
    for w in s["warnings"]:
        err.print(f"[yellow]warning:[/] {w}", highlight=False)


def verify_report(report, deep: bool, as_json: bool) -> None:
    """`verify`: every finding on a line, then a summary (or the JSON)."""
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        for f in report.findings:
            out.print(f.line(), highlight=False, soft_wrap=True)
        summary = (f"{report.files} files, {report.tensors} tensors, {report.quantized_modules} quantized modules, "
                   f"{report.bytes_hashed / 2**30:.2f} GiB hashed" + (f", {report.deep_checked} compared with the source"
                                                                     if deep else ""))
        out.print(f"[green]clean[/]: {summary}" if report.clean else f"[bold red]{len(report.findings)} finding(s)[/]: {summary}")


def plan_table(report, setup, as_json: bool, *, gpus: int, tp: int, dp: int, kv_budget_gib, mem_fraction: float,
               context_len: int) -> None:
    """`plan`: weights, KV bytes and tokens per scenario; published figures recomputed; notes."""
    from quantize import plan

    if as_json:
        out.print_json(json.dumps(report.to_dict(setup)))
        return
    budget = f"{kv_budget_gib} GiB KV per GPU" if kv_budget_gib is not None else (
        f"{setup.gpu_mem_gib:.1f} GiB x {mem_fraction} per GPU")
    t = Table(title=f"{report.model} on {gpus} GPU(s), TP {tp} x DP {dp}, {budget}", title_justify="left")
    for col in ("weights", "KV", "weights GiB (all / per GPU)", "KV B/token/GPU", "KV budget GiB/GPU",
                "tokens (all replicas)", f"requests at {context_len:,}"):
        t.add_column(col)
    for sc in report.scenarios:
        t.add_row(sc.weights, sc.kv_dtype.upper(), f"{sc.weights_total / plan.GIB:,.1f} / {sc.weights_per_gpu / plan.GIB:,.1f}",
                  f"{sc.kv.bytes_per_token:,}", f"{sc.kv_budget_per_gpu / plan.GIB:,.1f}", f"{sc.total_tokens:,}",
                  f"{sc.max_requests:,}")
    out.print(t)
    out.print(f"source: {report.source}", highlight=False)
    if report.scenarios:
        out.print(f"KV per token: {report.scenarios[0].kv.detail}", highlight=False)
    if report.claims:
        c = Table(title="published figures, recomputed", title_justify="left")
        for col in ("figure", "published", "computed", "holds"):
            c.add_column(col)
        for x in report.claims:
            c.add_row(x.what, f"{x.published:,.0f} {x.unit}", f"{x.computed:,.1f} {x.unit}",
                      "[green]yes[/]" if x.holds else "[red]no[/]")
        out.print(c)
    for n in report.notes:
        out.print(f"[yellow]note:[/] {n}", highlight=False)


def gate_table(run) -> None:
    from quantize import gate

    if not run.verdicts:
        t = Table(title=f"{run.meta['candidate']}", title_justify="left")
        for col in ("task", "metric", "value", "stderr"):
            t.add_column(col)
        for task, row in sorted(run.candidate["results"].items()):
            for k, v in row.items():
                if isinstance(v, float) and "_stderr" not in k:
                    name, _, flt = k.partition(",")
                    se = row.get(f"{name}_stderr,{flt}")
                    t.add_row(task, k, f"{v * 100:.2f}", f"{se * 100:.2f}" if isinstance(se, float) else "n/a")
        out.print(t)
        return
    style = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold red", "INCONCLUSIVE": "yellow"}
    at = gate.HEADER.index("verdict")
    t = Table(title=f"gate: {run.meta['candidate']} vs {run.meta['baseline']} (baseline {run.baseline_from}, "
                    f"candidate {run.candidate_from})",
              title_justify="left")
    for col in gate.HEADER[:-1]:  # the reasons of failures follow the table
        t.add_column(col, overflow="fold")
    for r in gate.rows(run.verdicts):
        r[at] = f"[{style[r[at]]}]{r[at]}[/]"
        t.add_row(*r[:-1])
    out.print(t)
    outcome = run.outcome
    color = "green" if outcome == "PASS" else "yellow" if outcome.startswith("INCONCLUSIVE") else "bold red"
    out.print(f"[{color}]{outcome}[/]" + "".join(f"\n  {v.task} {v.metric}: {v.verdict.upper()}: {v.reason}"
                                               for v in run.verdicts if v.verdict != "pass"), highlight=False)


def dry_run_table(files: list[dict], repo_id: str, message: str, tag: str | None) -> None:
    """`release --dry-run`: the files that would be committed, and the commit message."""
    t = Table(title=f"dry run: would commit {len(files)} file(s) to {repo_id}", title_justify="left")
    for col in ("file", "bytes", "sha256"):
        t.add_column(col)
    for f in files:
        t.add_row(f["path_in_repo"], f"{f['size']:,}", f["sha256"][:16])
    out.print(t)
    out.print(f"commit message: {message}"
              + (f"; tag {tag}" if tag else ""), highlight=False)
