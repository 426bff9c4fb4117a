"""Plain generation for one prompt at a time: prefill, then one token per step with a contiguous KV cache.

The reference path for tests and the quick start; batched serving is the engine's job. Greedy when
temperature is 0, otherwise temperature / top-k / top-p sampling from a generator seeded per prompt,
so the same seed gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.engine.request import SamplingParams
from pipeline.model.attention import ContiguousKVCache
from pipeline.model.llama import LlamaModel
from pipeline.model.loader import LoadedModel


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


@torch.inference_mode()
def generate_ids(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    sampling: SamplingParams = SamplingParams(),
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Completion token ids of one prompt: up to `sampling.max_tokens`, ending at (and including) an
    end-of-sequence or stop token unless `sampling.ignore_eos`. String stops are the engine's business."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: generation needs at least one prompt token")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + sampling.max_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
            f"{limit} positions"
        )
    stops = set() if sampling.ignore_eos else {*eos_token_ids, *sampling.stop_token_ids}
    generator = None
    if not sampling.greedy:
        generator = torch.Generator()
        generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
    cache = ContiguousKVCache(model.config.num_layers, model.scale)
    device = model.embed_tokens.weight.device
    tokens = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    out: list[int] = []
    while True:
        hidden = model(tokens, positions, cache)
        token = sample_next(model.compute_logits(hidden[-1:])[0].cpu(), sampling, generator)
        out.append(token)
        if token in stops or len(out) == sampling.max_tokens:
            return out
        tokens = torch.tensor([token], device=device)
        positions = positions[-1:] + 1


def generate(
    loaded: LoadedModel, prompts: Sequence[str], sampling: SamplingParams = SamplingParams(), chat: bool = True
) -> list[str]:
    """Completions of text prompts; with `chat`, each prompt is a user message in the model's chat template."""
    tok = loaded.tokenizer
    texts = []
    for prompt in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = generate_ids(loaded.model, tok.encode(text), sampling, tok.eos_token_ids)
        texts.append(tok.decode(ids))
    return texts
