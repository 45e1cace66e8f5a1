"""Where a conversion writes: OUT.partial/ while it works, OUT/ once it is complete, and the checks that keep a
destination from losing work or destroying the source. Every check runs before anything is read or written, and
this module imports no torch, so a refusal costs no start-up time."""

from pathlib import Path

from quantize import lock
from quantize.errors import UsageError
from quantize.hub import snapshot_roots


class Overlap(UsageError):
    """An output folder overlaps the source or another output: nothing may be written, not even a report."""


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def hold(out: Path) -> lock.Hold:
    """Hold OUT (its OUT.partial, and the rename to OUT) for this job, or raise lock.Held naming the job that does."""
    return lock.hold(out, "being written", shown=partial_dir(out))


def prepare_check(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a destination that would lose work: one a live job writes (whatever the flags), an existing OUT
    without --overwrite, an interrupted OUT.partial without --resume or --overwrite."""
    partial = partial_dir(out)
    lock.check_free(out, "being written", shown=partial)
    if out.exists() and not overwrite:
        raise UsageError(f"{out} already exists; pass --overwrite to replace it")
    if partial.exists() and not (resume or overwrite):
        raise UsageError(f"{partial} holds an interrupted conversion; pass --resume to continue it or --overwrite to start over")


def _relation(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "lies inside"
    if a in b.parents:
        return "contains"
    return None


def check_apart(src: Path, outputs: dict[str, Path]) -> None:
    """Refuse (exit 2) any output folder, or its OUT.partial, that is the source, lies inside it or contains it
    (following symlinks; for an HF-cache snapshot, its repo's blobs/ too), or that overlaps another output.
    `outputs` maps the option that named a folder (OUT, --prefill-out, --work-dir) to the folder."""
    guarded = snapshot_roots(Path(src))
    places = [(label, out, p) for label, out in outputs.items() for p in (Path(out), partial_dir(Path(out)))]
    for label, out, p in places:
        for g in guarded:
            rel = _relation(p.resolve(), g)
            if rel:
                what = f"{label} {out}" + (f" (its work folder {p.name})" if p != Path(out) else "")
                raise Overlap(f"{what} {rel} {'the source' if g == guarded[0] else 'where the source files live,'} "
                                 f"{g}: writing there would destroy the source; choose a folder outside it")
    for i, (la, a, pa) in enumerate(places):
        for lb, b, pb in places[i + 1:]:
            rel = _relation(pa.resolve(), pb.resolve()) if la != lb else None
            if rel:
                raise Overlap(f"{la} {a} and {lb} {b} overlap ({pa} {rel} {pb}): give the two outputs separate folders")
