"""Random PEFT LoRA adapters for the tests, made with `peft` itself, and the independent reference: the
adapter merged into the base model by `peft` (`merge_and_unload`), run by `transformers` in float32.

PEFT starts B at zero (an adapter that changes nothing); here A and B are both random, so every adapter
moves the logits and a row run with the wrong adapter (or none) gives other tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.reference import Decoded

# name -> (rank, target modules, rsLoRA): ranks 8 and 64, attention-only, MLP-only and every projection
ADAPTERS = {
    "a": (8, ["q_proj", "v_proj"], False),
    "b": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "c": (8, ["o_proj", "gate_proj", "down_proj"], True),
}


def make_adapter(base: Path, folder: Path, rank: int, targets: list[str], rslora: bool = False, seed: int = 0,
                 std: float = 0.05, **config) -> Path:
    """A PEFT checkpoint for the Hugging Face model in `base`, with random A and B; `config` adds
    LoraConfig fields (modules_to_save, ...)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(hf_model(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  use_rslora=rslora, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(folder)
    return folder


def make_adapters(base: Path, root: Path) -> dict[str, Path]:
    """The three adapters of ADAPTERS under `root`, one seed each."""
    return {name: make_adapter(base, root / name, rank, targets, rslora, seed=i)
            for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}


def hf_model(base: Path):
    """transformers' float32 model of a Hugging Face folder or a GGUF file (dequantized)."""
    from transformers import AutoModelForCausalLM

    if base.is_file():
        return AutoModelForCausalLM.from_pretrained(base.parent, gguf_file=base.name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)


def merged_model(base: Path, adapter: Path | None):
    """transformers' float32 model of `base` with `adapter` merged into its weights (None: the base)."""
    model = hf_model(base)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> Decoded:
    """Greedy tokens of one prompt (continuing past end-of-sequence) and each step's top-2 logit gap."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    tokens, gaps = [], []
    for _ in range(max_tokens):
        top2 = out.logits[0, -1].float().topk(2)
        token = int(top2.indices[0])
        tokens.append(token)
        gaps.append(float(top2.values[0] - top2.values[1]))
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return Decoded(tokens, gaps)


def reference_runs(base: Path, adapters: dict[str, Path], rows: list[tuple[list[int], str | None]],
                   max_tokens: int) -> dict[int, Decoded]:
    """Row index -> the merged reference's greedy decode of (prompt, adapter name or None)."""
    out = {}
    for name in {adapter for _, adapter in rows}:
        model = merged_model(base, adapters[name] if name else None)
        for i, (prompt, adapter) in enumerate(rows):
            if adapter == name:
                out[i] = reference_greedy(model, prompt, max_tokens)
    return out
