"""The native W8A8 decoder layers (`pipeline.model.native_decode`) against the same model's torch layers, on
the same engine steps, and where they must stand aside."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import pytest
import torch

from kernels import cpu_decode_layers, dispatch, vnni_gemm
from kernels.w8a8_reference import quantize_rows
from pipeline.engine.adapters import LoraConfig
from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.request import Request, SamplingParams
from pipeline.model import llama as llama_module
from pipeline.model.llama import LlamaModel
from pipeline.model.loader import load_model
from pipeline.model.lora.delta import LoraStep
from pipeline.model.native_decode import (
    LoraStacks,
    _linears,
    column_ranks,
    native_decode_reason,
    rank_bands,
    smoothed_a,
    weight_only_reason,
)
from pipeline.model.w8a8_gemm import NATIVE, PLAIN
from tests.lora_adapters import make_adapter, make_adapters
from tests.model.gemm_script import script_gemm_choice
from tests.reference import assert_only_near_ties, greedy_decode
from tests.tiny_model import build_tiny_checkpoint

PROMPTS = [[1 + (7 * i + j) % 900 for j in range(3 + 4 * i)] for i in range(6)]


@pytest.fixture
def native_gemm(monkeypatch):
    """The next load puts the layers on the native GEMM (skipped where this CPU cannot run the native layers)."""
    why = cpu_decode_layers.unavailable_reason()
    if why:
        pytest.skip(f"no native decode layers here: {why}")
    _script_native(monkeypatch)


def _script_native(monkeypatch) -> None:
    script_gemm_choice(monkeypatch, {"layers": NATIVE, "lm_head": PLAIN}, native=True)


# How far from a rounding boundary (x / s = n + 1/2) an activation must lie, in float32 units in the last
# place of x / s, for both paths to round it alike: their inputs differ in the last bits (another exp, sums in
# another order), and so does the row's scale.
BOUNDARY_ULPS = 8
# A row whose activation sits on a boundary may round it one step apart in the two paths: one int8 step of one
# activation moves the row's later layers by a fraction of a percent of the largest value (0.4% seen).
ONE_STEP_BOUND = 0.02


@dataclass
class Pair:
    """One forward pass run by both paths: the torch layers' hidden states, the native ones (None where the
    native layers stood aside), and which rows the two may round one step apart (`_one_step_rows`)."""

    rows: int
    expected: torch.Tensor
    got: torch.Tensor | None
    loose: torch.Tensor  # [T] bool
    adapters: torch.Tensor | None = None  # [T] bool: the rows that ran a LoRA adapter (None: no adapter step)


def _paired_steps(monkeypatch) -> list[Pair]:
    """Each forward pass runs the torch layers first (eager, recording the activations they quantize), then
    the native ones where they take the step, on the same inputs. Both write the step's keys and values to the
    same slots, the native layers last, so the next step reads theirs."""
    pairs = []
    forward, run = LlamaModel.forward, cpu_decode_layers.decode_layers
    ran, quantized = [], []
    monkeypatch.setattr(cpu_decode_layers, "decode_layers", lambda *a: ran.append(1) or run(*a))
    quantize = dispatch.quantize_rows
    monkeypatch.setattr(dispatch, "quantize_rows", lambda x, **kw: quantized.append(x.float()) or quantize(x, **kw))

    def both(model, ids, positions, attn, lora=None):
        native, model.native_layers = model.native_layers, None
        compiled, model.run_layers = model.run_layers, llama_module._run_layers  # eager: quantizers recorded
        quantized.clear()
        expected = forward(model, ids, positions, attn, lora)
        model.native_layers, model.run_layers = native, compiled
        loose = _one_step_rows(quantized, positions)
        ran.clear()
        if lora is not None:
            lora.calls = 0  # the torch layers' deltas count their linears from the first again
        got = forward(model, ids, positions, attn, lora)
        adapter_rows = None if lora is None else \
            torch.nn.functional.pad(lora.row_slots, (0, ids.shape[0] - lora.row_slots.shape[0]), value=-1) >= 0
        pairs.append(Pair(ids.shape[0], expected, got if ran else None, loose, adapter_rows))
        return got

    monkeypatch.setattr(LlamaModel, "forward", both)
    return pairs


def _one_step_rows(quantized: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Rows that may round an activation one int8 step apart in the two paths: those with an activation within
    BOUNDARY_ULPS of a rounding boundary (`kernels.w8a8_reference.quantize_rows`) in any layer, and the rows
    after them in the same prompt chunk (consecutive positions), which attend to their keys in the next layer."""
    near = torch.zeros(positions.shape[0], dtype=torch.bool)
    for x in quantized:
        if x.shape[0] != near.shape[0]:  # the head's rows, after the layers
            continue
        steps = x / x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny).div(127)
        margin = BOUNDARY_ULPS * torch.finfo(torch.float32).eps * steps.abs()
        near |= ((steps - steps.floor() - 0.5).abs() < margin).any(-1)
    for r in range(1, near.shape[0]):
        near[r] |= bool(near[r - 1]) and int(positions[r]) == int(positions[r - 1]) + 1
    return near


def _assert_same_arithmetic(pair: Pair, got: torch.Tensor | None = None) -> None:
    """The same W8A8 layers: only sums rounded in another order may differ (last float32 bits), except in rows
    where that rounding moved an activation across a rounding boundary (one int8 step, ONE_STEP_BOUND)."""
    got = pair.got if got is None else got
    expected, tight = pair.expected, ~pair.loose
    largest = expected.abs().max().item()
    torch.testing.assert_close(got[tight], expected[tight], rtol=1e-4, atol=1e-4 * largest)
    if pair.loose.any():
        assert (got[pair.loose] - expected[pair.loose]).abs().max().item() <= ONE_STEP_BOUND * largest


def _assert_steps_same_arithmetic(pairs: list[Pair]) -> None:
    """`_assert_same_arithmetic` on every pass the native layers ran, most rows held to the tight bound."""
    ran = [pair for pair in pairs if pair.got is not None]
    for pair in ran:
        _assert_same_arithmetic(pair)
    loose = sum(int(pair.loose.sum()) for pair in ran)
    assert loose <= sum(pair.rows for pair in ran) // 2, "most rows lie clear of every rounding boundary"


def _generate(loaded, max_tokens: int = 6, **engine) -> dict[int, list[int]]:
    engine = Engine(loaded, EngineConfig(kv_cache_memory="16MiB", **engine))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return {r.id: r.token_ids for r in engine.generate(Request(i, p, sp) for i, p in enumerate(PROMPTS))}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_layers_give_the_torch_layers_hidden_states_on_every_step(tiny_model_dir, native_gemm, monkeypatch,
                                                                          kv_dtype):
    loaded = load_model(tiny_model_dir, quant="w8a8", kv_dtype=kv_dtype)
    assert loaded.model.native_layers is not None, native_decode_reason(loaded.model)
    pairs = _paired_steps(monkeypatch)
    _generate(loaded, max_batched_tokens=16)  # prompts in chunks, then decodes: every step mixes both
    assert len(pairs) >= 6 and all(pair.got is not None for pair in pairs)
    assert loaded.model.kernel_choice.native_layer_steps == len(pairs)
    _assert_steps_same_arithmetic(pairs)


def test_the_mlp_activation_from_the_gemms_tiles_gives_the_stored_products_bits(tmp_path, native_gemm,
                                                                                 monkeypatch):
    """An MLP width that is a multiple of the GEMM's panel takes the fused gate_up + SiLU entry: the same
    hidden states as the torch layers, and the same bits as the native layers with that entry refused."""
    checkpoint = build_tiny_checkpoint(tmp_path / "wide", seed=3, intermediate_size=4 * vnni_gemm.PANEL)
    runs = []
    for fused in (True, False):
        loaded = load_model(checkpoint, quant="w8a8")
        native = loaded.model.native_layers
        assert native is not None, native_decode_reason(loaded.model)
        if not fused:  # the entry answers "not this width", as for any width off the panel
            refuse = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 13)(lambda *args: -2)
            native.gemm_silu = ctypes.cast(refuse, ctypes.c_void_p).value
        with monkeypatch.context() as patch:
            pairs = _paired_steps(patch)
            _generate(loaded, max_batched_tokens=16)
        assert len(pairs) >= 6 and all(pair.got is not None for pair in pairs)
        runs.append([pair.got for pair in pairs])
        if fused:
            _assert_steps_same_arithmetic(pairs)
        _script_native(monkeypatch)  # for the second load
    assert len(runs[0]) == len(runs[1]) and all(torch.equal(a, b) for a, b in zip(*runs))


def test_steps_split_by_rows_between_threads_give_the_bits_of_one_thread(tiny_model_dir, native_gemm, monkeypatch):
    """With two threads, a step of enough rows takes each thread's rows through every layer on its own (no
    pass waits for the other thread's rows); every pass is row by row, so the hidden states are the bits one
    thread computes pass by pass, and the torch layers' values. Rows of different lengths: the split weighs
    their keys."""
    prompts = [[1 + (5 * i + j) % 900 for j in range(2 + i % 13 + 30 * (i % 9 == 4))] for i in range(40)]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    runs = []
    threads_before = torch.get_num_threads()
    for threads in (2, 1):
        loaded = load_model(tiny_model_dir, quant="w8a8", kv_dtype=torch.int8)
        assert loaded.model.native_layers is not None, native_decode_reason(loaded.model)
        engine = Engine(loaded, EngineConfig(kv_cache_memory="16MiB", max_batched_tokens=64))
        with monkeypatch.context() as patch:
            pairs = _paired_steps(patch)
            torch.set_num_threads(threads)
            try:
                tokens = {r.id: r.token_ids for r in engine.generate(Request(i, p, sp) for i, p in enumerate(prompts))}
            finally:
                torch.set_num_threads(threads_before)
        runs.append((tokens, pairs))
        _script_native(monkeypatch)  # for the second load
    (split_tokens, split), (one_tokens, one) = runs
    assert split_tokens == one_tokens and len(split) == len(one)
    assert max(pair.rows for pair in split) >= 32  # steps of prompt chunks and decodes, split by their keys
    for pair, alone in zip(split, one):
        assert pair.got is not None and torch.equal(pair.got, alone.got), pair.rows
    _assert_steps_same_arithmetic(split)


@pytest.fixture(params=["float32 loops", "bfloat16 dot products", "bfloat16 tiles"])
def lora_arithmetic(request, monkeypatch) -> str:
    """Which native path runs the adapters' deltas: the float32 loops (the torch layers' arithmetic), or
    bfloat16 pairs on AVX-512 BF16's dot products or AMX's tiles where this CPU has them (the torch layers'
    deltas then rounded as both round: `_tiles_reference`)."""
    if request.param != "bfloat16 tiles":
        monkeypatch.setattr(cpu_decode_layers, "lora_tiles", lambda: False)
    if request.param == "float32 loops":
        monkeypatch.setattr(cpu_decode_layers, "lora_dots", lambda: False)
        return request.param
    available = cpu_decode_layers.lora_tiles if request.param == "bfloat16 tiles" else cpu_decode_layers.lora_dots
    if not available():
        pytest.skip(f"no {request.param} here")
    monkeypatch.setattr(LoraStep, "added", _tiles_reference)
    return request.param


def _tiles_reference(step: LoraStep, lora_id: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The deltas as the native layers' bfloat16 pairs (tiles or dot products) compute them, for the torch layers (x the linear's float input,
    y its dequantized products): the smoothed input and the smoothed A^T rounded to bfloat16, their sums over
    the row's int8 scale rounded to bfloat16 and times B^T's bfloat16 values, float32 sums, times the scale."""
    a, b = step.pairs.a[lora_id], step.pairs.b[lora_id]
    out = y.clone()
    if a is None:
        return out
    smooth = _smooth(lora_id)
    xs = x if smooth is None else x * smooth
    sx = xs.abs().amax(-1) / 127
    sx = torch.where(sx == 0, 1.0, sx)
    a = smoothed_a(a, smooth)

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    for row, slot in enumerate(step.row_slots.tolist()):
        if slot >= 0:
            t = (bf16(xs[row]) @ bf16(a[slot])) / sx[row]
            out[row] += (bf16(t) @ bf16(b[slot])) * sx[row]
    return out


_MODEL: list[LlamaModel] = []  # the model whose steps _lora_pairs runs


def _smooth(lora_id: int) -> torch.Tensor | None:
    """The smoothing vector of the model's linear numbered `lora_id` (its table numbers them at the first load)."""
    (module,) = [m for layer in _MODEL[0].layers for m in _linears(layer) if m.lora_id == lora_id]
    return module.w8a8_smooth


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """PEFT adapters of ranks 8 and 64 on the tiny model (tests/lora_adapters.py's three)."""
    pytest.importorskip("peft")
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("native_lora"))


def _lora_pairs(loaded, adapters: dict, monkeypatch, count: int, rows: int, max_loaded: int, threads: int = 1,
                tokens: int = 5) -> list[Pair]:
    """`count` prompts of 2-30 tokens cycling the base model and each adapter (consecutive prompts another
    adapter), paired steps of at most `rows` sequences on `threads` threads."""
    names = [None, *adapters]
    prompts = [[1 + (11 * i + j) % 900 for j in range(2 + (7 * i) % 29)] for i in range(count)]
    config = EngineConfig(kv_cache_memory="16MiB", max_batch_size=rows, max_batched_tokens=max(64, rows))
    engine = Engine(loaded, config, lora=LoraConfig({k: str(v) for k, v in adapters.items()}, max_loaded))
    _MODEL[:] = [loaded.model]
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    pairs = _paired_steps(monkeypatch)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = list(engine.generate(Request(i, p, sp, adapter=names[i % len(names)]) for i, p in enumerate(prompts)))
    finally:
        torch.set_num_threads(threads_before)
    assert all(r.finish_reason == "length" for r in results)
    return pairs


def _assert_adapter_steps_native(pairs: list[Pair], arithmetic: str) -> None:
    """Every pass ran natively, adapter rows among them, each with the torch layers' arithmetic. On the
    bfloat16 pairs, a projection's sum may round to another bfloat16 than the reference's (sums in another
    order), which moves the next layers' int8 roundings: adapter rows are held to one int8 step's bound."""
    assert any(pair.adapters is not None and pair.adapters.any() for pair in pairs)
    assert all(pair.got is not None for pair in pairs)
    if arithmetic != "float32 loops":
        pairs = [replace(pair, loose=pair.loose | pair.adapters) if pair.adapters is not None else pair
                 for pair in pairs]
        for pair in pairs:
            _assert_same_arithmetic(pair)
        return
    _assert_steps_same_arithmetic(pairs)


@pytest.mark.parametrize("count, rows, max_loaded, threads", [(8, 1, 3, 1), (72, 72, 3, 2), (12, 4, 1, 1)],
                         ids=["one row", "72 rows split by rows", "one slot: reloads, ranks 8 then 64"])
def test_adapter_rows_run_natively_with_the_torch_layers_deltas(tiny_model_dir, adapters, native_gemm, lora_arithmetic,
                                                                monkeypatch, count, rows, max_loaded, threads):
    """Rows of adapters of rank 8 (q and v; rsLoRA on o, gate and down) and 64 (every projection) mixed with
    base rows: the native layers add each linear's deltas as the eager torch layers do, at one row a step, at
    72 (split between two threads by rows) and with one slot whose adapter changes (its stacks widened from
    rank 8 to 64 and replaced while the native layers hold their addresses)."""
    loaded = load_model(tiny_model_dir, quant="w8a8")
    assert loaded.model.native_layers is not None, native_decode_reason(loaded.model)
    pairs = _lora_pairs(loaded, adapters, monkeypatch, count, rows, max_loaded, threads)
    _assert_adapter_steps_native(pairs, lora_arithmetic)
    if max_loaded > 1:  # decode steps of `rows` rows (one slot: a batch waits for its adapter to change)
        assert any(pair.adapters is not None and pair.rows == rows for pair in pairs)


def test_adapter_rows_on_the_mlp_keep_the_fused_activation_with_the_stored_products_bits(tmp_path, native_gemm,
                                                                                     lora_arithmetic, monkeypatch):
    """An MLP width on the GEMM's panel takes the fused gate_up + SiLU entry, steps with adapter rows on the
    MLP too: their gate and up deltas are added to the GEMM's tiles before the SiLU, and the down projection's
    adapter projects the smoothed activation (A divided by the smoothing vector). The same hidden states as the
    torch layers, and the same bits as the stored products' path (the entry refused) on every step."""
    pytest.importorskip("peft")
    checkpoint = build_tiny_checkpoint(tmp_path / "wide", seed=3, intermediate_size=4 * vnni_gemm.PANEL)
    mlp = {"m": make_adapter(checkpoint, tmp_path / "m", 8, ["gate_proj", "up_proj", "down_proj"], seed=5)}
    entry_type = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 13)
    runs = []
    for fused in (True, False):
        loaded = load_model(checkpoint, quant="w8a8")
        native = loaded.model.native_layers
        assert native is not None, native_decode_reason(loaded.model)
        real, hooked = entry_type(native.gemm_silu), []
        # counts the calls with a tile hook (adapter rows on gate_up), then runs the entry or refuses it
        entry = entry_type(lambda *args, real=real, hooked=hooked, fused=fused:
                           hooked.append(args[11] is not None) or (real(*args) if fused else -2))
        native.gemm_silu = ctypes.cast(entry, ctypes.c_void_p).value
        with monkeypatch.context() as patch:
            pairs = _lora_pairs(loaded, mlp, patch, count=8, rows=8, max_loaded=1, tokens=8)
        _assert_adapter_steps_native(pairs, lora_arithmetic)
        assert len(hooked) == len(loaded.model.layers) * len(pairs)
        assert sum(hooked) == len(loaded.model.layers) * sum(pair.adapters is not None for pair in pairs)
        runs.append([pair.got for pair in pairs])
        _script_native(monkeypatch)  # for the second load
    assert len(runs[0]) == len(runs[1]) and all(torch.equal(a, b) for a, b in zip(*runs))


def test_rank_bands_bound_each_16_columns_nonzero_ranks_over_every_slot():
    """A fused linear's block-diagonal B^T: each 16 columns' band holds every slot's nonzero ranks there (a
    slot of lower rank inside it), and columns no slot's B^T reaches get an empty band."""
    b = torch.zeros(3, 12, 72)  # [slots, R, out]: parts of 32, 24 and 16 columns (the last 16 untouched)
    b[0, 0:4, 0:32], b[0, 4:8, 32:56] = 1.0, -2.0
    b[2, 0:3, 0:32], b[2, 8:12, 32:56] = 0.5, 3.0  # slot 1 targets nothing
    expected = [[0, 4], [0, 4], [4, 12], [4, 12], [0, 0]]
    bands = rank_bands(column_ranks(b))
    assert bands.tolist() == expected and bands.dtype == torch.int32


def test_lora_stacks_refilled_a_slot_at_a_time_equal_stacks_packed_whole():
    """A load packs only its slot (`LoraStacks.refill`): after slot 1 takes a new adapter of another shape of
    B^T (other columns zero, so other bands), every packed form equals one made from the whole stacks."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 40, 16, generator=gen), torch.randn(3, 16, 72, generator=gen)
    b[:, 8:, :32] = 0.0
    smooth = torch.rand(40, generator=gen) + 0.1
    stacks = LoraStacks(a, b, smooth, bf16=True)
    a[1] = torch.randn(40, 16, generator=gen)
    b[1] = torch.randn(16, 72, generator=gen)
    b[1, :4] = 0.0
    stacks.refill(1)
    whole = LoraStacks(a, b, smooth, bf16=True)
    for name in ("smoothed", "used", "band", "a16", "b16"):
        assert torch.equal(getattr(stacks, name), getattr(whole, name)), name
    assert not torch.equal(whole.band, LoraStacks(a[[0, 2]], b[[0, 2]], smooth, bf16=False).band)


def test_smoothed_a_projects_the_smoothed_input_as_a_projects_the_input():
    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(5, 24, generator=gen), torch.randn(3, 24, 8, generator=gen)
    smooth = torch.rand(24, generator=gen) * 4 + 0.1
    torch.testing.assert_close((x * smooth) @ smoothed_a(a, smooth), x @ a)
    assert smoothed_a(a, None) is a


def _split(lens: list[int], first: list[int] | None = None, threads: int = 2) -> list[int]:
    lens_t = torch.tensor(lens, dtype=torch.int64)
    first_t = torch.zeros_like(lens_t) if first is None else torch.tensor(first, dtype=torch.int64)
    step = cpu_decode_layers.Step(rows=len(lens), lens=lens_t.data_ptr(), first=first_t.data_ptr())
    return cpu_decode_layers.split_rows(step, threads)


def test_a_step_is_split_between_threads_by_its_rows_work_never_inside_a_prompt_chunk(native_gemm):
    """Rows of one sequence's prompt chunk (consecutive lengths) read the keys the rows before them write in
    the same layer, so a split never falls between two of them; otherwise rows are weighed by their keys and
    split at the GEMM's 8-row tiles."""
    decodes = [40 + 3 * (i % 2) for i in range(256)]  # no two consecutive lengths
    assert _split(decodes) == [0, 128, 256]
    assert _split(decodes, threads=4) == [0, 64, 128, 192, 256]
    long_first = [2000 if i < 64 else 40 for i in range(256)]  # a quarter of the rows with many keys
    bounds = _split(long_first)
    assert bounds[1] % 8 == 0 and 64 < bounds[1] < 128
    chunk = [50 + 3 * (i % 2) for i in range(100)] + list(range(10, 90)) + [50 + 3 * (i % 2) for i in range(76)]
    bounds = _split(chunk)  # the chunk is rows 100-179: across the middle
    assert bounds[1] in (100, 180)
    g = torch.Generator().manual_seed(7)
    for _ in range(50):  # random steps of decodes and chunks: every bound outside a chunk, bounds in order
        lens = []
        while len(lens) < 300:
            n = 1 if torch.rand(1, generator=g).item() < 0.7 else int(torch.randint(2, 60, (1,), generator=g))
            start = int(torch.randint(1, 500, (1,), generator=g))
            lens.extend(range(start, start + n))
        for threads in (2, 3):
            bounds = _split(lens, threads=threads)
            assert bounds[0] == 0 and bounds[-1] == len(lens) and bounds == sorted(bounds)
            assert all(b in (0, len(lens)) or lens[b] != lens[b - 1] + 1 for b in bounds)


@pytest.mark.parametrize("quant", ["w8a8", "int4"])
def test_qkv_biases_and_a_sliding_window_run_natively_and_q_k_norms_keep_the_torch_layers(tmp_path, native_gemm,
                                                                                          monkeypatch, quant):
    """Qwen2's q/k/v biases, added to the scaled qkv products (W8A8 steps, and with int4 weights the weight-only
    steps below the switch on the W4A8 GEMM), and Mistral's sliding window run natively, with the torch layers'
    hidden states; Qwen3's per-head q/k norms keep the torch layers."""
    qwen2 = build_tiny_checkpoint(tmp_path / "qwen2", seed=2, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                  use_sliding_window=False)
    options = {"quant": "w8a8"} if quant == "w8a8" else {"quant": "int4", "w8a8_rows": 4, "prefer_speed": True}
    biased = load_model(qwen2, **options)
    assert biased.model.native_layers is not None, native_decode_reason(biased.model)
    if quant == "int4":
        biased.model.kernel_choice.w4a8_below = 4
        if weight_only_reason(biased.model):
            pytest.skip(f"no native weight-only layers here: {weight_only_reason(biased.model)}")
    pairs = _paired_steps(monkeypatch)
    _generate(biased, max_batch_size=3, max_batched_tokens=16)
    assert pairs and all(pair.got is not None for pair in pairs)
    _assert_steps_same_arithmetic(pairs)
    monkeypatch.undo()
    _script_native(monkeypatch)  # each load takes its own scripted GEMM choice
    qwen3 = build_tiny_checkpoint(tmp_path / "qwen3", seed=2, architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    normed = load_model(qwen3, quant="w8a8").model
    assert normed.native_layers is None and "q/k norms" in native_decode_reason(normed)
    _script_native(monkeypatch)
    mistral = build_tiny_checkpoint(tmp_path / "mistral", seed=2, architectures=["MistralForCausalLM"],
                                    model_type="mistral", sliding_window=8)
    windowed = load_model(mistral, quant="w8a8")
    assert windowed.model.native_layers is not None, native_decode_reason(windowed.model)
    pairs = _paired_steps(monkeypatch)
    _generate(windowed, max_tokens=12, max_batched_tokens=16)  # prompts of 3-23 tokens, then 12 more: past 8
    assert pairs and all(pair.got is not None for pair in pairs)
    _assert_steps_same_arithmetic(pairs)


def test_native_engine_tokens_match_the_eager_reference_but_for_near_ties(tiny_model_dir, native_gemm):
    loaded = load_model(tiny_model_dir, quant="w8a8")
    reference = dict(enumerate(greedy_decode(loaded.model, PROMPTS, 8)))  # contiguous caches: torch layers
    assert_only_near_ties(reference, _generate(loaded, max_tokens=8))


def test_steps_below_the_w8a8_rows_run_the_weight_only_layers(tiny_model_dir, native_gemm, monkeypatch):
    loaded = load_model(tiny_model_dir, quant="int8", w8a8_rows=4)
    assert loaded.model.native_layers is not None, native_decode_reason(loaded.model)
    pairs = _paired_steps(monkeypatch)
    # decode steps of 3 rows: weight-only; prefill chunks of 16 rows: W8A8 (short chunks, as in the test above:
    # a row near a rounding boundary loosens the rows after it in its chunk)
    _generate(loaded, max_batch_size=3, max_batched_tokens=16)
    assert {pair.rows < 4 for pair in pairs} == {True, False}
    for pair in pairs:
        assert (pair.got is None) == (pair.rows < 4), pair.rows
    _assert_steps_same_arithmetic(pairs)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_weight_only_steps_on_the_w4a8_gemm_give_the_torch_layers_hidden_states(tiny_model_dir, native_gemm,
                                                                                 monkeypatch, kv_dtype):
    """Steps below the W8A8 switch run natively on the int4 weights' W4A8 GEMM (model.quant=auto's small
    steps), as the torch layers run them on the same GEMM; steps from the switch on run the W8A8 layers."""
    loaded = load_model(tiny_model_dir, quant="int4", w8a8_rows=4, kv_dtype=kv_dtype, prefer_speed=True)
    model = loaded.model
    model.kernel_choice.w4a8_below = 4  # what the crossover's timing sets where the W4A8 GEMM wins
    why = weight_only_reason(model)
    if why:
        pytest.skip(f"no native weight-only layers here: {why}")
    pairs = _paired_steps(monkeypatch)
    _generate(loaded, max_batch_size=3, max_batched_tokens=16)  # decodes of 3 rows, prefill chunks of 16
    assert {pair.rows < 4 for pair in pairs} == {True, False}
    assert all(pair.got is not None for pair in pairs)
    assert model.kernel_choice.native_layer_steps == len(pairs)
    assert model.kernel_choice.steps["w4a8"] == 2 * sum(pair.rows < 4 for pair in pairs)  # each pass runs twice
    _assert_steps_same_arithmetic(pairs)


def test_adapter_rows_in_weight_only_steps_keep_the_torch_layers(tiny_model_dir, adapters, native_gemm, monkeypatch):
    """A weight-only step with adapter rows runs the torch layers (the native deltas are W8A8's); one without
    them, and every W8A8 step, runs natively (the deltas in float32 loops: the torch layers' arithmetic)."""
    monkeypatch.setattr(cpu_decode_layers, "lora_tiles", lambda: False)
    monkeypatch.setattr(cpu_decode_layers, "lora_dots", lambda: False)
    loaded = load_model(tiny_model_dir, quant="int4", w8a8_rows=4, prefer_speed=True)
    loaded.model.kernel_choice.w4a8_below = 4
    if weight_only_reason(loaded.model):
        pytest.skip(f"no native weight-only layers here: {weight_only_reason(loaded.model)}")
    pairs = _lora_pairs(loaded, adapters, monkeypatch, count=8, rows=3, max_loaded=3)
    adapter_steps = [pair.adapters is not None and bool(pair.adapters.any()) for pair in pairs]
    assert any(a and pair.rows < 4 for a, pair in zip(adapter_steps, pairs))
    for adapter_rows, pair in zip(adapter_steps, pairs):
        assert (pair.got is None) == (adapter_rows and pair.rows < 4), pair.rows
        if pair.got is not None:
            _assert_same_arithmetic(pair)


def test_without_the_native_gemm_or_w8a8_the_model_keeps_its_torch_layers(tiny_model_dir, monkeypatch):
    script_gemm_choice(monkeypatch, {"layers": PLAIN, "lm_head": PLAIN})
    plain_gemm = load_model(tiny_model_dir, quant="w8a8").model
    assert plain_gemm.native_layers is None
    assert f"do not run on the {NATIVE} GEMM" in native_decode_reason(plain_gemm) or cpu_decode_layers.unavailable_reason()
    assert "not quantized" in native_decode_reason(load_model(tiny_model_dir).model) or \
        cpu_decode_layers.unavailable_reason()


@pytest.mark.parametrize("k", [5, 16, 37, 600])
def test_native_quantize_rows_gives_the_reference_bits(k):
    """The int8 head's input quantized natively is quantize_rows(x, 128) bit for bit: values, scales, an
    all-zero row (scale 1), halves rounded to even; a row with a NaN or an infinity gets a NaN scale."""
    why = cpu_decode_layers.unavailable_reason()
    if why:
        pytest.skip(f"no native decode layers here: {why}")
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[2] = 0
    x[3, 0] = 127  # scale 1: the row's other values at halves, rounded to even
    x[3, 1:] = torch.arange(1, k).remainder(8).float() - 3.5
    got_u, got_scales = cpu_decode_layers.quantize_rows(x)
    want_u, want_scales = quantize_rows(x, zero_point=128)
    assert got_u.dtype == torch.uint8 and got_scales.shape == (9, 1)
    assert torch.equal(got_u, want_u) and torch.equal(got_scales, want_scales)
    assert got_scales[2].item() == 1.0
    x[4, k // 2], x[6, 0] = float("nan"), float("-inf")
    scales = cpu_decode_layers.quantize_rows(x)[1].reshape(-1)
    assert scales.isnan().tolist() == [i in (4, 6) for i in range(9)]


def test_the_switch_turns_the_native_layers_off(monkeypatch):
    cpu_decode_layers._library_or_reason.cache_clear()
    monkeypatch.setenv("PIPELINE_NATIVE", "gemm,attention")
    try:
        assert cpu_decode_layers.unavailable_reason() == "PIPELINE_NATIVE=gemm,attention leaves out the native decode"
    finally:
        cpu_decode_layers._library_or_reason.cache_clear()


def _layer(hidden: int, kv: int, intermediate: int) -> cpu_decode_layers.Layer:
    """A layer's linear sizes alone (what `splits_by_rows` reads), as the model's fused linears have them."""
    linear = cpu_decode_layers.Linear
    return cpu_decode_layers.Layer(qkv=linear(n=hidden + 2 * kv, k=hidden), o=linear(n=hidden, k=hidden),
                                   gate_up=linear(n=2 * intermediate, k=hidden), down=linear(n=hidden, k=intermediate))


def test_only_steps_of_small_layers_and_enough_rows_split_by_rows(native_gemm):
    """SmolLM2's layers (3.5 MB of int8) split by rows from 8 rows a thread; Llama-3.2-1B's (61 MB) never:
    each thread would read every weight, and its GEMMs dwarf the barriers the split saves."""
    small, large = _layer(576, 192, 1536), _layer(2048, 512, 8192)
    assert [cpu_decode_layers.splits_by_rows(small, rows, 2) for rows in (8, 15, 16, 256)] == [False, False, True, True]
    assert not cpu_decode_layers.splits_by_rows(small, 256, 1)  # one thread: nothing to split
    assert not any(cpu_decode_layers.splits_by_rows(large, rows, 2) for rows in (16, 64, 256, 4096))
