"""An OpenAI Batch API input file of mixed requests, and reading a job's openai_batch or JSON Lines output."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}}, "required": ["label"],
          "additionalProperties": False}
# line index -> (the raw line, words its error line's message holds): lines that cannot run
BAD = {
    7: (None, "n=2: this job writes sampling.n=1 samples per request"),
    17: ("{not json", "line 18 of batch.jsonl: not valid JSON"),
    27: (json.dumps({"custom_id": "req-27", "method": "POST", "url": "/v1/chat/completions"}), "no body"),
    37: (json.dumps({"custom_id": "req-37", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
         "/v1/embeddings requests need task=embed"),
    47: (None, "body.tools is not supported"),
    57: (None, "temperature must be a finite number >= 0"),
    67: ("", "line 68 of batch.jsonl: empty line"),
}


def request(i: int) -> dict:
    """Request i of a mixed batch: chat and completion requests, sampled and greedy, constrained, with
    logprobs, stops, content parts, and (at BAD's lines) values the job refuses."""
    messages = [{"role": "developer" if i % 3 else "system", "content": "You answer in one line."},
                {"role": "user", "content": f"Question {i}: what comes next after {i % 13}?"}]
    body: dict = {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 8}
    kind = i % 10
    if kind == 0:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA}}
        body["max_tokens"] = 24
    elif kind == 1:
        body = {"model": "x", "prompt": f"Once upon a time, number {i}", "max_tokens": 6, "logprobs": 2}
    elif kind == 2:
        body |= {"temperature": 0.8, "top_p": 0.9, "seed": i}
    elif kind == 3:
        body |= {"logprobs": True, "top_logprobs": 2}
    elif kind == 4:
        body |= {"stop": ["."], "max_completion_tokens": 6}
    elif kind == 5:
        body["messages"] = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                                      {"type": "text", "text": f"Part {i}."}]},
                            {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Go on."}]
    if i == 7:
        body["n"] = 2
    if i == 47:
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    if i == 57:
        body["temperature"] = -1
    url = "/v1/completions" if kind == 1 else "/v1/chat/completions"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def write_batch(path: Path, n: int = 200) -> Path:
    lines = []
    for i in range(n):
        raw = BAD.get(i, (None, ""))[0]
        lines.append(raw if raw is not None else json.dumps(request(i)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def read_lines(url: str) -> list[dict]:
    """Every line of the committed JSON Lines parts (never stray files), in unit order."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(root)
    out = []
    for rec_path in sorted(fs.glob(f"{root}/_progress/*.json")):
        part = json.loads(fs.cat_file(rec_path))["part"]
        out += [json.loads(line) for line in fs.cat_file(f"{root}/{part}").decode().split("\n") if line]
    return out
