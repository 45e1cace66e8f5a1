"""`quantize release` end to end on the tiny Llama fixture: convert, verify, plan, a real lm-eval gate on real
ARC data, the model card, and the upload through huggingface_hub itself, whose HTTP transport alone is faked
(an httpx.MockTransport playing the Hub: repo creation, preupload, LFS batch + PUT, the NDJSON commit, tags)."""

import base64
import json
import shutil
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner
from conftest import RECIPES, ROOT, dies_on_call
from huggingface_hub import ModelCard, constants
from huggingface_hub.utils import _http

from quantize import release
from quantize.cli import main
from quantize.engine import shard as engine_shard

DATA = ROOT.parent / "shared" / "data"
TOKEN = "hf_fakeTOKENthatMustNeverBePrinted0123"
REPO = "acme/tiny-llama-w4a16"


class FakeHub:
    """Just enough of the Hub's HTTP API for create_repo, create_commit (LFS for *.safetensors, inline for the
    rest) and create_tag; records what reached it."""

    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        self.lfs: dict[str, bytes] = {}
        self.commits: list[dict] = []
        self.tags: list[dict] = []
        self.repos: list[dict] = []
        self.auth: set[str] = set()
        self.validated: list[dict] = []
        self.head: str | None = None  # main's commit; None until the repo is created
        self.tag_refs: dict[str, str] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((request.method, path))
        if "authorization" in request.headers:
            self.auth.add(request.headers["authorization"])
        if request.method == "POST" and path == "/api/repos/create":
            self.repos.append(json.loads(request.content))
            self.head = self.head or "1" * 40  # the Hub's first commit (.gitattributes)
            return httpx.Response(200, json={"url": f"https://huggingface.co/{REPO}", "name": REPO})
        if request.method == "GET" and path == f"/api/models/{REPO}/refs":
            if self.head is None:
                return httpx.Response(404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "no such repo"})
            ref = [{"name": "main", "ref": "refs/heads/main", "targetCommit": self.head}]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in self.tag_refs.items()]
            return httpx.Response(200, json={"branches": ref, "converts": [], "tags": tags})
        if request.method == "POST" and path == "/api/validate-yaml":  # the README's front matter, before commit
            meta = yaml.safe_load(json.loads(request.content)["content"].split("---")[1])
            self.validated.append(meta)
            ok = meta.get("base_model_relation") in (None, "quantized", "finetune", "adapter", "merge")
            return httpx.Response(200 if ok else 400, json={"warnings": [], "errors": [] if ok else [{"message": "bad"}]})
        if request.method == "POST" and path == f"/api/models/{REPO}/preupload/main":
            files = json.loads(request.content)["files"]
            return httpx.Response(200, json={"files": [
                {"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                 "shouldIgnore": False} for f in files]})
        if request.method == "POST" and path == f"/{REPO}.git/info/lfs/objects/batch":
            objects = json.loads(request.content)["objects"]
            return httpx.Response(200, json={"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"],
                 "actions": {"upload": {"href": f"https://lfs.example/{o['oid']}"}}} for o in objects]})
        if request.method == "PUT" and request.url.host == "lfs.example":
            self.lfs[path.strip("/")] = request.read()
            return httpx.Response(200)
        if request.method == "POST" and path == f"/api/models/{REPO}/commit/main":
            lines = [json.loads(x) for x in request.read().decode().splitlines() if x.strip()]
            parent = next(x["value"] for x in lines if x["key"] == "header").get("parentCommit")
            if parent is not None and parent != self.head:  # what the Hub answers a commit on a stale parent
                return httpx.Response(412, json={"error": "A commit has happened since. Please refresh and try again."})
            self.commits.append({"lines": lines})
            self.head = "abc123" + "0" * 34
            return httpx.Response(200, json={"commitUrl": f"https://huggingface.co/{REPO}/commit/abc123",
                                             "commitOid": "abc123" + "0" * 34})
        if request.method == "POST" and path == f"/api/models/{REPO}/tag/{'abc123' + '0' * 34}":
            tag = json.loads(request.content)
            if tag["tag"] in self.tag_refs:
                return httpx.Response(409, json={"error": f"Tag {tag['tag']} already exists"})
            self.tags.append(tag)
            self.tag_refs[tag["tag"]] = self.head
            return httpx.Response(200, json={})
        return httpx.Response(404, json={"error": f"fake hub: no route {request.method} {path}"})

    def writes(self) -> list[tuple[str, str]]:
        """Requests that change the Hub's API or LFS (the release reads the repo's refs first; the eval's `datasets`
        library also asks the Hub, read-only, for its json loader: those reach this transport too and get a 404)."""
        return [r for r in self.requests if r[0] != "GET" and (r[1].startswith(("/api/", f"/{REPO}")) or r[0] == "PUT")]

    def committed(self) -> dict[str, bytes]:
        """path -> bytes of the last commit, LFS files taken from what was PUT."""
        out = {}
        for line in self.commits[-1]["lines"]:
            if line["key"] == "file":
                out[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] == "lfsFile":
                out[line["value"]["path"]] = self.lfs[line["value"]["oid"]]
        return out

    def header(self) -> dict:
        return next(x["value"] for x in self.commits[-1]["lines"] if x["key"] == "header")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    fake = FakeHub()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("QUANTIZE_CACHE", str(tmp_path / "quantize-cache"))  # baseline results: this test's own
    # hf_xet uploads from Rust, outside the Python transport: off, as HF_HUB_DISABLE_XET=1 does, so LFS goes
    # through the faked httpx client too
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    _http.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(fake), follow_redirects=True))
    yield fake
    _http.set_client_factory(_http.default_client_factory)


@pytest.fixture
def source(fixtures_dir, tmp_path):
    """The Llama fixture as the HF cache holds a Hub download (models--org--name/snapshots/REV), with a model
    card that carries a licence: the release names its base model and copies the licence."""
    snap = tmp_path / "hf-cache" / "models--acme--tiny-llama" / "snapshots" / ("f" * 40)
    shutil.copytree(fixtures_dir / "llama-bf16", snap)
    (snap / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny llama\n")
    return snap


def gate_file(tmp_path, name, limits) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"defaults": limits, "tasks": {"arc_challenge": {"metrics": ["acc,none"]}}}))
    return str(path)


def release_args(source, tmp_path, gate, *extra):
    return ["release", str(source), "--recipe", str(RECIPES / "dense-w4a16.yaml"), "--repo-id", REPO,
            "--gate", gate, "--tasks", "arc_challenge", "--limit", "2", "--data-dir", str(DATA), "--device", "cpu",
            "--work-dir", str(tmp_path / "work"), *extra]


def test_release_with_a_lenient_gate_uploads_the_card_and_every_file_in_one_tagged_commit(hub, source, tmp_path):
    lenient = gate_file(tmp_path, "lenient", {"max_drop": 100, "min_recovery": 0})
    result = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--revision-tag", "v1", "--private"))
    assert result.exit_code == 0, result.output
    work = tmp_path / "work"
    # exactly the converted folder's files, plus the card as README.md, reached the transport
    expected = sorted({p.name for p in (work / "model").iterdir()} | {"README.md"})  # the source's card replaced
    committed = hub.committed()
    assert sorted(committed) == sorted(expected)
    for name, data in committed.items():
        local = work / ("card" if name == "README.md" else "model") / name
        assert data == local.read_bytes(), name
    assert len(hub.commits) == 1 and hub.lfs  # one commit; the shards went through LFS
    assert hub.validated[0]["base_model"] == "acme/tiny-llama"  # the card's metadata as the Hub checked it
    assert hub.header()["summary"] == "quantize release: " + str(source) + " -> w4a16 g128 sym (rtn, recipe dense-w4a16)"
    assert hub.tags == [{"tag": "v1", "message": hub.header()["summary"]}]
    assert hub.repos[0]["visibility"] == "private" and hub.repos[0]["name"] == "tiny-llama-w4a16"
    assert hub.auth == {f"Bearer {TOKEN}"}  # the token went to the Hub ...
    report = (work / release.REPORT_JSON).read_text()
    assert TOKEN not in result.output and TOKEN not in report  # ... and nowhere else
    # the card: Hub metadata and what a serving engineer needs
    card = ModelCard.load(work / "card" / "README.md")
    assert card.data.base_model == "acme/tiny-llama" and card.data.base_model_relation == "quantized"
    assert card.data.license == "apache-2.0" and "compressed-tensors" in card.data.tags
    for text in ("w4a16 g128 sym", "## What fits", "Gate: **PASS**", "| arc_challenge | acc,none |",
                 f"vllm serve {REPO} --tensor-parallel-size 2", f"sglang.launch_server --model-path {REPO} --tp 2"):
        assert text in card.text, text
    doc = json.loads(report)
    assert doc["released"] is True and doc["exit_code"] == 0 and doc["commit"]["tag"] == "v1"
    assert [s["name"] for s in doc["steps"]] == ["convert", "verify", "plan", "eval", "card", "upload"]

    # a rerun reuses the finished conversion (same recipe) and commits the same files again
    again = CliRunner().invoke(main, release_args(source, tmp_path, lenient))
    assert again.exit_code == 0, again.output
    assert json.loads((work / release.REPORT_JSON).read_text())["steps"][0]["status"] == "reused"
    assert sorted(hub.committed()) == sorted(expected)


def test_release_with_a_strict_gate_uploads_nothing_and_exits_1(hub, source, tmp_path):
    strict = gate_file(tmp_path, "strict", {"max_drop": 0, "min_recovery": 1.5})  # recovery 1.5 x: never met
    result = CliRunner().invoke(main, release_args(source, tmp_path, strict))
    assert result.exit_code == 1, result.output
    assert hub.writes() == []  # not even the repo was created
    doc = json.loads((tmp_path / "work" / release.REPORT_JSON).read_text())
    assert doc["released"] is False and doc["exit_code"] == 1
    assert [(s["name"], s["status"]) for s in doc["steps"]][-1] == ("eval", "failed")
    assert "gate failed" in (tmp_path / "work" / release.REPORT_MD).read_text()


def test_release_dry_run_resumes_a_broken_conversion_and_errors(hub, source, tmp_path, monkeypatch):
    from quantize import recipe
    from quantize.checkpoint import Checkpoint
    from quantize.engine import stream
    from quantize.tensor_plan import build

    # a release job that died while converting: two of its shards are written
    plan = build(Checkpoint(source), recipe.load(RECIPES / "dense-w4a16.yaml"), 300_000)
    dies_on_call(monkeypatch, engine_shard, "write_shard_pair", 3, lambda: stream.run(plan, tmp_path / "work" / "model"))
    lenient = gate_file(tmp_path, "lenient", {"max_drop": 100, "min_recovery": 0})
    result = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--dry-run", "--max-shard-size", "300KB"))
    assert result.exit_code == 0, result.output
    assert "2 resumed" in result.output
    assert hub.writes() == [] and "would commit" in result.output and "model-00001-of-00005.safetensors" in result.output
    doc = json.loads((tmp_path / "work" / release.REPORT_JSON).read_text())
    assert doc["released"] is False and doc["steps"][-1]["status"] == "dry-run"
    assert doc["steps"][0]["status"] == "resumed"
    assert {f["path_in_repo"] for f in doc["files"]} >= {"README.md", "config.json", "quantize-manifest.json"}
    # no token: refused before any work, exit 2, the report says why
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    none = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--work-dir", str(tmp_path / "w2")))
    assert none.exit_code == 2 and "no Hugging Face token" in none.output
    assert json.loads((tmp_path / "w2" / release.REPORT_JSON).read_text())["exit_code"] == 2
    # a Hub that refuses the commit: exit 2, nothing tagged
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def refuse(request):
        if "/commit/" in request.url.path:
            return httpx.Response(403, json={"error": "forbidden"})
        return FakeHub.__call__(hub, request)

    _http.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(refuse), follow_redirects=True))
    refused = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--max-shard-size", "300KB"))
    assert refused.exit_code == 2 and "upload to acme/tiny-llama-w4a16 failed" in refused.output
    assert hub.tags == [] and TOKEN not in refused.output


def _held_by_another_process(folder: Path, doing: str):
    """A child process that holds folder as a live job would, until killed."""
    import subprocess
    import sys

    code = (f"from pathlib import Path; from quantize import lock; lock.hold(Path({str(folder)!r}), {doing!r}); "
            "print('held', flush=True); input()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_two_releases_into_one_work_dir_or_one_repo_are_refused(hub, source, tmp_path):
    """A second release sharing the first's work dir, or (on this machine) its Hub repo, is refused at once (exit
    2), naming the live one; it writes no report into the other's work dir and sends nothing to the Hub."""
    from quantize import cache_root

    lenient = gate_file(tmp_path, "lenient", {"max_drop": 100, "min_recovery": 0})
    work = tmp_path / "work"
    for folder, doing, extra, shown in ((work, "used by a release", ["--dry-run"], str(work)),
                                        (cache_root() / "releases" / REPO.replace("/", "--"), "being released", [], REPO)):
        child = _held_by_another_process(folder, doing)
        try:
            r = CliRunner().invoke(main, release_args(source, tmp_path, lenient, *extra))
        finally:
            child.kill()
            child.wait()
        assert r.exit_code == 2, r.output
        assert f"{shown} is {doing} by PID {child.pid}" in r.stderr and "wait for it or stop it" in r.stderr, r.stderr
        assert not (work / release.REPORT_JSON).exists() and not (work / release.MODEL_DIR).exists()
        assert hub.writes() == []


def test_a_tag_that_exists_is_refused_up_front_and_a_repo_that_moved_refuses_the_commit(hub, source, tmp_path):
    """Two CI runs pushing one --revision-tag: the later is refused before converting (a tag names one release).
    Two runs on different machines pushing one repo: the Hub refuses the commit whose parent is no longer main
    (412), so nothing of the later run lands on top of the other's files unseen."""
    lenient = gate_file(tmp_path, "lenient", {"max_drop": 100, "min_recovery": 0})
    hub.head, hub.tag_refs = "2" * 40, {"v1": "2" * 40}
    r = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--revision-tag", "v1"))
    assert r.exit_code == 2, r.output
    assert "--revision-tag v1 already exists on acme/tiny-llama-w4a16 (commit 222222222222)" in r.stderr
    assert not (tmp_path / "work" / release.MODEL_DIR).exists()  # refused before any work

    def another_push_meanwhile(request):
        if "/preupload/" in request.url.path:
            hub.head = "3" * 40
        return FakeHub.__call__(hub, request)

    _http.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(another_push_meanwhile),
                                                  follow_redirects=True))
    r = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--revision-tag", "v2"))
    assert r.exit_code == 2, r.output
    assert "changed while this release ran (main is no longer 222222222222" in r.stderr
    assert hub.commits == [] and hub.tags == []
    doc = json.loads((tmp_path / "work" / release.REPORT_JSON).read_text())
    assert doc["steps"][-1]["name"] == "upload" and doc["steps"][-1]["status"] == "failed"


def test_base_model_is_the_repo_id_or_the_hf_cache_snapshots_repo():
    from pathlib import Path

    assert release.base_model_id("org/name@main", Path("/nowhere")) == "org/name"
    snap = Path("/x/hub/models--moonshotai--Kimi-K2-Instruct/snapshots/abc")
    assert release.base_model_id(str(snap), snap) == "moonshotai/Kimi-K2-Instruct"
    assert release.base_model_id("./local", Path("/tmp/local")) is None


def test_release_sh_runs_the_job_from_environment_variables_and_keeps_the_artifacts(source, tmp_path):
    import os
    import subprocess
    import sys

    lenient = gate_file(tmp_path, "lenient", {"max_drop": 100, "min_recovery": 0})
    env = {**os.environ, "SRC": str(source), "RECIPE": str(RECIPES / "dense-w4a16.yaml"), "REPO_ID": REPO,
           "GATE": lenient, "TASKS": "arc_challenge", "BACKEND": "hf", "LIMIT": "2", "DRY_RUN": "1", "DATA_DIR": str(DATA),
           "WORK_DIR": str(tmp_path / "work"), "ARTIFACTS": str(tmp_path / "artifacts"),
           "QUANTIZE": f"{sys.executable} -m quantize", "QUANTIZE_CACHE": str(tmp_path / "cache")}
    env.pop("HF_TOKEN", None)
    p = subprocess.run([str(ROOT / "scripts" / "release.sh")], env=env, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert sorted(x.name for x in (tmp_path / "artifacts").iterdir()) == [
        "model-card.md", "release-report.json", "release-report.md"]
    assert "release: done" in p.stdout


def test_release_refuses_to_reuse_a_conversion_of_another_source(hub, source, tmp_path):
    """A finished conversion in the work dir is reused only when it has the fingerprint `--resume` checks: made
    from another source (same tensor names and shapes, other weights), it is refused with the reason, and
    nothing is evaluated against the wrong model."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(source, other)
    shard = other / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, shard, metadata={"format": "pt"})
    from quantize import recipe as recipes
    from quantize.checkpoint import Checkpoint
    from quantize.engine import stream
    from quantize.tensor_plan import build

    work = tmp_path / "work"
    stream.run(build(Checkpoint(other), recipes.load(RECIPES / "dense-w4a16.yaml"), 5 * 10**9), work / release.MODEL_DIR)
    lenient = gate_file(tmp_path, "lenient", {"max_drop": 100, "min_recovery": 0})
    result = CliRunner().invoke(main, release_args(source, tmp_path, lenient, "--dry-run"))
    assert result.exit_code == 2, result.output
    assert "was converted with another source (its files or config)" in result.stderr
    doc = json.loads((work / release.REPORT_JSON).read_text())
    assert [s["name"] for s in doc["steps"]] == ["convert"] and doc["steps"][0]["status"] == "failed"


def test_release_dry_run_of_smollm2_shows_fail_and_inconclusive_verdicts_and_exits_by_them(smollm2, tmp_path,
                                                                                           monkeypatch, eval_cache):
    """The real SmolLM2 released at RTN g64, ARC at 20 items: with --ppl-text the gate FAILs on perplexity (exit 1,
    the report's table shows the FAIL and ARC's INCONCLUSIVE); without it ARC alone is INCONCLUSIVE, which exits
    1 too and says so; --allow-inconclusive exits 0 and the card carries the INCONCLUSIVE verdicts."""
    monkeypatch.setenv("QUANTIZE_CACHE", str(eval_cache.parent))  # the baseline is evaluated once per session
    rec = tmp_path / "smol-g64.yaml"
    rec.write_text((RECIPES / "dense-w4a16.yaml").read_text().replace("group_size: 128", "group_size: 64"))
    work = tmp_path / "work"

    def release_smol(*extra):
        r = CliRunner().invoke(main, ["release", str(smollm2), "--recipe", str(rec), "--repo-id", "me/smol-w4a16",
                                      "--dry-run", "--tasks", "arc_challenge", "--limit", "20", "--data-dir", str(DATA),
                                      "--device", "cpu", "--work-dir", str(work), *extra])
        return r, json.loads((work / release.REPORT_JSON).read_text())

    r, doc = release_smol("--ppl-text", "/usr/share/common-licenses/GPL-3")
    assert r.exit_code == 1, r.output
    md = (work / release.REPORT_MD).read_text()
    assert "gate failed: nothing uploaded" in md and "Gate: **FAIL**" in md and "INCONCLUSIVE" in md
    assert (doc["steps"][-1]["name"], doc["steps"][-1]["status"]) == ("eval", "failed")
    r, doc = release_smol()
    assert r.exit_code == 1 and doc["steps"][0]["status"] == "reused", r.output
    assert doc["steps"][-1]["status"] == "inconclusive"
    assert "gate inconclusive" in (work / release.REPORT_MD).read_text()
    r, doc = release_smol("--allow-inconclusive")
    assert r.exit_code == 0, r.output
    card = (work / release.CARD_DIR / "README.md").read_text()
    assert "Gate: **INCONCLUSIVE (allowed)**" in card and "needs about" in card
