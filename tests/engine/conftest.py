"""A small random-weight Llama and a one-character-per-token stand-in tokenizer for engine tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pipeline.model.config import ModelConfig
from pipeline.model.llama import LlamaModel

EOS = 0


class CharTokenizer:
    """Token i decodes to one letter (a..z cycling); token 0 is EOS (special, decodes to nothing)."""

    eos_token_ids = (EOS,)

    @staticmethod
    def piece(token: int) -> str:
        return "" if token == EOS else chr(ord("a") + token % 26)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.piece(t) for t in ids)

    def incremental_decoder(self):
        tok = self

        class _Decoder:
            def push(self, token: int) -> str:
                return tok.piece(token)

        return _Decoder()


@dataclass
class TinyLoaded:
    model: LlamaModel
    tokenizer: CharTokenizer
    config: ModelConfig


def tiny_config(vocab: int = 128, max_pos: int = 4096) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=10000.0, max_position_embeddings=max_pos,
    )


def build_tiny(seed: int = 0, dtype: torch.dtype = torch.float32, vocab: int = 128) -> TinyLoaded:
    cfg = tiny_config(vocab)
    model = LlamaModel(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_((torch.randn(p.shape, generator=g) * 0.5).to(dtype))
            else:
                p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)).to(dtype))
        model.lm_head.weight.copy_((torch.randn(model.lm_head.weight.shape, generator=g)).to(dtype))
    return TinyLoaded(model, CharTokenizer(), cfg)


@pytest.fixture(scope="session")
def tiny() -> TinyLoaded:
    return build_tiny()


def random_prompts(count: int, lo: int, hi: int, seed: int = 0, vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
