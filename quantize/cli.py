"""The `quantize` command line: parse, call the library, hand the result to render.py. No logic of its own."""

import json
import re
import sys
from pathlib import Path

import click

from quantize import __version__, hub, render
from quantize import recipe as recipes
from quantize.convert import load_recipe, resolve_device
from quantize.errors import QuantizeError
from quantize.machine import cores
from quantize.render import err, out

GPU_CHOICES = ("h100", "h200", "b200")
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_workers(_ctx, _param, value):
    """--workers: auto, or a count from 1 to 64."""
    if value is None or value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise click.BadParameter(f"{value!r}: expected auto or a whole number from 1 to 64")
    return n


def parse_size(_ctx, _param, value: str) -> int:
    m = SIZE.match(value)
    if not m:
        raise click.BadParameter(f"{value!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(m[1]) * UNITS[(m[2] or "b").lower()])


def fail(e: QuantizeError) -> None:
    err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
    sys.exit(e.exit_code)




def _group_up() -> bool:
    """Whether this process is in a process group (imports torch only if it was imported already)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def _refused(e: QuantizeError) -> bool:
    """A refusal every rank agreed on (distributed.Refused), without importing torch for a plain error."""
    dist = sys.modules.get("quantize.engine.distributed")
    return dist is not None and isinstance(e, dist.Refused)


COMPUTE_DTYPE_OPTION = click.option(
    "--compute-dtype", type=click.Choice(["auto", "model", "float32"]), default="auto", show_default=True,
    help="dtype of the forwards (calibration, evaluation): auto is the model's, or float32 on a CPU without native "
    "bf16/fp16 (torch reports AVX2), where those GEMMs are 50-100x slower. Weights keep their dtype on disk.")
VERBOSE_OPTION = click.option(
    "--verbose", is_flag=True, help="Also show the libraries' own progress bars and notes (datasets, lm-eval, "
    "transformers), and every truncated prompt.")
PPL_TEXT_OPTION = click.option(
    "--ppl-text", type=click.Path(exists=True, dir_okay=False),
    help="Also gate held-out word perplexity on this text (task perplexity, lm-eval's wikitext definition; relative "
    "rise max_rise in the gate file). Neither calibration nor evaluation data, e.g. /usr/share/common-licenses/GPL-3.")
INCONCLUSIVE_OPTION = click.option(
    "--allow-inconclusive", is_flag=True,
    help="Exit 0 when no metric failed but some sample was too small to decide (INCONCLUSIVE); still reported.")
SCHEME_OPTION = click.option(
    "--scheme", type=click.Choice(recipes.SCHEMES),
    help="Quantize every Linear but lm_head (instead of --recipe): w4a16 INT4 groups; w4afp8 (the INT4 g128 "
    "weights with FP8 per-token activations: FP8 GEMMs on Hopper); fp8-block (e4m3, 128x128 "
    "block scales, compressed-tensors FP8_BLOCK; for prefill servers); nvfp4a16 (FP4 e2m1, an e4m3 scale per 16 "
    "under a global scale shared by the Linears an engine fuses; native on Blackwell, weight-only Marlin on "
    "Hopper); nvfp4 (the same weights with NVFP4 activations, W4A4: FP4 GEMMs on Blackwell; each Linear's "
    "input_global_scale measured on the calibration inputs, so --method gptq) or mxfp4a16 (FP4, an e8m0 scale per "
    "32). FP4 schemes take --method rtn or gptq (FP4 codes under the round-to-nearest scales).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantize")
def main() -> None:
    """Quantize giant Mixture-of-Experts checkpoints (Kimi K2, GLM-4.x/5, DeepSeek V3, dense Llama/Qwen)
    to INT4 (compressed-tensors pack-quantized) or FP8 blocks (float-quantized), the layouts vLLM and SGLang
    load as-is; plan what fits on the GPUs, gate on accuracy, and release to the Hub.

    \b
    Every command streams: memory is bounded by the largest tensor, never by the model.
    SRC is a Hugging Face Hub repo id (org/name[@revision]) or a local model folder.

    \b
    Typical session:
      quantize inspect moonshotai/Kimi-K2-Instruct --recipe recipes/kimi-k2-w4a16.yaml
      quantize convert moonshotai/Kimi-K2-Instruct out/kimi-int4 --recipe recipes/kimi-k2-w4a16.yaml --tp 8
      quantize verify out/kimi-int4 && quantize plan out/kimi-int4 --kv-dtype both
      quantize release moonshotai/Kimi-K2-Instruct --recipe recipes/kimi-k2-w4a16.yaml --repo-id me/K2-W4A16

    Exit codes: 0 done, 1 the input or environment failed (message says what to do), 2 invalid request
    (or an output another live job holds: it is named), 130 interrupted (Ctrl-C; a conversion keeps its
    finished shards: --resume continues).
    """


@main.command()
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def download(src: str, as_json: bool) -> None:
    """Fetch SRC from the Hub into the HF cache (safetensors, configs, tokenizer, remote-code files; never
    pickle weights). Resumes an interrupted download. Prints the local folder."""
    try:
        folder, info = hub.resolve(src)
    except QuantizeError as e:
        fail(e)
    if as_json:
        out.print_json(json.dumps({"path": str(folder), **info}))
    else:
        out.print(str(folder), highlight=False)


@main.command()
@click.argument("src")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False), help="Recipe YAML (see recipes/).")
@SCHEME_OPTION
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), help="Columns per scale: the --scheme's [128], "
              "or overriding an INT4 --recipe's.")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=parse_size)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def inspect(src: str, recipe_path: str | None, scheme: str | None, group_size: str | None, max_shard_size: int,
            as_json: bool) -> None:
    """Describe SRC: architecture, parameters by kind, source format, bytes on disk, what the recipe would
    quantize and the output size it would give. Reads headers only.

    \b
    Example:
      quantize inspect fixtures/kimi-k2-fp8 --recipe recipes/kimi-k2-w4a16.yaml
    """
    try:
        r = load_recipe(recipe_path, scheme, int(group_size) if group_size else None, "rtn")
        folder, _ = hub.resolve(src)
        from quantize import tensor_plan
        from quantize.checkpoint import Checkpoint

        plan = tensor_plan.build(Checkpoint(folder), r, max_shard_size)
    except QuantizeError as e:
        fail(e)
    s = tensor_plan.summary(plan)
    rows = None
    if (plan.ckpt.config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        from quantize import serving

        rows = serving.matrix_of(folder)  # a converted OUT: how the engines load it
        s["serving"] = [r.to_dict() for r in rows]
    if as_json:
        out.print_json(json.dumps(s))
        return
    render.inspect_table(src, s, rows)


@main.command()
@click.argument("src")
@click.argument("out_dir", metavar="OUT", type=click.Path(file_okay=False))
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False), help="Recipe YAML (see recipes/).")
@SCHEME_OPTION
@click.option("--group-size", type=click.Choice(["32", "64", "128"]),
              help="Columns per scale: the --scheme's [128], or overriding an INT4 --recipe's.")
@click.option("--method", type=click.Choice(["rtn", "gptq", "awq"]), help="Overrides the recipe's method (default rtn).")
@click.option("--calib", help="Calibration data: .jsonl/.txt/.parquet file or Hub dataset org/name[:split]. gptq and "
              "awq need it; with rtn it chooses each group's scale by the inputs' E[x^2] (one forward per layer).")
@click.option("--num-samples", type=click.IntRange(1), help="Calibration samples [recipe, else 512].")
@click.option("--seq-len", type=click.IntRange(8), help="Tokens per calibration sample at most [recipe, else 2048].")
@click.option("--seed", type=int, help="Seed that picks the samples [recipe, else 0].")
@click.option("--calibrate-all-experts", is_flag=True, default=None,
              help="Every token through every expert for the statistics (outputs keep the true routing).")
@click.option("--min-expert-tokens", type=click.IntRange(0), help="Experts routed fewer tokens fall back to RTN [16].")
@click.option("--scales", type=click.Choice(recipes.SCALE_RULES),
              help="gptq: each group's scale as the clip of least error weighted by its block of the inputs' Hessian "
              "(hessian, the default) or from its weights' min/max (minmax: llm-compressor's bytes); GPTQ then runs "
              "unchanged under it [recipe].")
@click.option("--tune-iters", type=click.IntRange(0),
              help="gptq: then tune each dense decoder layer's codes and scales by N signed gradient steps towards "
              "the float model's output (SignRound seeded from GPTQ's codes; kept only where the layer's error "
              f"drops; 0: none) [recipe, else {recipes.TUNE_ITERS} with hessian scales, 0 with minmax].")
@click.option("--tune-holdout", type=click.IntRange(0),
              help="gptq: judge each layer's tuning on N calibration samples held out of its steps, and keep it only "
              "where the layer's output error drops on them (0: on the tuned samples; Gemma 3 was better with 32, "
              "SmolLM2 worse: README) [recipe, else 0].")
@click.option("--offload", type=click.Choice(["auto", "gpu", "cpu", "disk"]), default="auto", show_default=True,
              help="Where calibration activations live.")
@click.option("--trust-remote-code", is_flag=True, help="Let the checkpoint's tokenizer code run (calibration only).")
@click.option("--device", default="auto", show_default=True,
              help="auto, cpu, cuda or cuda:N; under torchrun, cuda or auto: each rank the GPU of its LOCAL_RANK.")
@COMPUTE_DTYPE_OPTION
@click.option("--devices", help="gptq: one rank per device (cuda:0,cuda:1,... or cpu,cpu, at most 16); the "
              "calibration samples and the routed experts are split over them, and the bytes are those of one rank.")
@click.option("--rank-timeout", type=click.FloatRange(1, 10080), default=60, show_default=True,
              help="Minutes a rank may wait in one exchange with the others (while rank 0 plans, rehashes on "
              "--resume, solves and writes). A rank that dies ends the job within seconds whatever this is.")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=parse_size, help="Largest output shard.")
@click.option("--workers", default="auto", show_default=True, callback=parse_workers,
              help="Tensors converted at once (threads), or auto: one a CPU core this process may use, fewer where "
              "the largest tensors in flight would not fit in three quarters of the free memory. Memory grows with "
              "it; past 8 workers, output shards are written several at once.")
@click.option("--tp", type=click.IntRange(1, 64), help="Refuse unless the output serves at this tensor-parallel size.")
@click.option("--overwrite", is_flag=True, help="Replace OUT (and any interrupted OUT.partial); never an output a live "
              "job holds.")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion from OUT.partial (one a live job holds "
              "is refused).")
@click.option("--allow-nonfinite", is_flag=True,
              help="Convert a source whose weights hold NaN or Inf (refused by default): those values become 0 in what "
              "is quantized; kept tensors are copied as they are.")
@click.option("--kv-cache", type=click.Choice(["fp8"]),
              help="Also calibrate FP8 (e4m3) KV cache scales per layer (self_attn.k_scale / v_scale, kv_cache_scheme); "
              "gptq or awq only: the scales come from the calibration forwards.")
@click.option("--prefill-out", type=click.Path(file_okay=False),
              help="Also write an FP8 block variant here in the same pass over the source: prefill servers of a "
              "disaggregated deployment run it, decode servers run OUT.")
@click.option("--prefill-recipe", type=click.Path(dir_okay=False),
              help="Recipe of the --prefill-out variant [FP8 blocks on every Linear but lm_head].")
@VERBOSE_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def convert(src, out_dir, devices, group_size, as_json, **options):
    """Convert SRC to INT4 W4A16 (compressed-tensors pack-quantized) in OUT, or W4AFP8 (--scheme w4afp8: the
    same weights, FP8 activations on Hopper), FP8 blocks (--scheme fp8-block, compressed-tensors FP8_BLOCK), FP4
    (--scheme nvfp4a16 | nvfp4 | mxfp4a16), or INT4 and FP8 blocks at once (--prefill-out: FP8 for prefill servers).

    \b
    Methods: rtn streams tensor by tensor (no data, no model); with --calib it runs each layer once over the
    samples and chooses every group's scale by the error weighted by its inputs' E[x^2]. gptq and awq run the
    layerwise engine:
    calibration samples go through one decoder layer at a time; gptq quantizes each Linear against the
    Hessian of its real inputs (routed experts one at a time, with the tokens the router sends them); awq
    rescales input channels between each norm and the Linears it feeds, then rounds to nearest.

    \b
    Inputs: BF16/FP16 safetensors, DeepSeek-style FP8 blocks (Kimi K2, DeepSeek V3), compressed-tensors
    FP8 and INT4. Routers, norms, embeddings, lm_head and MTP layers stay float; FP8 weights the recipe
    leaves alone become BF16. Work happens in OUT.partial/ and becomes OUT/ only when complete and checked.

    \b
    Examples:
      quantize convert moonshotai/Kimi-K2-Instruct out/k2-int4 --recipe recipes/kimi-k2-w4a16.yaml --tp 8
      quantize convert ./Llama-3.1-8B out/llama-int4 --scheme w4a16 --group-size 128
      quantize convert ./SmolLM2 out/smol-gptq --scheme w4a16 --group-size 64 --method gptq --calib train.jsonl
      quantize convert ./SmolLM2 out/smol-rtn --scheme w4a16 --group-size 64 --calib train.jsonl --num-samples 32
      quantize convert zai-org/GLM-4.6 out/glm-int4 --recipe recipes/glm-w4a16.yaml --resume
      quantize convert zai-org/GLM-5 out/glm5-int4 --recipe recipes/glm-w4a16.yaml --prefill-out out/glm5-fp8
    """
    from quantize import convert as library

    o = library.Options(**options, group_size=int(group_size) if group_size else None,
                        devices=[d.strip() for d in devices.split(",")] if devices else [])
    code, result, said = 1, None, None
    try:
        with render.progress(as_json) as bar:
            result = library.convert(src, out_dir, o, render.events(bar))
        code = 0
    except QuantizeError as e:  # printed once the bars are gone: the error is the last line
        said = None if _refused(e) else f"[bold red]error:[/] {e}"  # an agreed refusal is rank 0's to say
        code = e.exit_code
    except KeyboardInterrupt:
        said, code = f"interrupted; finished shards are kept: rerun with --resume to continue {out_dir}", 130
    except Exception:
        if not _group_up():
            raise
        err.print_exception()
    if said:
        err.print(said, highlight=False, soft_wrap=True)
    if code:
        if _group_up():  # the group's destructor may wait on NCCL work a failed peer never completes
            from quantize.engine import distributed

            distributed.exit_now(code)
        sys.exit(code)
    if result is not None:  # None: a torchrun rank > 0, whose work rank 0 reports
        render.convert_report(result, as_json)


@main.command()
@click.argument("out_dir", metavar="OUT")
@click.option("--source", help="The source checkpoint (Hub id or folder), for --deep.")
@click.option("--deep", is_flag=True, help="Dequantize every packed weight and compare it with the source's.")
@click.option("--workers", default=lambda: min(8, cores()), show_default="CPU cores, at most 8",
              type=click.IntRange(1, 64), help="Files hashed at once.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def verify(out_dir, source, deep, workers, as_json):
    """Check that OUT is exactly what `convert` wrote, and well-formed.

    \b
    Recomputes every file's sha256 and every tensor's crc32 against quantize-manifest.json (one streamed
    pass per file, files in parallel), checks index vs shards vs manifest, that every packed module has its
    scale and shape sized as config.json's scheme says, and that no scale is NaN, Inf or zero. --deep
    --source SRC also dequantizes each packed weight against the source: RTN within half a scale step,
    GPTQ / AWQ within a relative error of 0.5.
    Exit codes: 0 clean, 1 findings (one line each: file, tensor, what is wrong), 2 bad request.

    \b
    Examples:
      quantize verify out/k2-int4
      quantize verify out/k2-int4 --deep --source moonshotai/Kimi-K2-Instruct --json
    """
    folder = Path(out_dir)
    if deep and not source:
        raise click.UsageError("--deep compares with the source: give --source SRC (the checkpoint OUT was made from)")
    if not folder.is_dir():
        fail(QuantizeError(f"{out_dir} is not a folder"))
    from quantize import verify as verifier

    try:
        src = hub.resolve(source)[0] if source else None
        with render.progress(transient=True) as bar:
            task = bar.add_task("hashing", total=None, bytes=True)
            report = verifier.verify(folder, source=src, deep=deep, workers=workers,
                                     progress=lambda done, total: bar.update(task, completed=done, total=total))
    except QuantizeError as e:
        fail(e)
    render.verify_report(report, deep, as_json)
    sys.exit(0 if report.clean else 1)


@main.command("plan")
@click.argument("src")
@click.option("--gpus", default=8, show_default=True, help="GPUs in the deployment (= --tp x --dp).")
@click.option("--tp", default=8, show_default=True, help="Tensor-parallel size of one replica.")
@click.option("--dp", default=1, show_default=True, help="Replicas (data parallel).")
@click.option("--gpu", type=click.Choice(sorted(GPU_CHOICES)), default="h200", show_default=True,
              help="GPU model, for its memory (nvidia-smi's total).")
@click.option("--gpu-mem-gib", type=float, help="Memory of one GPU in GiB, instead of --gpu.")
@click.option("--mem-fraction", type=float, default=0.9, show_default=True,
              help="Share of GPU memory for weights + KV cache (SGLang's --mem-fraction-static).")
@click.option("--overhead-gib", type=float, default=0.0, show_default=True,
              help="Per GPU, taken from the KV budget besides the weights (CUDA graphs, activations).")
@click.option("--kv-budget-gib", type=float, help="KV cache per GPU in GiB, instead of deriving it from memory.")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8", "both"]), default="both", show_default=True)
@click.option("--weights", default="as-is", show_default=True,
              help="'as-is' (the source's own format); a scheme (w4a16 at group 128, w4afp8, fp8-block, nvfp4a16, "
              "nvfp4, mxfp4a16) or a recipe YAML to compare its output against it; 'schemes': a row for every scheme.")
@click.option("--disaggregated", is_flag=True,
              help="Show the prefill/decode pair: prefill on FP8 blocks of every Linear but lm_head, decode on --weights.")
@click.option("--context-len", default=131072, show_default=True, help="Context per request, for max requests.")
@click.option("--mtp", is_flag=True, help="Serve with MTP speculative decoding: the MTP layers' KV counts too.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def plan_(src, gpus, tp, dp, gpu, gpu_mem_gib, mem_fraction, overhead_gib, kv_budget_gib, kv_dtype, weights,
          disaggregated, context_len, mtp, as_json):
    """How many KV tokens and concurrent requests fit when SRC is served, with BF16 vs FP8 KV cache and the
    source vs INT4 weights, side by side. SRC is a checkpoint folder (headers only are read), a converted
    OUT, a bare config.json (shapes come from transformers' model class on the meta device), or a Hub repo id
    (only its config.json is fetched).

    \b
    KV bytes per token follow SGLang's memory pools: MLA latent (kv_lora_rank + qk_rope_head_dim) per layer on
    every rank; DSA adds the indexer's FP8 key cache; GQA max(1, kv_heads / tp) x (head_dim + v_head_dim).
    Published figures for Kimi K2 and GLM-5 are recomputed, and any that do not follow are said so.

    \b
    Examples:
      quantize plan path/to/Kimi-K2-Instruct/config.json --kv-budget-gib 44.9
      quantize plan path/to/GLM-5-FP8 --weights recipes/glm-w4a16.yaml --gpu h200 --tp 8
      quantize plan path/to/GLM-5-FP8 --weights recipes/glm-w4a16.yaml --disaggregated
      quantize plan path/to/GLM-5-FP8 --weights schemes --gpu b200   # INT4, W4AFP8, FP8, NVFP4, MXFP4 side by side
    """
    from quantize import plan

    try:
        def preset(name: str):  # sizes only: W4A4 is calibrated, which does not change its bytes
            return recipes.preset(name, 128, method="gptq" if name == "nvfp4" else "rtn")
        if weights == "schemes" and not Path(weights).exists():
            if disaggregated:
                raise click.UsageError("--disaggregated takes one decode recipe or scheme, not --weights schemes")
            r = [preset(name) for name in recipes.SCHEMES]
        else:
            r = None if weights == "as-is" else (preset(weights) if weights in recipes.SCHEMES and
                                                  not Path(weights).exists() else recipes.load(Path(weights)))
        setup = plan.Setup(gpus=gpus, tp=tp, dp=dp, gpu_mem_gib=gpu_mem_gib or plan.GPUS[gpu],
                           mem_fraction=mem_fraction, overhead_gib=overhead_gib, kv_budget_gib=kv_budget_gib,
                           context_len=context_len, mtp=mtp)
        kinds = ["bf16", "fp8"] if kv_dtype == "both" else [kv_dtype]
        local = hub.check_local(src) if not Path(src).is_file() else Path(src)
        report = plan.capacity(local or hub.fetch_config(src), setup, kinds, r, disaggregated)
    except QuantizeError as e:
        fail(e)
    render.plan_table(report, setup, as_json, gpus=gpus, tp=tp, dp=dp, kv_budget_gib=kv_budget_gib,
                      mem_fraction=mem_fraction, context_len=context_len)


@main.command("eval")
@click.argument("candidate")
@click.option("--baseline", help="The original checkpoint (Hub id or folder); its results are cached.")
@click.option("--baseline-results", type=click.Path(exists=True, dir_okay=False),
              help="Baseline results JSON instead of --baseline (a previous `quantize eval --json`, or lm-eval's).")
@click.option("--tasks", default="gsm8k,mmlu,arc_challenge", show_default=True, help="Comma-separated.")
@click.option("--gate", "gate_path", type=click.Path(exists=True, dir_okay=False),
              help="Thresholds per task and metric [eval/gate.yaml: drop <= 1 point, recovery >= 0.95].")
@click.option("--backend", type=click.Choice(["hf", "vllm", "sglang"]), default="hf", show_default=True,
              help="lm-eval model backend; vllm and sglang need their extra installed.")
@click.option("--tp", type=click.IntRange(1, 64), default=1, show_default=True, help="Tensor parallel size (vllm, sglang).")
@click.option("--device", default="auto", show_default=True, help="hf backend: auto, cpu, cuda or cuda:N.")
@COMPUTE_DTYPE_OPTION
@click.option("--limit", type=click.IntRange(1), help="At most N samples per task (per MMLU subject): for smoke runs.")
@click.option("--num-fewshot", type=click.IntRange(0), help="Override each task's few-shot count (default: lm-eval's).")
@click.option("--batch-size", default="8", show_default=True, help="A number, or auto.")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False),
              help="Local copies of the data (layout of ../shared/data) instead of the Hub datasets.")
@click.option("--report", type=click.Path(dir_okay=False), help="Write the Markdown table here (for a model card).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write everything as JSON here (- for stdout).")
@click.option("--log-samples", type=click.Path(file_okay=False), help="Write each model's per-sample outputs here.")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Baseline results cache [~/.cache/quantize/eval].")
@click.option("--no-cache", is_flag=True, help="Evaluate the baseline even when its results are cached.")
@click.option("--trust-remote-code", is_flag=True, help="Let the models' own code run (off by default).")
@PPL_TEXT_OPTION
@INCONCLUSIVE_OPTION
@VERBOSE_OPTION
def eval_(candidate, baseline, baseline_results, tasks, gate_path, backend, tp, device, compute_dtype, limit, num_fewshot,
          batch_size, data_dir, report, json_path, log_samples, cache_dir, no_cache, trust_remote_code, ppl_text,
          allow_inconclusive, verbose):
    """Gate CANDIDATE on GSM8K, MMLU and ARC-Challenge (and held-out perplexity, --ppl-text) against its
    baseline with lm-eval.

    \b
    Every metric in the gate file is judged: accuracy may drop at most min(max_drop, (1 - min_recovery) x
    baseline) points, perplexity rise at most max_rise. First the sample must be able to decide: the noise is
    1.96 x the standard error of the paired per-item differences; when it is wider than the limit, the verdict
    is INCONCLUSIVE (with the items that would resolve it) unless the drop is beyond both. A task that errors,
    a missing metric, no samples or a NaN fails the gate.
    Exit codes: 0 pass, 1 a failure or INCONCLUSIVE (0 with --allow-inconclusive when nothing failed),
    2 the evaluation could not run (or a bad option).

    \b
    Examples:
      quantize eval out/k2-int4 --baseline moonshotai/Kimi-K2-Instruct --backend vllm --tp 8 --report card.md
      quantize eval out/smol-int4 --baseline ./SmolLM2 --data-dir ../shared/data --limit 20
      quantize eval out/next-int4 --baseline-results last-eval.json --gate eval/gate.yaml
    """
    from quantize import gate

    batch = batch_size if batch_size == "auto" or batch_size.startswith("auto:") else int(batch_size)
    try:
        run = gate.run_gate(
            candidate, baseline=baseline, baseline_results=baseline_results,
            tasks=[t.strip() for t in tasks.split(",") if t.strip()], gate_path=gate_path, backend=backend,
            device=resolve_device(device) if backend == "hf" else device, batch_size=batch, limit=limit,
            num_fewshot=num_fewshot, tp=tp, data_dir=Path(data_dir) if data_dir else None,
            log_samples=Path(log_samples) if log_samples else None, cache_dir=Path(cache_dir) if cache_dir else None,
            use_cache=not no_cache, trust_remote_code=trust_remote_code, compute_dtype=compute_dtype, verbose=verbose,
            ppl_text=Path(ppl_text) if ppl_text else None, allow_inconclusive=allow_inconclusive,
            status=lambda msg: err.print(msg, highlight=False))
    except QuantizeError as e:
        fail(e)
    if report:
        Path(report).write_text(gate.markdown(run.verdicts, run.meta["baseline"] or "(none)", candidate, {
            k: run.meta[k] for k in ("backend", "limit", "num_fewshot", "data", "lm_eval")}, allow_inconclusive))
    if json_path == "-":
        out.print_json(json.dumps(run.to_dict()))
    elif json_path:
        Path(json_path).write_text(json.dumps(run.to_dict(), indent=1))
    if json_path != "-":
        render.gate_table(run)
    if run.baseline is None:
        err.print("no --baseline: results only, nothing gated", highlight=False)
        return
    sys.exit(0 if run.passed else 1)


@main.command()
@click.argument("src")
@click.option("--recipe", "recipe_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Recipe YAML (see recipes/).")
@click.option("--repo-id", required=True, help="Hub repo to publish to: ORG/NAME (created if needed).")
@click.option("--gate", "gate_path", type=click.Path(exists=True, dir_okay=False),
              help="Thresholds per task and metric [eval/gate.yaml].")
@click.option("--tasks", default="gsm8k,mmlu,arc_challenge", show_default=True, help="Comma-separated.")
@click.option("--backend", type=click.Choice(["hf", "vllm", "sglang"]), default="hf", show_default=True,
              help="lm-eval backend for the gate (vllm on a GPU runner).")
@click.option("--eval-tp", type=click.IntRange(1, 64), default=1, show_default=True, help="TP size for vllm/sglang eval.")
@click.option("--device", default="auto", show_default=True, help="convert and the hf eval backend: auto, cpu, cuda[:N].")
@click.option("--calib", help="Calibration data for gptq/awq recipes, or for an rtn recipe's scale choice (else the "
              "recipe's calibration.data).")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False),
              help="Local copies of the eval data (layout of ../shared/data) instead of the Hub datasets.")
@click.option("--limit", type=click.IntRange(1), help="At most N samples per task: smoke releases only.")
@click.option("--gpus", default=8, show_default=True, help="Target deployment for the card's capacity table.")
@click.option("--gpu", type=click.Choice(sorted(GPU_CHOICES)), default="h200", show_default=True)
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--revision-tag", help="Tag the release commit (e.g. v1).")
@click.option("--dry-run", is_flag=True, help="Everything but the upload: print what would be committed.")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Output, card and report [release/ORG--NAME].")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=parse_size, help="Largest output shard.")
@PPL_TEXT_OPTION
@INCONCLUSIVE_OPTION
@VERBOSE_OPTION
def release(src, recipe_path, repo_id, gate_path, tasks, backend, eval_tp, device, calib, data_dir, limit, gpus,
            gpu, private, revision_tag, dry_run, work_dir, max_shard_size, ppl_text, allow_inconclusive, verbose):
    """Release SRC as a gated, documented Hub checkpoint: convert (resumable), verify, plan, eval gate against
    SRC, model card, upload. Only a release that passed every step is uploaded.

    \b
    WORK_DIR/model is the converted checkpoint (a re-run resumes it, or reuses it when it was made from the same
    source files, recipe and calibration; anything else is refused with the reason), WORK_DIR/card/README.md the
    model card, WORK_DIR/release-report.json and .md the report, written whatever the outcome (CI keeps them
    as artifacts). The token comes from HF_TOKEN or the HF cache and is never printed.
    Exit codes: 0 released (or a dry run that passed), 1 gate failed or INCONCLUSIVE (nothing uploaded), 2 error.

    \b
    Examples:
      quantize release moonshotai/Kimi-K2-Instruct --recipe recipes/kimi-k2-w4a16.yaml --repo-id me/Kimi-K2-W4A16 \\
          --backend vllm --eval-tp 8 --revision-tag v1
      quantize release fixtures/llama-bf16 --recipe recipes/dense-w4a16.yaml --repo-id me/tiny --dry-run \\
          --tasks arc_challenge --limit 2 --data-dir ../shared/data --device cpu
    """
    from quantize import plan
    from quantize import release as rel

    try:
        opts = rel.Options(
            src=src, recipe_path=Path(recipe_path), repo_id=repo_id,
            work_dir=rel.work_dir_for(work_dir, repo_id), gate_path=Path(gate_path) if gate_path else None,
            tasks=tuple(t.strip() for t in tasks.split(",") if t.strip()), backend=backend, eval_tp=eval_tp,
            device=resolve_device(device), calib=calib, data_dir=Path(data_dir) if data_dir else None, limit=limit,
            gpus=gpus, gpu_mem_gib=plan.GPUS[gpu], private=private, tag=revision_tag, dry_run=dry_run,
            max_shard_size=max_shard_size, verbose=verbose, ppl_text=Path(ppl_text) if ppl_text else None,
            allow_inconclusive=allow_inconclusive)
    except QuantizeError as e:
        fail(e)
    with render.progress(False) as bar:
        report, files = rel.run(opts, render.events(bar), status=lambda msg: err.print(msg, highlight=False),
                                on_gate=render.gate_table, on_convert=lambda result: render.convert_report(result, False))
    if report.error:
        err.print(f"[bold red]error:[/] {report.error}", highlight=False, soft_wrap=True)
    if report.exit_code == rel.EXIT_RELEASED and dry_run:
        render.dry_run_table(files, repo_id, report.step("upload").detail["commit_message"], revision_tag)
    elif report.exit_code == rel.EXIT_RELEASED:
        out.print(f"released {repo_id}: {report.commit['url']}", highlight=False)
    if report.saved:
        err.print(f"report: {opts.work_dir / rel.REPORT_MD}", highlight=False)
    sys.exit(report.exit_code)
