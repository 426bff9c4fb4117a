"""Speed at real model sizes without a download: random-weight Hugging Face checkpoints with the layer shapes of
Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-1.5B (SmolLM2's tokenizer and 49,152-token vocabulary: the tokens are
noise, the arithmetic of the layers is the real model's), then the job's start-up and throughput on them.

    python bench/shapes.py --shape llama-3.2-1b                          # build once, then both figures
    python bench/shapes.py --shape llama-3.2-1b --only throughput -- --prompts 64 --new-tokens 64 --hf-batches 64
    python bench/shapes.py --shape qwen2.5-0.5b --only startup

Checkpoints (float32 safetensors, 2-6 GB) are kept in `$XDG_CACHE_HOME/llm-batch-pipeline/shapes/<shape>`.
`startup` runs `bench/startup.py` on the checkpoint (first start with empty caches, then a warm one, then the
exact float job); `throughput` runs `bench/throughput.py --model <checkpoint>` in the default mode against
transformers, passing on the arguments after `--`. Both print the CPU flags beside their figures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# config.json keys of each shape (the vocabulary is SmolLM2's, so its tokenizer serves every shape)
SHAPES = {
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                     "use_sliding_window": False, "max_position_embeddings": 32768},
    "llama-3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
                     "tie_word_embeddings": True, "max_position_embeddings": 131072},
    "qwen2.5-1.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
                     "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                     "use_sliding_window": False, "max_position_embeddings": 32768},
}


def checkpoint(shape: str) -> Path:
    """The shape's random-weight checkpoint, built on first use."""
    from pipeline.model.remote import package_cache_dir
    from tests.tiny_model import build_tiny_checkpoint

    directory = package_cache_dir("shapes") / shape
    if not (directory / "tokenizer_config.json").is_file():  # written last by the builder
        print(f"building {directory} ...", flush=True)
        build_tiny_checkpoint(directory, seed=0, **SHAPES[shape])
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--only", choices=["startup", "throughput"], default=None)
    parser.add_argument("rest", nargs="*", help="after --: arguments for bench/throughput.py")
    opts = parser.parse_args()
    model = checkpoint(opts.shape)
    if opts.only in (None, "startup"):
        subprocess.run([sys.executable, str(REPO / "bench/startup.py"), "--args", f"model.path={model}",
                        "sampling.max_tokens=16"], check=True)
    if opts.only in (None, "throughput"):
        subprocess.run([sys.executable, str(REPO / "bench/throughput.py"), "--model", str(model), "--modes", "auto",
                        *(opts.rest or ["--prompts", "64", "--new-tokens", "64", "--hf-batches", "64"])], check=True)


if __name__ == "__main__":
    main()
