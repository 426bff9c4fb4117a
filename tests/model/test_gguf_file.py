"""The GGUF path on a small file this test writes with `gguf.GGUFWriter`: the tiny random Llama, its
tensors in several block formats and Q/K permuted the way llama.cpp's converter does. Checked against
`gguf.GGUFReader` (container parsing) and transformers loading the same file (the network)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from pipeline.model.gguf_file import GGUFCheckpoint, unpermute_qk_rows
from pipeline.model.gguf_format import GGUFFile
from pipeline.model.loader import load_model
from tests.reference import prompt_logits
from tests.tiny_model import TINY_CONFIG, tiny_state_dict

Q = gguf.GGMLQuantizationType
# Block format per tensor kind: covers every format the gguf package can both quantize and dequantize.
FORMATS = {
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q8_0,
    "attn_output": Q.BF16,
    "ffn_gate": Q.F16,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q8_0,
}
HF_KIND = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K reordering: each head's two rotate-half halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(kind: str, value: np.ndarray):
    """(data to write, raw_dtype) of a tensor in the format FORMATS picks for its kind."""
    qtype = FORMATS.get(kind, Q.F32)
    if qtype == Q.F32:
        return value.astype(np.float32), None
    if qtype == Q.F16:
        return value.astype(np.float16), None
    return quantize(value, qtype), qtype


def tiny_weights(arch: str = "llama") -> dict[str, np.ndarray]:
    config = {**TINY_CONFIG, "tie_word_embeddings": True, "model_type": arch}
    return {k: v.numpy() for k, v in tiny_state_dict(config, seed=1).items()}


def gguf_kind(hf_name: str) -> str:
    return HF_KIND.get(hf_name.split(".", 3)[-1].rsplit(".", 1)[0], "")


def write_tiny_gguf(path, tokenizer_metadata: dict, arch: str = "llama") -> None:
    c = TINY_CONFIG
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model(tokenizer_metadata["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tokenizer_metadata["tokenizer.ggml.pre"])
    w.add_token_list(tokenizer_metadata["tokenizer.ggml.tokens"])
    w.add_token_types(tokenizer_metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(tokenizer_metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(tokenizer_metadata["tokenizer.chat_template"])
    sd = tiny_weights(arch)
    data, raw_dtype = _stored("attn_v", sd["model.embed_tokens.weight"])  # Q8_0, as in SmolLM2
    w.add_tensor("token_embd.weight", data, raw_dtype=raw_dtype)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for name, value in sd.items():
        if not name.startswith("model.layers."):
            continue
        kind = gguf_kind(name)
        if kind == "attn_q" and arch == "llama":  # llama.cpp's converter permutes Llama's Q/K only
            value = llama_cpp_permute(value, c["num_attention_heads"])
        elif kind == "attn_k" and arch == "llama":
            value = llama_cpp_permute(value, c["num_key_value_heads"])
        data, raw_dtype = _stored(kind, value)
        w.add_tensor(f"blk.{name.split('.')[2]}.{kind}.weight", data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_model(transformers, arch: str = "llama"):
    """transformers' model of `arch` with the tiny weights after the same quantize/dequantize round trip,
    computed on the never-permuted matrices (block rounding is per row, so the permutation does not change it)."""
    from gguf.quants import dequantize

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    model = model_cls(config_cls(**{**TINY_CONFIG, "tie_word_embeddings": True})).eval()
    state = {}
    for name, value in tiny_weights(arch).items():
        kind = "attn_v" if name == "model.embed_tokens.weight" else gguf_kind(name)
        data, raw_dtype = _stored(kind, value)
        restored = dequantize(data, raw_dtype) if raw_dtype is not None else data.astype(np.float32)
        state[name] = torch.from_numpy(np.ascontiguousarray(restored).reshape(value.shape))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def tokenizer_metadata(smollm2_path) -> dict:
    meta = GGUFFile(smollm2_path).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer_metadata):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tokenizer_metadata)
    return path


def test_container_matches_gguf_reader(tmp_path):
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("a.u32", 7)
    w.add_int64("a.i64", -3)
    w.add_float32("a.f32", 0.5)
    w.add_float64("a.f64", 1e-300)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo 🤖")
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.strs", ["x", "", "世界"])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_tensor("f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("f16", np.ones((3, 5), dtype=np.float16))
    w.add_tensor(
        "q8", quantize(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64), Q.Q8_0), raw_dtype=Q.Q8_0
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF.") and key != "a.nested":  # GGUFReader flattens nested arrays
            assert ours.metadata[key] == field.contents(), key
    assert ours.metadata["a.nested"] == [[1, 2], [3]] and ours.metadata["a.str"] == "héllo 🤖"
    assert list(ours.tensors) == [t.name for t in ref.tensors] == ["f32", "f16", "q8"]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type and info.shape == tuple(int(n) for n in reversed(t.shape))
        assert np.array_equal(ours.blocks(t.name).ravel(), np.asarray(t.data).view(np.uint8).ravel())


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 16 * 3).reshape(8 * 16, 3)
    assert np.array_equal(unpermute_qk_rows(llama_cpp_permute(w, 8), 8), w)
    t = torch.from_numpy(llama_cpp_permute(w, 4))
    assert torch.equal(unpermute_qk_rows(t, 4), torch.from_numpy(w))


def test_raw_blocks_stay_reachable(tiny_gguf):
    ckpt = GGUFCheckpoint(tiny_gguf)
    blocks, qtype, shape = ckpt.raw("blk.0.attn_k.weight")
    assert (
        qtype == Q.Q4_1 and shape == (64, 128) and blocks.dtype == np.uint8 and blocks.shape == (64, 4 * 20)
    )
    raw = dict(ckpt.raw_hf_tensors())["model.layers.0.self_attn.k_proj.weight"]
    assert np.array_equal(raw.blocks, unpermute_qk_rows(blocks, 4))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loaded_model_matches_transformers(tmp_path, tokenizer_metadata, arch):
    """Llama (Q/K permuted by llama.cpp) and Qwen3 (not permuted; per-head q/k norms) GGUF files."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tokenizer_metadata, arch=arch)
    loaded = load_model(path)
    assert loaded.config.tie_word_embeddings and loaded.name == "tiny" and loaded.config.architecture == arch
    assert loaded.config.qk_norm == (arch == "qwen3")
    ref = reference_model(transformers, arch)
    ids = loaded.tokenizer.encode(
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi 42"}])
    )
    ours = prompt_logits(loaded.model, ids)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (ours - expected).abs().max().item() < 1e-4


def test_non_llama_architecture_is_named(tmp_path, tokenizer_metadata):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, tokenizer_metadata, arch="gpt2")
    with pytest.raises(ValueError, match=r"other\.gguf.*'gpt2'.*Llama"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"model\.gguf: not a valid GGUF"):
        load_model(bad)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(tmp_path / "missing.gguf")
