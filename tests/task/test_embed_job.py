"""task=embed on the tiny random model (in-process `pipeline.job.run`), against transformers in float32."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import load_job_config
from pipeline.job import run
from pipeline.model.loader import load_model
from tests.task.reference import pooled, reference_hidden
from tests.test_config import compose_job

OPENING = "The same opening words, long enough to fill more than one block of sixteen tokens in the cache:"
TEXTS = [f"{OPENING} then one ending.", f"{OPENING} then another ending.", "Something else entirely", "x"]


def embed_job(model_dir, inp, out, *overrides):
    return load_job_config(compose_job(
        f"input.path={inp}", f"output.path={out}", f"model.path={model_dir}", "engine.kv_cache_memory=16MiB",
        "progress.mode=off", "model.quant=none", "task=embed", "input.chat_template=false", *overrides))


@pytest.mark.parametrize(("pooling", "normalize"), [("last", True), ("mean", False)])
def test_embeddings_match_transformers(tmp_path, tiny_model_dir, tiny_reference, pooling, normalize):
    rows = [{"id": i, "prompt": t} for i, t in enumerate(TEXTS)] + [{"id": 9, "prompt": "  "}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    metrics = run(embed_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", f"embed.pooling={pooling}",
                            f"embed.normalize={str(normalize).lower()}", "engine.block_size=16"), stdout=io.StringIO())
    table = pq.read_table(tmp_path / "out")
    field = table.schema.field("embedding")
    assert field.type == pa.list_(pa.float32(), 128)  # the tiny model's hidden size
    assert field.metadata == {b"pooling": pooling.encode(), b"normalize": str(normalize).lower().encode()}
    assert table.column_names == ["id", "embedding", "prompt_tokens", "cached_tokens", "error"]
    out = {r["id"]: r for r in table.to_pylist()}
    tokenizer = load_model(tiny_model_dir).tokenizer
    for i, text in enumerate(TEXTS):
        ids = tokenizer.encode(text)
        want = pooled(reference_hidden(tiny_reference, ids), pooling, normalize)
        got = torch.tensor(out[i]["embedding"])
        assert out[i]["error"] is None and out[i]["prompt_tokens"] == len(ids)
        assert (got - want).abs().max() < 1e-4, i
    assert out[9]["embedding"] is None and out[9]["error"] == "prompt is empty (column 'prompt')"
    assert metrics["error_rows"] == 1 and metrics["generated_tokens"] == 0
    # last pooling reuses the shared opening's cached blocks; mean pooling needs every position computed
    assert (metrics["cached_tokens"] > 0) == (pooling == "last")
    # a fixed-size list reads back as a 2-D array
    matrix = np.stack(table.filter(pa.compute.is_valid(table["embedding"]))["embedding"].to_numpy(zero_copy_only=False))
    assert matrix.shape == (len(TEXTS), 128) and matrix.dtype == np.float32


def test_a_prompt_may_fill_max_model_len(tmp_path, tiny_model_dir):
    """Nothing is generated, so no room is kept after the prompt: 24 tokens fit max_model_len=24, 25 do not
    (unless cut on the left)."""
    tokenizer = load_model(tiny_model_dir).tokenizer
    words = [" word"] * 30
    fits = next(n for n in range(30) if len(tokenizer.encode("".join(words[:n]))) == 24)
    texts = ["".join(words[:fits]), "".join(words[: fits + 1])]
    pq.write_table(pa.table({"id": [0, 1], "prompt": texts}), tmp_path / "in.parquet")
    run(embed_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "engine.max_model_len=24"),
        stdout=io.StringIO())
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert out[0]["error"] is None and out[0]["prompt_tokens"] == 24
    assert out[1]["error"] == "prompt has 25 tokens; max_model_len=24 allows 24 (input.truncate=left keeps the last 24)"
