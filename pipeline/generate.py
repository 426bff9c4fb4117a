"""Plain generation for a few prompts: prefill, then one token per step, each sequence in its own
contiguous KV cache.

The reference path for tests, benchmarks and the quick start; scheduling and paged memory are the
engine's job. All live sequences share each forward pass (the weights are read once per step), so a few
dozen prompts cost little more than one. Greedy when temperature is 0, otherwise temperature / top-k /
top-p / min-p sampling; prompt i draws from its own generator seeded with `seed + i`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.engine.request import SamplingParams
from pipeline.model.attention import ContiguousKVCache
from pipeline.model.llama import LlamaModel
from pipeline.model.loader import LoadedModel

GREEDY = SamplingParams()


def sample_next(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from float32 logits [vocab]."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the line included).
        drop = sorted_probs.cumsum(0) - sorted_probs >= sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    if sampling.min_p > 0:
        probs = probs.masked_fill(probs < sampling.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


class SequenceCaches:
    """Attention backend for several sequences, each with its own contiguous cache. `select` names the
    sequences of the next forward pass and how many of its flat tokens each owns, in order."""

    def __init__(self, model: LlamaModel, count: int):
        self.caches = [ContiguousKVCache(model.config.num_layers, model.scale, model.config.sliding_window)
                       for _ in range(count)]
        self._runs: list[tuple[int, int]] = []

    def select(self, sequences: Sequence[int], counts: Sequence[int]) -> None:
        self._runs = list(zip(sequences, counts))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for seq, n in self._runs:
            part = slice(start, start + n)
            outs.append(self.caches[seq].attend(layer, q[part], k[part], v[part]))
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@torch.inference_mode()
def generate_batch(
    model: LlamaModel,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams = GREEDY,
    eos_token_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Completion token ids of each prompt: up to `sampling.max_tokens`, ending at (and including) an
    end-of-sequence or stop token unless `sampling.ignore_eos`. String stops are the engine's business."""
    limit = model.config.max_position_embeddings
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
        if len(p) + sampling.max_tokens > limit:
            raise ValueError(
                f"prompt {i} ({len(p)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"{limit} positions"
            )
    stops = set() if sampling.ignore_eos else {*eos_token_ids, *sampling.stop_token_ids}
    generators = [None] * len(prompts)
    if not sampling.greedy:
        base = sampling.seed if sampling.seed is not None else torch.seed()
        generators = [torch.Generator().manual_seed(base + i) for i in range(len(prompts))]
    caches = SequenceCaches(model, len(prompts))
    device = model.embed_tokens.weight.device
    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    tokens = [list(p) for p in prompts]  # what each live sequence feeds next
    lengths = [0] * len(prompts)  # tokens already in each cache
    while live:
        counts = [len(tokens[i]) for i in live]
        ids = torch.tensor([t for i in live for t in tokens[i]], device=device)
        positions = torch.cat([torch.arange(lengths[i], lengths[i] + len(tokens[i])) for i in live]).to(
            device
        )
        caches.select(live, counts)
        hidden = model(ids, positions, caches)
        last_rows = torch.tensor(counts).cumsum(0) - 1
        logits = model.compute_logits(hidden[last_rows.to(device)]).cpu()
        still = []
        for row, i in enumerate(live):
            token = sample_next(logits[row], sampling, generators[i])
            outputs[i].append(token)
            lengths[i] += len(tokens[i])
            tokens[i] = [token]
            if token not in stops and len(outputs[i]) < sampling.max_tokens:
                still.append(i)
        live = still
    return outputs


def generate_ids(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    sampling: SamplingParams = GREEDY,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Completion token ids of one prompt (see `generate_batch`)."""
    return generate_batch(model, [prompt_ids], sampling, eos_token_ids)[0]


def generate(
    loaded: LoadedModel, prompts: Sequence[str], sampling: SamplingParams = GREEDY, chat: bool = True
) -> list[str]:
    """Completions of text prompts; with `chat`, each prompt is a user message in the model's chat template."""
    tok = loaded.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompts]
    completions = generate_batch(loaded.model, [tok.encode(t) for t in texts], sampling, tok.eos_token_ids)
    return [tok.decode(ids) for ids in completions]
