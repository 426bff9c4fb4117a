"""Job manifest: resume only with the same fingerprint; modes resume / overwrite / fail_if_exists."""

from __future__ import annotations

import fsspec
import pytest

from pipeline.output.ledger import Ledger
from pipeline.output.manifest import (
    JOB_FILE,
    OutputConflict,
    describe_changes,
    make_manifest,
    prepare_output,
    read_manifest,
)

FP = {
    "model": {"name": "smollm2-135m", "path": "/m/a.gguf", "dtype": "float32"},
    "sampling": {"max_tokens": 16, "temperature": 0.0},
    "template": {"chat_template": True, "system_prompt": None},
    "input": {"files": [["in/a.parquet", 100, 10], ["in/b.parquet", 200, 20]]},
}


def changed(**section_updates) -> dict:
    out = {k: dict(v) for k, v in FP.items()}
    for dotted, value in section_updates.items():
        section, key = dotted.split("__")
        out[section][key] = value
    return out


def fs_root(url: str):
    return fsspec.core.url_to_fs(url)


def test_fresh_then_resume_then_complete(output_url: str) -> None:
    fs, root = fs_root(output_url)
    m = make_manifest(FP)
    assert prepare_output(fs, root, m, "resume") == "fresh"
    assert read_manifest(fs, root) == m
    assert prepare_output(fs, root, make_manifest(FP), "resume") == "resume"
    Ledger(fs, root).mark_success([])
    assert prepare_output(fs, root, m, "resume") == "complete"


def test_changed_model_is_refused_with_what_changed(output_url: str) -> None:
    fs, root = fs_root(output_url)
    prepare_output(fs, root, make_manifest(FP), "resume")
    new = make_manifest(changed(model__path="/m/b.gguf", sampling__max_tokens=32))
    with pytest.raises(OutputConflict) as err:
        prepare_output(fs, root, new, "resume")
    msg = str(err.value)
    assert 'model.path: "/m/a.gguf" -> "/m/b.gguf"' in msg and "sampling.max_tokens: 16 -> 32" in msg
    assert "output.mode=overwrite" in msg


def test_describe_changes_of_listing() -> None:
    grown = changed(input__files=FP["input"]["files"] + [["in/c.parquet", 5, 1]])
    assert describe_changes(FP, grown) == ["input.files: 2 entries -> 3 entries"]
    resized = changed(input__files=[["in/a.parquet", 100, 10], ["in/b.parquet", 201, 20]])
    assert describe_changes(FP, resized) == ["input.files[1][1]: 200 -> 201"]
    assert describe_changes(FP, changed(template__extra=1)) == ["template.extra added (1)"]


def test_fail_if_exists(output_url: str) -> None:
    fs, root = fs_root(output_url)
    assert prepare_output(fs, root, make_manifest(FP), "fail_if_exists") == "fresh"
    with pytest.raises(OutputConflict, match="fail_if_exists"):
        prepare_output(fs, root, make_manifest(FP), "fail_if_exists")


def test_overwrite_deletes_outputs_but_keeps_leases(output_url: str) -> None:
    fs, root = fs_root(output_url)
    prepare_output(fs, root, make_manifest(FP), "resume")
    ledger = Ledger(fs, root)
    fs.pipe_file(f"{root}/part-000000.parquet", b"part")
    ledger.commit("000000", "part-000000.parquet", 4, [1])
    fs.makedirs(f"{root}/_lease", exist_ok=True)
    fs.pipe_file(f"{root}/_lease/all.json", b"{}")
    fs.pipe_file(f"{root}/metrics.json", b"{}")
    fs.pipe_file(f"{root}/notes.txt", b"the user's")
    new = make_manifest(changed(model__path="/m/b.gguf"))
    assert prepare_output(fs, root, new, "overwrite") == "fresh"
    assert ledger.committed() == {}
    assert not fs.exists(f"{root}/part-000000.parquet") and not fs.exists(f"{root}/metrics.json")
    assert fs.exists(f"{root}/_lease/all.json") and fs.exists(f"{root}/notes.txt")
    assert read_manifest(fs, root) == new
    with pytest.raises(OutputConflict, match="num_shards > 1"):
        prepare_output(fs, root, new, "overwrite", num_shards=4)


USER_FILES = {".git/HEAD": b"ref: refs/heads/main", ".env": b"TOKEN=1", "notes.csv": b"a,b",
              "_drafts/x.md": b"draft", "metrics_2024.csv": b"1", "part-of-my-thesis.tex": b"tex",
              "_metrics-of-mine.json": b"{}"}


def put_user_files(fs, root: str) -> None:
    for name, data in USER_FILES.items():
        fs.makedirs(f"{root}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{name}", data)


def test_overwrite_refuses_a_folder_without_a_job_and_names_what_overwrite_all_would_delete(output_url) -> None:
    fs, root = fs_root(output_url)
    put_user_files(fs, root)
    with pytest.raises(OutputConflict) as err:
        prepare_output(fs, root, make_manifest(FP), "overwrite")
    message = str(err.value)
    assert "holds no _job.json" in message and "output.mode=overwrite_all" in message
    for name in (".env", ".git", "_drafts", "notes.csv", "part-of-my-thesis.tex"):
        assert name in message
    assert all(fs.cat_file(f"{root}/{n}") == d for n, d in USER_FILES.items())  # nothing deleted
    assert prepare_output(fs, root, make_manifest(FP), "overwrite_all") == "fresh"
    assert all(not fs.exists(f"{root}/{n}") for n in USER_FILES)


def test_overwrite_deletes_only_what_the_job_wrote(tmp_path) -> None:
    """A user's `.git/`, `.env`, `notes.csv` (and look-alike names) beside a job survive its overwrite."""
    fs, root = fs_root(str(tmp_path / "out"))
    manifest = make_manifest({**FP, "plan": {"files": [["a.parquet", 10, 4]], "window_rows": 10,
                                             "rows_per_part": 2}})
    prepare_output(fs, root, manifest, "resume")
    put_user_files(fs, root)
    ledger = Ledger(fs, root)
    fs.pipe_file(f"{root}/part-000000.parquet", b"part")
    ledger.commit("000000", "part-000000.parquet", 4, [1])
    fs.pipe_file(f"{root}/part-000001.parquet", b"an interrupted attempt of unit 1")
    fs.pipe_file(f"{root}/.part-000001.parquet.tmp-1-ab", b"half")
    fs.pipe_file(f"{root}/_metrics.json", b"{}")
    fs.makedirs(f"{root}/_report", exist_ok=True)
    fs.pipe_file(f"{root}/_report/report.html", b"<html>")
    fs.pipe_file(f"{root}/_metrics-shard-00001-of-00002.json", b"{}")
    fs.makedirs(f"{root}/_report-shard-00001-of-00002", exist_ok=True)
    fs.pipe_file(f"{root}/_report-shard-00001-of-00002/report.html", b"<html>")
    fs.pipe_file(f"{root}/metrics.json", b"{}")  # the name jobs used before `_metrics.json`
    fs.pipe_file(f"{root}/_SUCCESS", b"")
    assert prepare_output(fs, root, make_manifest(FP), "overwrite") == "fresh"
    left = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert left == sorted([*USER_FILES, JOB_FILE])
    assert all(fs.cat_file(f"{root}/{n}") == d for n, d in USER_FILES.items())


def test_output_path_is_a_file(tmp_path) -> None:
    target = tmp_path / "out.parquet"
    target.write_bytes(b"x")
    fs, root = fs_root(str(target))
    with pytest.raises(OutputConflict, match="is a file"):
        prepare_output(fs, root, make_manifest(FP), "resume")


def test_foreign_files_without_manifest_are_not_adopted(output_url: str) -> None:
    fs, root = fs_root(output_url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/somebody-elses.csv", b"a,b")
    with pytest.raises(OutputConflict, match=r"not empty \(somebody-elses.csv\) and has no _job.json.*overwrite_all"):
        prepare_output(fs, root, make_manifest(FP), "resume")


def test_corrupt_manifest_and_bad_mode(output_url: str) -> None:
    fs, root = fs_root(output_url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{JOB_FILE}", b"[1, 2")
    with pytest.raises(OutputConflict, match="_job.json is not a job manifest"):
        prepare_output(fs, root, make_manifest(FP), "resume")
    with pytest.raises(OutputConflict, match="output.mode must be one of resume, overwrite, overwrite_all, fail_if_exists"):
        prepare_output(fs, root, make_manifest(FP), "append")
