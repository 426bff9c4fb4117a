"""Models from any fsspec URL (s3://, gs://, http(s)://, ...): copied once into a local cache, then loaded
from there like any local file or directory.

The copy of `<url>` lives in `<cache_dir>/<sha256(url)[:16]>/<url's last name>` (so the loaded model keeps
its own name). A file lock next to it makes concurrent jobs (Slurm array tasks on one node, or on a shared
file system) download once: the first takes the lock and copies, the others wait and find the copy done.
Files are streamed into a temporary folder while their sha256 is computed, each size is checked against
the listing, and `MANIFEST` (url, files, sizes, sha256) is written last, after the folder is moved into
place; a copy without it is incomplete and is redone. With the manifest present nothing remote is touched:
delete the cache entry to fetch a changed model again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import fsspec
from filelock import FileLock

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_CHUNK = 8 << 20


def is_url(path: str) -> bool:
    """Whether `path` names a remote (non-local) location fsspec must fetch."""
    protocol = path.split("://", 1)[0] if "://" in path else "file"
    return protocol not in ("file", "local")


def package_cache_dir(name: str) -> Path:
    """`$XDG_CACHE_HOME/llm-batch-pipeline/<name>` (`~/.cache/...` when unset): where the package keeps
    what it can rebuild."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llm-batch-pipeline" / name


def default_cache_dir() -> Path:
    """Local copies of remote models: `package_cache_dir("models")`."""
    return package_cache_dir("models")


def cached_model(url: str, cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """(local path of `url`'s copy, whether this call downloaded it). Raises FileNotFoundError when `url`
    does not exist, OSError when the copy fails."""
    entry = Path(cache_dir or default_cache_dir()) / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    name = url.rstrip("/").rsplit("/", 1)[-1] or "model"
    local = entry / name
    if (entry / MANIFEST).is_file():
        return local, False
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if (entry / MANIFEST).is_file():  # another job copied it while we waited
            return local, False
        _download(url, entry, name)
    return local, True


def _download(url: str, entry: Path, name: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.exists(root):
        raise FileNotFoundError(f"model.path={url!r} does not exist")
    if fs.isdir(root):
        listing = {p: info for p, info in fs.find(root, detail=True).items() if info.get("type") != "directory"}
        files = {os.path.relpath(p, root): info for p, info in listing.items()}
    else:
        files = {"": fs.info(root)}
    log.info("copying %s (%d files, %d bytes) into %s", url, len(files), sum(i.get("size") or 0 for i in files.values()), entry)
    partial = entry.with_name(entry.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(entry, ignore_errors=True)  # a copy without MANIFEST never finished
    record = {}
    for rel, info in sorted(files.items()):
        target = partial / name / rel if rel else partial / name
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with fs.open(info["name"], "rb") as src, open(target, "wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        size = target.stat().st_size
        if info.get("size") is not None and size != info["size"]:
            raise OSError(f"copy of {info['name']} has {size} bytes, the listing says {info['size']}")
        record[rel or name] = {"bytes": size, "sha256": digest.hexdigest()}
    os.replace(partial, entry)
    manifest = entry / MANIFEST
    manifest.with_suffix(".tmp").write_text(json.dumps({"url": url, "files": record}, indent=1))
    os.replace(manifest.with_suffix(".tmp"), manifest)
