"""Compiled decoder layers (`LlamaModel.compile_layers`) against the same model run eagerly, and how their
compiled graphs are shared through torch's on-disk cache."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.model.layers import pin_vector_isa, vector_isa_ok
from pipeline.model.llama import LAYERS_PER_GRAPH, layer_runs
from pipeline.model.loader import load_model
from tests.reference import assert_only_near_ties, greedy_decode, prompt_logits

IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]
PROMPTS = [IDS, IDS[:5], [1, 77, 5000, 12, 900, 33, 2, 8]]


@pytest.mark.parametrize("per_graph", [1, LAYERS_PER_GRAPH])
def test_compiled_w8a8_layers_match_eager(tiny_model_dir, per_graph):
    eager = load_model(tiny_model_dir, quant="w8a8").model
    compiled = load_model(tiny_model_dir, quant="w8a8").model
    compiled.compile_layers(per_graph)
    assert compiled.compiled and not eager.compiled
    assert [layer for run in compiled.layer_runs for layer in run] == list(compiled.layers)
    ref = prompt_logits(eager, IDS)
    # fused quantization and reductions may round the last float32 bits differently, nothing more
    torch.testing.assert_close(prompt_logits(compiled, IDS), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # steps of 3, 2 and 1 rows (prefills of several lengths first): one graph for every token count
    reference = dict(enumerate(greedy_decode(eager, PROMPTS, 6)))
    other = {i: d.tokens for i, d in enumerate(greedy_decode(compiled, PROMPTS, 6))}
    assert_only_near_ties(reference, other)


@pytest.mark.parametrize("layers", [1, 5, 6, 7, 12, 13, 30, 32])
@pytest.mark.parametrize("per_run", [1, 4, 6])
def test_layer_runs_cover_the_layers_in_order_with_at_most_two_lengths(layers, per_run):
    runs = layer_runs(list(range(layers)), per_run)
    assert [layer for run in runs for layer in run] == list(range(layers))
    lengths = {len(run) for run in runs}
    assert max(lengths) <= per_run and max(lengths) - min(lengths) <= 1
    assert len(runs) == -(-layers // per_run)  # no more graph calls than needed


def test_without_a_cpp_compiler_compiling_fails_clearly_and_auto_stays_eager(tiny_model_dir, monkeypatch):
    from pipeline.engine.engine import compile_layers_wanted

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    model = load_model(tiny_model_dir, quant="w8a8").model
    assert not compile_layers_wanted("auto", model, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        model.compile_layers()
    assert not model.compiled


def test_models_compiled_in_one_process_keep_graphs_of_their_own(tiny_model_dir):
    """Dynamo caches graphs per code object: were it shared by every model, past Dynamo's recompile limit a
    new model would run eagerly."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as graphs_of

    models = [load_model(tiny_model_dir, quant="w8a8").model for _ in range(2)]
    for model in models:
        model.compile_layers()
        prompt_logits(model, IDS)
    for compiled in ([m.run_layers for m in models], [m.lm_head.forward for m in models]):
        codes = [fn._torchdynamo_orig_callable.__code__ for fn in compiled]
        assert codes[0] is not codes[1]
        assert [len(graphs_of(code)) for code in codes] == [1, 1]  # one prefill each: its own graph only


# Compiles one elementwise function through `compiled_copy`; with "broken", as in a process whose check of the
# CPU's vector instructions failed (torch then generates scalar loops).
COMPILE_ONCE = """
import sys
import torch
import torch._inductor.cpu_vec_isa as isa
from pipeline.model.layers import compiled_copy

if sys.argv[1] == "broken":  # no instruction set's check program builds
    isa.valid_vec_isa_list, isa.supported_vec_isa_list = lambda: [], []
fn = compiled_copy(lambda x, y: torch.nn.functional.silu(x) * y)
fn(torch.randn(64, 256), torch.randn(64, 256))
"""


def vectorized_kernels(cache: Path) -> int:
    """Generated C++ loops (`void kernel(...)`; not torch's check programs, which use vector types too) in
    torch's cache directory that use its vector types."""
    sources = [f.read_text() for f in cache.rglob("*.cpp")]
    return sum(bool(re.search(r"\bvoid\s+kernel\(", s)) and "at::vec::Vectorized" in s for s in sources)


def test_scalar_loops_cached_by_a_process_whose_vector_check_failed_are_not_served_to_the_next(tmp_path):
    """Both processes share torch's on-disk graph cache. The verdict pinned into the config keys it, so
    the second process (its check passing) compiles vectorized loops instead of loading the first's."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    root = Path(__file__).resolve().parents[2]
    if not pin_vector_isa():
        pytest.skip("torch.compile vectorizes nothing on this CPU")
    for case, expect_vectorized in (("broken", False), ("working", True)):
        subprocess.run([sys.executable, "-c", COMPILE_ONCE, case], cwd=root, env=env, check=True, timeout=600)
        assert (vectorized_kernels(tmp_path) > 0) == expect_vectorized, case


def test_a_preset_vector_verdict_is_kept_and_a_failed_check_is_recorded(monkeypatch):
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa

    # torch's config is patched through its own context manager (pytest's monkeypatch deletes the key)
    with config.patch({"cpp.vec_isa_ok": False}):  # as TORCHINDUCTOR_VEC_ISA_OK=0 sets it
        assert pin_vector_isa() is False
    monkeypatch.setattr(isa, "valid_vec_isa_list", lambda: [])
    monkeypatch.setattr(isa, "supported_vec_isa_list", [])
    with config.patch({"cpp.vec_isa_ok": None}):
        assert pin_vector_isa() is False and config.cpp.vec_isa_ok is False


class FakeIsa:
    """An instruction set whose check program passes or not (`ok`); each check is recorded in `checked`."""

    def __init__(self, name: str, ok: bool, checked: list[str]):
        self.name, self.ok, self.checked = name, ok, checked

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:
        self.checked.append(self.name)
        return self.ok


@pytest.mark.skipif((sys.platform, platform.machine()) != ("linux", "x86_64"), reason="x86-64 Linux's order")
def test_the_vector_check_stops_at_the_widest_set_that_passes_and_skips_sets_the_cpu_lacks(monkeypatch):
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(isa, "x86_isa_checker", lambda: ["avx2", "avx512"])
    checked: list[str] = []
    sets = [FakeIsa(name, ok, checked) for name, ok in
            (("avx512 amx_tile", True), ("avx512", False), ("avx2", True), ("avx2 zz", True))]
    monkeypatch.setattr(isa, "supported_vec_isa_list", sets)
    with config.patch({"cpp.vec_isa_ok": None, "cpp.simdlen": None}):
        assert vector_isa_ok() is True and checked == ["avx512", "avx2"]
        checked.clear()
        sets[2].ok = False
        assert vector_isa_ok() is False and checked == ["avx512", "avx2"]
