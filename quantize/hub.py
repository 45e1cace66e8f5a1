"""Resolve SRC (a Hub repo id `org/name[@revision]` or a local folder) to a local snapshot folder."""

import hashlib
import os
import re
from pathlib import Path

from quantize.errors import QuantizeError, UsageError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# What a conversion needs; pickle weights (*.bin, *.pt) are never fetched.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.py",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "tokenizer*",
    "*.md",
    "LICENSE*",
]


def split_revision(src: str) -> tuple[str, str | None]:
    repo_id, _, revision = src.partition("@")
    return repo_id, revision or None


def is_repo_id(src: str) -> bool:
    return bool(REPO_ID.match(src)) and not src.startswith((".", "/", "~"))


def check_local(src: str) -> Path | None:
    """The local folder SRC names, or None when SRC can only be a Hub repo id; a path that cannot be either is
    an error here, before anything is imported or fetched."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UsageError(f"SRC {src} is a file; pass the model folder or a Hub repo id (org/name)")
    if not is_repo_id(src) or _looks_local(path):
        parent = next((p for p in path.parents if p.is_dir() and str(p) != "."), None)
        where = f": {parent}/ has no {path.relative_to(parent).parts[0]}" if parent else ""
        raise UsageError(f"SRC {src} does not exist{where}; pass an existing model folder"
                         + ("" if _looks_local(path) or not REPO_ID.match(src) else " or a Hub repo id (org/name)"))
    return None


def _looks_local(path: Path) -> bool:
    """`fixtures/x` where ./fixtures is a folder is a path that is missing, not a Hub repo named fixtures/x."""
    return len(path.parts) > 1 and Path(path.parts[0]).is_dir()


def resolve(src: str) -> tuple[Path, dict]:
    """(local folder, source info for the manifest). Downloads into the normal HF cache when needed."""
    path = check_local(src)
    if path is not None:
        return path, {"path": str(path.resolve())}
    return download(src)


def fetch_config(src: str) -> Path:
    """config.json of a Hub repo id (into the HF cache, or from it when offline), for what needs only the shapes."""
    from huggingface_hub import hf_hub_download

    return _from_hub(src, lambda repo_id, revision: Path(hf_hub_download(repo_id, "config.json", revision=revision)),
                     "its config.json", "pass a local config.json or model folder, or run where the Hub is reachable")


def download(src: str) -> tuple[Path, dict]:
    from huggingface_hub import snapshot_download

    repo_id, revision = split_revision(src)
    folder = _from_hub(src, lambda r, v: Path(snapshot_download(r, revision=v, allow_patterns=ALLOW_PATTERNS)),
                       "it", f"run `quantize download {src}` where the Hub is reachable, or pass a local folder")
    checked = check_blobs(folder)
    return folder, {"repo_id": repo_id, "revision": folder.name, "requested_revision": revision, "sha256_checked": checked}


def _from_hub(src: str, fetch, what: str, fix: str):
    """fetch(repo_id, revision), huggingface_hub's errors turned into one line that says what to do; `what` is
    what was fetched (for a cache miss while offline) and `fix` the way out of that miss."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, revision = split_revision(src)
    try:
        return fetch(repo_id, revision)
    except GatedRepoError as e:
        raise QuantizeError(f"{repo_id} is gated: accept its licence on the Hub and set HF_TOKEN") from e
    except RepositoryNotFoundError as e:
        raise QuantizeError(f"{src} is not a local folder, and {repo_id} is not a repo on the Hub (or it is private: "
                            "set HF_TOKEN)") from e
    except RevisionNotFoundError as e:
        raise QuantizeError(f"{repo_id} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise QuantizeError(f"{src} is not a local folder, and as a Hub repo id {what} is not in the HF cache and the "
                            f"Hub cannot be reached{offline}; {fix}") from e
    except EntryNotFoundError as e:
        raise QuantizeError(f"{src} has no {what} on the Hub") from e
    except HfHubHTTPError as e:
        raise QuantizeError(f"Hub error for {src}: {e}".splitlines()[0]) from e
    except OSError as e:
        raise QuantizeError(f"cannot download {src}: {e}") from e


def check_blobs(folder: Path) -> int:
    """Check each file of a Hub snapshot against the sha256 the Hub published for it.

    In the HF cache a snapshot's files link to `blobs/<etag>`, and the etag of an LFS file (every weight
    shard) is its sha256: the Hub's own checksum, kept without asking the network again. Returns the number
    of files checked; a mismatch is an error naming the file."""
    n = 0
    for p in sorted(folder.rglob("*")):
        etag = hub_sha256(p) if p.is_file() else None
        if etag is None:
            continue
        with open(p, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()  # streamed through a small buffer
        if digest != etag:
            raise QuantizeError(f"{p.relative_to(folder)}: its sha256 differs from the Hub's ({etag[:12]}...); the "
                                f"download is corrupt: delete {p.resolve()} and run `quantize download` again")
        n += 1
    return n


def snapshot_roots(folder: Path) -> list[Path]:
    """The folders a checkpoint's files may live in, resolved: the folder itself and, for a snapshot in the HF
    cache (`models--org--name/snapshots/REV/`, whose files link to `../../blobs/<sha256>`), its repo's blobs/."""
    root = Path(folder).resolve()
    blobs = root.parent.parent / "blobs"
    return [root, blobs] if root.parent.name == "snapshots" and blobs.is_dir() else [root]


def hub_sha256(path: Path) -> str | None:
    """The sha256 the Hub published for a file of an HF-cache snapshot: the name of the blob it links to, for
    LFS files. None for other files (a small git file's etag is a git blob sha1, not a content sha256)."""
    if not path.is_symlink():
        return _local_dir_sha256(path)
    etag = path.resolve().name
    return etag if _is_sha256(etag) else None


def _is_sha256(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def _local_dir_sha256(path: Path) -> str | None:
    """The Hub's sha256 of a file `hf download --local-dir` put there: the etag its metadata file records
    (.cache/huggingface/download/NAME.metadata: commit, etag, timestamp), trusted as huggingface_hub trusts it,
    while the file is no newer than the record (a second of slack for coarse mtimes). Read only: no lock taken,
    nothing created in the source folder."""
    meta = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    try:
        _commit, etag, stamp = meta.read_text().splitlines()[:3]
        fresh = path.stat().st_mtime - 1 <= float(stamp)
    except (OSError, ValueError):
        return None
    return etag.strip() if fresh and _is_sha256(etag.strip()) else None


def release_target(repo_id: str, tag: str | None) -> str | None:
    """The commit the repo's main points to now (None for a repo not created yet), read before hours of work; the
    release commits on top of exactly this one (upload_release). A --revision-tag that already exists is refused
    here: a tag names one release, and moving it would change what a pinned deployment loads."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        refs = HfApi().list_repo_refs(repo_id)
    except RepositoryNotFoundError:
        return None
    except (HfHubHTTPError, OSError) as e:
        raise QuantizeError(f"cannot read the refs of {repo_id} on the Hub: {str(e).splitlines()[0]}") from e
    taken = next((t for t in refs.tags if t.name == tag), None) if tag else None
    if taken is not None:
        raise UsageError(f"--revision-tag {tag} already exists on {repo_id} (commit {taken.target_commit[:12]}); a tag "
                         "names one release: choose another tag")
    return next((b.target_commit for b in refs.branches if b.name == "main"), None)


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def upload_release(repo_id: str, files: list[dict], message: str, description: str, *, private: bool, tag: str | None,
                   parent: str | None = None) -> dict:
    """Create the repo if needed and commit every file (`path_in_repo`, `local`) in one commit on top of `parent`
    (release_target's commit: if another release pushed since, the Hub refuses the commit and nothing changes);
    tag it when asked. LFS blobs the Hub already has are not sent again, so a rerun after a broken upload resumes."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()  # token: HF_TOKEN or the HF cache, resolved by huggingface_hub and never echoed here
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        ops = [CommitOperationAdd(path_in_repo=f["path_in_repo"], path_or_fileobj=f["local"]) for f in files]
        info = api.create_commit(repo_id, operations=ops, commit_message=message, commit_description=description,
                                 repo_type="model", parent_commit=parent)
    except (HfHubHTTPError, ValueError, OSError) as e:  # ValueError: the Hub rejected the card's metadata
        if _status(e) == 412:
            raise QuantizeError(f"{repo_id} changed while this release ran (main is no longer {parent[:12]}: another "
                                "release pushed to it); nothing was committed: rerun to release on top of it, or "
                                "publish to another --repo-id") from e
        raise QuantizeError(f"upload to {repo_id} failed: {str(e).splitlines()[0]}; rerun the release to resume "
                            "(files the Hub already has are not sent again)") from e
    out = {"url": str(info.commit_url), "oid": info.oid}
    if tag:
        try:
            api.create_tag(repo_id, tag=tag, revision=info.oid, tag_message=message)
        except HfHubHTTPError as e:
            why = ("another run created it while this one ran" if _status(e) == 409 else str(e).splitlines()[0])
            raise QuantizeError(f"the release is committed ({info.commit_url}) but tag {tag} was not set: {why}; "
                                f"tag {info.oid[:12]} by hand if it is the release to name") from e
        out["tag"] = tag
    return out


def check_token() -> None:
    """Fail before hours of work when there is no token to upload with (the value itself is never shown)."""
    from huggingface_hub import get_token

    if not get_token():
        raise UsageError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or pass --dry-run)")
