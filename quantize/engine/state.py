"""Finished units of a conversion, recorded in OUT.partial/state.json so that `--resume` continues.

The fingerprint ties the state to its source, recipe, calibration, output layout and tool version: resuming with
any of them changed would splice two different conversions together, so it is refused, naming what changed. The
manifest of a finished output records the same parts, so that `release` reuses only a conversion it would make.
"""

import hashlib
import json
import threading
from pathlib import Path

from quantize import __version__
from quantize.errors import UsageError
from quantize.writer import write_json

STATE_NAME = "state.json"


# what each part of a fingerprint means, for the message that refuses a resume or a reuse
PART_NAMES = {"source": "source (its files or config)", "recipe": "recipe",
              "calibration": "calibration (data, samples, sequence length or seed)",
              "layout": "output layout (--max-shard-size)", "tool_version": "tool version"}


def fingerprint_parts(parts: dict) -> dict[str, str]:
    """{part: sha256 of its JSON}, `tool_version` added: small enough to keep in state.json and the manifest."""
    parts = {**parts, "tool_version": __version__}
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest() for k, v in sorted(parts.items())}


def fingerprint(parts: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def changed(saved: dict | None, now: dict[str, str]) -> str:
    """What differs between two fingerprints' parts, in words ("recipe and calibration (...)")."""
    if not isinstance(saved, dict):
        return "source, recipe, calibration, layout or tool version (recorded by an older quantize)"
    names = [PART_NAMES.get(k, k) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    return " and ".join(names) or "nothing"


class State:
    def __init__(self, partial: Path, parts: dict[str, str], done: dict[str, dict]):
        self.partial, self.parts, self.done = partial, parts, done
        self.fingerprint = fingerprint(parts)
        self._lock = threading.Lock()  # a calibrated run's writers mark their shards from threads of their own

    @classmethod
    def open(cls, partial: Path, parts: dict[str, str], resume: bool) -> "State":
        path = partial / STATE_NAME
        if resume and path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") != fingerprint(parts):
                raise UsageError(
                    f"{partial} was started with another {changed(saved.get('parts'), parts)}; "
                    "it cannot be resumed: rerun with --overwrite to start over"
                )
            return cls(partial, parts, saved.get("done", {}))
        state = cls(partial, parts, {})
        state.save()
        return state

    def save(self) -> None:
        with self._lock:
            write_json(self.partial / STATE_NAME, {"fingerprint": self.fingerprint, "parts": self.parts,
                                                   "done": dict(self.done)})

    def mark(self, unit: str, **info) -> None:
        self.mark_all({unit: info})

    def mark_all(self, units: dict[str, dict]) -> None:
        """Record finished units, one save for all of them."""
        if not units:
            return
        with self._lock:
            self.done.update(units)
        self.save()
