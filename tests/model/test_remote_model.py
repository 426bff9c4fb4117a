"""Models from an S3 URL (moto's S3 API server): copied once into the local cache, with checksums; a second
use reads nothing remote; concurrent users download once; the job and `pipeline.roofline` name the model."""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_job_config
from pipeline.job import run
from pipeline.model.loader import load_model
from pipeline.model.remote import MANIFEST, cached_model
from tests.output.conftest import monkeypatch_session_env, s3_bucket, s3_endpoint  # noqa: F401 (fixtures)
from tests.test_config import compose_job


@pytest.fixture
def remote_model(s3_bucket, tiny_model_dir) -> str:  # noqa: F811
    """The tiny checkpoint uploaded to s3://<bucket>/models/tiny-llama (a directory of 6 objects)."""
    import s3fs

    url = f"{s3_bucket}/models/tiny-llama"
    s3fs.S3FileSystem(skip_instance_cache=True).put(f"{tiny_model_dir}/", url, recursive=True)
    return url


def empty_bucket(url: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.rm(url, recursive=True)
    assert not fs.exists(url)


def test_copied_once_with_checksums_then_read_locally(remote_model, tiny_model_dir, tmp_path):
    local, downloaded = cached_model(remote_model, tmp_path / "cache")
    assert downloaded and local.name == "tiny-llama"
    manifest = json.loads((local.parent / MANIFEST).read_text())
    assert manifest["url"] == remote_model
    assert sorted(manifest["files"]) == sorted(p.name for p in tiny_model_dir.iterdir())
    for name, entry in manifest["files"].items():
        data = (local / name).read_bytes()
        assert data == (tiny_model_dir / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    empty_bucket(remote_model)  # the second use must not read a single object
    again, downloaded = cached_model(remote_model, tmp_path / "cache")
    assert again == local and not downloaded
    assert load_model(again).name == "tiny-llama"


def test_an_unfinished_copy_is_redone(remote_model, tmp_path):
    local, _ = cached_model(remote_model, tmp_path / "cache")
    (local.parent / MANIFEST).unlink()  # as if the copying process died before finishing
    (local / "config.json").write_text("garbage")
    local, downloaded = cached_model(remote_model, tmp_path / "cache")
    assert downloaded and json.loads((local / "config.json").read_text())["hidden_size"] == 128


def test_missing_remote_model(s3_bucket, tmp_path):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cached_model(f"{s3_bucket}/nothing-here", tmp_path / "cache")


def _fetch(url: str, cache: str, queue) -> None:
    queue.put(cached_model(url, cache)[1])


def test_concurrent_jobs_download_once(remote_model, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fetch, args=(remote_model, str(tmp_path / "cache"), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert sorted(queue.get(timeout=5) for _ in procs) == [False, False, True]


def test_job_and_plan_name_the_remote_model(remote_model, tmp_path, capsys):
    from pipeline.perf.roofline_cli import main

    pq.write_table(pa.table({"id": [1, 2], "prompt": ["a", "b"]}), tmp_path / "in.parquet")
    overrides = [f"model.path={remote_model}", f"model.cache_dir={tmp_path / 'cache'}"]
    cfg = load_job_config(compose_job(f"input.path={tmp_path / 'in.parquet'}", f"output.path={tmp_path / 'out'}",
                                      "sampling.max_tokens=2", "progress.mode=off", "model.quant=none", *overrides))
    metrics = run(cfg, stdout=io.StringIO())
    assert metrics["model"]["name"] == "tiny-llama"
    meta = pq.read_metadata(next(Path(tmp_path / "out").glob("part-*.parquet"))).metadata
    assert meta[b"pipeline.model"] == b"tiny-llama" and meta[b"pipeline.model_path"] == remote_model.encode()
    assert main([*overrides, "hardware=h100", "roofline.sample_rows=0"]) == 0
    assert "tiny-llama" in capsys.readouterr().out
