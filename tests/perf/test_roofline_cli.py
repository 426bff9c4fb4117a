"""`python -m pipeline.roofline`: job config + hardware profile in, the roofline table out."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.model.hf_file import config_from_hf
from pipeline.model.roofline import decode_ceiling, kv_bytes_per_token
from pipeline.perf.roofline_cli import main, split_args
from tests.model.test_roofline import H100

PROMPTS = ["What is 2+2?", "What is the capital of France?", "What is 2+3?", "Name a colour.",
           "What is the capital of Spain?", "What is 2+2?"]


@pytest.fixture(scope="module")
def input_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "prompts.parquet"
    pq.write_table(pa.table({"id": list(range(len(PROMPTS))), "prompt": PROMPTS}), path)
    return path


def run_json(capsys, *args: str) -> dict:
    assert main([*args, "roofline.json=true"]) == 0
    return json.loads(capsys.readouterr().out)


def test_split_args():
    job, hw, hw_over, opts = split_args(["model.path=x", "hardware=h200", "hardware.price_per_hour=3",
                                         "roofline.batch=8", "engine.max_batch_size=4"])
    assert (job, hw, hw_over, opts) == (["model.path=x", "engine.max_batch_size=4"], "h200",
                                        ["price_per_hour=3"], ["batch=8"])


def test_plan_of_a_job(capsys, tiny_model_dir, input_path):
    from pipeline.model.tokenizer import Tokenizer

    f = run_json(capsys, f"model.path={tiny_model_dir}", f"input.path={input_path}", "hardware=h100",
                 "model.dtype=float32", "engine.max_batch_size=8", "sampling.max_tokens=10", "hardware.price_per_hour=3.6",
                 "roofline.api_price=0.5")
    # prefix sharing, against a brute-force prefix-tree count of independently built prompts
    tok = Tokenizer.from_hf_dir(tiny_model_dir)
    seqs = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    nodes = {tuple(s[:n]) for s in seqs for n in range(1, len(s) + 1)}
    assert f["prefill"]["tokens_without_reuse"] == sum(map(len, seqs))
    assert f["prefill"]["tokens_with_reuse"] == len(nodes)
    assert f["prefill"]["sample_rows"] == f["estimate"]["rows"] == len(PROMPTS)
    # the job's settings flow into the arithmetic
    cfg = config_from_hf(json.loads((tiny_model_dir / "config.json").read_text()), "config.json")
    context = int(sum(map(len, seqs)) / len(seqs) + 10 / 2)
    assert f["kv"]["context"] == context
    assert f["kv"]["bytes_per_token"] == kv_bytes_per_token(cfg, "fp32")
    one, eight = f["decode"]
    assert (one["batch"], eight["batch"]) == (1, 8)
    expected = decode_ceiling(cfg, H100, "fp32", batch=8, context=context, kv_dtype="fp32", compute_dtype="fp32")
    assert eight["tokens_per_s"] == pytest.approx(expected.tokens_per_s)
    assert f["cost"]["per_million_tokens"] == pytest.approx(3.6 / (expected.tokens_per_s * 3600) * 1e6)
    assert f["cost"]["api_per_million_tokens"] == 0.5


def test_plan_options_override_the_job(capsys, tiny_model_dir):
    f = run_json(capsys, f"model.path={tiny_model_dir}", "hardware=a100", "roofline.sample_rows=0",
                 "roofline.weights=int4-g32", "roofline.batch=32", "roofline.context=100", "roofline.tp=2")
    assert f["weights"]["bits_per_weight"] == 5
    assert f["decode"][1]["batch"] == 32 and f["kv"]["context"] == 100
    assert f["hardware"]["tp"] == 2 and f["hardware"]["bandwidth_bytes_s"] == pytest.approx(2 * 2.039e12)
    assert "prefill" not in f and "cost" not in f


@pytest.mark.parametrize(("args", "message"), [
    (["hardware=tpu9"], "unknown hardware='tpu9'; available: a100, cpu, h100"),
    (["roofline.bogus=1"], "bogus"),
    (["engine.nope=1"], "nope"),
    (["roofline.weights=int3"], "unknown precision 'int3'"),
    (["roofline.tp=3"], "tensor_parallel=3 must divide"),
])
def test_bad_arguments_are_named(capsys, tiny_model_dir, args, message):
    assert main([f"model.path={tiny_model_dir}", "hardware=h100", "roofline.sample_rows=0", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_command_line(tiny_model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.roofline", f"model.path={tiny_model_dir}", "model.dtype=float32", "hardware=h200",
         "roofline.sample_rows=0"], capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert re.search(r"ridge point +14 FLOP/byte", out)  # the model's fp32 compute: 67 TFLOP/s / 4.8 TB/s
    # engine.max_batch_size=auto (the default) plans for its largest candidate
    assert "decode batch 1 " in out and "decode batch 256" in out and "memory-bound" in out


def test_job_file_is_read_like_the_job_reads_it(capsys, tiny_model_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"model:\n  path: {tiny_model_dir}\nengine:\n  max_batch_size: 5\nsampling:\n  max_tokens: 7\n")
    f = run_json(capsys, f"conf={job}", "hardware=l40s", "roofline.sample_rows=0", "engine.max_batch_size=6")
    assert f["decode"][1]["batch"] == 6  # the command line wins over the file, as in `python -m pipeline`
    assert f["kv"]["sequence_len"] == 512 + 7  # no sample: a 512-token prompt is assumed


def test_weights_that_do_not_fit_are_said_plainly_with_what_would_fit(capsys, tiny_model_dir):
    """Before: "0 sequences fit", then decode ceilings as if they did."""
    from pipeline.model.roofline import weight_bytes

    cfg = config_from_hf(json.loads((tiny_model_dir / "config.json").read_text()), "config.json")
    memory_gb = 0.6 * weight_bytes(cfg, "fp32") / 1e9  # the weights need 1/0.6 devices of this size
    args = [f"model.path={tiny_model_dir}", "model.dtype=float32", "hardware=h100", f"hardware.memory_gb={memory_gb}",
            "roofline.sample_rows=0"]
    f = run_json(capsys, *args)
    assert f["max_batch"]["device_memory"] == 0 and "decode" not in f and "estimate" not in f
    assert f["does_not_fit"]["suggestions"][0].startswith("engine.tensor_parallel=2 ")
    assert f["does_not_fit"]["suggestions"][1].startswith("model.quant=int8 ")
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "DOES NOT FIT" in table and "no ceilings computed" in table and "decode batch" not in table


def test_a_model_directory_with_config_json_alone_is_enough(capsys, tiny_model_dir, tmp_path, input_path):
    (tmp_path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    assert main([f"model.path={tmp_path}", f"input.path={input_path}", "hardware=h100"]) == 0
    table = capsys.readouterr().out
    assert "input sample skipped (no prefill estimate): no tokenizer" in table and "decode batch 1 " in table


CPU_FIGURES = ["hardware=cpu", "hardware.bandwidth_tbs=0.0265", "hardware.memory_gb=24", "hardware.peak_tflops.fp32=0.32",
               "hardware.peak_tflops.bf16=1.3", "hardware.peak_tflops.int8=4.0"]  # given: nothing measured


def test_the_ceilings_follow_model_quant_as_the_job_resolves_it(capsys, tiny_model_dir):
    """auto on a CPU: batch 1 in the weight-only scheme choose_quant picks, the engine's batch in W8A8 where it
    is past the switch; a named scheme is taken as named, and roofline.weights still overrides."""
    from kernels.wq_cpu import weight_only_kernels_fast
    from pipeline.model.quant_choice import choose_quant, dequantized_per_call
    from pipeline.model.roofline import precision
    from pipeline.perf.probe import load_hardware

    args = [f"model.path={tiny_model_dir}", *CPU_FIGURES, "roofline.sample_rows=0", "engine.max_batch_size=256"]
    f = run_json(capsys, *args)
    cfg = config_from_hf(json.loads((tiny_model_dir / "config.json").read_text()), "config.json")
    hw = load_hardware("cpu", [a.removeprefix("hardware.") for a in CPU_FIGURES[1:]])
    choice = choose_quant(cfg, hw, "int4", weight_only_kernels_fast(), 256)
    one, top = f["decode"]
    small = ("int4-g32", "bf16") if weight_only_kernels_fast() else ("int4-g32->fp32", "fp32")
    below = choice.w8a8_rows is None or choice.w8a8_rows > 1
    assert (one["weights"], one["compute_dtype"]) == (small if below else ("int8", "int8"))
    past = choice.w8a8_rows is not None and choice.w8a8_rows <= 256
    assert (top["weights"], top["compute_dtype"]) == (("int8", "int8") if past else small)
    assert any(n.startswith("model.quant=auto -> ") for n in f["notes"])
    weights = precision(top["weights"].removesuffix("->fp32"))
    weights = dequantized_per_call(weights) if top["weights"].endswith("->fp32") else weights
    assert top["tokens_per_s"] == pytest.approx(
        decode_ceiling(cfg, hw, weights, 256, f["kv"]["context"], f["kv"]["dtype"], top["compute_dtype"]).tokens_per_s)
    w8a8 = run_json(capsys, *args, "model.quant=w8a8")["decode"]
    assert {(d["weights"], d["compute_dtype"]) for d in w8a8} == {("int8", "int8")}
    exact = run_json(capsys, *args, "model.quant=none")["decode"]
    assert {(d["weights"], d["compute_dtype"]) for d in exact} == {("fp32", "fp32")}
    forced = run_json(capsys, *args, "roofline.weights=int8", "roofline.compute_dtype=fp32")["decode"]
    assert {(d["weights"], d["compute_dtype"]) for d in forced} == {("int8", "fp32")}
