"""task=score and task=embed on the real SmolLM2 (model.quant=none, the exact float job) against transformers
loading the same GGUF in float32, fed the job's own token ids: scores within 1e-3 per token, embeddings within
1e-4, at batch 1 and 64; a prompt shared by candidates and rows is computed once (the job's metrics). Then
the default mode (model.quant=auto), which approximates the float job."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import load_job_config
from pipeline.job import run
from pipeline.model.loader import load_model
from tests.task.reference import pooled, reference_hidden, reference_logprobs
from tests.test_config import compose_job

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Which planet is closest to the sun?", "What is 7 times 8?",
             "Who wrote Hamlet?", "What colour is a ripe banana?", "How many legs does a spider have?",
             "What gas do plants take in?", "Which ocean is the largest?"]
# Candidates that share a prefix with each other ("The answer is ...") and ones that share none.
CANDIDATES = ["The answer is Paris.", "The answer is Mars.", "The answer is 56.", "Shakespeare", "I do not know.",
              "eight"]
SYSTEM = "You are a careful quiz master. Answer in a few words."
BLOCK = 16


def rows(count: int) -> list[dict]:
    """`count` rows: the eight questions cycled, each row with four of the candidates, rotated."""
    return [{"id": i, "prompt": QUESTIONS[i % 8], "candidates": [CANDIDATES[(i + k) % 6] for k in range(4)]}
            for i in range(count)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_model(smollm2_path).tokenizer


@pytest.fixture(scope="module")
def reference(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32).eval()


def task_job(tmp_path, smollm2_path, data: list[dict], *overrides: str) -> tuple[list[dict], dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "in.parquet")
    cfg = load_job_config(compose_job(
        f"input.path={tmp_path}/in.parquet", f"output.path={tmp_path}/out", f"model.path={smollm2_path}",
        f"input.system_prompt='{SYSTEM}'", "progress.mode=off", f"engine.block_size={BLOCK}", *overrides))
    run(cfg, stdout=io.StringIO())
    return pq.read_table(tmp_path / "out").to_pylist(), json.loads((tmp_path / "out" / "_metrics.json").read_text())


def chat_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]))


@pytest.mark.parametrize("batch", [1, 64])
def test_scores_match_transformers_and_prompts_are_computed_once(tmp_path, smollm2_path, reference, tokenizer, batch):
    data = rows(64)
    out, metrics = task_job(tmp_path, smollm2_path, data, "task=score", "model.quant=none",
                            f"engine.max_batch_size={batch}")
    assert metrics["rows"] == 64 and metrics["error_rows"] == 0 and metrics["max_batch_size"] == batch
    got = {r["id"]: r for r in out}
    prompts = {q: chat_prompt(tokenizer, q) for q in QUESTIONS}
    wanted: dict[tuple[str, str], list[float]] = {}  # each (question, candidate) once: the rows repeat them
    worst = 0.0
    for row in data:
        prompt = prompts[row["prompt"]]
        scores = got[row["id"]]["scores"]
        for score, text in zip(scores, row["candidates"], strict=True):
            key = (row["prompt"], text)
            if key not in wanted:
                wanted[key] = reference_logprobs(reference, prompt, tokenizer.encode(text))
            want = wanted[key]
            assert score["num_tokens"] == len(want)
            worst = max(worst, abs(score["logprob_sum"] - sum(want)) / len(want))
        best = max(range(4), key=lambda k: sum(wanted[row["prompt"], row["candidates"][k]]))
        assert got[row["id"]]["best_candidate"] == best
    print(f"batch {batch}: largest difference of a candidate's log-probability sum from transformers, per token: "
          f"{worst:.2e}")
    assert worst < 1e-3
    # Computed once: every candidate computes only what no earlier sequence of the window had (the prefix
    # tree's new nodes), plus at most the rest of a block (reuse is by block, and the last prompt token
    # is computed again for the logits that score the candidate's first token).
    sequences = 64 * 4
    assert metrics["computed_prompt_tokens"] <= metrics["prefill_lower_bound_tokens"] + sequences * BLOCK
    prompt_tokens = sum(len(prompts[r["prompt"]]) + len(tokenizer.encode(c)) for r in data for c in r["candidates"])
    assert metrics["prompt_tokens"] == prompt_tokens
    assert metrics["cached_tokens"] > 0.75 * prompt_tokens


@pytest.mark.parametrize(("pooling", "batch"), [("last", 64), ("mean", 64), ("mean", 1)])
def test_embeddings_match_transformers(tmp_path, smollm2_path, reference, tokenizer, pooling, batch):
    data = [{"id": i, "prompt": f"{QUESTIONS[i % 8]} {CANDIDATES[i % 6]}"} for i in range(24)]
    out, metrics = task_job(tmp_path, smollm2_path, data, "task=embed", "model.quant=none", f"embed.pooling={pooling}",
                            "embed.normalize=false", f"engine.max_batch_size={batch}")
    got = {r["id"]: r for r in out}
    worst = 0.0
    for row in data:
        ids = chat_prompt(tokenizer, row["prompt"])
        want = pooled(reference_hidden(reference, ids), pooling, normalize=False)
        worst = max(worst, float((torch.tensor(got[row["id"]]["embedding"]) - want).abs().max()))
    print(f"{pooling} pooling, batch {batch}: largest difference from transformers {worst:.2e}")
    assert worst < 1e-4
    assert (metrics["cached_tokens"] > 0) == (pooling == "last")  # the shared system prompt


def test_default_mode_approximates_the_float_job(tmp_path, smollm2_path):
    """model.quant=auto (on CPU the GGUF's 4-bit weights, with W8A8 for large steps): every candidate scored,
    mean log-probabilities per token near the float job's on average (4-bit weights move single tokens by up
    to a nat), and embeddings close in direction."""
    data = rows(16)
    exact, _ = task_job(tmp_path / "exact", smollm2_path, data, "task=score", "model.quant=none")
    fast, metrics = task_job(tmp_path / "fast", smollm2_path, data, "task=score")
    assert metrics["model"]["quant"] != "none" and metrics["error_rows"] == 0
    exact_rows = {r["id"]: r for r in exact}
    drift = []
    for row in fast:
        want = exact_rows[row["id"]]["scores"]
        assert [s["num_tokens"] for s in row["scores"]] == [s["num_tokens"] for s in want]
        drift += [abs(a["logprob_mean"] - b["logprob_mean"]) for a, b in zip(row["scores"], want)]
    print(f"model.quant={metrics['model']['quant']}: mean log-probability per token {sum(drift) / len(drift):.3f} "
          f"from the float job's on average, {max(drift):.3f} at most")
    assert sum(drift) / len(drift) < 0.3
    texts = [{"id": i, "prompt": q} for i, q in enumerate(QUESTIONS)]
    exact, _ = task_job(tmp_path / "exact-embed", smollm2_path, texts, "task=embed", "model.quant=none")
    fast, _ = task_job(tmp_path / "fast-embed", smollm2_path, texts, "task=embed")
    by_id = {r["id"]: torch.tensor(r["embedding"]) for r in exact}
    cosines = [float(torch.dot(torch.tensor(r["embedding"]), by_id[r["id"]])) for r in fast]  # unit vectors
    print(f"embeddings: cosine similarity to the float job's {min(cosines):.4f} at least")
    assert min(cosines) > 0.95
