"""Every command block of README.md runs as written on a fresh clone.

The blocks marked `<!-- cpu-example -->` run in order, in one shell, as a new user would type them: in a copy of
the tracked tree with ../shared beside it, the first block creating and activating its own .venv with pip, and
with an empty HF home. Every other bash block must say why it is not a CPU example."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import ROOT

README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- (cpu-example|not-a-cpu-example: [^>]+) -->\n)?```bash\n(.*?)```", re.S)


def blocks() -> list[tuple[str | None, str]]:
    return [(m[1], m[2]) for m in BLOCK.finditer(README.read_text())]


def test_every_bash_block_says_whether_it_is_a_cpu_example():
    found = blocks()
    assert len(found) >= 6
    unmarked = [body.splitlines()[0] for mark, body in found if mark is None]
    assert not unmarked, f"bash blocks with neither <!-- cpu-example --> nor <!-- not-a-cpu-example: why -->: {unmarked}"


def fresh_clone(dest):
    """The tracked files as they are in the working tree (what a clone of this commit holds), ../shared beside."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest.parent / "shared").symlink_to(ROOT.parent / "shared", target_is_directory=True)
    return dest


def pip_install_args(command: str) -> list[str]:
    """The arguments of the first `pip install` in a shell command line."""
    words = shlex.split(command.replace("&&", " && "))
    start = next(i for i, w in enumerate(words[:-1]) if w == "pip" and words[i + 1] == "install")
    end = next((i for i in range(start, len(words)) if words[i] == "&&"), len(words))
    return words[start + 2:end]


def test_the_first_run_installs_what_ci_installs():
    """The README's first command installs what .ci/run installs from a clean checkout (the same pip arguments,
    but for .ci/run's -q): so the clone below may start from the packages of this test run."""
    first = next(body for mark, body in blocks() if mark == "cpu-example")
    ci = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if " pip install " in line
              and "--upgrade pip" not in line)
    assert pip_install_args(first) == [a for a in pip_install_args(ci) if a != "-q"]


def _link(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def seed_venv(clone: Path) -> None:
    """clone/.venv with this test run's packages (hard links), but for quantize itself. The README's first
    command then runs as written: `python3 -m venv .venv` keeps them, and pip finds every requirement satisfied
    but the clone's own editable install. Installing them from nothing is what .ci/run does, with the same pip
    arguments (test_the_first_run_installs_what_ci_installs); doing it again here took 3 of this test's 8
    minutes on an AVX2 CPU."""
    venv = clone / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = Path(sysconfig.get_paths()["purelib"])
    dest = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert dest.is_dir(), dest
    for entry in site.iterdir():
        if entry.name.startswith(("quantize-", "__editable__.quantize-", "__editable___quantize_")) \
                or (dest / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest / entry.name, symlinks=True, copy_function=_link)
        else:
            _link(entry, dest / entry.name)


def test_readme_cpu_examples_run_as_written_in_a_fresh_clone(tmp_path, smollm2, eval_cache):
    """SmolLM2 is built by ../shared/scripts/build_smollm2.py, the script the README runs, which skips a finished
    build: the clone gets the session's build, and shares the session's baseline results (keyed by content).
    The clone's .venv starts from this run's packages (seed_venv)."""
    examples = [body for mark, body in blocks() if mark == "cpu-example"]
    assert examples[0].startswith("python3 -m venv .venv && . .venv/bin/activate && pip install")
    clone = fresh_clone(tmp_path / "quantize")
    seed_venv(clone)
    shutil.copytree(smollm2, clone / ".cache" / "smollm2")
    script = "set -euo pipefail\n" + "".join(f"echo '### README block {i}'\n{body}" for i, body in enumerate(examples, 1))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"HF_HOME": str(tmp_path / "hf-home"), "QUANTIZE_CACHE": str(eval_cache.parent),
            "HF_HUB_OFFLINE": "1"}  # nothing in the examples may need the Hub
    run = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=1800)
    log = run.stdout + run.stderr
    block = (re.findall(r"### README block (\d+)", log) or ["none"])[-1]
    assert run.returncode == 0, f"README block {block} failed (exit {run.returncode}):\n{log[-4000:]}"
    assert log.count("### README block") == len(examples)
    assert re.search(r"clean\W+\d+ files", log), log[-2000:]  # verify --deep after the first run
    assert "dry run: would commit" in log and "PASS" in log  # the release dry run and the eval example
    assert "--disable-shared-experts-fusion" in log  # inspect's serving matrix of the GLM-4.5 output
    assert "INCONCLUSIVE" in log and "exit 1: the gate refused the candidate" in log  # SmolLM2's RTN g64 fails
    for out in ("kimi-k2-int4", "k2-fp8-block", "k2-int4", "k2-fp8", "kimi-gptq", "kimi-awq", "kimi-gptq-kv8",
                "glm45-int4"):
        assert (clone / "out" / out / "quantize-manifest.json").is_file(), out
