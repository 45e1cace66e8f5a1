"""Recipes: which Linear modules to quantize and how, as data (YAML in recipes/), validated once.

Scheme fields and `targets` / `ignore` follow compressed-tensors: a pattern is an exact module name or
`re:<regex>` matched from the start of the name; the target `Linear` means every Linear weight the
architecture declares. The same lists go into the output's quantization_config, so vLLM and SGLang see
exactly the split we made.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantize.errors import UsageError

METHODS = ("rtn", "gptq", "awq")
GROUP_SIZES = (32, 64, 128)
RECIPE_KEYS = {"name", "description", "method", "scheme", "targets", "ignore", "gptq", "awq", "calibration", "kv_cache"}
KV_CACHE = ("fp8",)


@dataclass(frozen=True)
class GPTQParams:
    dampening_frac: float = 0.01
    block_size: int = 128
    actorder: str | None = "static"  # static: columns by descending Hessian diagonal, groups unchanged


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

    @property
    def label(self) -> str:
        return f"w{self.num_bits}a16 g{self.group_size} {'sym' if self.symmetric else 'asym'}"

    def args(self):
        """The scheme as compressed-tensors QuantizationArgs."""
        # imported here: compressed_tensors pulls in transformers (~3 s), which inspect and --help never need
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(
            num_bits=self.num_bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            strategy=self.strategy,
            type=self.type,
        )


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

    def targets_module(self, module: str, is_linear: bool) -> bool:
        """Whether a module is quantized: a Linear that a target names and no ignore pattern matches."""
        if not is_linear or any(matches(p, module) for p in self.ignore):
            return False
        return any(t == "Linear" or matches(t, module) for t in self.targets)

    def quantization_config(self, extra_ignore: tuple[str, ...] = ()) -> dict:
        """The compressed-tensors `quantization_config` for config.json, built by the library itself."""
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

        from quantize import kvcache

        qc = QuantizationConfig(
            config_groups={
                "group_0": QuantizationScheme(
                    targets=list(self.targets), weights=self.scheme.args(), format="pack-quantized"
                )
            },
            format="pack-quantized",
            quantization_status="compressed",
            ignore=list(self.ignore) + [p for p in extra_ignore if p not in self.ignore],
            kv_cache_scheme=kvcache.scheme_args() if self.kv_cache else None,
        )
        return qc.model_dump(mode="json")

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "method": self.method,
            "scheme": vars(self.scheme),
            "targets": list(self.targets),
            "ignore": list(self.ignore),
        }
        if self.method != "rtn":
            d[self.method] = vars(getattr(self, self.method))
            d["calibration"] = vars(self.calibration)
        if self.kv_cache:
            d["kv_cache"] = self.kv_cache
        return d


def matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _scheme(raw: object, where: str) -> Scheme:
    s = _section(Scheme, raw, "scheme", where)
    if s.num_bits != 4 or s.type != "int" or s.strategy != "group":
        raise UsageError(f"{where}: only INT4 group schemes are supported (num_bits 4, type int, strategy group)")
    if s.group_size not in GROUP_SIZES:
        raise UsageError(f"{where}: group_size {s.group_size} is not one vLLM's Marlin kernels serve; use one of {GROUP_SIZES}")
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
    awq_params = _section(AWQParams, raw.get("awq"), "awq", where)
    if awq_params.n_grid < 2 or awq_params.max_tokens < 1:
        raise UsageError(f"{where}: awq needs n_grid >= 2 and max_tokens >= 1")
    kv_cache = raw.get("kv_cache")
    if kv_cache not in (None, *KV_CACHE):
        raise UsageError(f"{where}: kv_cache {kv_cache!r} is not available; choose one of {KV_CACHE} or leave it out")
    if kv_cache and method == "rtn":
        raise UsageError(f"{where}: kv_cache scales are calibrated: use method gptq or awq with calibration data")
    calibration = _section(Calibration, raw.get("calibration"), "calibration", where)
    if calibration.num_samples < 1 or calibration.seq_len < 8 or calibration.min_expert_tokens < 0:
        raise UsageError(f"{where}: calibration needs num_samples >= 1, seq_len >= 8, min_expert_tokens >= 0")
    return Recipe(
        gptq=gptq,
        awq=awq_params,
        calibration=calibration,
        name=str(raw.get("name") or Path(where).stem),
        scheme=_scheme(raw.get("scheme", {}), where),
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
        raise UsageError(f"{path}: not valid YAML ({e})") from e
    return from_dict(raw, str(path))


def preset(scheme: str, group_size: int, method: str = "rtn", symmetric: bool = True) -> Recipe:
    """The recipe for `--scheme w4a16 --group-size G`: every Linear but lm_head."""
    if scheme != "w4a16":
        raise UsageError(f"scheme {scheme!r} is not available; choose w4a16")
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
