"""Constrained decoding: one grammar matcher per constrained sample, one token mask per step for the batch.

Built on llguidance (MIT; a 3 MB wheel with no dependencies). It computes each mask lazily from an Earley
parser walking the token trie, about 0.05-1 ms per row, with no per-schema pass over the vocabulary first,
so a dataset where every row brings its own schema costs no more than one shared schema. Grammars:
`json_schema` (compact JSON: no free whitespace, so a model cannot pad it endlessly; a schema's own
`x-guidance` options may change that), `regex`, and `choice` (a Lark alternation of the literal strings).

Masks are computed on llguidance's thread pool, outside the GIL, while the model runs the step
(`start_masks` before the forward pass, `MaskJob.result` after it).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from pipeline.engine.request import SamplingParams

_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHED_GRAMMARS = 256  # compiled matchers kept to copy from (rows sharing a schema compile it once)


def constraint_key(sp: SamplingParams) -> str:
    """The sampling key that holds the request's constraint (for messages)."""
    return "json_schema" if sp.json_schema is not None else "regex" if sp.regex is not None else "choice"


def grammar_text(sp: SamplingParams) -> str:
    """llguidance grammar of the request's constraint; ValueError for a schema it cannot read."""
    if sp.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(sp.json_schema, defaults=_JSON_OPTIONS)
    if sp.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(sp.regex)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in sp.choice))


class Constraints:
    """Matchers for constrained requests and the masks of a step. `tokenizer_json` is the model tokenizer's
    `tokenizers` JSON; token ids run to `vocab_size` (the logits' width)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32  # int32 words per row of the bit mask
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._bits = torch.arange(32, dtype=torch.int32)

    def matcher(self, sp: SamplingParams) -> llguidance.LLMatcher:
        """A fresh matcher for the request's constraint; ValueError naming the key when it does not compile (on
        one line: llguidance draws the error under the grammar, and it becomes a job's error line or a row's
        `error`)."""
        key = constraint_key(sp)
        try:
            grammar = grammar_text(sp)
        except ValueError as e:
            raise ValueError(f"{key}: {' '.join(str(e).split())}") from None
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"{key} cannot be used: {' '.join(compiled.get_error().split())}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Allowed next tokens [len(matchers), vocab_size] (bool) of each matcher's current state."""
        bits = torch.empty(len(matchers), self.width, dtype=torch.int32)
        if matchers:
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), self.width * 4, len(matchers))
        return ((bits.unsqueeze(-1) >> self._bits) & 1).view(len(matchers), -1)[:, : self.vocab_size].bool()

    def start_masks(self, matchers: list[llguidance.LLMatcher]) -> Future:
        """`masks(matchers)` computed in the background (the model runs meanwhile)."""
        return self._thread.submit(self.masks, matchers)
