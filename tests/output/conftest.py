"""Fixtures for the output tests: output filesystems (local, memory://, a real S3 API from moto)."""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator

import fsspec
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint(monkeypatch_session_env) -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1; s3fs (and child processes) reach it through AWS_* env."""
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    monkeypatch_session_env.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch_session_env.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch_session_env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch_session_env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def monkeypatch_session_env() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket; returns its s3:// URL."""
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
    return f"s3://{name}"


@pytest.fixture(params=["local", "memory", "s3"])
def output_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """An empty output location on each kind of filesystem the job supports."""
    if request.param == "local":
        yield str(tmp_path / "out")
    elif request.param == "memory":
        url = f"memory://out-{uuid.uuid4().hex[:12]}"
        yield url
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
    else:
        yield f"{request.getfixturevalue('s3_bucket')}/out"


@pytest.fixture(scope="session")
def job_runner(tmp_path_factory) -> Iterator:
    """Forks `python -m pipeline` runs from one preloaded process (tests/output/zygote.py)."""
    from tests.output.jobs import JobRunner

    runner = JobRunner(tmp_path_factory.mktemp("jobs"))
    yield runner
    runner.close()


TOPICS = ["the sea", "a cat", "rain", "bread", "the moon", "trains", "music", "snow"]


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    """48 prompt rows (int ids) with shared prefixes, as one Parquet file."""
    from tests.output.jobs import write_prompts

    rows = [{"id": 1000 + i, "prompt": f"Write one line about {TOPICS[i % 8]}, variant {i // 8}."} for i in range(48)]
    return write_prompts(tmp_path_factory.mktemp("input") / "prompts.parquet", rows)


@pytest.fixture(scope="session")
def job_args(tiny_model_dir, prompts_file) -> list[str]:
    """Arguments shared by the whole-run tests: tiny model, small parts, short greedy completions."""
    return [f"input.path={prompts_file}", f"model.path={tiny_model_dir}", "sampling.max_tokens=5",
            "output.rows_per_part=2", "engine.kv_cache_memory=32MiB", "engine.max_batch_size=16",
            "progress.mode=off", "model.quant=none"]
