"""No output may destroy its source: OUT, --prefill-out and release's --work-dir are refused (exit 2, one line,
nothing touched) when they are the source, lie inside it, contain it, or overlap each other; symlinks and the
HF cache's blobs are followed. Every case checks the source's bytes afterwards."""

import hashlib
import shutil

import pytest
from click.testing import CliRunner
from conftest import RECIPES

from quantize.cli import main

RECIPE = str(RECIPES / "dense-w4a16.yaml")


def digest(folder):
    """sha256 over every path, link target and file byte below `folder`."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_symlink():
            h.update(str(p.readlink()).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def src(fixtures_dir, tmp_path):
    dst = tmp_path / "models" / "llama"
    shutil.copytree(fixtures_dir / "llama-bf16", dst)
    return dst


def refused(args, source, *words):
    before = digest(source)
    r = CliRunner().invoke(main, [str(a) for a in args])
    err = r.stderr.strip()
    assert r.exit_code == 2, r.output
    assert len(err.splitlines()) == 1 and ("destroy the source" in err or "overlap" in err), err
    for w in words:
        assert w in err, err
    assert digest(source) == before
    return err


def convert(src, out, *extra):
    return ["convert", src, out, "--recipe", RECIPE, "--overwrite", *extra]


def test_out_equal_to_src_is_refused_and_the_source_is_untouched(src):
    refused(convert(src, src), src, "OUT", "is the source")


def test_out_inside_src_is_refused(src):
    refused(convert(src, src / "int4"), src, "lies inside the source")
    assert not (src / "int4").exists() and not (src / "int4.partial").exists()


def test_out_containing_src_is_refused(src):
    refused(convert(src, src.parent), src, "contains the source")


def test_out_through_a_symlink_to_src_is_refused(src, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    refused(convert(src, link), src, "is the source")
    refused(convert(link, tmp_path / "models"), src, "contains the source")


def test_out_whose_work_folder_is_the_source_is_refused(fixtures_dir, tmp_path):
    source = tmp_path / "llama.partial"
    shutil.copytree(fixtures_dir / "llama-bf16", source)
    refused(convert(source, tmp_path / "llama"), source, "work folder llama.partial", "is the source")


def test_prefill_out_equal_to_out_inside_it_or_equal_to_src_is_refused(src, tmp_path):
    out = tmp_path / "int4"
    refused(convert(src, out, "--prefill-out", out), src, "--prefill-out", "overlap")
    refused(convert(src, out, "--prefill-out", out / "fp8"), src, "overlap")
    refused(convert(src, out, "--prefill-out", src), src, "--prefill-out", "is the source")
    assert not out.exists() and not (tmp_path / "int4.partial").exists()


def hf_cache_snapshot(src, hub):
    """`src` laid out as huggingface_hub downloads it: snapshots/<rev>/<file> links to ../../blobs/<sha256>."""
    repo = hub / "models--org--llama"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("a" * 40)
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / sha)
        (snap / f.name).symlink_to(f"../../blobs/{sha}")
    return repo, blobs, snap


def test_an_hf_cache_snapshot_converts_like_the_plain_folder(src, tmp_path):
    """Its files are links into the repo's blobs/, outside the snapshot folder, and still the checkpoint's own."""
    _, _, snap = hf_cache_snapshot(src, tmp_path / "hub")
    for source, out in ((src, tmp_path / "plain"), (snap, tmp_path / "cached")):
        r = CliRunner().invoke(main, ["convert", str(source), str(out), "--recipe", RECIPE])
        assert r.exit_code == 0, r.output
    for f in sorted((tmp_path / "plain").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "cached" / f.name).read_bytes()


def test_hf_cache_snapshot_blobs_and_repo_folder_are_guarded(src, tmp_path):
    """Losing the blobs folder or the repo folder loses the source although neither is the snapshot folder."""
    repo, blobs, snap = hf_cache_snapshot(src, tmp_path / "hub")
    refused(convert(snap, blobs), repo, "where the source files live")
    refused(convert(snap, repo), repo, "contains the source")
    refused(convert(snap, blobs / "out"), repo, "lies inside")


def test_release_work_dir_overlapping_src_is_refused_without_writing_a_report(src):
    for work in (src, src / "release", src.parent):
        r = CliRunner().invoke(main, ["release", str(src), "--recipe", RECIPE, "--repo-id", "me/x", "--dry-run",
                                      "--work-dir", str(work)])
        assert r.exit_code == 2, r.output
        assert "--work-dir" in r.stderr and "destroy the source" in r.stderr, r.stderr
    assert not (src / "release").exists() and not (src / "release-report.json").exists()
    assert not (src.parent / "release-report.json").exists()
