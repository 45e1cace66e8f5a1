"""The GPU check's install chain, kept in step on the CPU: everything quantize imports is on the lent machine's
image or among the wheels scripts/gpu_check.sh installs from .whl/ (no registry there), and the scripts agree on
one list of them. The chain itself is rehearsed by `scripts/gpu_check.sh --device cpu` (README)."""

import ast
import re
import sys
from importlib import metadata

from conftest import ROOT
from packaging.requirements import Requirement

# imported only by paths the GPU check does not take: lm-eval and datasets by `eval` / `release` and a Hub
# calibration set; each is a lazy import inside the function that needs it
NOT_ON_THE_GPU_PATH = {"lm-eval", "datasets"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image() -> set[str]:
    text = (ROOT / "tests" / "data" / "gpu-image-packages.txt").read_text().splitlines()
    return {_norm(x) for x in text if x and not x.startswith("#")}


def wheels() -> dict[str, str]:
    out = {}
    for line in (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[_norm(name)] = version
    return out


def imported_modules() -> set[str]:
    """The top-level modules that quantize's code imports, at module level or lazily inside functions."""
    found = set()
    for path in (ROOT / "quantize").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"quantize"}


def test_every_import_of_quantize_is_on_the_gpu_image_or_among_the_carried_wheels():
    dists = metadata.packages_distributions()
    have = image() | set(wheels()) | NOT_ON_THE_GPU_PATH
    missing = {m: dists.get(m) for m in imported_modules() if not {_norm(d) for d in dists.get(m, [m])} & have}
    assert not missing, f"imported by quantize, but neither on the GPU image nor in scripts/gpu_wheels.txt: {missing}"


def test_the_carried_wheels_are_what_the_image_lacks_at_the_versions_tested_here():
    """The closure of the carried packages' requirements is on the image or carried too, and each carried version
    is the one installed here, which the tests run against."""
    carried, on_image = wheels(), image()
    assert "compressed-tensors" in carried and not set(carried) & on_image
    todo, seen = list(carried), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert metadata.version(name) == carried[name], f"{name}: {metadata.version(name)} here, {carried[name]} carried"
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"python_version": "3.12", "sys_platform": "linux",
                                                                   "extra": ""}):
                continue  # the image's Python is 3.12, on Linux; no extras
            dep = _norm(req.name)
            assert dep in on_image or dep in carried, f"{name} needs {dep}, neither on the image nor carried"
            if dep in carried:
                todo.append(dep)


def test_the_scripts_download_and_install_the_one_list():
    download = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    install = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for script in (download, install):
        assert "-r scripts/gpu_wheels.txt" in script
    assert "--no-index" in install and "--target" in install and "PYTHONPATH" in install
    assert 'for py in 3.12 ' in download and '--python-version "$py"' in download  # the image's Python
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_check_that_hangs_is_stopped_at_its_timeout_and_the_json_is_kept_after_each_check(tmp_path, monkeypatch):
    """The GPU day has one 600-second call: a check that hangs must fail alone, at its own timeout, and what ran
    before it must already be on disk (gpu-check.json rewritten after every check)."""
    import json
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import make_fixture

    seen = []

    def hangs(ctx):
        seen.append(json.loads((tmp_path / "out" / "gpu-check.json").read_text())["results"])
        time.sleep(30)

    def after(ctx):
        return "ran"

    registered = list(gpu_check.CHECKS)
    checks = [gpu_check.check(5)(lambda ctx: "first"), gpu_check.check(1)(hangs), gpu_check.check(5)(after)]
    gpu_check.CHECKS[:] = registered  # the real list as it was: these three run only here
    for fn, name in zip(checks, ("first", "hangs", "after"), strict=True):
        fn.__name__ = name
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    monkeypatch.setattr(make_fixture, "build", lambda kind, out: None)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path / "work"))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu"])
    t0 = time.monotonic()
    assert gpu_check.main() == 1
    assert time.monotonic() - t0 < 20
    assert [r["check"] for r in seen[0]] == ["first"]  # on disk before the hanging check began
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert doc["complete"] and [(r["check"], r["status"]) for r in doc["results"]] == [
        ("first", "PASS"), ("hangs", "FAIL"), ("after", "PASS")]
    assert "CheckTimeout" in doc["results"][1]["detail"]
