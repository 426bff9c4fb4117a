"""The seed rules: each row's seed and each sample's, shared by the prompt builder (`pipeline.source`) and the
engine that draws from them, so it sits below both."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Seeds of the n samples of one request are spread by a large odd constant so sample i's stream does not
# coincide with another request's seed + i.
_SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15
_SEED_MASK = 2**63 - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """Sample `sample_index`'s seed of a request seeded `seed` (sample 0: `seed` itself)."""
    return (seed + sample_index * _SAMPLE_SEED_STRIDE) & _SEED_MASK


def row_seed(job_seed: int, row_id: Any) -> int:
    """A row's seed: a stable hash of (job seed, row id), the same in every process, run and shard.

    Why: a seed drawn in admission order changes when a resume, a shard split or a batch size changes
    which rows are admitted when; one shared seed makes identical prompts in different rows sample
    identically. Hashing the row id gives each row its own stream that depends on nothing else.
    """
    key = json.dumps([job_seed, row_id], sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK
