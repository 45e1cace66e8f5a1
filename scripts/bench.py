#!/usr/bin/env python
"""Speed and memory, side by side with the reference tool on the same input, in one run.

    python scripts/bench.py rtn [--size-gb 2.2] [--dims small|kimi] [--scheme S] [--device cpu|cuda] [--workers N]
                                [--repeat N] [--work DIR] [--json FILE]
    python scripts/bench.py gptq|awq [--num-samples 128|32] [--seq-len 512] [--repeat N] [--work DIR] [--json FILE]
    python scripts/bench.py depth [--work DIR] [--json FILE]
    python scripts/bench.py scale [--layers 12 --hidden 2048 --inter 5632] [--work DIR] [--json FILE]
    python scripts/bench.py moe-layer [--experts 384 --hidden 7168 --moe-inter 2048] [--device cuda] [--json FILE]
    python scripts/bench.py moe-ranks [--experts 128 --hidden 512 --moe-inter 512] [--old REV] [--json FILE]
    python scripts/bench.py awq-moe [--moe-layers 8] [--ranks 2,3] [--old REV] [--hidden 2048 --moe-inter 1280] [--json FILE]
    python scripts/bench.py gptq --dither 0.25 --seeds 0,1,2,3 --scales minmax,hessian --rtn-samples 32
    python scripts/bench.py gptq --dither 0.25 --seeds 0,1,2,3 --scales hessian --autoround 50,200 --resume
    python scripts/bench.py experts [--tokens 64,192,576,2304] [--dampings 0.01,0.03,0.1,0.3] [--json FILE]
    python scripts/bench.py search-cost [--stack 2 --hidden 7168 --moe-inter 2048] [--device cpu|cuda] [--json FILE]

`awq-moe`: AWQ and GPTQ of a synthetic DeepSeek-V3-architecture checkpoint (128 experts a layer, top-8, the
Kimi recipe): wall time and peak RSS of each on one rank, AWQ pinned to one core (`taskset`) and on 2 and 3 gloo
ranks, every AWQ output's bytes against the one-rank one, and with `--old` the AWQ of that revision beside. A
larger --hidden / --moe-inter (2048 x 1280: 1.88 GiB of bf16 experts a layer) measures peak RSS against one
layer's experts.

`gptq` / `awq`: SmolLM2-135M-Instruct (rebuilt by ../shared/scripts/build_smollm2.py; `--model gemma3`: Gemma 3
270M, a second family, rebuilt by scripts/build_gemma3.py) quantized W4A16 group 64
symmetric by our RTN, our layerwise GPTQ (or AWQ) and llm-compressor's `oneshot` + GPTQModifier (or AWQModifier +
QuantizationModifier) from the same calibration token windows of pydoc_data.topics (not shuffled); perplexity of
each on /usr/share/common-licenses/GPL-3 (neither calibration nor evaluation data), wall time and peak RSS of ours
and of oneshot in their own processes. Every finished run is kept in WORK's ledger.json as it ends (with the load
average before and after it, and the machine); `--resume` takes a run from there instead of running it again
where the command, the machine and, for ours, the quantize sources are the same and its output is still there:
four draws of every tool with auto-round's default (`--autoround 50,200`: about 50 minutes a draw on 2 cores)
take longer than a session, and finish in parts (Ledger).

`scale`: our GPTQ and oneshot + GPTQModifier on a synthetic ~0.6B-parameter Llama (random bf16 weights), the same
token ids, group 128: wall time and peak RSS where the model rather than the imports sets the reference's memory.

`depth`: peak RSS of our GPTQ on synthetic Llama models of 4 and 16 layers (memory must not grow with depth).

`moe-ranks`: GPTQ of a synthetic DeepSeek-V3-architecture checkpoint whose bytes are mostly routed experts
(128 experts a layer, top-8, two MoE layers; the Kimi recipe, so only the routed experts are calibrated) with 1
rank and with 2 gloo ranks (`--devices cpu,cpu`), and the same with the code of `--old` (a git revision, checked
out beside in a worktree): wall time, peak RSS, the bytes of every output compared, and per MoE layer the
routed-expert phase (old: its expert loop and the experts' forwards, timed by a wrapper; new: the `experts`
and `routed_output_and_exchange` phases it reports).

`rtn`: a synthetic Kimi-K2-style checkpoint in DeepSeek FP8 blocks (MLA attention, a dense first layer, routed
and shared experts, router with float32 bias; random FP8 bytes, 4 shards) converted with the Kimi release
recipe (routed experts INT4 g32) by `quantize convert` and by llm-compressor's `model_free_ptq` with the same
scheme, targets and ignore list and compressed-tensors' FP8BlockDequantizer. Each tool runs in its own process;
wall time and peak RSS (getrusage of that process) are reported with ratios, and the quantized tensors of
the two outputs are compared byte for byte. Needs the `bench` extra (llmcompressor).
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Dims:
    """Shapes of a synthetic DeepSeek/Kimi-style checkpoint; Kimi K2 itself is hidden 7168, moe_inter 2048,
    64 heads, 384 experts."""

    hidden: int = 2048
    moe_inter: int = 1024
    inter: int = 4096
    vocab: int = 32000
    heads: int = 16
    experts: int = 64
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def random_fp8(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 bytes (NaN codes avoided) with a plausible block scale."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    raw = torch.where((raw & 0x7F) == 0x7F, raw & 0xF0, raw)
    scale = torch.rand(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128), generator=g) * 1e-4 + 1e-5
    return raw.view(torch.float8_e4m3fn), scale


def synthetic_kimi(out: Path, size_gb: float | None = None, n_shards: int = 4, dims: Dims = Dims(),
                   n_layers: int | None = None, part_bytes: int | None = None) -> Path:
    """Write the checkpoint shard by shard: a dense first layer, then MoE layers (as many as make `size_gb`, or
    `n_layers` in all). With `part_bytes`, a shard is cut into files of about that size, so that not even one
    layer is whole in memory (a real Kimi K2 MoE layer is 17 GB of FP8)."""
    H, E = dims.hidden, dims.experts
    if n_layers is None:
        n_layers = max(1, round(size_gb * 1e9 / (E * 3 * dims.moe_inter * H))) + 1
    g = torch.Generator().manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)

    def layer_tensors(i: int):
        p = f"model.layers.{i}."

        def fp8(name, shape):
            w, scale = random_fp8(shape, g)
            return [(p + name + ".weight", w), (p + name + ".weight_scale_inv", scale)]

        yield from fp8("self_attn.q_a_proj", (1536, H))
        yield from fp8("self_attn.q_b_proj", (dims.heads * 192, 1536))
        yield from fp8("self_attn.kv_a_proj_with_mqa", (512 + 64, H))
        yield from fp8("self_attn.kv_b_proj", (dims.heads * 256, 512))
        yield from fp8("self_attn.o_proj", (H, dims.heads * 128))
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"):
            size = {"self_attn.q_a_layernorm": 1536, "self_attn.kv_a_layernorm": 512}.get(n, H)
            yield p + n + ".weight", torch.ones(size, dtype=torch.bfloat16)
        if i == 0:
            for n, shape in (("gate_proj", (dims.inter, H)), ("up_proj", (dims.inter, H)), ("down_proj", (H, dims.inter))):
                yield from fp8(f"mlp.{n}", shape)
            return
        yield p + "mlp.gate.weight", (torch.randn(E, H, generator=g) * 0.02).to(torch.bfloat16)
        yield p + "mlp.gate.e_score_correction_bias", torch.zeros(E)
        for kind in [f"experts.{e}" for e in range(E)] + ["shared_experts"]:
            yield from fp8(f"mlp.{kind}.gate_proj", (dims.moe_inter, H))
            yield from fp8(f"mlp.{kind}.up_proj", (dims.moe_inter, H))
            yield from fp8(f"mlp.{kind}.down_proj", (H, dims.moe_inter))

    n_shards = min(n_shards, n_layers)
    groups = [list(range(n_layers))[i::n_shards] for i in range(n_shards)]
    weight_map, total, parts = {}, 0, 0

    def save(tensors: dict, s: int) -> None:
        nonlocal total, parts
        parts += 1
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors" if part_bytes is None else f"model-{parts:05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    for s, layers in enumerate(groups):
        tensors: dict[str, torch.Tensor] = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = (torch.randn(dims.vocab, H, generator=g) * 0.02).to(torch.bfloat16)
        if s == n_shards - 1:
            tensors["lm_head.weight"] = (torch.randn(dims.vocab, H, generator=g) * 0.02).to(torch.bfloat16)
            tensors["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        held = 0
        for i in layers:
            for name, t in layer_tensors(i):
                tensors[name] = t
                held += t.numel() * t.element_size()
                if part_bytes is not None and held >= part_bytes:
                    save(tensors, s)
                    tensors, held = {}, 0
        if tensors:
            save(tensors, s)
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "torch_dtype": "bfloat16",
        "vocab_size": dims.vocab, "hidden_size": H, "intermediate_size": dims.inter, "moe_intermediate_size": dims.moe_inter,
        "num_hidden_layers": n_layers, "first_k_dense_replace": 1, "n_routed_experts": E, "n_shared_experts": 1,
        "num_experts_per_tok": min(8, E), "num_attention_heads": dims.heads, "num_key_value_heads": dims.heads,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


REFERENCE = r"""
import sys, torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from llmcompressor.entrypoints.model_free import model_free_ptq
src, out, device, ignore, which = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(","), sys.argv[5]
scheme = QuantizationScheme(targets=[r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
    weights=QuantizationArgs(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int"))
if which in ("fp8-block", "nvfp4a16", "mxfp4a16", "w4afp8"):
    scheme = which.replace("-", "_").upper()
dequant = FP8BlockDequantizer(targets=[r"re:.*_proj$", r"re:.*kv_a_proj_with_mqa$"], dtype=torch.bfloat16)
model_free_ptq(src, out, scheme=scheme, ignore=ignore, max_workers=1, device=device, converter=dequant)
"""

MEASURE = r"""
import resource, subprocess, sys, time
keep = sys.argv[1]  # where the command's stdout goes ("-": nowhere)
t = time.perf_counter()
with open(keep if keep != "-" else "/dev/null", "w") as out:
    rc = subprocess.run(sys.argv[2:], stdout=out, stderr=subprocess.PIPE, text=True)
dt = time.perf_counter() - t
if rc.returncode:
    sys.stderr.write(rc.stderr[-3000:])
print(rc.returncode, dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def fresh(out: Path) -> None:
    """Remove an output and the OUT.partial an interrupted bench left, which convert would refuse to overwrite."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(Path(str(out) + ".partial"), ignore_errors=True)


def measure(cmd: list[str], report: Path | None = None) -> dict:
    """Wall time and peak RSS of `cmd` in a process of its own; with `report`, its stdout (a --json report)
    is kept there and its `phases` (thread-seconds per phase, quantize/phases.py) returned too."""
    p = subprocess.run([sys.executable, "-c", MEASURE, str(report) if report else "-", *cmd], capture_output=True,
                       text=True)
    rc, seconds, rss = p.stdout.split()
    if int(rc):
        raise SystemExit(f"{cmd[:4]} failed:\n{p.stderr}")
    out = {"seconds": float(seconds), "peak_rss": int(rss)}
    if report is not None:
        got = json.loads(report.read_text())
        out |= {"conversion_seconds": got.get("seconds"), "phases": got.get("phases", {}),
                "phases_cpu": got.get("phases_cpu", {})}
    return out


def machine() -> dict:
    """What a run's time and bytes depend on besides its command and code: the CPU (bf16 rounds otherwise, and runs
    at another speed, on another vector unit), the cores this process may use (a container's cpuset, not the
    host's count), and the library versions the tools run on."""
    from importlib.metadata import PackageNotFoundError, version

    from quantize.compute import cpu_capability
    from quantize.machine import cores

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if Path("/proc/cpuinfo").exists() else ""
    libs = {}
    for lib in ("torch", "transformers", "compressed-tensors", "llmcompressor"):
        try:
            libs[lib] = version(lib)
        except PackageNotFoundError:
            libs[lib] = None
    return {"cpu": cpu, "cpu_capability": cpu_capability(), "cores": cores(), **libs}


def package_digest() -> str:
    """sha256 of the quantize package's code: a run of ours is only as good as the code that made it. Its syntax
    trees without docstrings (comments are not in them), so that a measurement written into a docstring does not
    make every run of ours stale."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for f in sorted((root / "quantize").rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return h.hexdigest()


class Ledger:
    """The runs a bench has finished, kept in WORK/ledger.json as each ends, so that one comparison can outlast a
    session: `--resume` takes a run from it instead of running it again where the command, the machine (machine())
    and, for a run of ours, the quantize package's sources (package_digest()) are the ones recorded and its output
    is still whole on disk. auto-round's default takes about 50 minutes a draw on 2 cores, and four draws of every
    tool side by side are 5 hours: longer than a session.

    Each record keeps the system's load average when the run began and ended (a run not alone shows it) and when it
    was recorded; a perplexity, once measured, is kept beside its run. A run that was cut off has no record and runs
    again, from a fresh folder."""

    def __init__(self, path: Path, resume: bool):
        self.path, self.resume = path, resume
        self.records = json.loads(path.read_text()) if path.exists() else {}
        self.reused: list[str] = []

    @staticmethod
    def key(cmd: list[str]) -> str:
        ours = cmd[1:3] == ["-m", "quantize"]  # its results change with our code
        blob = json.dumps({"cmd": cmd, "machine": machine(), "code": package_digest() if ours else None})
        return hashlib.sha256(blob.encode()).hexdigest()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records, indent=1))
        tmp.replace(self.path)

    def run(self, name: str, cmd: list[str], out: Path) -> dict:
        """`cmd` measured (measure()), which writes `out`, or with --resume its record where it still holds."""
        key, rec = self.key(cmd), self.records.get(name)
        if self.resume and rec and rec["key"] == key and out.is_dir() and any(out.rglob("config.json")):
            self.reused.append(name)
            return rec["run"]
        fresh(out)
        load = os.getloadavg()[0]
        run = measure(cmd) | {"load_before": load, "load_after": os.getloadavg()[0]}
        self.records[name] = {"key": key, "run": run, "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "machine": machine()}
        self._save()
        return run

    def perplexity(self, name: str, folder: Path, measure_it) -> float:
        """The perplexity of `name`'s output, measured once after its run."""
        rec = self.records.get(name)
        if rec is not None and "perplexity" in rec:
            return rec["perplexity"]
        value = measure_it()
        if rec is not None:
            rec["perplexity"] = value
            self._save()
        return value


def best_of(runs: list[dict]) -> dict:
    """The fastest run's time (the least disturbed by other work on a shared machine) and the highest peak RSS,
    with every run kept."""
    return {"seconds": min(r["seconds"] for r in runs), "peak_rss": max(r["peak_rss"] for r in runs), "runs": runs}


def compare_outputs(ours: Path, theirs: Path) -> dict:
    """Byte-compare every tensor both outputs hold (read one at a time)."""
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if not index.exists():  # one unsharded file
            with safe_open(folder / "model.safetensors", "pt") as f:
                return dict.fromkeys(f.keys(), folder / "model.safetensors")
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}

    a, b = where(ours), where(theirs)
    common = sorted(set(a) & set(b))
    differ = []
    for name in common:
        with safe_open(a[name], "pt") as fa, safe_open(b[name], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.dtype == y.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)  # compare the bytes (fp8 has no CPU equality)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            differ.append(name)
    packed = [n for n in common if n.endswith(("weight_packed", "weight_scale"))]
    return {"tensors_compared": len(common), "packed_compared": len(packed), "differ": len(differ),
            "differ_examples": differ[:5], "only_ours": len(set(a) - set(b)), "only_reference": len(set(b) - set(a))}


# --dims kimi: Kimi K2's own expert and attention shapes (hidden 7168, experts 2048 wide, 64 heads), with 16
# experts a layer so that a few layers make a couple of GB: the weights a real conversion spends its time on
KIMI_DIMS = Dims(hidden=7168, moe_inter=2048, inter=18432, vocab=32000, heads=64, experts=16)


def bench_rtn(args) -> dict:
    work = Path(args.work)
    src = work / ("kimi-fp8" if args.dims == "small" else "kimi-fp8-kimi-dims")
    if not (src / "config.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        synthetic_kimi(src, args.size_gb, dims=Dims() if args.dims == "small" else KIMI_DIMS)
        print(f"built {src} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    shards = sorted(src.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in shards)
    largest = max(p.stat().st_size for p in shards)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "kimi-k2-w4a16.yaml"
    ours_out, ref_out = work / "out-quantize", work / "out-model-free-ptq"
    for d in (ours_out, ref_out):
        fresh(d)
    if args.scheme != "w4a16":
        # every Linear but lm_head; model_free_ptq takes every 2-D weight, so routers and embeddings are named for it
        what, ignore = ["--scheme", args.scheme], ["lm_head", r"re:.*mlp\.gate$", r"re:.*embed_tokens$"]
    else:
        what, ignore = ["--recipe", str(recipe)], KIMI_IGNORE
    runs = []
    for _ in range(args.repeat):  # the fastest counts (the least disturbed on a shared machine); RSS the highest
        fresh(ours_out)
        runs.append(measure([sys.executable, "-m", "quantize", "convert", str(src), str(ours_out), *what, "--device",
                             args.device, "--workers", str(args.workers), "--json"], work / "quantize-report.json"))
    ours = min(runs, key=lambda r: r["seconds"]) | {"peak_rss": max(r["peak_rss"] for r in runs)}
    if args.repeat > 1:
        ours["runs"] = [{k: r[k] for k in ("seconds", "peak_rss", "conversion_seconds")} for r in runs]
    ref = measure([sys.executable, "-c", REFERENCE, str(src), str(ref_out), args.device, ",".join(ignore), args.scheme])
    result = {
        "input": {"path": str(src), "bytes": src_bytes, "shards": len(shards), "largest_shard": largest,
                  "dims": dataclasses.asdict(Dims() if args.dims == "small" else KIMI_DIMS)},
        "device": args.device,
        "scheme": args.scheme,
        # gb_per_s: the process's wall (imports, plan, conversion, finish); conversion_gb_per_s: the conversion
        # the engine reports (stream.run: from the destination's checks to the final rename)
        "quantize": {**ours, "gb_per_s": src_bytes / 1e9 / ours["seconds"],
                     "conversion_gb_per_s": src_bytes / 1e9 / ours["conversion_seconds"],
                     "startup_seconds": ours["seconds"] - ours["conversion_seconds"]},
        "model_free_ptq": {**ref, "gb_per_s": src_bytes / 1e9 / ref["seconds"]},
        "speedup": ref["seconds"] / ours["seconds"],
        "rss_ratio_vs_reference": ours["peak_rss"] / ref["peak_rss"],
        "rss_over_largest_shard": ours["peak_rss"] / largest,
        "parity": compare_outputs(ours_out, ref_out),
    }
    if args.scheme == "w4afp8":
        result["w4afp8_codes"] = compare_unpacked_codes(ours_out, ref_out)
    return result


def compare_unpacked_codes(ours: Path, theirs: Path) -> dict:
    """Our pack-quantized INT4 codes against model_free_ptq's int-quantized ones (int8 `X.weight`), module by
    module, read one at a time."""
    from safetensors import safe_open

    from quantize.quant import pack

    def where(folder: Path) -> dict[str, Path]:
        return {k: folder / v for k, v in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].items()}

    a, b = where(ours), where(theirs)
    modules = [k.removesuffix(".weight_packed") for k in a if k.endswith(".weight_packed")]
    differ = []
    for m in modules:
        with safe_open(a[f"{m}.weight_packed"], "pt") as fa, safe_open(b[f"{m}.weight"], "pt") as fb:
            mine, ref = fa.get_tensor(f"{m}.weight_packed"), fb.get_tensor(f"{m}.weight")
        if ref.dtype != torch.int8 or not torch.equal(pack.unpack_int4(mine)[:, :ref.shape[1]], ref):
            differ.append(m)
    return {"modules_compared": len(modules), "differ": len(differ), "differ_examples": differ[:5]}


ONESHOT = r"""
import json, sys, torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
if not torch.cuda.is_available():
    # llm-compressor 0.14's AWQ pins its activation cache, which needs an accelerator; on CPU pinning is moot
    from llmcompressor.pipelines.cache import IntermediatesCache
    IntermediatesCache.pin_memory = lambda self, *a, **k: None
src, out, samples_file, group, method, preset, dtype = sys.argv[1:3] + [sys.argv[3], int(sys.argv[4])] + sys.argv[5:8]
ids = json.load(open(samples_file))
ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
if preset == "w4a16":
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, group_size=group,
                                                                              symmetric=True, strategy="group", type="int"))
else:  # the library's own preset, e.g. NVFP4A16
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset.upper()])
if method == "rtn":  # weights only, data-free: no calibration set
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"]),
            output_dir=out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    sys.exit(0)
if method == "gptq":
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], dampening_frac=0.01, block_size=128,
                          actorder="static")
else:
    recipe = [AWQModifier(duo_scaling=True, n_grid=20),
              QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ids), max_seq_length=max(map(len, ids)),
        shuffle_calibration_samples=False, output_dir=out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
"""

PPL_TEXT = Path("/usr/share/common-licenses/GPL-3")

# Intel's auto-round (SignRound), the reference of issue 39, as a user runs it: its defaults but the scheme and the
# calibration windows (ours, the same token ids), fake-quantized weights saved in the model's layout.
AUTOROUND_VERSION = "0.16.1"
AUTOROUND = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
import auto_round
from auto_round import AutoRound
src, out, samples_file, group, iters, dtype = sys.argv[1:3] + [sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]]
ids = [torch.tensor([x]) for x in json.load(open(samples_file))]
assert auto_round.__version__ == sys.argv[7], auto_round.__version__
data_type = sys.argv[8]  # int; nv_fp, mx_fp: its NVFP4 and MXFP4 weights, with 16-bit activations (A16)
model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
tok = AutoTokenizer.from_pretrained(src)
ar = AutoRound(model, tok, bits=4, group_size=group, sym=True, data_type=data_type, act_bits=16, dataset=ids,
               nsamples=len(ids), seqlen=ids[0].shape[1], iters=iters)
ar.quantize_and_save(out, format="fake")
"""


# auto-round's weight data type and group size of each of our schemes (its NVFP4 / MXFP4 presets' weights)
AUTOROUND_SCHEMES = {"w4a16": ("int", None), "nvfp4a16": ("nv_fp", 16), "mxfp4a16": ("mx_fp", 32)}


def autoround(work: Path, src: Path, out: Path, samples: Path, group_size: int, iters: int,
              scheme: str = "w4a16") -> list[str]:
    """The command of auto-round (AUTOROUND) in its own process. auto-round is a bench dependency, never a runtime
    one: installed here without its dependencies (llm-compressor's environment has them all; its own pin of
    auto-round is older) into a folder put first on the path of that process alone."""
    data_type, group_size = AUTOROUND_SCHEMES[scheme][0], AUTOROUND_SCHEMES[scheme][1] or group_size
    site = work.parent / f"auto-round-{AUTOROUND_VERSION}"
    if not (site / "auto_round").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        f"auto-round=={AUTOROUND_VERSION}"], check=True)
    return ["env", f"PYTHONPATH={site}", sys.executable, "-c", AUTOROUND, str(src), str(out), str(samples),
            str(group_size), str(iters), str(forward_dtype()).removeprefix("torch."), AUTOROUND_VERSION, data_type]


def saved_model(out: Path) -> Path:
    """The folder under `out` that holds the saved model (auto-round saves into a subfolder named for it)."""
    return out if (out / "config.json").exists() else next(p.parent for p in sorted(out.rglob("config.json")))


def forward_dtype() -> torch.dtype:
    """What the reference's forwards and every perplexity compute in: bf16, SmolLM2's own dtype, where the CPU
    computes it natively, else float32 (a bf16 GEMM is ~50x slower on AVX2; bf16 weights widen exactly, and ours
    computes its forwards the same way, quantize.compute). Every bench JSON records it."""
    from quantize import compute

    return compute.choose(torch.bfloat16, "cpu")


def oneshot(src: Path, out: Path, samples: Path, group_size: int, method: str, scheme: str) -> list[str]:
    """The command of llm-compressor's oneshot (ONESHOT) on SmolLM2-like `src`, in its own process."""
    # RTN is data-free (no forward): in the model's own dtype, so that its bytes compare with ours
    dtype = "bfloat16" if method == "rtn" else str(forward_dtype()).removeprefix("torch.")
    return [sys.executable, "-c", ONESHOT, str(src), str(out), str(samples), str(group_size), method, scheme, dtype]


def perplexity(folder: Path, text: str, window: int = 512) -> float:
    """Mean next-token perplexity over non-overlapping windows of a held-out text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=forward_dtype())
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    nll, n = 0.0, 0
    from quantize import compute

    with torch.no_grad(), compute.widened_linears():  # an FP4 checkpoint decompresses in bf16 (compute.py)
        for i in range(0, len(ids) - 1, window):
            chunk = ids[i : i + window + 1].unsqueeze(0)
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
            n += chunk.shape[1] - 1
    return math.exp(nll / n)


def calibration_text(work: Path, tokens: int = 0) -> Path:
    """Running English text that ships with Python: neither the perplexity text nor an evaluation set. With
    `tokens`, repeated until it holds about that many tokens of the fixture tokenizer (153k a copy): timings at
    512 x 2048 tokens need 1M."""
    import pydoc_data.topics

    text = "\n\n".join(v for _, v in sorted(pydoc_data.topics.topics.items()))
    copies = max(1, math.ceil(tokens * 1.1 / 153_000))
    path = work / (f"pydoc-topics-x{copies}.txt" if copies > 1 else "pydoc-topics.txt")
    path.write_text("\n\n".join([text] * copies))
    return path


# the real models a bench can rebuild from the registry: SmolLM2-135M (Llama) and Gemma 3 270M, a second family
BUILDERS = {"smollm2": Path(__file__).resolve().parents[2] / "shared/scripts/build_smollm2.py",
            "gemma3": Path(__file__).resolve().parent / "build_gemma3.py"}


def source_model(work: Path, model: str, dither: float) -> Path:
    """`model`'s bf16 build under `work` (dithered off its GGUF's 4-bit lattice by `dither`), built once."""
    src = work / (model if not dither else f"{model}-dither{dither}")
    if not (src / "model.safetensors").exists():
        subprocess.run([sys.executable, str(BUILDERS[model]), str(src), *(["--dither", str(dither)] if dither else [])],
                       check=True)
    return src


def rule_flags(rule: str | None) -> list[str]:
    """A scale rule of --scales as convert's flags: hessian, minmax, or either with its tuning steps (hessian+tune0:
    GPTQ alone; hessian is tuned by default)."""
    if not rule:
        return []
    scales, _, iters = rule.partition("+tune")
    return ["--scales", scales, *(["--tune-iters", iters] if iters else [])]


def bench_calibrated(args) -> dict:
    """Our layerwise GPTQ or AWQ vs llm-compressor's oneshot on SmolLM2, same token windows, plus our RTN.

    With several --seeds, each seed draws its own calibration windows and both tools quantize with that draw
    (paired). GPTQ's codes move with float summation order alone (one tool, one draw: a few % of perplexity), so
    one pair says little about a 1% difference; the mean over paired draws, and its spread, do."""
    import statistics

    from quantize import calib

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work, args.model, args.dither)
    if args.dither or args.model != "smollm2":  # other weights, other outputs: apart from the plain SmolLM2's
        work = work / f"{src.name}-runs"
        work.mkdir(exist_ok=True)
    data = calibration_text(work)
    seeds = [int(x) for x in args.seeds.split(",")]
    samples = {}
    for seed in seeds:
        samples[seed] = calib.load_samples(str(data), calib.load_tokenizer(src), args.num_samples, args.seq_len,
                                           seed=seed)
        (work / f"samples-{seed}.json").write_text(json.dumps([x[0].tolist() for x in samples[seed]]))
    m, fp4 = args.what, args.scheme != "w4a16"
    tag = lambda seed: "" if seed == 0 else f"-seed{seed}"  # noqa: E731 - seed 0 keeps the folder names it had
    outs = {"rtn": work / f"smol-{args.scheme}-rtn"} | ({"llmc-rtn": work / f"smol-{args.scheme}-llmc-rtn"} if fp4 else {})
    rules = args.scales.split(",") if m == "gptq" else [None]
    ar_iters = [int(x) for x in args.autoround.split(",") if x] if m == "gptq" else []
    ar_runs: dict[int, list] = {iters: [] for iters in ar_iters}
    name = lambda rule, seed: f"{m}{'' if rule in (None, rules[0]) else '-' + rule}{tag(seed)}"  # noqa: E731
    cal_rtn = m == "gptq" and args.rtn_samples > 0  # calibrated RTN on every draw too, against GPTQ's gap
    for seed in seeds:
        for rule in rules:
            outs[name(rule, seed)] = work / f"smol-{args.scheme}-{name(rule, seed)}"
        if cal_rtn:
            outs[f"rtn-calib{tag(seed)}"] = work / f"smol-{args.scheme}-rtn-calib{tag(seed)}"
        outs[f"llmc-{m}{tag(seed)}"] = work / f"smol-{args.scheme}-llmc-{m}{tag(seed)}"
        for iters in ar_iters:
            outs[f"autoround{iters}{tag(seed)}"] = work / f"smol-{args.scheme}-autoround{iters}{tag(seed)}"
    if args.resume and args.repeat > 1:
        raise SystemExit("--resume keeps one run of each tool a draw: leave out --repeat")
    ledger = Ledger(work / "ledger.json", args.resume)
    common = ["--scheme", args.scheme, "--json", *(() if fp4 else ("--group-size", str(args.group_size)))]
    rtn = ledger.run(outs["rtn"].name, [sys.executable, "-m", "quantize", "convert", str(src), str(outs["rtn"]), *common],
                     outs["rtn"])
    ref_rtn = None
    if fp4:  # FP4: the library's RTN too (A16: data-free)
        ref_rtn = ledger.run(outs["llmc-rtn"].name, oneshot(src, outs["llmc-rtn"], work / f"samples-{seeds[0]}.json",
                                                 args.group_size, "rtn", args.scheme), outs["llmc-rtn"])
    runs, ref_runs, cal_runs = {rule: [] for rule in rules}, [], []
    for seed in seeds:
        for _ in range(args.repeat):  # alternated, so that a slow spell of the machine weighs on every run alike
            ref = outs[f"llmc-{m}{tag(seed)}"]
            if cal_rtn:
                out = outs[f"rtn-calib{tag(seed)}"]
                cal_runs.append(ledger.run(out.name, [
                    sys.executable, "-m", "quantize", "convert", str(src), str(out), *common, "--calib", str(data),
                    "--num-samples", str(args.rtn_samples), "--seq-len", str(args.seq_len), "--seed", str(seed)], out))
            for rule in rules:
                ours = outs[name(rule, seed)]
                runs[rule].append(ledger.run(ours.name, [
                    sys.executable, "-m", "quantize", "convert", str(src), str(ours), *common, "--method", m, "--calib",
                    str(data), "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--seed",
                    str(seed), *rule_flags(rule)], ours))
            ref_runs.append(ledger.run(ref.name, oneshot(src, ref, work / f"samples-{seed}.json", args.group_size, m,
                                                         args.scheme), ref))
            for iters in ar_iters:
                out = outs[f"autoround{iters}{tag(seed)}"]
                ar_runs[iters].append(ledger.run(out.name, autoround(work, src, out, work / f"samples-{seed}.json",
                                                                     args.group_size, iters, args.scheme), out))
    ours, ref = best_of(runs[rules[0]]), best_of(ref_runs)
    text = PPL_TEXT.read_text()
    ppl = {"bf16": perplexity(src, text)} | {
        n: ledger.perplexity(d.name, d, lambda d=d: perplexity(saved_model(d), text)) for n, d in outs.items()}
    draws = [{"seed": seed, "ours": ppl[f"{m}{tag(seed)}"], "llmc": ppl[f"llmc-{m}{tag(seed)}"],
              "ratio": ppl[f"{m}{tag(seed)}"] / ppl[f"llmc-{m}{tag(seed)}"]} for seed in seeds]
    # per scale rule: the share of llm-compressor's gap to bf16 that it closes, draw by draw (paired)
    by_rule = {}
    for rule in rules:
        closed = [(ppl[f"llmc-{m}{tag(s)}"] - ppl[name(rule, s)]) / (ppl[f"llmc-{m}{tag(s)}"] - ppl["bf16"])
                  for s in seeds]
        by_rule[rule or m] = {
            "perplexity": [ppl[name(rule, s)] for s in seeds], "mean": statistics.mean(ppl[name(rule, s)] for s in seeds),
            "gap_closed_per_draw": closed, "gap_closed_mean": statistics.mean(closed),
            "gap_closed_stderr": (statistics.stdev(closed) / math.sqrt(len(closed))) if len(closed) > 1 else 0.0,
            "seconds_best": best_of(runs[rule])["seconds"], "seconds": [r["seconds"] for r in runs[rule]],
            "seconds_vs_first_rule": best_of(runs[rule])["seconds"] / best_of(runs[rules[0]])["seconds"]}
    spread = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    for iters in ar_iters:  # auto-round on the same draws: its gap closed, and each rule's paired difference to it
        mine = [ppl[f"autoround{iters}{tag(s)}"] for s in seeds]
        closed = [(ppl[f"llmc-{m}{tag(s)}"] - p) / (ppl[f"llmc-{m}{tag(s)}"] - ppl["bf16"])
                  for s, p in zip(seeds, mine, strict=True)]
        vs = {}
        for rule in rules:
            diff = [ppl[name(rule, s)] - p for s, p in zip(seeds, mine, strict=True)]
            vs[rule] = {"ppl_minus_autoround_per_draw": diff, "mean": statistics.mean(diff),
                        "stderr": spread(diff) / math.sqrt(len(diff)),
                        "seconds_ratio": best_of(runs[rule])["seconds"] / best_of(ar_runs[iters])["seconds"]}
        by_rule[f"autoround-iters{iters}"] = {
            "version": AUTOROUND_VERSION, "settings": {"bits": 4, "sym": True, "act_bits": 16, "iters": iters,
                                                       "data_type": AUTOROUND_SCHEMES[args.scheme][0],
                                                       "group_size": AUTOROUND_SCHEMES[args.scheme][1] or args.group_size,
                                                       "nsamples": args.num_samples, "seqlen": args.seq_len,
                                                       "format": "fake"},
            "perplexity": mine, "mean": statistics.mean(mine), "gap_closed_per_draw": closed,
            "gap_closed_mean": statistics.mean(closed), "gap_closed_stderr": spread(closed) / math.sqrt(len(closed)),
            "seconds_best": best_of(ar_runs[iters])["seconds"], "seconds": [r["seconds"] for r in ar_runs[iters]],
            "peak_rss": best_of(ar_runs[iters])["peak_rss"], "ours_vs_it": vs}
    if cal_rtn:  # the share of the gap from our plain RTN down to llm-compressor's GPTQ that calibrated RTN closes
        closed = [(ppl["rtn"] - ppl[f"rtn-calib{tag(s)}"]) / (ppl["rtn"] - ppl[f"llmc-{m}{tag(s)}"]) for s in seeds]
        by_rule["rtn-calib"] = {
            "num_samples": args.rtn_samples, "perplexity": [ppl[f"rtn-calib{tag(s)}"] for s in seeds],
            "mean": statistics.mean(ppl[f"rtn-calib{tag(s)}"] for s in seeds),
            "rtn_to_llmc_gptq_gap_closed_per_draw": closed, "rtn_to_llmc_gptq_gap_closed_mean": statistics.mean(closed),
            "rtn_to_llmc_gptq_gap_closed_stderr": spread(closed) / math.sqrt(len(closed)),
            "seconds_best": best_of(cal_runs)["seconds"], "seconds": [r["seconds"] for r in cal_runs],
            "seconds_vs_gptq": {rule: best_of(cal_runs)["seconds"] / best_of(runs[rule])["seconds"] for rule in rules}}
    mean_ours, mean_ref = statistics.mean(d["ours"] for d in draws), statistics.mean(d["llmc"] for d in draws)
    ratios = [d["ratio"] for d in draws]
    extra = {}
    if fp4:
        extra = {"llmc_rtn": ref_rtn, "ours_vs_llmc_rtn_ppl_ratio": ppl["rtn"] / ppl["llmc-rtn"],
                 "rtn_bytes_vs_llmc": compare_outputs(outs["rtn"], outs["llmc-rtn"])}
        extra |= {f"{m}{tag(s)}_bytes_vs_llmc": compare_outputs(outs[f"{m}{tag(s)}"], outs[f"llmc-{m}{tag(s)}"])
                  for s in seeds}
    return {
        "model": {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}[args.model], "method": m,
        "forward_dtype": str(forward_dtype()).removeprefix("torch."),  # the reference's and the perplexities'

        "scheme": args.scheme if fp4 else f"w4a16 g{args.group_size} symmetric",
        "calibration": {"data": "pydoc_data.topics (running text, windows)", "num_samples": args.num_samples,
                        "seq_len": args.seq_len, "tokens": sum(x.numel() for x in samples[seeds[0]]), "seeds": seeds},
        "perplexity_text": str(PPL_TEXT), "perplexity": ppl, "draws": draws,
        "mean_perplexity": {"ours": mean_ours, "llmc": mean_ref,
                            "ours_stdev": spread([d["ours"] for d in draws]),
                            "llmc_stdev": spread([d["llmc"] for d in draws])},
        # the paired ratios' mean and its standard error: what the draws say about the tools' difference
        "ours_vs_llmc_ppl_ratio": mean_ours / mean_ref,
        "paired_ratio_mean": statistics.mean(ratios),
        "paired_ratio_stderr": spread(ratios) / math.sqrt(len(ratios)),
        "ours_vs_rtn_ppl_ratio": mean_ours / ppl["rtn"],
        "quantize_rtn": rtn, f"quantize_{m}": ours, f"llmc_oneshot_{m}": ref, "by_scale_rule": by_rule,
        "dither": args.dither,
        "speedup_vs_oneshot": ref["seconds"] / ours["seconds"],
        # runs taken from an earlier invocation's ledger (--resume), each with when it was recorded and its load
        "from_ledger": {n: {"recorded": ledger.records[n]["recorded"], "load_before": ledger.records[n]["run"]["load_before"]}
                        for n in ledger.reused},
        "rss_ratio_vs_oneshot": ours["peak_rss"] / ref["peak_rss"], **extra,
    }


def bench_experts(args) -> dict:
    """What a thinly routed expert's GPTQ gains from damping and from Hessian-chosen scales, measured on real weights
    and activations: SmolLM2's MLP Linears stand for experts (gate and up of 576 inputs, down of 1536), their
    Hessians summed from `tokens` rows of their real inputs (drawn from the calibration windows), their output error
    ||X (W - Q)^T||^2 / ||X W^T||^2 on 8192 other rows of the same layer. Per token count: each dampening fraction,
    the `tokens` rule (gptq.damping), and the Hessian-chosen scales (blocks of H, or its diagonal)."""
    import statistics

    from transformers import AutoModelForCausalLM

    from quantize import calib
    from quantize.quant import gptq, rtn, scales

    work = Path(args.work)
    src = source_model(work, "smollm2", args.dither)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    samples = calib.load_samples(str(calibration_text(work)), calib.load_tokenizer(src), 48, 512, seed=0)
    layers = [int(x) for x in args.layers.split(",")]
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i in layers:
        mlp = model.model.layers[i].mlp
        for leaf in ("gate_proj", "down_proj"):
            hooks.append(getattr(mlp, leaf).register_forward_pre_hook(
                lambda mod, a, key=f"{i}.{leaf}": seen.setdefault(key, []).append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for ids in samples:
            model(ids)
    for h in hooks:
        h.remove()
    g = torch.Generator().manual_seed(0)
    counts = [int(x) for x in args.tokens.split(",")]
    damps = [float(x) for x in args.dampings.split(",")]
    table: dict[str, dict[str, list[float]]] = {}
    for key, xs in seen.items():
        X = torch.cat(xs)
        perm = torch.randperm(X.shape[0], generator=g)
        test = X[perm[:8192]]
        i, leaf = key.split(".")
        W = getattr(model.model.layers[int(i)].mlp, leaf).weight.detach().to(torch.bfloat16)
        ref = test @ W.float().t()

        def error(codes, scale, test=test, ref=ref) -> float:
            Q = rtn.dequantize_groups(codes, scale).float()
            return float(((test @ Q.t() - ref) ** 2).sum() / (ref**2).sum())

        for n in counts:
            for draw in range(args.draws):
                rows = X[perm[8192 + draw * n: 8192 + (draw + 1) * n]]
                H = rows.t() @ rows
                base, _ = rtn.group_qparams(W, args.group_size)
                row = table.setdefault(str(n), {})
                row.setdefault("rtn", []).append(error(rtn.quantize_groups(W, base), base))
                for d in damps:
                    row.setdefault(f"damp {d}", []).append(error(gptq.gptq_quantize(W, H.clone(), base, percdamp=d)[0], base))
                rule = gptq.damping(0.01, n, W.shape[1])
                row.setdefault("damp tokens rule", []).append(
                    error(gptq.gptq_quantize(W, H.clone(), base, percdamp=rule)[0], base))
                for weigh in ("blocks", "diagonal"):
                    Hw = H if weigh == "blocks" else torch.diag(H.diagonal())
                    s = scales.int4(W[None], base[None], scales.diagonal_blocks(Hw[None], args.group_size))[0]
                    row.setdefault(f"hessian scales ({weigh}), damp rule", []).append(
                        error(gptq.gptq_quantize(W, H.clone(), s, percdamp=rule)[0], s))
    return {"model": str(src), "layers": layers, "group_size": args.group_size, "draws": args.draws,
            "relative_output_error_mean": {n: {k: statistics.mean(v) for k, v in row.items()} for n, row in table.items()}}


def synthetic_llama(out: Path, layers: int, hidden: int = 1024, inter: int = 2816) -> Path:
    """A dense Llama of random weights, written layer by layer, one shard per layer, with the fixture tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_fixture

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    vocab = make_fixture.VOCAB
    weight_map = {}

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": rnd(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append({
            p + "self_attn.q_proj.weight": rnd(hidden, hidden), p + "self_attn.k_proj.weight": rnd(hidden // 4, hidden),
            p + "self_attn.v_proj.weight": rnd(hidden // 4, hidden), p + "self_attn.o_proj.weight": rnd(hidden, hidden),
            p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    shards.append({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": rnd(vocab, hidden)})
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    (out / "config.json").write_text(json.dumps(config))
    make_fixture.build_tokenizer(out)
    return out


def bench_depth(args) -> dict:
    work = Path(args.work)
    data = str(calibration_text(work))
    result = {}
    for layers in (4, 16):
        src = work / f"llama-{layers}"
        if not (src / "config.json").exists():
            synthetic_llama(src, layers)
        out = work / f"llama-{layers}-gptq"
        fresh(out)
        result[f"layers_{layers}"] = measure([sys.executable, "-m", "quantize", "convert", str(src), str(out),
                                              "--scheme", "w4a16", "--group-size", "128", "--method", "gptq", "--calib",
                                              data, "--num-samples", "32", "--seq-len", "256", "--json"])
        result[f"layers_{layers}"]["source_bytes"] = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    result["rss_ratio_16_vs_4"] = result["layers_16"]["peak_rss"] / result["layers_4"]["peak_rss"]
    return result


def bench_scale(args) -> dict:
    """Our GPTQ vs oneshot + GPTQModifier on a synthetic dense Llama big enough that the model, not the imports,
    sets the reference's memory: same token ids for both, group 128, wall time and peak RSS."""
    from quantize import calib

    work = Path(args.work)
    src = work / f"llama-{args.layers}x{args.hidden}"
    if not (src / "config.json").exists():
        synthetic_llama(src, args.layers, hidden=args.hidden, inter=args.inter)
    data = calibration_text(work)
    samples = calib.load_samples(str(data), calib.load_tokenizer(src), args.num_samples, args.seq_len, seed=0)
    samples_file = work / "scale-samples.json"
    samples_file.write_text(json.dumps([s[0].tolist() for s in samples]))
    outs = {name: work / f"scale-{name}" for name in ("gptq", "llmc-gptq")}
    for d in outs.values():
        fresh(d)
    ours = measure([sys.executable, "-m", "quantize", "convert", str(src), str(outs["gptq"]), "--scheme", "w4a16",
                    "--group-size", "128", "--method", "gptq", "--calib", str(data), "--num-samples",
                    str(args.num_samples), "--seq-len", str(args.seq_len), "--json"])
    ref = measure(oneshot(src, outs["llmc-gptq"], samples_file, 128, "gptq", "w4a16"))
    return {
        "model": f"synthetic Llama, {args.layers} layers, hidden {args.hidden}, intermediate {args.inter} (random bf16)",
        "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors")),
        "calibration": {"num_samples": args.num_samples, "seq_len": args.seq_len,
                        "tokens": sum(s.numel() for s in samples)},
        "quantize_gptq": ours, "llmc_oneshot_gptq": ref,
        "speedup_vs_oneshot": ref["seconds"] / ours["seconds"],
        "rss_ratio_vs_oneshot": ours["peak_rss"] / ref["peak_rss"],
    }


def bench_search_cost(args) -> dict:
    """What the Hessian-chosen scales add to GPTQ on a stack of Kimi K2-shaped routed experts (gate/up [2048, 7168]
    under one input Hessian, down [7168, 2048] under another), the way engine/experts.py solves a chunk: the
    search over the stack (full diagonal blocks, and the diagonal alone for thinly routed experts) against
    gptq_quantize_batched of the same stack. Both grow with the stack, so the ratio is a Kimi layer's (384
    experts in chunks) and the model's: the search's share of the expert work."""
    from torch.nn import functional as F

    from quantize import compute, recipe
    from quantize.quant import codec, gptq, scales

    torch.manual_seed(0)
    dev, E, s = torch.device(args.device), args.stack, recipe.preset("w4a16", args.group_size).scheme
    # Kimi K2 at the default calibration (512 x 2048 tokens, 8 of 384 experts a token): tokens per expert on average
    kimi_tokens = 512 * 2048 * 8 // 384
    out = {"device": args.device, "stack": E, "group_size": args.group_size, "cpu_threads": torch.get_num_threads(),
           "tokens_measured": args.tokens, "kimi_tokens_per_expert": kimi_tokens}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # an expert's own work besides the solve, per token (measured on `tokens` rows, scaled to Kimi's count): its
    # Hessians (engine/experts.py: gptq.add_batch of x and of act(gate x) * up x) and its forwards (that product
    # in the calibration pass, the routed output after it)
    # in the dtype the engine's forwards compute in (quantize.compute: float32 where bf16 is not native)
    cdt = compute.choose(torch.bfloat16, dev)
    out["compute_dtype"] = str(cdt).removeprefix("torch.")
    x = torch.randn(args.tokens, args.hidden, device=dev).to(cdt)
    gate, up = [(torch.randn(args.moe_inter, args.hidden, device=dev) * 0.02).to(cdt) for _ in range(2)]
    down = (torch.randn(args.hidden, args.moe_inter, device=dev) * 0.02).to(cdt)
    H_in = torch.zeros(args.hidden, args.hidden, device=dev)
    H_down = torch.zeros(args.moe_inter, args.moe_inter, device=dev)
    t = time.perf_counter()
    h = F.silu(F.linear(x, gate)) * F.linear(x, up)
    F.linear(h, down)
    sync()
    forward = time.perf_counter() - t
    t = time.perf_counter()
    gptq.add_batch(H_in, x)
    gptq.add_batch(H_down, h)
    sync()
    hessians = time.perf_counter() - t
    del x, h, H_in, H_down
    scale = kimi_tokens / args.tokens
    # the calibration pass's gate/up product and the routed output's whole forward: about 1.7 forwards an expert
    out["per_expert_at_kimi_tokens"] = {"hessians_s": hessians * scale, "forwards_s": 1.7 * forward * scale}
    for name, (rows, width) in {"gate_up": (2 * args.moe_inter, args.hidden), "down": (args.hidden, args.moe_inter)}.items():
        W = (torch.randn(E, rows, width, device=dev) * 0.02).to(torch.bfloat16)
        X = torch.randn(E, args.tokens, width, device=dev)
        H = torch.einsum("eni,enj->eij", X, X)
        del X
        t = time.perf_counter()
        blocks = torch.stack([scales.diagonal_blocks(gptq.mirror_upper(H[e].clone())[None], s.group_size)[0]
                              for e in range(E)])
        chosen = codec.searched(s, list(W), [None] * E, blocks)
        search = time.perf_counter() - t
        t = time.perf_counter()
        codec.searched(s, list(W), [None] * E, torch.diag_embed(H.diagonal(dim1=1, dim2=2).reshape(E, -1, s.group_size)))
        search_diag = time.perf_counter() - t
        step = torch.stack([c.step for c in chosen])
        t = time.perf_counter()
        gptq.gptq_quantize_batched(W, H.clone(), step, None, 4, 128, 0.01, actorder=True, consume=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        solve = time.perf_counter() - t
        out[name] = {"search_s": search, "search_diag_s": search_diag, "solve_s": solve,
                     "search_over_solve": search / solve, "search_diag_over_solve": search_diag / solve}
    total_search = (out["gate_up"]["search_s"] + out["down"]["search_s"]) / E  # per expert
    total_solve = (out["gate_up"]["solve_s"] + out["down"]["solve_s"]) / E
    rest = sum(out["per_expert_at_kimi_tokens"].values())
    out["solve_with_search_over_without"] = (total_search + total_solve) / total_solve
    # an expert's GPTQ at Kimi's token count: Hessians, forwards, solve; with the search on top
    out["expert_gptq_with_search_over_without"] = (rest + total_solve + total_search) / (rest + total_solve)
    out["kimi_layer_search_s_extrapolated"] = total_search * 384  # 384 routed experts a layer
    out["kimi_layer_expert_gptq_s_extrapolated"] = (rest + total_solve) * 384
    return out


def bench_moe_layer(args) -> dict:
    """GPTQ of one Kimi-shaped MoE layer on `--device` (the GPU check): seconds by phase, and Kimi K2's whole
    model extrapolated (one dense layer and 60 MoE layers of 384 experts) on 1 and on 8 devices."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_fixture

    work = Path(args.work).resolve()
    dims = Dims(hidden=args.hidden, moe_inter=args.moe_inter, inter=args.moe_inter, vocab=make_fixture.VOCAB,
                heads=args.heads, experts=args.experts)
    src = work / f"moe-layer-{args.experts}x{args.hidden}x{args.moe_inter}"
    t = time.perf_counter()
    if not (src / "config.json").exists():
        synthetic_kimi(src, dims=dims, n_layers=2, n_shards=2, part_bytes=2 << 30)
        make_fixture.build_tokenizer(src)
    calib = calibration_text(work, args.num_samples * args.seq_len).resolve()
    print(f"checkpoint and calibration text ready in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    out = work / "moe-layer-gptq"
    fresh(out)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "kimi-k2-w4a16.yaml"
    devices = args.devices or args.device
    cmd = [sys.executable, "-m", "quantize", "convert", str(src), str(out), "--recipe", str(recipe), "--method", "gptq",
           "--calib", str(calib), "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--device",
           devices.split(",")[0], "--min-expert-tokens", str(args.min_expert_tokens), "--json"]
    if "," in devices:
        cmd += ["--devices", devices]
    t = time.perf_counter()
    measured, report, _ = _convert_timed(cmd, Path(__file__).resolve().parents[1])
    cal = report["calibration"]
    per_layer, phases = cal["seconds_per_layer"], cal["seconds_per_phase"]
    experts_bf16 = args.experts * 3 * args.hidden * args.moe_inter * 2
    # the expert work (solves, routed outputs) scales with the expert count, the forwards and the dense solves do
    # not; on 8 devices the routed experts split 8 ways while the dense work stays on rank 0
    expert_part = sum(v for k, v in phases[1].items() if k in ("experts", "routed_output_and_exchange"))
    moe = per_layer[1] - expert_part + expert_part * 384 / args.experts
    moe_8 = per_layer[1] - expert_part + expert_part * 384 / args.experts / 8
    shutil.rmtree(out, ignore_errors=True)
    return {
        "device": devices, "dims": dataclasses.asdict(dims), "num_samples": args.num_samples,
        "seq_len": args.seq_len, "tokens": sum(cal["tokens_per_expert"].get("1", {}).values()) // 8
        if cal["tokens_per_expert"] else None,
        "seconds_total": time.perf_counter() - t, "peak_rss": measured["peak_rss"],
        "moe_layer_experts_bytes_bf16": experts_bf16, "peak_rss_over_layer_experts": measured["peak_rss"] / experts_bf16,
        "seconds_per_layer": per_layer, "seconds_per_phase": phases,
        "moe_layer_seconds": per_layer[1], "experts_calibrated": cal["experts_calibrated"],
        "fallbacks": len(cal["fallbacks"]),
        "memory": cal["memory"],  # the account the ranks agreed on, and the device's measured peak (CUDA)
        "kimi_k2_extrapolated_hours_1_device": (per_layer[0] + 60 * moe) / 3600,
        "kimi_k2_extrapolated_hours_8_devices": (per_layer[0] + 60 * moe_8) / 3600,
    }


OLD_PHASES = r"""
import sys, time
import quantize.engine.layerwise as L
spent = {"routed": 0.0}
def timed(f):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent["routed"] += time.perf_counter() - t
    return run
# what an old revision calls its routed-expert work: whichever of these it has
for owner, name in ((L.LayerwiseQuantizer, "_quantize_experts"), (getattr(L, "UnfusedExperts", None), "forward"),
                    (L.LayerwiseQuantizer, "_finish_experts")):
    if owner is not None and hasattr(owner, name) and not (name == "_finish_experts" and
                                                           hasattr(L.LayerwiseQuantizer, "_quantize_experts")):
        setattr(owner, name, timed(getattr(owner, name)))
layer = L.LayerwiseQuantizer._quantize_layer
def per_layer(self, i):
    spent["routed"] = 0.0
    layer(self, i)
    print(f"ROUTED {i} {spent['routed']:.3f}", file=sys.stderr)
L.LayerwiseQuantizer._quantize_layer = per_layer
from quantize.cli import main
sys.argv = ["quantize", *sys.argv[1:]]
main()
"""


def _old_tree(rev: str, work: Path) -> Path:
    tree = work / f"old-{rev}"
    if not (tree / "quantize").is_dir():
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(tree), rev], check=True, capture_output=True)
    return tree


def _convert_timed(cmd: list[str], tree: Path) -> tuple[dict, dict, str]:
    """(wall time and peak RSS, the --json report, stderr) of one convert in its own process, importing the
    `quantize` of `tree` (run from there: `python -c` puts the working directory first on the path)."""
    import os

    p = subprocess.run([sys.executable, "-c", MEASURE_OUT, *cmd], capture_output=True, text=True, cwd=tree,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])})
    if p.returncode:
        raise SystemExit(f"{cmd[:4]} failed:\n{p.stderr[-3000:]}")
    head, _, report = p.stdout.partition("\n")
    rc, seconds, rss = head.split()
    if int(rc):
        raise SystemExit(f"{cmd[:4]} failed:\n{p.stderr[-3000:]}")
    return {"seconds": float(seconds), "peak_rss": int(rss)}, json.loads(report), p.stderr


MEASURE_OUT = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
dt = time.perf_counter() - t
sys.stderr.write(rc.stderr)
print(rc.returncode, dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
print(rc.stdout)
"""


KIMI_LAYER_OUTPUT_BYTES = 9e9  # Kimi K2 in the release recipe: ~550 GB over 61 layers, ~93% of it routed experts


def _writers_summary(ranks: list[dict], layers: int) -> dict:
    """Each rank's writers (bytes, seconds busy writing and hashing, waiting for layers), their throughput, and
    what it means for a Kimi K2 layer on 8 GPUs: one writer for all of it against each rank writing its share."""
    per_rank = [{"rank": r["rank"], "bytes": sum(w["bytes"] for w in r["writers"]),
                 "busy_s": sum(w["busy"] for w in r["writers"]),
                 "waiting_for_layers_s": sum(w["waiting_for_layers"] for w in r["writers"]),
                 "compute_s": r["seconds"], "loop_waited_for_writers_s": r["waited_for_writers"]} for r in ranks]
    written = sum(r["bytes"] for r in per_rank)
    busy = sum(r["busy_s"] for r in per_rank)
    rate = written / max(busy, 1e-9)
    return {"per_rank": per_rank, "bytes_per_busy_second": rate, "layers": layers,
            "kimi_8_gpus_writer_seconds_per_layer": {"one_writer": KIMI_LAYER_OUTPUT_BYTES / rate,
                                                     "per_rank_writers": KIMI_LAYER_OUTPUT_BYTES / (8 * rate)}}


def _moe_fixture(args, name: str):
    """(work dir, dims, the synthetic DeepSeek-V3-architecture checkpoint of args' shape, built once, the Kimi
    recipe, the calibration text) of the MoE benches."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_fixture

    work = Path(args.work).resolve()
    dims = Dims(hidden=args.hidden, moe_inter=args.moe_inter, inter=2 * args.moe_inter, vocab=make_fixture.VOCAB,
                heads=args.heads, experts=args.experts)
    src = work / f"{name}-{args.experts}x{args.hidden}x{args.moe_inter}-{args.moe_layers}moe"
    if not (src / "config.json").exists():
        synthetic_kimi(src, dims=dims, n_layers=args.moe_layers + 1, n_shards=2)
        make_fixture.build_tokenizer(src)
    return work, dims, src, Path(__file__).resolve().parents[1] / "recipes" / "kimi-k2-w4a16.yaml", \
        calibration_text(work).resolve()


def bench_moe_ranks(args) -> dict:
    """1 rank vs 2 gloo ranks, new code vs --old, on a DeepSeek-V3-architecture MoE checkpoint."""
    work, dims, src, recipe, data = _moe_fixture(args, "moe-ranks")

    def cmd(out: Path, devices: str) -> list[str]:
        return ["convert", str(src), str(out), "--recipe", str(recipe), "--method", "gptq",
                "--calib", str(data), "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
                "--devices", devices, "--json"]

    runs, outs = {}, {}
    trees = {"new": Path(__file__).resolve().parents[1]}
    if args.old:
        trees["old"] = _old_tree(args.old, work)
    # 1 rank on every core, 1 rank on one core (`taskset`: a rank of the 2-rank run has one core each, as each
    # rank has one GPU), 2 ranks
    one_core = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if shutil.which("taskset") else None
    for code, tree in trees.items():
        for ranks, devices, pin in ((1, "cpu", None), (2, "cpu,cpu", None), *([(1, "cpu", one_core)] if one_core else [])):
            if code == "old" and (ranks == 2 and not args.old_ranks or pin):
                continue
            name = f"{code}_{ranks}" + ("_1_core" if pin else "")
            out = work / f"moe-ranks-{name.replace('_', '-')}"
            fresh(out)
            prog = [sys.executable, "-c", OLD_PHASES] if code == "old" else [sys.executable, "-m", "quantize"]
            measured, report, err = _convert_timed([*(pin or []), *prog, *cmd(out, devices)], tree)
            cal = report["calibration"]
            row = {**measured, "seconds_per_layer": cal["seconds_per_layer"]}
            if code == "old":
                row["routed_phase_per_layer"] = [float(x.split()[2]) for x in err.splitlines()
                                                 if x.startswith("ROUTED ")][1:]
            else:
                row["seconds_per_phase"] = cal["seconds_per_phase"]
                row["ranks"] = cal.get("ranks", [])
                row["routed_phase_per_layer"] = [p.get("experts", 0) + p.get("routed_output_and_exchange", 0)
                                                 for p in cal["seconds_per_phase"]][1:]
            runs[f"{code}_{ranks}_rank" + ("_1_core" if pin else "")] = row
            outs[name] = out
    result = {
        "checkpoint": {"dims": dataclasses.asdict(dims), "moe_layers": args.moe_layers,
                       "source_bytes": sum(p.stat().st_size for p in src.glob("*.safetensors"))},
        "calibration": {"num_samples": args.num_samples, "seq_len": args.seq_len},
        "runs": runs,
        "two_ranks_speedup": runs["new_1_rank"]["seconds"] / runs["new_2_rank"]["seconds"],
        "two_ranks_bytes": compare_outputs(outs["new_1"], outs["new_2"]),
    }
    result["writers"] = _writers_summary(runs["new_2_rank"]["ranks"], len(runs["new_2_rank"]["seconds_per_layer"]))
    if args.old and args.old_ranks:  # the old code: rank 0's one writer wrote and hashed every shard
        result["wall_one_writer_vs_per_rank_writers"] = runs["old_2_rank"]["seconds"] / runs["new_2_rank"]["seconds"]
    if "new_1_1_core" in outs:
        result["two_ranks_speedup_vs_one_core"] = runs["new_1_rank_1_core"]["seconds"] / runs["new_2_rank"]["seconds"]
        result["one_core_bytes"] = compare_outputs(outs["new_1"], outs["new_1_1_core"])
    if args.old:
        new, old = runs["new_1_rank"]["routed_phase_per_layer"], runs["old_1_rank"]["routed_phase_per_layer"]
        result["old_revision"] = args.old
        result["routed_phase_speedup_per_layer"] = [o / n for o, n in zip(old, new, strict=True)]
        result["one_rank_speedup_vs_old"] = runs["old_1_rank"]["seconds"] / runs["new_1_rank"]["seconds"]
        if args.old_ranks:
            result["old_two_ranks_speedup"] = runs["old_1_rank"]["seconds"] / runs["old_2_rank"]["seconds"]
    return result


def bench_awq_moe(args) -> dict:
    """AWQ against GPTQ on a DeepSeek-V3-architecture MoE (routed experts streamed, split by expert groups): time
    and peak RSS of GPTQ and AWQ on one rank, AWQ on one rank pinned to one core and on --ranks gloo ranks, the
    bytes of every AWQ run against the one-rank run, and --old's AWQ (experts built whole) beside."""
    work, dims, src, recipe, data = _moe_fixture(args, "awq-moe")
    one_core = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if shutil.which("taskset") else []
    if args.no_one_core:
        one_core = []
    runs, outs = {}, {}
    trees = {"new": Path(__file__).resolve().parents[1], **({"old": _old_tree(args.old, work)} if args.old else {})}
    plan = [("gptq", "new", "cpu", []), ("awq", "new", "cpu", []), *([("awq", "new", "cpu", one_core)] if one_core else []),
            *[("awq", "new", ",".join(["cpu"] * n), []) for n in args.ranks], *([("awq", "old", "cpu", [])] if args.old else [])]
    for method, code, devices, pin in plan:
        if args.skip_gptq and method == "gptq":
            continue
        name = f"{code}_{method}_{devices.count('cpu')}_rank" + ("_1_core" if pin else "")
        out = work / f"awq-moe-{name.replace('_', '-')}"
        fresh(out)
        cmd = ["convert", str(src), str(out), "--recipe", str(recipe), "--method", method, "--calib", str(data),
               "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--json"]
        cmd += ["--devices", devices] if "," in devices else ["--device", "cpu"]
        measured, report, _ = _convert_timed([*pin, sys.executable, "-m", "quantize", *cmd], trees[code])
        cal = report["calibration"]
        runs[name] = {**measured, "seconds_per_layer": cal["seconds_per_layer"],
                      "seconds_per_phase": cal["seconds_per_phase"]}
        outs[name] = out
    experts_bytes = args.experts * 3 * args.hidden * args.moe_inter * 2
    one = runs["new_awq_1_rank"]
    result = {
        "checkpoint": {"dims": dataclasses.asdict(dims), "moe_layers": args.moe_layers,
                       "moe_layer_experts_bytes_bf16": experts_bytes},
        "calibration": {"num_samples": args.num_samples, "seq_len": args.seq_len},
        "runs": runs,
        "awq_peak_rss_over_layer_experts": one["peak_rss"] / experts_bytes,
        "bytes_vs_one_rank": {n: compare_outputs(outs["new_awq_1_rank"], o) for n, o in outs.items()
                              if n.startswith("new_awq") and n != "new_awq_1_rank"},
    }
    if "new_gptq_1_rank" in runs:
        result["awq_over_gptq_time"] = one["seconds"] / runs["new_gptq_1_rank"]["seconds"]
        result["gptq_peak_rss_over_layer_experts"] = runs["new_gptq_1_rank"]["peak_rss"] / experts_bytes
    for n in args.ranks:
        r = runs[f"new_awq_{n}_rank"]
        result[f"awq_{n}_ranks_speedup_vs_one_rank"] = one["seconds"] / r["seconds"]
        if "new_awq_1_rank_1_core" in runs:
            result[f"awq_{n}_ranks_speedup_vs_one_rank_one_core"] = runs["new_awq_1_rank_1_core"]["seconds"] / r["seconds"]
    if args.old:
        result["old_revision"] = args.old
        result["old_awq_over_new_awq_time"] = runs["old_awq_1_rank"]["seconds"] / one["seconds"]
        result["old_awq_peak_rss_over_layer_experts"] = runs["old_awq_1_rank"]["peak_rss"] / experts_bytes
        result["bytes_new_vs_old"] = compare_outputs(outs["old_awq_1_rank"], outs["new_awq_1_rank"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rtn", help="streaming RTN convert vs llm-compressor model_free_ptq")
    r.add_argument("--size-gb", type=float, default=2.2)
    r.add_argument("--device", default="cpu")
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--scheme", choices=["w4a16", "w4afp8", "fp8-block", "nvfp4a16", "mxfp4a16"], default="w4a16",
                   help="w4a16: the Kimi recipe (routed experts INT4 g32); w4afp8, fp8-block, nvfp4a16, mxfp4a16: every "
                   "Linear but lm_head in that scheme (model_free_ptq writes W4AFP8's codes unpacked: compared code by "
                   "code)")
    r.add_argument("--dims", choices=["small", "kimi"], default="small", help="small: hidden 2048, experts 1024 wide, "
                   "64 a layer (the README's bench); kimi: Kimi K2's shapes (hidden 7168, experts 2048 wide), 16 a layer")
    r.add_argument("--repeat", type=int, default=1, help="runs of ours (the fastest counts); the reference runs once")
    r.add_argument("--work", default=".cache/bench")
    r.add_argument("--json", dest="json_out")
    for method, n in (("gptq", 128), ("awq", 32)):
        q = sub.add_parser(method, help=f"{method} on SmolLM2: perplexity, time, RSS vs llm-compressor oneshot")
        q.add_argument("--num-samples", type=int, default=n)
        q.add_argument("--seq-len", type=int, default=512)
        q.add_argument("--group-size", type=int, default=64)
        q.add_argument("--scheme", choices=["w4a16", *(["nvfp4a16", "mxfp4a16"] if method == "gptq" else [])],
                       default="w4a16", help="w4a16: INT4 at --group-size; nvfp4a16, mxfp4a16: compressed-tensors' "
                       "FP4 presets (their own group sizes), with llm-compressor's RTN of the same preset beside")
        q.add_argument("--repeat", type=int, default=1, help="runs of each tool, alternated; the fastest counts")
        q.add_argument("--dither", type=float, default=0.0, help="build the model with its builder's --dither F (its "
                       "weights off the GGUF's 4-bit lattice); 0: the plain build")
        q.add_argument("--model", choices=sorted(BUILDERS), default="smollm2", help="smollm2: SmolLM2-135M-Instruct "
                       "(Llama; ../shared/scripts/build_smollm2.py); gemma3: Gemma 3 270M, a second family "
                       "(scripts/build_gemma3.py)")
        if method == "gptq":
            q.add_argument("--autoround", default="", help="also auto-round at these iters on every draw, e.g. 200,50 "
                           "(its default and its light preset; under nvfp4a16 / mxfp4a16 its nv_fp / mx_fp weights, A16)")
            q.add_argument("--scales", default="minmax", help="our GPTQ's scale rules to run, e.g. minmax,hessian "
                           "(each on every draw; the first is the one compared byte for byte); +tuneN adds --tune-iters N, e.g. "
                           "hessian+tune0 (GPTQ alone: hessian is tuned by default, minmax is not)")
            q.add_argument("--rtn-samples", type=int, default=0, help="also our calibrated RTN (--method rtn --calib) "
                           "on every draw, with this many samples (0: not run)")
        q.add_argument("--seeds", default="0", help="calibration draws, e.g. 0,1,2,3: both tools quantize each "
                       "seed's windows; the perplexities are reported per draw and as paired means")
        q.add_argument("--resume", action="store_true", help="take each run from WORK's ledger where this machine "
                       "ran the same command (ours: on the same quantize sources) and its output is still there; "
                       "runs again what is missing (a comparison longer than a session, finished in parts)")
        q.add_argument("--work", default=".cache/bench")
        q.add_argument("--json", dest="json_out")
    def moe_parser(name, about, experts, hidden, inter, heads, num_samples, seq_len):
        """The shape of a synthetic DeepSeek-V3-architecture checkpoint and its calibration tokens."""
        x = sub.add_parser(name, help=about)
        for flag, default in (("--experts", experts), ("--hidden", hidden), ("--moe-inter", inter), ("--heads", heads),
                              ("--num-samples", num_samples), ("--seq-len", seq_len)):
            x.add_argument(flag, type=int, default=default)
        return x

    k = moe_parser("moe-layer", "GPTQ time for one Kimi-shaped MoE layer (run it on a GPU)", 384, 7168, 2048, 64, 512,
                   2048)
    k.add_argument("--min-expert-tokens", type=int, default=16)
    k.add_argument("--device", default="cuda")
    k.add_argument("--devices", help="several ranks, e.g. cuda:0,cuda:1 (default: --device alone)")
    k.add_argument("--work", default=".cache/bench")
    k.add_argument("--json", dest="json_out")
    m = moe_parser("moe-ranks", "GPTQ with 1 vs 2 gloo ranks, new code vs --old, on a routed-expert-heavy MoE", 128,
                   512, 512, 4, 32, 256)
    m.add_argument("--moe-layers", type=int, default=2)
    m.add_argument("--old", help="a git revision to run beside (e.g. the commit before a change)")
    m.add_argument("--old-ranks", action="store_true", help="also run --old with 2 ranks")
    m.add_argument("--work", default=".cache/bench")
    m.add_argument("--json", dest="json_out")
    w = moe_parser("awq-moe", "AWQ vs GPTQ on a MoE: time, RSS, ranks (streamed experts), bytes across ranks", 128,
                   512, 512, 4, 64, 256)
    w.add_argument("--moe-layers", type=int, default=8)
    w.add_argument("--ranks", type=lambda v: [int(x) for x in v.split(",") if x], default=[2, 3],
                   help="rank counts to run AWQ with, e.g. 2,3 ('' for none)")
    w.add_argument("--no-one-core", action="store_true", help="skip AWQ on one rank pinned to one core")
    w.add_argument("--old", help="a git revision whose AWQ to run beside (e.g. the commit before a change)")
    w.add_argument("--skip-gptq", action="store_true")
    w.add_argument("--work", default=".cache/bench")
    w.add_argument("--json", dest="json_out")
    s = sub.add_parser("scale", help="GPTQ time and RSS vs oneshot on a synthetic ~0.6B-parameter Llama")
    s.add_argument("--layers", type=int, default=12)
    s.add_argument("--hidden", type=int, default=2048)
    s.add_argument("--inter", type=int, default=5632)
    s.add_argument("--num-samples", type=int, default=32)
    s.add_argument("--seq-len", type=int, default=256)
    s.add_argument("--work", default=".cache/bench")
    s.add_argument("--json", dest="json_out")
    x = sub.add_parser("experts", help="damping and Hessian-chosen scales of thinly routed experts, on SmolLM2's MLPs")
    x.add_argument("--tokens", default="64,192,576,2304", help="rows behind each Hessian")
    x.add_argument("--dampings", default="0.01,0.03,0.1,0.3")
    x.add_argument("--layers", default="3,9,15,21,27")
    x.add_argument("--draws", type=int, default=3)
    x.add_argument("--group-size", type=int, default=64)
    x.add_argument("--dither", type=float, default=0.25)
    x.add_argument("--work", default=".cache/bench")
    x.add_argument("--json", dest="json_out")
    c = sub.add_parser("search-cost", help="Hessian-chosen scales vs the GPTQ solve on a stack of Kimi-shaped experts")
    for flag, default in (("--stack", 2), ("--hidden", 7168), ("--moe-inter", 2048), ("--tokens", 8192),
                          ("--group-size", 32)):
        c.add_argument(flag, type=int, default=default)
    c.add_argument("--device", default="cpu")
    c.add_argument("--json", dest="json_out")
    d = sub.add_parser("depth", help="GPTQ peak RSS at 4 vs 16 layers")
    d.add_argument("--work", default=".cache/bench")
    d.add_argument("--json", dest="json_out")
    a = p.parse_args()
    result = {"rtn": bench_rtn, "gptq": bench_calibrated, "awq": bench_calibrated, "depth": bench_depth,
              "experts": bench_experts, "search-cost": bench_search_cost,
              "scale": bench_scale, "moe-layer": bench_moe_layer,
              "moe-ranks": bench_moe_ranks, "awq-moe": bench_awq_moe}[a.what](a)
    # figures from one kind of CPU do not carry to another (bf16 GEMMs: ~50x slower on AVX2): say which ran them
    from quantize.compute import cpu_capability

    result = {"cpu_capability": cpu_capability(), **result}
    text = json.dumps(result, indent=2)
    print(text)
    if a.json_out:
        Path(a.json_out).write_text(text)


if __name__ == "__main__":
    main()
