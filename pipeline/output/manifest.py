"""Job manifest `_job.json`: the fingerprint of everything that determines the outputs.

Why: resuming is only correct if the rows already committed are the rows this run would have produced.
The manifest records model identity, sampling, template, input listing and plan; a restart compares its
own fingerprint with the stored one and refuses, naming what changed, unless `output.mode=overwrite`.

`output.mode`:
- `resume` (default): start fresh, or continue a run with the same fingerprint; a complete output is a no-op.
- `overwrite`: delete what the job in the output wrote (the files its manifest and ledger name: parts of its
  plan, ledger records, metrics, report, `_SUCCESS`, `_job.json`) and start fresh. Nothing else is touched;
  a non-empty folder without a manifest is refused, naming what `overwrite_all` would delete.
- `overwrite_all`: delete everything in the output folder (but the live lease) and start fresh.
- `fail_if_exists`: refuse any output that already holds a job.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

import fsspec

from pipeline.errors import JobError
from pipeline.faults import fault_point
from pipeline.output.lease import LEASE_DIR
from pipeline.output.ledger import (
    PART_SUFFIXES,
    PROGRESS_DIR,
    SUCCESS_FILE,
    CommitRecord,
    LedgerError,
    part_name,
    write_whole,
)
from pipeline.output.sink import METRICS_FILE, REPORT_DIR
from pipeline.plan.units import InputFile, WorkPlan

JOB_FILE = "_job.json"
MODES = ("resume", "overwrite", "overwrite_all", "fail_if_exists")
# What jobs before the dataset-clean layout wrote beside the parts (overwrite removes them too).
_LEGACY_METRICS = re.compile(r"metrics(-shard-\d{5}-of-\d{5})?\.json")
_OURS_SHARDED = re.compile(rf"({re.escape(METRICS_FILE.removesuffix('.json'))}|{REPORT_DIR})-shard-\d{{5}}-of-\d{{5}}(\.json)?")
MAX_LISTED_CHANGES = 8


class OutputConflict(JobError):
    """The output cannot be used by this job as configured; the message says why and what to do."""


def make_manifest(fingerprint: Mapping[str, Any], inputs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Canonical manifest: the fingerprint as plain JSON plus its digest.

    `inputs` (input file name -> URL) is recorded outside the digest, for `verify` to re-check the
    input's content: the same files under another spelling are the same job."""
    canon = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()
    return {"digest": digest, "fingerprint": canon, **({"inputs": dict(inputs)} if inputs else {})}


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


def plan_of(manifest: Mapping[str, Any]) -> WorkPlan | None:
    """The work plan a manifest was written for (None for a manifest without one)."""
    plan = manifest["fingerprint"].get("plan")
    if plan is None:
        return None
    return WorkPlan(tuple(InputFile(*f) for f in plan["files"]), plan["window_rows"], plan["rows_per_part"])


def _entries(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Names directly in the output folder (none if it does not exist)."""
    fs.invalidate_cache(root)
    try:
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
    except FileNotFoundError:
        return []


def _recorded_parts(fs: fsspec.AbstractFileSystem, root: str) -> set[str]:
    """Part names the ledger records name (unreadable records name none: they are deleted anyway)."""
    parts = set()
    for path in fs.glob(posixpath.join(root, PROGRESS_DIR, "*.json")):
        try:
            parts.add(CommitRecord.from_json(fs.cat_file(path), path).part)
        except (LedgerError, OSError):
            continue
    return parts


def job_files(fs: fsspec.AbstractFileSystem, root: str, stored: Mapping[str, Any]) -> list[str]:
    """Names in the output folder that the job of manifest `stored` wrote: what `overwrite` deletes.

    Its manifest, ledger, `_SUCCESS`, metrics and report, the parts of its plan and of its ledger
    records, and the temp files of interrupted writes of those. Never a name the job could not have made.
    """
    plan = plan_of(stored)
    parts = {part_name(u.id, s) for u in plan.units() for s in PART_SUFFIXES} if plan is not None else set()
    parts |= _recorded_parts(fs, root)

    def made(name: str) -> bool:
        return (name in (JOB_FILE, SUCCESS_FILE, PROGRESS_DIR, METRICS_FILE, REPORT_DIR) or name in parts
                or bool(_OURS_SHARDED.fullmatch(name) or _LEGACY_METRICS.fullmatch(name)))

    def temp_of_ours(name: str) -> bool:
        return name.startswith(".") and ".tmp-" in name and made(name[1:].split(".tmp-")[0])

    return [n for n in _entries(fs, root) if made(n) or temp_of_ours(n)]


def _remove(fs: fsspec.AbstractFileSystem, root: str, names: list[str]) -> None:
    for name in names:
        path = posixpath.join(root, name)
        try:
            fs.rm(path, recursive=True)
        except OSError as e:
            raise OutputConflict(f"cannot delete {path} for output.mode=overwrite: {e}") from None


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
    if mode in ("overwrite", "overwrite_all"):
        if num_shards > 1:
            raise OutputConflict(
                f"output.mode={mode} cannot be used with runtime.num_shards > 1 (one shard would delete "
                "another's work); delete the output once, then run the shards with output.mode=resume"
            )
        everything = [n for n in _entries(fs, root) if n != LEASE_DIR]  # the lease is ours, held now
        if mode == "overwrite_all":
            doomed = everything
        elif stored is None and everything:
            listed = ", ".join(everything[:MAX_LISTED_CHANGES])
            more = f" and {len(everything) - MAX_LISTED_CHANGES} more" if len(everything) > MAX_LISTED_CHANGES else ""
            raise OutputConflict(
                f"output.path {root} holds no {JOB_FILE}, so output.mode=overwrite deletes nothing there; "
                f"it holds {listed}{more}. Choose a new output.path, or use output.mode=overwrite_all to "
                "delete all of that"
            )
        else:
            doomed = job_files(fs, root, stored) if stored is not None else []
        # The manifest goes last: an overwrite cut short still names what is left to delete.
        _remove(fs, root, sorted(doomed, key=lambda n: n == JOB_FILE))
        stored, others = None, _user_files(fs, root)
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
    if others and mode == "resume":
        raise OutputConflict(
            f"output.path {root} is not empty ({', '.join(others[:5])}) and has no {JOB_FILE}; "
            "choose a new output.path or use output.mode=overwrite_all to delete what is there"
        )
    fs.makedirs(root, exist_ok=True)
    write_whole(fs, posixpath.join(root, JOB_FILE), json.dumps(manifest, indent=1).encode(), "manifest")
    fault_point("manifest.after_write")
    return "fresh"
