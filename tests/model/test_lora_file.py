"""PEFT LoRA checkpoints the model cannot take are refused with one line naming the adapter and the problem:
a module the model does not have, a rank or shape that does not match, a changed vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.model.hf_file import config_from_hf
from pipeline.model.lora.peft_file import AdapterError, read_adapter
from tests.lora_adapters import make_adapter
from tests.tiny_model import TINY_CONFIG, build_tiny_checkpoint

pytest.importorskip("peft")

SHAPE = config_from_hf({"architectures": ["LlamaForCausalLM"], **TINY_CONFIG}, "tiny")


@pytest.fixture(scope="module")
def good(tiny_model_dir, tmp_path_factory):
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "good", 8, ["q_proj", "down_proj"],
                        rslora=True)


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def copy_of(folder, tmp_path):
    import shutil

    return shutil.copytree(folder, tmp_path / "copy")


def test_reads_rank_scale_and_pairs(good):
    adapter = read_adapter(good, SHAPE, "good")
    assert adapter.rank == 8 and adapter.scale == pytest.approx(16 / 8**0.5)  # rsLoRA: alpha / sqrt(r)
    assert adapter.targets == ["q_proj", "down_proj"] and len(adapter.pairs) == 2 * SHAPE.num_layers
    a, b = adapter.pairs[(1, "down_proj")]
    assert a.shape == (8, SHAPE.intermediate_size) and b.shape == (SHAPE.hidden_size, 8) and a.dtype == torch.float32


def test_missing_folder_or_file(tmp_path):
    with pytest.raises(AdapterError, match=r"adapter 'x': .*adapter_config.json not found"):
        read_adapter(tmp_path, SHAPE, "x")


def test_target_the_model_does_not_have(good, tmp_path):
    bad = copy_of(good, tmp_path)
    edit_config(bad, target_modules=["q_proj", "c_attn"])
    with pytest.raises(AdapterError, match=r"targets \['c_attn'\], which the model does not have"):
        read_adapter(bad, SHAPE, "bad")


def test_lora_on_the_head_is_refused(tiny_model_dir, tmp_path):
    head = make_adapter(tiny_model_dir, tmp_path / "head", 4, ["q_proj", "lm_head"])
    edit_config(head, target_modules="q_proj|lm_head")  # as a pattern, so the file's tensors are judged
    with pytest.raises(AdapterError, match=r"targets 'lm_head', which the model does not have as a LoRA target"):
        read_adapter(head, SHAPE, "head")


def test_rank_mismatch(good, tmp_path):
    bad = copy_of(good, tmp_path)
    edit_config(bad, r=4)
    with pytest.raises(AdapterError, match=r"layer 0 down_proj: lora_A \(8, 256\) and lora_B \(128, 8\) do not have rank r=4"):
        read_adapter(bad, SHAPE, "bad")


def test_adapter_of_another_model_shape(tmp_path):
    other = build_tiny_checkpoint(tmp_path / "wide", intermediate_size=512)
    adapter = make_adapter(other, tmp_path / "wide-lora", 4, ["down_proj"])
    with pytest.raises(AdapterError, match=r"do not fit the model's 256 -> 128 projection"):
        read_adapter(adapter, SHAPE, "wide")


@pytest.mark.parametrize("how", ["modules_to_save", "resized_embeddings"])
def test_vocabulary_changing_adapters(good, tmp_path, how):
    bad = copy_of(good, tmp_path)
    if how == "modules_to_save":
        edit_config(bad, modules_to_save=["lm_head"])
    else:  # PEFT saves the embedding table with the adapter when the vocabulary was resized
        tensors = load_file(bad / "adapter_model.safetensors")
        tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(49160, 128)
        save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="changes the vocabulary"):
        read_adapter(bad, SHAPE, "bad")


def test_unsupported_variants(good, tmp_path):
    bad = copy_of(good, tmp_path)
    edit_config(bad, use_dora=True)
    with pytest.raises(AdapterError, match="use_dora=True is not supported"):
        read_adapter(bad, SHAPE, "bad")
