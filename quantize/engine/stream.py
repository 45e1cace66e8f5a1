"""The stream engine: RTN conversion with no model and no data, one output shard per work unit.

Output shards are written one after another, each tensor appended as soon as it is ready; `workers` threads
read source tensors (pread, no mmap), decode them on the chosen device, quantize and pack, in order, while
this thread writes and hashes. Peak memory is the largest tensors in flight (workers + 1), whatever the
model's size; a shard is the unit of resume.
"""

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantize import __version__, compute
from quantize.checkpoint import INDEX_NAME
from quantize.destination import check_apart, hold, partial_dir, prepare_check
from quantize.engine import devices, shard, writers
from quantize.engine.layer_state import CALIB_DIR
from quantize.engine.ordered import in_order
from quantize.engine.state import STATE_NAME, State, fingerprint_parts
from quantize.errors import QuantizeError
from quantize.hub import hub_sha256
from quantize.phases import Phases, timer
from quantize.tensor_plan import Plan, shard_depth, shards_in_flight
from quantize.verify import verify
from quantize.writer import (
    MANIFEST_NAME,
    copy_side_files,
    finalize,
    output_config,
    sha256_file,
    write_index,
    write_json,
)


@dataclass
class Result:
    out: Path
    seconds: float
    src_bytes: int
    out_bytes: int
    shards: int
    resumed_shards: int
    device: str
    workers: int
    counts: dict
    tp_served: list[int]
    warnings: list[str] = field(default_factory=list)
    prefill: dict | None = None  # the second output of a pair: out, output_bytes, tp_served
    phases: dict = field(default_factory=dict)  # thread-seconds per phase (quantize/phases.py)
    phases_cpu: dict = field(default_factory=dict)  # the CPU seconds of those threads in each phase

    @property
    def gb_per_s(self) -> float:
        return self.src_bytes / 1e9 / max(self.seconds, 1e-9)


def plan_fingerprint(plan: Plan) -> dict[str, str]:
    """What a conversion's bytes depend on, part by part (engine/state.py): `--resume` and `release`'s reuse
    continue only work whose every part is the same."""
    ckpt, recipe = plan.ckpt, plan.recipe.to_dict()
    calibration = recipe.pop("calibration", None)
    if calibration is not None:
        data = Path(str(calibration.get("data") or ""))
        calibration = {**calibration, "data_sha256": sha256_file(data) if data.is_file() else None}
    return fingerprint_parts({
        "source": {"tensors": {n: [t.main.path.name, t.main.start, t.main.nbytes] for n, t in ckpt.tensors.items()},
                   "config": ckpt.config, "files": _source_files(ckpt.root)},
        "recipe": recipe,
        "calibration": calibration,
        "layout": [[s.name for e in shard for s in e.outputs] for shard in plan.shards],
    })


def _source_files(root: Path) -> dict[str, list]:
    """Each source file's size and the Hub's sha256 (an HF-cache snapshot) or, for a local folder, its
    modification time: another source with the same tensor names still differs here, at no read of the weights."""
    return {p.name: [p.stat().st_size, hub_sha256(p) or p.stat().st_mtime_ns]
            for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")}


def prepare(out: Path, resume: bool, overwrite: bool) -> Path:
    """Check the destination and create OUT.partial (emptied unless resuming)."""
    prepare_check(out, resume, overwrite)
    partial = partial_dir(out)
    if partial.exists() and not resume:
        shutil.rmtree(partial)
    try:
        partial.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuantizeError(f"cannot create {partial}: {e.strerror}") from e
    return partial


class _Output:
    """One output folder of a run: its OUT.partial, its resume state and the shards still to write."""

    def __init__(self, plan: Plan, out: Path, resume: bool, overwrite: bool):
        self.plan, self.out, self.overwrite = plan, Path(out), overwrite
        self.partial = prepare(self.out, resume, overwrite)
        self.state = State.open(self.partial, plan_fingerprint(plan), resume)
        self.names = plan.shard_names
        self.todo: list[int] = []

    def find_todo(self) -> None:
        """The shards still to write: those not recorded, or whose bytes are no longer the recorded ones (each
        finished shard is hashed once here: a Kimi-sized output is minutes of reading)."""
        self.todo = [i for i, n in enumerate(self.names) if not _still_good(self.partial / n, self.state.done.get(n))]

    @property
    def need_bytes(self) -> int:
        return sum(e.out_bytes for i in self.todo for e in self.plan.shards[i])

    def mark(self, i: int, written: tuple[int, str, dict]) -> None:
        size, sha, tensors = written
        self.state.mark(self.names[i], size=size, sha256=sha, tensors=tensors)

    def finish(self, source_info: dict | None, source_hashes: Future) -> None:
        """Index, config, side files and manifest; the fast verify; then the final name."""
        plan, partial, names, state = self.plan, self.partial, self.names, self.state
        weight_map = {s.name: names[i] for i, shard in enumerate(plan.shards) for e in shard for s in e.outputs}
        write_index(partial, weight_map, plan.out_bytes)
        write_json(partial / "config.json", output_config(plan.ckpt.config, plan.quantization_config()))
        copied = copy_side_files(plan.ckpt.root, partial)
        files = {n: {"size": state.done[n]["size"], "sha256": state.done[n]["sha256"]} for n in names}
        for name in ["config.json", INDEX_NAME, *copied]:
            files[name] = {"size": (partial / name).stat().st_size, "sha256": sha256_file(partial / name)}
        write_json(
            partial / MANIFEST_NAME,
            {
                "tool": "quantize",
                "tool_version": __version__,
                "libraries": library_versions(),
                "source": (source_info or {"path": str(plan.ckpt.root)}) | {"files": source_hashes.result()},
                "recipe": plan.recipe.to_dict(),
                "fingerprint": state.parts,
                "files": files,
                "tensors": {t: rec for n in names for t, rec in sorted(state.done[n].get("tensors", {}).items())},
            },
        )
        # the fast verify, before the output takes its final name: structure, scheme, scales (hashes were taken
        # from the bytes as they were written)
        report = verify(partial, rehash=False, unlisted_ok=frozenset({STATE_NAME}))
        if not report.clean:
            lines = "; ".join(f.line() for f in report.findings[:3])
            raise QuantizeError(f"output check failed, {len(report.findings)} finding(s): {lines}; kept in {partial}")
        (partial / STATE_NAME).unlink()
        finalize(partial, self.out, self.overwrite)


def run(
    plan: Plan,
    out: Path,
    *,
    device: str = "cpu",
    workers: int = 1,
    resume: bool = False,
    overwrite: bool = False,
    source_info: dict | None = None,
    progress: Callable[[int, int], None] | None = None,
    calibrated=None,
    prefill: tuple[Plan, Path] | None = None,
) -> Result:
    """Convert per `plan` into `out`. `progress(done_bytes, total_bytes)` is called from worker threads.

    `calibrated`, for the calibrated methods, is engine/layerwise.Calibrated (its ranks started, their terms
    agreed): once the destination is known to be usable it starts the layer loop, and this rank's writers
    (engine/writers.py) write its streams' shards while the other ranks write theirs.

    `prefill=(plan2, out2)`: also write a second output (the FP8 prefill variant of a disaggregated pair) in the
    same pass; the two plans come from tensor_plan.pair, so shard i of both holds the same source tensors."""
    check_apart(plan.ckpt.root, {"OUT": Path(out)} | ({"--prefill-out": Path(prefill[1])} if prefill else {}))
    holds = []
    try:  # from before the first write until the rename: a second job into the same output is refused
        for o in [Path(out)] + ([Path(prefill[1])] if prefill else []):
            holds.append(hold(o))
        return _run(plan, out, device, workers, resume, overwrite, source_info, progress, calibrated, prefill)
    finally:
        for h in holds:
            h.release()


def _run(plan, out, device, workers, resume, overwrite, source_info, progress, calibrated, prefill) -> Result:
    t0 = time.perf_counter()
    if prefill is not None:
        prepare_check(Path(out), resume, overwrite)
        prepare_check(Path(prefill[1]), resume, overwrite)
    main = _Output(plan, out, resume, overwrite)
    second = _Output(*prefill, resume, overwrite) if prefill is not None else None
    outputs = [main] + ([second] if second else [])
    if resume:  # shards other ranks finished before the run stopped
        _fold_receipts(outputs)
    for o in outputs:
        o.find_todo()
    todo = sorted(set().union(*(o.todo for o in outputs)))
    for o in outputs:
        free = shutil.disk_usage(o.partial).free
        need = sum(x.need_bytes for x in outputs if x.partial.stat().st_dev == o.partial.stat().st_dev)
        if need > free:
            raise QuantizeError(f"the output needs {need / 2**30:.1f} GiB more but {o.partial} has "
                                f"{free / 2**30:.1f} GiB free; free space and rerun")
    total = sum(e.tensor.stored_bytes for e in plan.entries)
    done = [sum(e.tensor.stored_bytes for i, s in enumerate(plan.shards) if i not in todo for e in s)]
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            if progress:
                progress(done[0], total)

    advance(0)
    phases = Phases()
    source_hashes = _hash_source_in_background(plan.ckpt.root, phases)
    dev = torch.device(device)
    threads = torch.get_num_threads()
    try:
        if calibrated is not None:
            workers = 1  # the layer loop uses every core; each writer has one thread that reads ahead
            _write_calibrated(plan, outputs, calibrated, dev, advance)
        else:
            torch.set_num_threads(max(1, compute.cores() // workers))
            _write_shards(plan, outputs, todo, dev, workers, advance, phases)
    finally:
        torch.set_num_threads(threads)
        shard.stashes.pop(id(plan), None)
    shutil.rmtree(main.partial / CALIB_DIR, ignore_errors=True)  # every shard is written: the layer checkpoints are done
    shutil.rmtree(main.partial / writers.RECEIPTS, ignore_errors=True)  # folded into the state
    with phases("finish (index, manifest, verify)"):
        for o in reversed(outputs):  # the prefill variant first: OUT appearing means both are there
            o.finish(source_info, source_hashes)
    return Result(
        out=main.out,
        seconds=time.perf_counter() - t0,
        src_bytes=sum(e.tensor.stored_bytes for i in todo for e in plan.shards[i]),
        out_bytes=plan.out_bytes,
        shards=len(main.names),
        resumed_shards=len(main.names) - len(main.todo),
        device=str(dev),
        workers=workers,
        counts=dict(plan.counts()),
        tp_served=plan.tp_served,
        warnings=plan.warnings,
        prefill=None if second is None else {"out": str(second.out), "recipe": second.plan.recipe.name,
                                             "scheme": second.plan.recipe.scheme.label,
                                             "output_bytes": second.plan.out_bytes, "tp_served": second.plan.tp_served},
        phases=phases.to_dict(),
        phases_cpu=phases.cpu_dict(),
    )


def _write_shards(plan: Plan, outputs: list[_Output], todo: list[int], dev: torch.device, workers: int, advance,
                  phases: Phases) -> None:
    """The shards to write, several at once where one shard's writer would hold the workers back
    (tensor_plan.shards_in_flight): the workers are shared, each shard has its writer thread and its hasher, and
    the state records the shards in order."""
    in_flight = shards_in_flight(workers, len(todo))
    depth = shard_depth(workers, in_flight)
    second = outputs[1].plan if len(outputs) > 1 else None

    def one(i: int) -> tuple:
        paths = tuple(o.partial / o.names[i] if i in o.todo else None for o in outputs)
        return shard.write_shard_pair(plan, second, i, (*paths, None)[:2], dev, advance, pool, depth=depth,
                                      phases=phases)

    with devices.pool(workers) as pool, ThreadPoolExecutor(in_flight, thread_name_prefix="shard") as shards:
        # at most in_flight shards started: after a failure no other is begun (in_order cancels the rest)
        for i, pair in zip(todo, in_order(shards, one, todo, in_flight), strict=True):
            _mark(outputs, i, pair)


def _mark(outputs: list[_Output], i: int, pair: tuple) -> None:
    for o, written in zip(outputs, pair, strict=False):
        if written is not None:
            o.mark(i, written)


def _fold_receipts(outputs: list[_Output]) -> None:
    """Mark the shards other ranks wrote (engine/writers.py's receipts) in each output's state, saved once."""
    index = {n: i for i, n in enumerate(outputs[0].names)}
    receipts = writers.read_receipts(outputs[0].partial)
    for k, o in enumerate(outputs):
        o.state.mark_all({o.names[index[name]]: dict(zip(("size", "sha256", "tensors"), written[k], strict=True))
                          for name, written in receipts.items() if k < len(written) and written[k] is not None})


def _write_calibrated(plan: Plan, outputs: list[_Output], calibrated, dev: torch.device, advance) -> None:
    """The layer loop of every rank, and this rank's writers (its streams, engine/writers.py); the other ranks'
    shards are in the state once their receipts are folded in."""
    todo = [o.todo for o in outputs]
    engine = calibrated.start([o.partial for o in outputs], todo)
    mine = writers.own_todo(plan, sorted(set().union(*map(set, todo))), calibrated.rank, calibrated.world)

    def on_written(i: int, pair: tuple) -> None:
        _mark(outputs, i, pair)
        calibrated.shard_written(i, pair[:len(outputs)])

    second = outputs[1].plan if len(outputs) > 1 else None
    stats = writers.run(plan, second, [o.partial for o in outputs], todo, mine, engine, dev, on_written, advance)
    calibrated.join(stats)
    _fold_receipts(outputs)
    for o in outputs:
        missing = [i for i in o.todo if o.names[i] not in o.state.done]
        if missing:
            raise QuantizeError(f"{o.names[missing[0]]} was not written by the rank that owns it; its error is "
                                f"printed above: rerun with --resume")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "safetensors", "compressed-tensors", "transformers", "huggingface_hub"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def _hash_source_in_background(root: Path, phases: Phases | None = None) -> Future:
    """sha256 of each source file, for the manifest. A Hub snapshot's files link to blobs named by their
    sha256 (LFS), so those cost nothing; other files are hashed in a thread while the conversion runs."""
    def run() -> dict[str, dict]:
        out = {}
        with timer(phases)("source sha256 (background)"):
            for p in sorted(q for q in root.iterdir() if q.is_file() and not q.name.startswith(".")):
                out[p.name] = {"size": p.stat().st_size, "sha256": hub_sha256(p) or sha256_file(p)}
        return out

    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(run)
    pool.shutdown(wait=False)
    return future


def _still_good(path: Path, info: dict | None) -> bool:
    """A shard recorded as finished counts only if its bytes are still the ones recorded."""
    return bool(info) and path.is_file() and path.stat().st_size == info["size"] and sha256_file(path) == info["sha256"]
