"""Recipes: which Linear modules to quantize and how, as data (YAML in recipes/), validated once.

Scheme fields and `targets` / `ignore` follow compressed-tensors: a pattern is an exact module name or
`re:<regex>` matched from the start of the name; the target `Linear` means every Linear weight the
architecture declares. The same lists go into the output's quantization_config, so vLLM and SGLang see
exactly the split we made.
"""

import functools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from quantize import hf
from quantize.errors import UsageError

METHODS = ("rtn", "gptq", "awq")
SCALE_RULES = ("minmax", "hessian")
DAMPING_RULES = ("fixed", "tokens")
GROUP_SIZES = (32, 64, 128)
RECIPE_KEYS = {"name", "description", "method", "scheme", "targets", "ignore", "gptq", "awq", "calibration", "kv_cache"}
KV_CACHE = ("fp8",)
# GPTQ's default tuning steps under Hessian scales. Measured on the dithered SmolLM2 (W4A16 g64, seed 0, 2 cores):
# GPTQ alone 33.74 held-out perplexity in 353 s; then 20 steps towards the float model's path 30.79 in 519 s, 40
# steps 30.36 in 598 s, where auto-round 0.16.1's light preset (50 iterations) gives 31.07 in 837 s (README)
TUNE_ITERS = 40
# the samples each grid tunes on where a recipe does not say (tune_samples). NVFP4 takes 128 (all of the bench's
# 128 x 512 tokens): on the dithered SmolLM2 (NVFP4A16, draw 3; Intel Xeon with AMX, torch capability AVX512) 128 gave
# 30.00 against 32's 30.73 with the offset in e2m1's spacing, and 29.55 against 30.26 in units of 1
# (quant/signround.py), for 22% more time (714 s against 584, two converts side by side). INT4 takes 128 with the
# attention's inputs tuned (README, issue 39: four draws' mean 30.76 against 32 samples' 30.98 with them kept as
# solved); MXFP4 keeps 32 for its perplexity (128 measured 32.64 / 31.81 against 31.41 / 31.41 on draws 0 / 1; with
# the offset in units of 1, 32.71 against 32's 31.00 on draw 0)
TUNE_SAMPLES = {"int4": 128, "nvfp4": 128, "mxfp4": 32}


@dataclass(frozen=True)
class GPTQParams:
    dampening_frac: float = 0.01
    block_size: int = 128
    actorder: str | None = "static"  # static: columns by descending Hessian diagonal, groups unchanged
    # hessian: the clip of least error weighted by the group's block of H (quant/scales.py), then GPTQ unchanged
    # under it (measured: README, "Better than llm-compressor in the same bytes"); minmax: each group's scale
    # from its weights alone (llm-compressor's GPTQ, byte for byte)
    scales: str = "hessian"
    # tokens: more than dampening_frac for a Hessian built from fewer tokens than its width (a thinly routed
    # expert's, gptq.damping); fixed: dampening_frac of the mean diagonal for every Hessian (llm-compressor's)
    dampening: str = "tokens"
    # after GPTQ, each dense decoder layer's Linears tuned on the layer's output (engine/tune.py): tune_iters signed
    # steps (0: none), each over tune_batch of the tune_samples samples spread over the calibration set. Unset, it
    # is TUNE_ITERS under hessian scales and 0 under minmax, which stays llm-compressor's bytes (`iters`); unset,
    # tune_samples is the grid's TUNE_SAMPLES (`samples`)
    tune_iters: int | None = None
    tune_samples: int | None = None
    # samples held out of the tuning, spread over the set between the tuned ones: a layer keeps its tuning only if
    # its output error over these drops; 0: judged on the tuned samples themselves (engine/tune.py: measured, 32
    # helps Gemma 3 and costs SmolLM2)
    tune_holdout: int = 0
    tune_batch: int = 4
    # whether the attention's inputs (q/k/v; MLA's, an indexer's) are tuned too; unset, they are (engine/tune.py:
    # `tuned`). false keeps GPTQ's codes there and skips attention in the steps: faster, and on INT4 with 32
    # samples what the default was before issue 39 (four draws' mean 30.98 against 30.76)
    tune_attention: bool | None = None
    # each step's move of a rounding offset (times SignRound's decay from 2 to 0); unset, the grid's signround.LR
    # (INT4's 0.03 was measured over 128 tuned samples: over 32, 0.02 is the safer, quant/signround.py)
    tune_rate: float | None = None

    @property
    def iters(self) -> int:
        """The tuning steps this recipe runs: tune_iters where it is set, else the scale rule's default."""
        if self.tune_iters is not None:
            return self.tune_iters
        return TUNE_ITERS if self.scales == "hessian" else 0

    def samples(self, grid: str) -> int:
        """The samples tuned on for `grid` ("int4", "nvfp4", "mxfp4"): tune_samples where it is set, else the
        grid's default."""
        return self.tune_samples if self.tune_samples is not None else TUNE_SAMPLES[grid]


@dataclass(frozen=True)
class AWQParams:
    n_grid: int = 20
    # token positions the grid search evaluates, spread evenly over the samples. Measured on SmolLM2 (32 x 512
    # tokens): all 16384 give perplexity within 0.5% of llm-compressor's AWQ, a 4096 subsample 2.3% worse.
    # Each recorded input costs max_tokens x hidden x 2 bytes of host memory (0.9 GB at Kimi's 7168).
    max_tokens: int = 65536


@dataclass(frozen=True)
class Calibration:
    data: str | None = None
    num_samples: int = 512
    seq_len: int = 2048
    seed: int = 0
    calibrate_all_experts: bool = False
    min_expert_tokens: int = 16


@dataclass(frozen=True)
class Scheme:
    num_bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    strategy: str = "group"
    type: str = "int"
    block_structure: list[int] | None = None  # FP8_BLOCK: [128, 128]
    # "fp8": INT4 weights with FP8 (e4m3) per-token dynamic activations, compressed-tensors' W4AFP8: the same
    # weights as W4A16 g128, and FP8 tensor-core GEMMs on Hopper. "nvfp4": NVFP4 weights with NVFP4 activations
    # (compressed-tensors' NVFP4, W4A4: e4m3 scales per 16 computed at run time under a global scale per Linear
    # that calibration measures, `input_global_scale`), FP4 tensor-core GEMMs on Blackwell
    activations: str | None = None

    @property
    def w4afp8(self) -> bool:
        return self.activations == "fp8"

    @property
    def w4a4(self) -> bool:
        """NVFP4 weights and activations: each quantized Linear also stores input_global_scale."""
        return self.activations == "nvfp4"

    @property
    def fp8_block(self) -> bool:
        """compressed-tensors FP8_BLOCK (float-quantized): e4m3 weights, one scale per 128x128 block."""
        return self.type == "float" and self.num_bits == 8

    @property
    def fp4(self) -> str | None:
        """"nvfp4" (e2m1 weights, an e4m3 scale per 16 under a float32 global scale: compressed-tensors'
        NVFP4A16, nvfp4-pack-quantized) or "mxfp4" (an e8m0 scale per 32: MXFP4A16, mxfp4-pack-quantized)."""
        if self.type != "float" or self.num_bits != 4:
            return None
        return "nvfp4" if self.strategy == "tensor_group" else "mxfp4"

    @property
    def format(self) -> str:
        """The compressed-tensors format the weights are written in."""
        if self.fp8_block:
            return "float-quantized"
        return f"{self.fp4}-pack-quantized" if self.fp4 else "pack-quantized"

    @property
    def grid(self) -> str:
        """The 4-bit grid the tuning after GPTQ works on (quant/signround.py): "nvfp4", "mxfp4", else "int4"."""
        return self.fp4 or "int4"

    @property
    def label(self) -> str:
        if self.fp8_block:
            return "fp8 block {}x{}".format(*self.block_structure)
        if self.w4a4:
            return f"nvfp4 g{self.group_size} (w4a4)"
        if self.fp4:
            return f"{self.fp4}a16 g{self.group_size}"
        if self.w4afp8:
            return f"w4afp8 g{self.group_size}"
        return f"w{self.num_bits}a16 g{self.group_size} {'sym' if self.symmetric else 'asym'}"

    def args(self):
        """The scheme as compressed-tensors QuantizationArgs."""
        # imported here: compressed_tensors pulls in transformers (~3 s), which inspect and --help never need
        QuantizationArgs = hf.compressed_tensors().QuantizationArgs

        if self.fp8_block:
            return self.preset_fp8_block()["weights"]
        if self.fp4:
            return hf.compressed_tensors().quant_scheme.PRESET_SCHEMES[FP4_PRESETS[self.fp4]]["weights"]
        return QuantizationArgs(
            num_bits=self.num_bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            strategy=self.strategy,
            type=self.type,
        )

    @staticmethod
    def preset_fp8_block() -> dict:
        """compressed-tensors' own FP8_BLOCK preset: static 128x128 weight blocks and dynamic per-token-group
        activations, the pairing vLLM's and SGLang's block-FP8 kernels take."""
        return hf.compressed_tensors().quant_scheme.PRESET_SCHEMES["FP8_BLOCK"]


@dataclass(frozen=True)
class Recipe:
    name: str
    scheme: Scheme
    method: str = "rtn"
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    description: str = ""
    gptq: GPTQParams = GPTQParams()
    awq: AWQParams = AWQParams()
    calibration: Calibration = Calibration()
    kv_cache: str | None = None  # "fp8": calibrate per-layer FP8 KV cache scales (calibrated methods only)
    source: str = field(default="", compare=False)

    @property
    def calibrated(self) -> bool:
        """Whether the layers run calibration forwards: gptq and awq always; rtn with calibration data chooses
        each group's scale by the error weighted by its inputs' E[x^2] (one forward per layer, no Hessian)."""
        return self.method != "rtn" or self.calibration.data is not None

    def targets_module(self, module: str, is_linear: bool) -> bool:
        """Whether a module is quantized: a Linear that a target names and no ignore pattern matches."""
        if not is_linear or any_matches(self.ignore, module):
            return False
        return "Linear" in self.targets or any_matches(self.targets, module)

    def quantization_config(self, extra_ignore: tuple[str, ...] = ()) -> dict:
        """The compressed-tensors `quantization_config` for config.json, built by the library itself."""
        from quantize import kvcache

        ct = hf.compressed_tensors()
        QuantizationConfig, QuantizationScheme = ct.QuantizationConfig, ct.QuantizationScheme

        fmt = self.scheme.format
        if self.scheme.fp8_block:
            group = QuantizationScheme(targets=list(self.targets), format=fmt, **self.scheme.preset_fp8_block())
        elif self.scheme.w4afp8 or self.scheme.w4a4:
            preset = "W4AFP8" if self.scheme.w4afp8 else "NVFP4"
            group = QuantizationScheme(targets=list(self.targets), weights=self.scheme.args(), format=fmt,
                                       input_activations=ct.quant_scheme.PRESET_SCHEMES[preset]["input_activations"])
        else:
            group = QuantizationScheme(targets=list(self.targets), weights=self.scheme.args(), format=fmt)
        qc = QuantizationConfig(
            config_groups={"group_0": group},
            format=fmt,
            quantization_status="compressed",
            ignore=list(self.ignore) + [p for p in extra_ignore if p not in self.ignore],
            kv_cache_scheme=kvcache.scheme_args() if self.kv_cache else None,
        )
        return qc.model_dump(mode="json")

    def fp8_block_variant(self) -> "Recipe":
        """The prefill half of a disaggregated pair for this (decode) recipe: FP8 blocks on every Linear but
        lm_head, the layout of the official FP8 releases (DeepSeek V3, Kimi K2, GLM-5-FP8). Keeping an INT4
        recipe's ignore list instead would leave attention and shared experts in BF16: a prefill checkpoint
        larger than the FP8 source (GLM-5: 729 vs 704 GiB). Pass a recipe with `--prefill-recipe` for another split."""
        return replace(self, name=f"{self.name}-prefill-fp8", scheme=Scheme(**{"group_size": None, **FP8_BLOCK}),
                       method="rtn", targets=("Linear",), ignore=("lm_head",), kv_cache=None,
                       description=f"FP8 block prefill variant of {self.name}")

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "method": self.method,
            "scheme": {k: v for k, v in vars(self.scheme).items() if k != "block_structure" or v is not None},
            "targets": list(self.targets),
            "ignore": list(self.ignore),
        }
        if self.method != "rtn":
            d[self.method] = vars(getattr(self, self.method))
        if self.calibrated:
            d["calibration"] = vars(self.calibration)
        if self.kv_cache:
            d["kv_cache"] = self.kv_cache
        return d


def with_overrides(r: Recipe, where: str, method: str | None = None, calibration: dict | None = None,
                   kv_cache: str | None = None, scales: str | None = None, tune_iters: int | None = None,
                   tune_holdout: int | None = None) -> Recipe:
    """The recipe with the command line's options in place, checked again by every rule of from_dict: an option
    must not let through what the same recipe written in its file is refused for (an FP8-block recipe with
    --method gptq)."""
    d = {**r.to_dict(), "description": r.description}
    d["method"] = method or r.method
    d["calibration"] = {**vars(r.calibration), **(calibration or {})}
    if d["method"] == "gptq":
        d["gptq"] = {**vars(r.gptq), **({"scales": scales} if scales else {}),
                     **({"tune_iters": tune_iters} if tune_iters is not None else {}),
                     **({"tune_holdout": tune_holdout} if tune_holdout is not None else {})}
    elif d["method"] == "awq":
        d["awq"] = vars(r.awq)
    if kv_cache:
        d["kv_cache"] = kv_cache
    return replace(from_dict(d, where), source=r.source)


def matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def any_matches(patterns: tuple[str, ...], name: str) -> bool:
    """Whether any pattern matches: `matches` of each, as one set lookup and precompiled regexes (plan asks this of
    each of GLM-5's ~60,000 tensors per recipe)."""
    names, regexes = _matcher(tuple(patterns))
    return name in names or any(r.match(name) for r in regexes)


@functools.lru_cache(maxsize=256)
def _matcher(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[re.Pattern, ...]]:
    return (frozenset(p for p in patterns if not p.startswith("re:")),
            tuple(re.compile(p[3:]) for p in patterns if p.startswith("re:")))


def _scheme(raw: object, where: str) -> Scheme:
    if isinstance(raw, dict) and raw.get("type") == "float" and raw.get("num_bits") == 4:
        s = _section(Scheme, raw, "scheme", where)
        if (s.strategy, s.group_size, s.symmetric) not in (("tensor_group", 16, True), ("group", 32, True)):
            raise UsageError(f"{where}: FP4 schemes are NVFP4 (strategy tensor_group, group_size 16) or MXFP4 "
                             "(strategy group, group_size 32), symmetric")
        if s.activations not in (None, "nvfp4") or (s.activations and s.fp4 != "nvfp4"):
            raise UsageError(f"{where}: FP4 weights take activations: nvfp4 (NVFP4 W4A4, with NVFP4 weights only) or "
                             f"none (A16); got activations {s.activations!r} with {s.fp4.upper()} weights")
        return s
    if isinstance(raw, dict) and raw.get("type") == "float":
        # group_size has no meaning for blocks; leave it out rather than carry the INT4 default
        s = _section(Scheme, {"group_size": None, **raw}, "scheme", where)
        if (s.num_bits, s.strategy, s.symmetric, s.group_size) != (8, "block", True, None) or s.block_structure != [128, 128]:
            raise UsageError(f"{where}: the float scheme is FP8_BLOCK only: num_bits 8, type float, strategy block, "
                             "block_structure [128, 128], symmetric, no group_size")
        return s
    s = _section(Scheme, raw, "scheme", where)
    if s.block_structure is not None:
        raise UsageError(f"{where}: block_structure belongs to the FP8 block scheme (type float)")
    if s.num_bits != 4 or s.type != "int" or s.strategy != "group":
        raise UsageError(f"{where}: schemes are INT4 groups (num_bits 4, type int, strategy group) "
                         "or FP8 blocks (num_bits 8, type float, strategy block, block_structure [128, 128])")
    if s.activations is not None and (s.activations != "fp8" or s.group_size != 128 or not s.symmetric):
        raise UsageError(f"{where}: activations: fp8 (W4AFP8) is INT4 symmetric group_size 128 weights: vLLM's "
                         "CompressedTensorsW4A8Fp8 refuses any other group size; got "
                         f"activations {s.activations!r}, group_size {s.group_size}, symmetric {s.symmetric}")
    if s.group_size not in GROUP_SIZES:
        raise UsageError(f"{where}: group_size {s.group_size} is not one that vLLM's Marlin kernels serve; "
                         f"use one of {GROUP_SIZES}")
    return s


def _section(cls, raw: object, key: str, where: str):
    if raw is None:
        return cls()
    known = set(cls.__dataclass_fields__)
    if not isinstance(raw, dict) or set(raw) - known:
        bad = sorted(set(raw) - known) if isinstance(raw, dict) else raw
        raise UsageError(f"{where}: unknown key(s) in `{key}`: {bad}; allowed: {sorted(known)}")
    value = cls(**raw)
    for f, default in vars(cls()).items():
        v = getattr(value, f)
        numeric = isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool)
        if default is not None and v is not None and not isinstance(v, type(default)) and not numeric:
            raise UsageError(f"{where}: `{key}.{f}` must be a {type(default).__name__}, got {v!r}")
    return value


def from_dict(raw: object, where: str) -> Recipe:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: a recipe is a YAML mapping")
    unknown = set(raw) - RECIPE_KEYS
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(RECIPE_KEYS)}")
    method = raw.get("method", "rtn")
    if method not in METHODS:
        raise UsageError(f"{where}: method {method!r} is not available; choose one of {METHODS}")
    for key in ("targets", "ignore"):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UsageError(f"{where}: `{key}` must be a list of module names or re: patterns")
        for p in value:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as e:
                    raise UsageError(f"{where}: bad regex in {key}: {p!r} ({e})") from e
    gptq = _section(GPTQParams, raw.get("gptq"), "gptq", where)
    if not 0 <= gptq.dampening_frac < 1 or gptq.block_size < 1 or gptq.actorder not in ("static", None):
        raise UsageError(f"{where}: gptq needs 0 <= dampening_frac < 1, block_size >= 1, actorder static or null")
    iters = gptq.tune_iters
    if (iters is not None and (not isinstance(iters, int) or isinstance(iters, bool) or iters < 0)
            or gptq.tune_samples is not None and gptq.tune_samples < 1 or gptq.tune_batch < 1 or gptq.tune_holdout < 0
            or gptq.tune_attention not in (None, True, False)
            or gptq.tune_rate is not None and (isinstance(gptq.tune_rate, bool) or not isinstance(gptq.tune_rate, (int, float))
                                               or not 0 < gptq.tune_rate <= 0.5)):
        raise UsageError(f"{where}: gptq needs tune_iters >= 0 (or unset: {TUNE_ITERS} under hessian scales, 0 under "
                         "minmax), tune_samples >= 1 (or unset), tune_holdout >= 0, tune_batch >= 1 and "
                         "tune_attention true, false (or unset), 0 < tune_rate <= 0.5 (or unset)")
    if gptq.scales not in SCALE_RULES or gptq.dampening not in DAMPING_RULES:
        raise UsageError(f"{where}: gptq scales must be one of {', '.join(SCALE_RULES)}, dampening one of "
                         f"{', '.join(DAMPING_RULES)}")
    awq_params = _section(AWQParams, raw.get("awq"), "awq", where)
    if awq_params.n_grid < 2 or awq_params.max_tokens < 1:
        raise UsageError(f"{where}: awq needs n_grid >= 2 and max_tokens >= 1")
    kv_cache = raw.get("kv_cache")
    if kv_cache not in (None, *KV_CACHE):
        raise UsageError(f"{where}: kv_cache {kv_cache!r} is not available; choose one of {KV_CACHE} or leave it out")
    scheme = _scheme(raw.get("scheme", {}), where)
    if scheme.w4a4 and method != "gptq":
        raise UsageError(f"{where}: NVFP4 activations (W4A4) need each Linear's input_global_scale, measured on "
                         "calibration inputs: use method gptq with calibration data (--method gptq --calib FILE)")
    if scheme.fp4 and method == "awq":
        raise UsageError(f"{where}: FP4 weights are quantized by round to nearest or GPTQ; AWQ's scale search is "
                         "INT4's here: use method rtn or gptq")
    if scheme.fp8_block and method != "rtn":
        raise UsageError(f"{where}: FP8 block weights are data-free (max per block, as compressed-tensors' FP8_BLOCK); "
                         "use method rtn")
    if kv_cache and method == "rtn":
        raise UsageError(f"{where}: kv_cache scales are calibrated: use method gptq or awq with calibration data "
                         "(--method gptq or awq --calib FILE)")
    calibration = _section(Calibration, raw.get("calibration"), "calibration", where)
    if calibration.data is not None and method == "rtn" and (scheme.fp8_block or not scheme.symmetric):
        raise UsageError(f"{where}: calibrated rtn chooses symmetric INT4 or FP4 scales; FP8 blocks and asymmetric "
                         "INT4 keep their min/max scales: leave calibration.data (--calib) out")
    if calibration.num_samples < 1 or calibration.seq_len < 8 or calibration.min_expert_tokens < 0:
        raise UsageError(f"{where}: calibration needs num_samples >= 1, seq_len >= 8, min_expert_tokens >= 0")
    return Recipe(
        gptq=gptq,
        awq=awq_params,
        calibration=calibration,
        name=str(raw.get("name") or Path(where).stem),
        scheme=scheme,
        method=method,
        targets=tuple(raw.get("targets") or ["Linear"]),
        ignore=tuple(raw.get("ignore", ["lm_head"])),
        description=str(raw.get("description", "")),
        kv_cache=kv_cache,
        source=where,
    )


def load(path: Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"recipe {path} not found; see recipes/ for examples")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UsageError(f"{path}: not valid YAML: {getattr(e, 'problem', None) or ' '.join(str(e).split())}{where}") from e
    return from_dict(raw, str(path))


SCHEMES = ("w4a16", "w4afp8", "fp8-block", "nvfp4a16", "nvfp4", "mxfp4a16")
FP8_BLOCK = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}
FP4 = {"nvfp4a16": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
       "nvfp4": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "activations": "nvfp4"},
       "mxfp4a16": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}
FP4_PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}  # compressed-tensors' preset of each


def preset(scheme: str, group_size: int, method: str = "rtn", symmetric: bool = True) -> Recipe:
    """The recipe for `--scheme w4a16 --group-size G` or `--scheme fp8-block`: every Linear but lm_head."""
    if scheme == "fp8-block":
        return from_dict({"name": "fp8-block", "method": method, "scheme": FP8_BLOCK, "targets": ["Linear"],
                          "ignore": ["lm_head"]}, "--scheme fp8-block")
    if scheme == "w4afp8":
        if group_size != 128:
            raise UsageError(f"--scheme w4afp8 is group_size 128 (vLLM's W4A8 kernels take no other), not {group_size}")
        return from_dict({"name": "w4afp8-g128", "method": method, "scheme": {"num_bits": 4, "group_size": 128,
                          "symmetric": True, "activations": "fp8"}, "targets": ["Linear"], "ignore": ["lm_head"]},
                         "--scheme w4afp8")
    if scheme in FP4:
        return from_dict({"name": scheme, "method": method, "scheme": FP4[scheme], "targets": ["Linear"],
                          "ignore": ["lm_head"]}, f"--scheme {scheme}")
    if scheme != "w4a16":
        raise UsageError(f"scheme {scheme!r} is not available; choose one of {SCHEMES}")
    return from_dict(
        {
            "name": f"{scheme}-g{group_size}",
            "method": method,
            "scheme": {"num_bits": 4, "group_size": group_size, "symmetric": symmetric},
            "targets": ["Linear"],
            "ignore": ["lm_head"],
        },
        f"--scheme {scheme}",
    )
