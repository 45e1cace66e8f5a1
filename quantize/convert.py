"""`convert` as a library call: SRC to OUT under a recipe and the command line's options.

`convert(src, out, options, events)` owns the recipe and its overrides, the devices and ranks, the holds on the
outputs, the prefill pairing and the report; the CLI parses and displays, `release` and the tests call it.
Nothing here prints: what a user should see goes through `Events`.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from quantize import hub
from quantize import recipe as recipes
from quantize.destination import check_apart, hold, prepare_check
from quantize.errors import QuantizeError, UsageError
from quantize.machine import cores


@dataclass
class Options:
    """What `quantize convert` takes besides SRC and OUT; None: the recipe's (or the preset's) own."""

    recipe_path: str | None = None
    scheme: str | None = None
    group_size: int | None = None  # overrides an INT4 recipe's; with --scheme its group size [128]
    method: str | None = None
    calib: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    calibrate_all_experts: bool | None = None
    min_expert_tokens: int | None = None
    scales: str | None = None
    tune_iters: int | None = None
    tune_holdout: int | None = None
    offload: str = "auto"
    trust_remote_code: bool = False
    device: str = "auto"
    compute_dtype: str = "auto"
    devices: list[str] = field(default_factory=list)
    rank_timeout: float = 60  # minutes
    max_shard_size: int = 5 * 10**9
    workers: int | str = "auto"  # a count, or auto: tensor_plan.auto_workers once the plan is known
    tp: int | None = None
    overwrite: bool = False
    resume: bool = False
    allow_nonfinite: bool = False
    kv_cache: str | None = None
    prefill_out: str | None = None
    prefill_recipe: str | None = None
    verbose: bool = False


def _quiet(*_args) -> None:
    return None


@dataclass
class Events:
    """What the caller shows: lines, warnings, the bytes converted, each layer and expert of a calibrated run."""

    status: Callable[[str], None] = _quiet
    warning: Callable[[str], None] = _quiet
    converted: Callable[[int, int], None] = _quiet  # (bytes done, total)
    layer: Callable = _quiet  # (layerwise.LayerReport, layers)
    expert: Callable[[int, int], None] = _quiet  # (expert, experts)


@dataclass
class Result:
    """What a conversion did: the report `--json` prints, the calibration's stats (None under plain RTN), the
    engines' loading matrices per output folder."""

    report: dict
    stats: object | None
    serving: dict[str, list]
    src_bytes: int
    stream: object  # engine/stream.Result


def load_recipe(recipe_path: str | None, scheme: str | None, group_size: int | None, method: str) -> recipes.Recipe:
    """The recipe of --recipe (an explicit --group-size overrides its INT4 group size) or of --scheme."""
    if recipe_path and scheme:
        raise UsageError("give --recipe or --scheme, not both")
    if not recipe_path:
        return recipes.preset(scheme or "w4a16", group_size or 128, method)
    r = recipes.load(Path(recipe_path))
    if group_size is None or r.scheme.group_size == group_size:
        return r
    s = r.scheme
    if s.fp4 or s.fp8_block or s.w4afp8 or s.type != "int":
        raise UsageError(f"--group-size {group_size}: {recipe_path}'s scheme fixes its own group size "
                         f"({s.group_size or 'blocks'}); --group-size overrides only an INT4 W4A16 recipe's")
    return replace(r, scheme=replace(s, group_size=group_size))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantizeError(f"--device {device}: no CUDA device is visible; use --device cpu")
    return device


def recipe_of(o: Options) -> recipes.Recipe:
    """The recipe with the command line's options, through every rule a recipe file goes through."""
    r = load_recipe(o.recipe_path, o.scheme, o.group_size, o.method or "rtn")
    overrides = {k: v for k, v in dict(data=o.calib, num_samples=o.num_samples, seq_len=o.seq_len, seed=o.seed,
                                       calibrate_all_experts=o.calibrate_all_experts,
                                       min_expert_tokens=o.min_expert_tokens).items() if v is not None}
    r = recipes.with_overrides(r, f"{o.recipe_path or 'the preset'} with the command line's options", o.method,
                               overrides, o.kv_cache, o.scales, o.tune_iters,
                               o.tune_holdout)
    if r.method != "rtn" and not r.calibration.data:
        raise UsageError(f"--method {r.method} needs calibration data: --calib FILE or the recipe's calibration.data")
    return r


def launcher_rank() -> int:
    """This process's rank under torchrun (RANK with WORLD_SIZE > 1), else 0; read without importing torch."""
    return int(os.environ.get("RANK", 0)) if int(os.environ.get("WORLD_SIZE", 1)) > 1 else 0


@dataclass
class _Ranks:
    """The ranks of this conversion, decided once: the devices, this process's device, torchrun or spawned."""

    devices: list[str]
    device: str
    torchrun: bool
    world: int


def _ranks(o: Options, method: str):
    from quantize.engine import devices as rank_devices
    from quantize.engine import distributed

    torchrun = distributed.launched_by_torchrun()
    if o.devices:
        rank_devices.check_devices(o.devices, rank_devices.visible_gpus())
    device = o.devices[0] if o.devices else o.device
    dev = (rank_devices.torchrun_device(device, os.environ, rank_devices.visible_gpus()) if torchrun
           else rank_devices.explicit(resolve_device(device)))
    world = int(os.environ.get("WORLD_SIZE", 1)) if torchrun else max(len(o.devices), 1)
    if world > 1 and method not in ("gptq", "awq"):
        raise UsageError("several ranks (--devices or torchrun) serve --method gptq and awq")
    if world > distributed.GROUPS:
        raise UsageError(f"{world} ranks: at most {distributed.GROUPS} share a conversion (the work is "
                         f"split in {distributed.GROUPS} fixed groups); use fewer devices")
    rank_devices.bind(dev)  # this process's device, in this thread and every thread the engine starts
    return _Ranks(list(o.devices), dev, torchrun, world)


def convert(src: str, out: str | Path, o: Options, events: Events | None = None) -> Result | None:
    """Convert SRC into OUT. Returns the result on the rank that reports (None on a torchrun rank > 0); raises
    QuantizeError (a UsageError for a request that cannot be carried out) and leaves OUT.partial to --resume."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # 14 GiB blocks churn each layer
    ev = events or Events()
    calibrated, launch, holds, ok, ranks = None, None, [], False, None
    r = recipe_of(o)
    local = hub.check_local(src)  # a missing path fails here, before torch is imported
    outputs = {"OUT": Path(out)} | ({"--prefill-out": Path(o.prefill_out)} if o.prefill_out else {})
    writes = launcher_rank() == 0  # under torchrun, rank 0 holds and writes the outputs for every rank
    try:
        if writes:
            for p in outputs.values():
                prepare_check(p, o.resume, o.overwrite)  # a held output is refused here, whatever the flags
            if local is not None:  # held from now until the rename; the source first, as the lock file goes beside OUT
                check_apart(local, outputs)
                holds += [hold(p) for p in outputs.values()]
        from quantize import quiet, tensor_plan
        from quantize.checkpoint import Checkpoint
        from quantize.engine import distributed, stream

        ranks = _ranks(o, r.method)
        r2 = _prefill_recipe(o, r)
        if ranks.torchrun and distributed.init_torchrun(ranks.device, o.rank_timeout * 60) != 0:
            _torchrun_rank(src, r, ranks.device, o, r2)
            ok = True
            return None
        folder, info = hub.resolve(src)
        check_apart(folder, outputs)
        if writes and not holds:  # a Hub source: held once it is here
            for p in outputs.values():
                holds.append(hold(p))
                prepare_check(p, o.resume, o.overwrite)  # again: the download took time
        if ranks.world > 1 and not ranks.torchrun:  # the other ranks start now: their imports overlap the planning
            from quantize.engine.layerwise import rank_job, run_rank

            launch = distributed.Launch(rank_job(folder, r, ranks.devices, o.offload, o.allow_nonfinite,
                                                 o.rank_timeout * 60, max_shard_size=o.max_shard_size,
                                                 prefill_recipe=r2), run_rank)
        ckpt = Checkpoint(folder, o.allow_nonfinite)
        workers = 1 if o.workers == "auto" else o.workers  # auto: chosen from the plan's tensors, checked again
        plan = tensor_plan.build(ckpt, r, o.max_shard_size, tp=o.tp, workers=workers, device=ranks.device)
        prefill = None
        if o.prefill_out:
            plan, plan2 = tensor_plan.pair(plan, tensor_plan.build(ckpt, r2, o.max_shard_size, tp=o.tp,
                                                                   workers=workers, device=ranks.device),
                                           o.max_shard_size)
            prefill = (plan2, Path(o.prefill_out))
        if o.workers == "auto":
            workers = tensor_plan.auto_workers(plan, ranks.device, cores())
        _announce(o, [plan] + ([prefill[0]] if prefill else []), ev)
        with quiet.libraries(o.verbose or not r.calibrated):  # rtn loads no transformers model
            if r.calibrated:
                calibrated = _calibration(plan, folder, r, ranks, o, ev, launch)
            result = stream.run(plan, Path(out), device=ranks.device, workers=workers, resume=o.resume,
                                overwrite=o.overwrite, source_info=info, progress=ev.converted, calibrated=calibrated,
                                prefill=prefill)
        ok = True
    except QuantizeError:
        raise
    except Exception as e:
        died = launch.dead() if launch is not None else None
        if died is None:
            raise
        raise QuantizeError(died) from e  # gloo's error for a dead peer's connection: the rank and the layer instead
    finally:
        if calibrated is not None:
            calibrated.close(ok)
        elif launch is not None:
            launch.close()
        if ranks is not None and ranks.torchrun:
            distributed.leave(ok)
        for h in holds:
            h.release()
    return _result(plan, result, r, calibrated, ranks.device)


def _prefill_recipe(o: Options, r: recipes.Recipe) -> recipes.Recipe | None:
    if not o.prefill_out:
        return None
    r2 = recipes.load(Path(o.prefill_recipe)) if o.prefill_recipe else r.fp8_block_variant()
    if r2.calibrated:
        raise UsageError("--prefill-recipe: the second output is written in the same pass, data-free; give it "
                         "method rtn")
    return r2


def _announce(o: Options, plans: list, ev: Events) -> None:
    if not o.recipe_path and not o.scheme:
        ev.status("no --recipe or --scheme: every Linear but lm_head becomes w4a16 g128 (as --scheme w4a16 "
                  "--group-size 128); release recipes are in recipes/")
    for p in plans:
        for w in p.warnings:
            ev.warning(w)
        pr = p.recipe
        ev.status(f"{p.model.arch.family} ({p.model.model_type}) {p.ckpt.format.kind} -> {pr.scheme.label} "
                  f"{pr.method}: {p.counts().get('quantize', 0) + p.counts().get('passthrough', 0)} Linear weights "
                  f"to {'FP8' if pr.scheme.fp8_block else 'FP4' if pr.scheme.fp4 else 'INT4'}, {len(p.shards)} output "
                  f"shard(s); serves at TP {', '.join(map(str, p.tp_served)) or 'none'}")


def _samples(folder: Path, r, trust_remote_code: bool):
    from quantize import calib

    c = r.calibration
    return calib.load_samples(c.data, calib.load_tokenizer(folder, trust_remote_code), c.num_samples, c.seq_len, c.seed)


def _torchrun_rank(src: str, r, dev: str, o: Options, r2) -> None:
    """A rank > 0 under torchrun: the same plan as rank 0, rank 0's samples and terms, then its share of each
    layer and its own shards."""
    import torch

    from quantize.engine.layerwise import rank_job, run_rank

    folder, _ = hub.resolve(src)
    run_rank(rank_job(folder, r, [dev], o.offload, o.allow_nonfinite, max_shard_size=o.max_shard_size,
                      prefill_recipe=r2), torch.device(dev))


def _calibration(plan, folder: Path, r, ranks: _Ranks, o: Options, ev: Events, launch):
    """The layerwise engine hook for stream.run."""
    import torch

    from quantize import compute
    from quantize.engine.layerwise import Calibrated

    c = r.calibration
    samples = _samples(folder, r, o.trust_remote_code)
    ev.status(f"calibration: {len(samples)} samples, {sum(s.numel() for s in samples)} tokens from {c.data} "
              f"(seed {c.seed})")
    if len(ranks.devices) > 1:
        ev.status(f"ranks: {', '.join(ranks.devices)} (calibration samples and routed experts split across them)")
    calibrated = Calibrated(plan, samples, torch.device(ranks.device), o.offload, on_layer=ev.layer,
                            devices=ranks.devices, on_expert=ev.expert, compute_dtype=o.compute_dtype, launch=launch)
    ev.status(f"layer forwards in {compute.describe(plan.ckpt.dtype, calibrated.compute, ranks.device)}")
    ev.status(f"memory: {calibrated.account.line()}")
    return calibrated


def _device_peak(dev: str) -> int | None:
    """The GPU memory this process held at most (torch's allocator), to set against the account; None on CPU."""
    import torch

    return torch.cuda.max_memory_allocated(dev) if dev.startswith("cuda") else None


def _result(plan, result, r, calibrated, dev: str) -> Result:
    from quantize import serving

    report = {
        "out": str(result.out),
        "seconds": round(result.seconds, 3),
        "source_bytes": result.src_bytes,
        "output_bytes": result.out_bytes,
        "gb_per_s": round(result.gb_per_s, 4),
        "shards": result.shards,
        "resumed_shards": result.resumed_shards,
        "device": result.device,
        "workers": result.workers,
        "tensors": result.counts,
        "tp_served": result.tp_served,
        "warnings": result.warnings,
        "phases": result.phases,  # thread-seconds per phase (quantize/phases.py): where the time went
        "phases_cpu": result.phases_cpu,  # and the CPU seconds spent in each
    }
    if result.prefill:
        report["prefill"] = result.prefill
    matrices = {str(result.out): serving.matrix_of(result.out)}
    if result.prefill:
        matrices[result.prefill["out"]] = serving.matrix_of(result.prefill["out"])
    report["serving"] = {k: [row.to_dict() for row in v] for k, v in matrices.items()}
    stats = calibrated.quantizer.stats if calibrated is not None and calibrated.quantizer is not None else None
    if stats is not None:
        from quantize.engine import tune as tuning
        from quantize.quant import signround

        account = calibrated.account
        report["calibration"] = {
            "compute_dtype": str(calibrated.compute).removeprefix("torch."),
            "cpu_capability": calibrated.cpu_capability,
            "offload": stats.offload,
            "samples": r.calibration.num_samples, "seq_len": r.calibration.seq_len, "seed": r.calibration.seed,
            # what chose each group's scale: min/max, the Hessian's diagonal blocks, the inputs' E[x^2] (rtn), AWQ
            "scales": {"gptq": r.gptq.scales, "rtn": "inputs-x2", "awq": "awq"}[r.method],
            **({"gptq": {"scales": r.gptq.scales, "dampening": r.gptq.dampening,
                         "dampening_frac": r.gptq.dampening_frac, "tune_iters": r.gptq.iters,
                         "tune_samples": r.gptq.samples(r.scheme.grid), "tune_holdout": r.gptq.tune_holdout,
                         "tune_rate": signround.offset_rate(r.scheme.grid, r.gptq.tune_rate),
                         # whether the attention's inputs were tuned (unless the recipe's tune_attention is false)
                         "tune_attention": tuning.tunes_attention(r.gptq.tune_attention)}}
               if r.method == "gptq" else {}),
            "memory": {"device": account.device, "layer": account.layer, "bytes": account.total, "free": account.free,
                       "parts": account.parts, "peak": _device_peak(dev)},
            "layers": len(stats.layers),
            "resumed_layers": stats.resumed_layers,
            "seconds_per_layer": [round(x.seconds, 3) for x in stats.layers],
            "seconds_per_phase": [{k: round(v, 3) for k, v in x.phases.items()} for x in stats.layers],
            # each tuned layer's output error before and after tuning, over the held-out samples (gptq
            # tune_holdout) or else the tuned ones (tune_iters; None: not tuned)
            **({"tuned_error": [x.tuned for x in stats.layers]} if any(x.tuned for x in stats.layers) else {}),
            "experts_calibrated": sum(x.experts_calibrated for x in stats.layers),
            # each rank's seconds per phase, its loop's waits and its writers' (an idle GPU shows as a number)
            "ranks": stats.ranks,
            "fallbacks": [f for x in stats.layers for f in x.fallbacks],
            "mean_relative_weight_error": stats.mean_error(),
            "tokens_per_expert": {x.layer: x.tokens_per_expert for x in stats.layers if x.tokens_per_expert},
            "kv_scales": {x.layer: x.kv_scale for x in stats.layers if x.kv_scale},
        }
    return Result(report, stats, matrices, plan.src_bytes, result)
