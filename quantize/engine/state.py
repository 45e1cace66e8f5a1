"""Finished units of a conversion, recorded in OUT.partial/state.json so that `--resume` continues.

The fingerprint ties the state to its source, recipe, output layout and tool version: resuming with any of
them changed would splice two different conversions together, so it is refused.
"""

import hashlib
import json
from pathlib import Path

from quantize import __version__
from quantize.errors import UsageError
from quantize.writer import write_json

STATE_NAME = "state.json"


def fingerprint(parts: dict) -> str:
    payload = json.dumps({**parts, "tool_version": __version__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


class State:
    def __init__(self, partial: Path, fp: str, done: dict[str, dict]):
        self.partial, self.fingerprint, self.done = partial, fp, done

    @classmethod
    def open(cls, partial: Path, fp: str, resume: bool) -> "State":
        path = partial / STATE_NAME
        if resume and path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") != fp:
                raise UsageError(
                    f"{partial} was started with another source, recipe, layout or tool version; "
                    "it cannot be resumed: rerun with --overwrite to start over"
                )
            return cls(partial, fp, saved.get("done", {}))
        state = cls(partial, fp, {})
        state.save()
        return state

    def save(self) -> None:
        write_json(self.partial / STATE_NAME, {"fingerprint": self.fingerprint, "done": self.done})

    def mark(self, unit: str, **info) -> None:
        self.done[unit] = info
        self.save()
