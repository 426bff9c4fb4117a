"""The independent reference of the task tests: transformers' Llama in float32 on the tiny checkpoint (see
reference.py for what is computed from it)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
