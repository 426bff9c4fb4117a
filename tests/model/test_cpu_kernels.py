"""Which CPU kernels run (`pipeline.model.cpu_kernels`): the rule for each class of CPU, as the table in
docs/quantization.md states it, and the record of a loaded model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernels import cpu_w4a8, vnni_gemm
from pipeline.model.cpu_kernels import (
    AMX,
    AVX2,
    NATIVE,
    OTHER,
    PACKED,
    PLAIN,
    VNNI,
    CpuFeatures,
    cpu_kernels,
    int8_gemm_rule,
)
from pipeline.model.loader import load_model
from tests.model.gemm_script import AMX_FLAGS, NATIVE_OFF, stand_in_for_amx

DOC = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"
VNNI_FLAGS = frozenset({"avx512_vnni", "avx512f", "avx2"})
# each row of the doc's table, and the feature sets it stands for
ROWS = {
    "AMX": [CpuFeatures(AMX_FLAGS, None)],
    "AVX-512 VNNI without AMX": [CpuFeatures(VNNI_FLAGS, None)],
    "AVX2 only": [CpuFeatures(frozenset({"avx2"}), NATIVE_OFF), CpuFeatures(frozenset({"avx2", "avx_vnni"}), NATIVE_OFF)],
    "no native compiler": [CpuFeatures(AMX_FLAGS, NATIVE_OFF), CpuFeatures(VNNI_FLAGS, NATIVE_OFF)],
    "none of these": [CpuFeatures(frozenset(), NATIVE_OFF)],
}


def doc_table() -> dict[str, list[str]]:
    """The rows of the doc's "Which CPU kernels run" table: {CPU: its other cells}."""
    section = DOC.read_text().split("## Which CPU kernels run", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def gemms_in(cell: str) -> set[str]:
    return {name for name in (PLAIN, PACKED, NATIVE) if f"`{name}`" in cell}


def test_the_docs_table_has_a_row_for_each_class_of_cpu():
    assert list(doc_table()) == list(ROWS)
    assert {f.cpu_class for rows in ROWS.values() for f in rows} == {AMX, VNNI, AVX2, OTHER}


@pytest.mark.parametrize("row", list(ROWS))
def test_each_row_of_the_docs_table_is_the_rule_for_its_cpus(row):
    layers, head, decoder, greedy = doc_table()[row]
    for part, cell in (("layers", layers), ("lm_head", head)):
        rules = [int8_gemm_rule(features, part) for features in ROWS[row]]
        assert gemms_in(cell) == {g for rule in rules for g in rule.gemms}, (row, part, cell)
        assert ("timed" in cell) == any(len(rule.gemms) > 1 for rule in rules), (row, part, cell)
    native = any(NATIVE in int8_gemm_rule(f, part).gemms for f in ROWS[row] for part in ("layers", "lm_head"))
    assert decoder.startswith("native") == native and (NATIVE in greedy) == native, row


def test_the_features_here_are_read_from_the_cpu():
    features = CpuFeatures.here()
    assert features.native_gemm == vnni_gemm.unavailable_reason()
    assert features.cpu_class in (AMX, VNNI, AVX2, OTHER)


def test_the_record_names_the_kernels_the_model_runs(tiny_model_dir, monkeypatch):
    stand_in_for_amx(monkeypatch)  # timed: torch._int_mm against oneDNN's packed GEMM
    model = load_model(tiny_model_dir, quant="w8a8", quant_lm_head="int8").model
    kernels = cpu_kernels(model, CpuFeatures(AMX_FLAGS, NATIVE_OFF))
    assert kernels.cpu == AMX and kernels.flags == sorted(AMX_FLAGS)
    assert kernels.int8_gemm == model.kernel_choice.int8_gemm and kernels.weight_bound == model.kernel_choice.weight_bound
    assert kernels.decoder_layers.startswith("eager (not native: ")  # not compiled here; not on the native GEMM
    assert kernels.greedy_head.startswith(("chunk maxima", "argmax")) or NATIVE in kernels.greedy_head
    assert json.loads(json.dumps(kernels.as_dict())) == kernels.as_dict()
    line = kernels.line()
    assert "\n" not in line and line.startswith("AMX (amx_int8 ") and "decoder layers: eager" in line
    assert re.search(r"int8 GEMM layers: (torch\._int_mm|oneDNN packed) \(", line), line


def test_a_float_model_has_no_int8_gemm_and_no_native_layers(tiny_model_dir):
    model = load_model(tiny_model_dir).model
    kernels = cpu_kernels(model, CpuFeatures.here())
    assert kernels.int8_gemm == {} and kernels.weight_bound is None
    assert kernels.decoder_layers == "eager (not native: its linears are not quantized (model.quant w8a8 or auto))"
    assert kernels.greedy_head == "argmax of the logits"
    assert "no int8 GEMM" in kernels.line()
    assert kernels.weight_only.startswith("none")


def test_the_record_names_the_weight_only_kernel(tiny_model_dir):
    """auto's int4 weight-only steps: on the native W4A8 GEMM below the timed limit, where it runs here."""
    model = load_model(tiny_model_dir, quant="int4", w8a8_rows=16, prefer_speed=True).model
    model.kernel_choice.w4a8_below = 4
    kernels = cpu_kernels(model, CpuFeatures.here())
    why = cpu_w4a8.unavailable_reason()
    expected = "native W4A8 below 4 rows, else torch's" if why is None else f"torch's (not W4A8: {why})"
    assert kernels.weight_only == expected and f"weight-only steps: {expected}" in kernels.line()
