import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import make_fixture  # noqa: E402

RECIPES = ROOT / "recipes"
RECIPE_FOR = {
    "kimi-k2-fp8": "kimi-k2-w4a16",
    "kimi-k25-int4": "kimi-k2-w4a16",
    "glm4-moe-bf16": "glm-w4a16",
    "glm4-moe-fp8": "glm-w4a16",
    "glm5-bf16": "glm-w4a16",
    "llama-bf16": "dense-w4a16",
    "deepseek-v32-fp8": "moe-w4a16",
    "qwen3-moe-fp8": "moe-w4a16",
    "minimax-m2-fp8": "moe-w4a16",
    "mixtral-bf16": "moe-w4a16",
    "gemma3-bf16": "dense-w4a16",
    "phi3-bf16": "dense-w4a16",
    "mistral-bf16": "dense-w4a16",
}


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (.ci/run: one worker per core), the tests that share the session's evaluation cache
    run in one worker (`--dist loadgroup`), so SmolLM2's baseline is evaluated once, as in a single process."""
    for item in items:
        if "eval_cache" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("eval_cache"))


def pytest_terminal_summary(terminalreporter):
    from quantize.compute import choose, cpu_capability

    # bf16 forwards are ~50x slower on AVX2 CPUs, where they run in float32: the log says which kind ran the tests
    terminalreporter.write_line(f"CPU capability: {cpu_capability()}; bf16 forwards computed in "
                                f"{str(choose(torch.bfloat16, 'cpu')).removeprefix('torch.')}")


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fixtures")
    for kind in make_fixture.BUILDERS:
        make_fixture.build(kind, root / kind)
    return root


@pytest.fixture(scope="session")
def converted(fixtures_dir, tmp_path_factory):
    """Each fixture converted once with its release recipe (the CLI's library path), keyed by fixture name."""
    from quantize import recipe
    from quantize.checkpoint import Checkpoint
    from quantize.engine import stream
    from quantize.tensor_plan import build

    root = tmp_path_factory.mktemp("converted")
    outs = {}
    for kind, r in RECIPE_FOR.items():
        plan = build(Checkpoint(fixtures_dir / kind), recipe.load(RECIPES / f"{r}.yaml"), max_shard_size=2**20)
        stream.run(plan, root / kind)
        outs[kind] = root / kind
    return outs


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


MODEL_FREE = r"""
import json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the library prints goes to the log, never between the replies
from llmcompressor.entrypoints.model_free import model_free_ptq
for line in sys.stdin:
    job = json.loads(line)
    try:
        model_free_ptq(job["src"], job["out"], scheme=job["scheme"], ignore=job["ignore"], max_workers=1, device="cpu")
        replies.write(json.dumps({"ok": True}) + "\n")
    except Exception:
        replies.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
    replies.flush()
"""


@pytest.fixture(scope="session")
def model_free_ptq(tmp_path_factory):
    """llm-compressor's model_free_ptq(src, out, scheme, ignore): the reference of the model-free schemes. It runs
    in a process of its own (llm-compressor rewrites transformers' globals), one for the session: importing it
    takes 13 s of an AVX2 CPU, and ten tests ask it for a reference."""
    import subprocess

    log = tmp_path_factory.mktemp("model-free") / "log.txt"
    proc = None

    def run(src: Path, out: Path, scheme: str, ignore: list[str]) -> None:
        nonlocal proc
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-c", MODEL_FREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log.open("w"), text=True)
        proc.stdin.write(json.dumps({"src": str(src), "out": str(out), "scheme": scheme, "ignore": ignore}) + "\n")
        proc.stdin.flush()
        reply = proc.stdout.readline()
        assert reply, f"model_free_ptq's process ended:\n{log.read_text()[-3000:]}"
        reply = json.loads(reply)
        assert reply["ok"], reply["error"]

    yield run
    if proc is not None:
        proc.stdin.close()
        proc.wait(timeout=120)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct rebuilt by ../shared/scripts/build_smollm2.py (about a minute, then cached in the
    git-ignored .cache/ of the checkout)."""
    import fcntl
    import subprocess

    out = ROOT / ".cache" / "smollm2"
    out.parent.mkdir(exist_ok=True)
    with open(ROOT / ".cache" / "smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build when several test workers ask at once
        if not (out / "model.safetensors").exists():
            script = ROOT.parent / "shared" / "scripts" / "build_smollm2.py"
            subprocess.run([sys.executable, str(script), str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def eval_cache(tmp_path_factory) -> Path:
    """One results cache for the tests that gate on SmolLM2: a model is evaluated once per task and settings
    (results are keyed by content, task definition and settings, as for any user), so the RTN candidate that
    several tests and the README gate is evaluated once in a session."""
    return tmp_path_factory.mktemp("quantize-cache") / "eval"  # as QUANTIZE_CACHE=<parent> lays it out


def dies_on_call(monkeypatch, owner, name: str, n: int, run) -> None:
    """`run()` with owner.name raising an I/O error on its n-th call (the shards before it are finished), then
    owner.name restored: an interrupted conversion to resume."""
    real, calls = getattr(owner, name), []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise OSError(5, "I/O error")
        return real(*a, **k)

    monkeypatch.setattr(owner, name, dying)
    with pytest.raises(OSError):
        run()
    monkeypatch.setattr(owner, name, real)
