"""Hugging Face directories: the tiny random checkpoint (two safetensors shards) against transformers
loading the same directory, config variants (tied head, Qwen2 biases, Llama-3 RoPE scaling) and errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.model.loader import load_model
from tests.reference import ContiguousKVCache, prompt_logits
from tests.tiny_model import build_tiny_checkpoint

transformers = pytest.importorskip("transformers")

IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
]


def reference_logits(directory, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_sharded_checkpoint_matches_transformers(tiny_model_dir):
    assert len(list(tiny_model_dir.glob("*.safetensors"))) == 2
    loaded = load_model(tiny_model_dir)
    assert loaded.name == tiny_model_dir.name and loaded.path == str(tiny_model_dir)
    assert loaded.config.architecture == "llama" and not loaded.config.tie_word_embeddings
    torch.testing.assert_close(
        prompt_logits(loaded.model, IDS), reference_logits(tiny_model_dir, IDS), atol=1e-4, rtol=0
    )


def test_decode_with_cache_equals_full_forward(tiny_model_dir):
    loaded = load_model(tiny_model_dir)
    full = prompt_logits(loaded.model, IDS)
    cache = ContiguousKVCache(loaded.config.num_layers, loaded.model.scale)
    steps = [loaded.model(torch.tensor(IDS[:8]), torch.arange(8), cache)[-1:]]
    for pos in range(8, len(IDS)):
        steps.append(loaded.model(torch.tensor([IDS[pos]]), torch.tensor([pos]), cache))
    torch.testing.assert_close(loaded.model.compute_logits(torch.cat(steps)), full[7:], atol=1e-5, rtol=0)


VARIANTS = {
    "tied": {"tie_word_embeddings": True},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    # a window of 8 over 80 positions: every later query sees a tenth of its context
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8},
    "llama3_rope": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    directory = build_tiny_checkpoint(tmp_path / variant, seed=2, **VARIANTS[variant])
    loaded = load_model(directory)
    ids = IDS * 4  # 80 positions: past the 64 the llama3 variant was "trained" on
    ours, ref = prompt_logits(loaded.model, ids), reference_logits(directory, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))  # greedy picks agree at every position
    cfg = loaded.config
    assert cfg.architecture == VARIANTS[variant].get("model_type", "llama")
    assert cfg.qk_norm == (variant == "qwen3") and cfg.sliding_window == (8 if variant == "mistral" else None)
    assert cfg.tie_word_embeddings == (variant == "tied") and cfg.attention_bias == (variant == "qwen2")
    if variant == "tied":  # the head is the embedding table itself: stored once, read every step
        assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
        assert loaded.weight_bytes == cfg.num_parameters() * 4 == loaded.bytes_read_per_token


def test_bfloat16_load_and_weight_bytes(tiny_model_dir):
    f32, bf16 = load_model(tiny_model_dir), load_model(tiny_model_dir, dtype=torch.bfloat16)
    cfg = f32.config
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size  # RMSNorm weights stay float32
    assert f32.weight_bytes == cfg.num_parameters() * 4
    assert bf16.weight_bytes == (cfg.num_parameters() - norms) * 2 + norms * 4
    assert f32.bytes_read_per_token == f32.weight_bytes - cfg.vocab_size * cfg.hidden_size * 4
    assert bf16.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    a, b = prompt_logits(f32.model, IDS), prompt_logits(bf16.model, IDS)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


# ------------------------------------------------------------------------------------------- errors


@pytest.fixture
def broken(tmp_path, tiny_model_dir):
    """A fresh copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_model_dir, tmp_path / "copy")


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere.*\.gguf file or a Hugging Face directory"):
        load_model(tmp_path / "nowhere")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"copy/config\.json not found"):
        load_model(broken)


def test_not_llama_family(broken):
    edit_config(broken, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"config\.json: architectures=\['GPT2LMHeadModel'\].*Llama-family"):
        load_model(broken)


def test_missing_key(broken):
    raw = json.loads((broken / "config.json").read_text())
    del raw["hidden_size"]
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json: required key 'hidden_size'"):
        load_model(broken)


def test_per_layer_sliding_window_refused(broken):
    edit_config(broken, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=128)
    with pytest.raises(ValueError, match=r"use_sliding_window=true, sliding_window=128.*qwen2"):
        load_model(broken)


def test_mistral_engine_greedy_matches_transformers_past_the_window(tmp_path):
    """Paged KV with blocks of 4 and a window of 8: prompt and generation run well past the window, through
    chunked prefill and decodes; tokens equal transformers' greedy generation."""
    from pipeline.engine.config import EngineConfig
    from pipeline.engine.engine import Engine
    from pipeline.engine.request import Request, SamplingParams

    directory = build_tiny_checkpoint(tmp_path / "mistral", seed=3, **VARIANTS["mistral"])
    loaded = load_model(directory)
    engine = Engine(loaded, EngineConfig(block_size=4, max_batched_tokens=16, kv_cache_memory="4MiB"))
    prompts = [IDS, IDS[3:] * 2, IDS[:5]]
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    got = {r.id: r.token_ids for r in engine.generate(Request(i, p, sampling) for i, p in enumerate(prompts))}
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert got[i] == ref[0, len(prompt):].tolist()


def test_tokenizer_larger_than_model_vocab(broken):
    edit_config(broken, vocab_size=1000)
    with pytest.raises(
        ValueError, match=r"tokenizer\.json has 49152 tokens but .*config\.json says vocab_size=1000"
    ):
        load_model(broken)


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_model(broken)


def test_missing_shard(broken):
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"index\.json lists shard files that do not exist.*00002"):
        load_model(broken)


def test_no_weights(broken):
    for f in broken.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(broken)


def test_missing_tensor(broken):
    shard = broken / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(ValueError, match="checkpoint is missing 1 weights"):
        load_model(broken)


def test_unknown_quant_mode(tiny_model_dir):
    with pytest.raises(ValueError, match="quant='int3'"):
        load_model(tiny_model_dir, quant="int3")
