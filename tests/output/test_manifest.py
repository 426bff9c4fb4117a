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
    with pytest.raises(OutputConflict, match=r"not empty \(somebody-elses.csv\) and has no _job.json"):
        prepare_output(fs, root, make_manifest(FP), "resume")


def test_corrupt_manifest_and_bad_mode(output_url: str) -> None:
    fs, root = fs_root(output_url)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{JOB_FILE}", b"[1, 2")
    with pytest.raises(OutputConflict, match="_job.json is not a job manifest"):
        prepare_output(fs, root, make_manifest(FP), "resume")
    with pytest.raises(OutputConflict, match="output.mode must be one of resume, overwrite, fail_if_exists"):
        prepare_output(fs, root, make_manifest(FP), "append")
