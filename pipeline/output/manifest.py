"""Job manifest `_job.json`: the fingerprint of everything that determines the outputs.

Why: resuming is only correct if the rows already committed are the rows this run would have produced.
The manifest records model identity, sampling, template, input listing and plan; a restart compares its
own fingerprint with the stored one and refuses, naming what changed, unless `output.mode=overwrite`.

`output.mode`:
- `resume` (default): start fresh, or continue a run with the same fingerprint; a complete output is a no-op.
- `overwrite`: delete this pipeline's files in the output (not leases, not foreign files) and start fresh.
- `fail_if_exists`: refuse any output that already holds a job.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec

from pipeline.errors import JobError
from pipeline.faults import fault_point
from pipeline.output.lease import LEASE_DIR
from pipeline.output.ledger import SUCCESS_FILE, write_whole

JOB_FILE = "_job.json"
MODES = ("resume", "overwrite", "fail_if_exists")
MAX_LISTED_CHANGES = 8


class OutputConflict(JobError):
    """The output cannot be used by this job as configured; the message says why and what to do."""


def make_manifest(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """Canonical manifest: the fingerprint as plain JSON plus its digest."""
    canon = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()
    return {"digest": digest, "fingerprint": canon}


def describe_changes(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Human-readable differences between two fingerprints, as dotted keys."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old:
                out.append(f"{name} added ({_short(new[key])})")
            elif key not in new:
                out.append(f"{name} removed (was {_short(old[key])})")
            else:
                out.extend(describe_changes(old[key], new[key], name))
        return out
    if isinstance(old, list) and isinstance(new, list) and old != new:
        if len(old) != len(new):
            return [f"{prefix}: {len(old)} entries -> {len(new)} entries"]
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            out.extend(describe_changes(a, b, f"{prefix}[{i}]"))
        return out
    return [] if old == new else [f"{prefix}: {_short(old)} -> {_short(new)}"]


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _user_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Entries of the output that are not our bookkeeping (names starting with '_' or '.')."""
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.startswith(("_", ".")))


def _is_ours(name: str) -> bool:
    """What `overwrite` deletes: parts, metrics and bookkeeping; never live leases or foreign files."""
    return name != LEASE_DIR and (name.startswith(("part-", "metrics", "_", ".")))


def read_manifest(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any] | None:
    path = posixpath.join(root, JOB_FILE)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(data)
        manifest["digest"], manifest["fingerprint"]  # noqa: B018 - shape check
        return manifest
    except (ValueError, KeyError, TypeError):
        raise OutputConflict(f"{path} is not a job manifest; remove it or use another output.path") from None


def check_not_a_file(fs: fsspec.AbstractFileSystem, root: str) -> None:
    fs.invalidate_cache(root)
    if fs.isfile(root):
        raise OutputConflict(f"output.path {root} is a file; it must be a directory (or a prefix in a bucket)")


def prepare_output(
    fs: fsspec.AbstractFileSystem, root: str, manifest: dict[str, Any], mode: str, num_shards: int = 1
) -> str:
    """Check the output against this job and make it ready. Returns 'fresh', 'resume' or 'complete'.

    Call it while holding the lease, so that `overwrite` cannot delete a live writer's work.
    """
    if mode not in MODES:
        raise OutputConflict(f"output.mode must be one of {', '.join(MODES)}, got {mode!r}")
    check_not_a_file(fs, root)
    stored = read_manifest(fs, root)
    others = _user_files(fs, root)
    if mode == "fail_if_exists" and (stored is not None or others):
        raise OutputConflict(
            f"output.path {root} already holds {'a job' if stored else 'files'} and output.mode=fail_if_exists; "
            "choose a new output.path or use output.mode=resume|overwrite"
        )
    if mode == "overwrite":
        if num_shards > 1:
            raise OutputConflict(
                "output.mode=overwrite cannot be used with runtime.num_shards > 1 (one shard would delete "
                "another's work); delete the output once, then run the shards with output.mode=resume"
            )
        for path in fs.ls(root, detail=False) if fs.exists(root) else []:
            if _is_ours(posixpath.basename(path.rstrip("/"))):
                fs.rm(path, recursive=True)
        stored, others = None, []
    if stored is not None:
        if stored["digest"] != manifest["digest"]:
            changes = describe_changes(stored["fingerprint"], manifest["fingerprint"])
            listed = "; ".join(changes[:MAX_LISTED_CHANGES])
            more = f" (and {len(changes) - MAX_LISTED_CHANGES} more)" if len(changes) > MAX_LISTED_CHANGES else ""
            raise OutputConflict(
                f"output.path {root} holds a job with a different configuration: {listed}{more}. "
                "Resuming would mix outputs of two configurations; use output.mode=overwrite to start again "
                "or choose a new output.path"
            )
        return "complete" if fs.exists(posixpath.join(root, SUCCESS_FILE)) else "resume"
    if others:
        raise OutputConflict(
            f"output.path {root} is not empty ({', '.join(others[:5])}) and has no {JOB_FILE}; "
            "choose a new output.path or use output.mode=overwrite"
        )
    fs.makedirs(root, exist_ok=True)
    write_whole(fs, posixpath.join(root, JOB_FILE), json.dumps(manifest, indent=1).encode(), "manifest")
    fault_point("manifest.after_write")
    return "fresh"
