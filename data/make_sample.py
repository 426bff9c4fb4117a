"""Write the sample prompt shards in data/sample/ (deterministic: same files on every run).

200 rows in 3 Parquet shards. Columns:
- `id` (int64), `topic` (string, a passthrough example);
- `prompt`: a plain question (the default `input.prompt_column`);
- `messages`: the same question as chat messages (`input.messages_column=messages`): most rows start with
  one of four shared system prompts (what prefix reuse feeds on), some are multi-turn, some have none.

Run: python data/make_sample.py [output_dir]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARD_ROWS = (70, 70, 60)

SYSTEM_PROMPTS = [
    "You are a patient science teacher. Answer in two or three short sentences a curious twelve-year-old "
    "can follow, use one everyday example, and avoid jargon unless you explain it right away.",
    "You are a careful translator. Give only the translation, keep the register of the original, and keep "
    "names and numbers unchanged. If a phrase is an idiom, translate its meaning, not its words.",
    "You are a concise assistant for software engineers. Answer precisely, prefer a short list over prose, "
    "mention one pitfall when there is one, and never invent an API that does not exist.",
    "You are a poet who writes short, concrete verse. Use plain words and strong images, no rhymes forced "
    "at the cost of sense, and no title.",
]

QUESTIONS = {
    "science": (0, "Explain {} in simple terms.", [
        "photosynthesis", "gravity", "why the sky is blue", "how vaccines work", "evaporation", "magnetism",
        "the water cycle", "what an atom is", "how rainbows form", "why we have seasons", "friction",
        "what DNA does", "how the heart pumps blood", "sound waves", "electric circuits",
    ]),
    "translation": (1, "Translate into French: \"{}\"", [
        "Good morning, how are you?", "The train leaves at seven.", "I would like a cup of tea.",
        "Where is the library?", "It is raining again today.", "Thank you for your help.",
        "My brother lives in Berlin.", "We are going to the beach tomorrow.", "This book is very interesting.",
        "Can you speak more slowly?",
    ]),
    "code": (2, "{}", [
        "What does Python's `enumerate` return?", "How do I reverse a list in Python?",
        "What is the difference between a process and a thread?", "When should I use a set instead of a list?",
        "What does `git rebase` do?", "How do I read a CSV file with pandas?", "What is a race condition?",
        "Why is floating point addition not associative?", "What does HTTP status 404 mean?",
        "How do I measure how long a function takes in Python?",
    ]),
    "poetry": (3, "Write a four-line poem about {}.", [
        "the sea at night", "an old bicycle", "morning coffee", "a city in the rain", "autumn leaves",
        "a lighthouse", "a cat asleep in the sun", "the first snow", "a train station", "a garden in spring",
    ]),
    "arithmetic": (None, "What is {} + {}? Answer with the number only.", None),
}


def _rows(rng: random.Random, count: int) -> list[dict]:
    topics = list(QUESTIONS)
    rows = []
    for i in range(count):
        topic = topics[i % len(topics)]
        system_index, template, items = QUESTIONS[topic]
        question = (template.format(rng.randint(2, 99), rng.randint(2, 99)) if items is None
                    else template.format(rng.choice(items)))
        messages = [{"role": "user", "content": question}]
        if system_index is not None:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[system_index]})
        if i % 9 == 4:  # a multi-turn conversation: an earlier exchange before the question
            messages[-1:-1] = [
                {"role": "user", "content": "Hi! I have a question for you."},
                {"role": "assistant", "content": "Of course, go ahead."},
            ]
        rows.append({"id": i, "topic": topic, "prompt": question, "messages": messages})
    return rows


def main(out_dir: str = "data/sample") -> None:
    rng = random.Random(1234)
    rows = _rows(rng, sum(SHARD_ROWS))
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("id", pa.int64()), ("topic", pa.string()), ("prompt", pa.string()),
                        ("messages", pa.list_(message))])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    start = 0
    for shard, n in enumerate(SHARD_ROWS):
        table = pa.Table.from_pylist(rows[start:start + n], schema=schema)
        pq.write_table(table, f"{out_dir}/prompts-{shard:02d}.parquet", compression="zstd")
        start += n
    print(f"wrote {start} rows in {len(SHARD_ROWS)} shards to {out_dir}")


if __name__ == "__main__":
    main(*sys.argv[1:])
