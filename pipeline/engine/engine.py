"""The engine loop: pull requests lazily, schedule, run the model, sample, yield finished results.

`Engine(loaded_model, config).generate(requests)` keeps at most `engine.waiting_window` requests read ahead
of the running batch, so the input can be a stream larger than memory. Requests that cannot run (bad
parameters, empty or too long prompts, unknown token ids) come back as `finish_reason="error"` results.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engine import batch_tuning
from pipeline.engine.adapters import AdapterManager, LoraConfig
from pipeline.engine.batch_tuning import PROMPT_TOKENS, BatchChoice, candidates, unmeasured
from pipeline.engine.config import EngineConfig, SpeculativeConfig
from pipeline.engine.constraints import Constraints, constraint_key
from pipeline.engine.kv_cache import KVCacheManager
from pipeline.engine.prefill import Embed, PrefillState, Score
from pipeline.engine.request import Request, Result, SamplingParams
from pipeline.engine.runner import (
    PromptSpan,
    Runner,
    RunnerFactory,
    StepBatch,
    build_batch,
    kv_bytes_per_block,
)
from pipeline.engine.sampler import Allowed, Sampled, sample, verify
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence, Status
from pipeline.engine.spec_gate import SpeculationGate
from pipeline.engine.speculative import make_proposer
from pipeline.engine.stats import EngineStats
from pipeline.engine.timing import Stamp, StepClock
from pipeline.model.llama import LlamaModel, cpp_compiler
from pipeline.model.lora.peft_file import AdapterError
from pipeline.seeds import sample_seed


@dataclass
class _StepRows:
    """One step's batch and what its logits rows are for: 1 + len(draft) rows per sampler, in order (plain
    rows sample, speculating rows verify), then the prompt-logprob and score rows, then the embedding rows
    (whose final hidden states are wanted, not logits)."""

    batch: StepBatch
    plain: list[tuple[int, Sequence]]  # (logits row, sequence) of each sampler with no guesses
    checking: list[Sequence]  # the speculating samplers
    check_rows: list[int]  # their logits rows
    prompt_spans: list[PromptSpan]
    constrained: list[int]  # indices into `plain`
    masks: Future | None  # the constrained rows' token masks, computed beside the forward pass
    greedy_only: bool  # every row plain greedy: the forward pass returns the argmaxes
    hidden_spans: list[PromptSpan]  # the embedding rows
    hidden: torch.Tensor | None = None  # their final hidden states, once the forward pass ran

    def prompt_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The prompt-logprob and score rows (after the samplers'; `logits` has none for the embedding rows)."""
        return logits[logits.shape[0] - sum(len(span) for _, span in self.prompt_spans):]

    def plain_logits(self, logits: torch.Tensor, fork_rows: list[int]) -> torch.Tensor:
        """One row per plain sampler, `fork_rows` giving each one's index in `plain` (forked samples share
        their parent's row)."""
        if not (self.checking or len(fork_rows) > len(self.plain) or self.prompt_spans):
            return logits
        rows = [self.plain[r][0] for r in fork_rows]
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))


class Engine:
    def __init__(self, loaded_model: Any, config: EngineConfig | None = None, make_runner: RunnerFactory = Runner,
                 speculative: SpeculativeConfig | None = None, draft_model: Any = None,
                 lora: LoraConfig | None = None):
        """`make_runner` builds the step executor once the KV pool is sized: the plain `Runner`, or the
        tensor-parallel runner that `pipeline.parallel.runner.open_model` hands out with a split model.
        An unsplit model on CUDA runs on `GpuRunner` (Triton paged attention, CUDA graphs) instead.
        `speculative` turns on speculative decoding; method draft needs `draft_model` (a `LlamaModel` with
        the same vocabulary, on one rank). `lora` lets requests run LoRA adapters (`Request.adapter`)."""
        self.config = config = config or EngineConfig()
        self.model = loaded_model.model
        self.tokenizer = loaded_model.tokenizer
        self.model_config = self.model.config
        param = next(self.model.parameters())
        self.device = param.device if config.device == "auto" else torch.device(config.device)
        if self.device != param.device:
            if self.device.type == "cuda" and any(getattr(m, "cpu_packed", None) for m in self.model.modules()):
                raise ValueError(
                    f"engine.device={config.device}: the model was loaded on CPU and packed for the CPU kernels; "
                    "load it on the GPU instead (load_model(..., device=...), or engine.device in a job)"
                )
            self.model.to(self.device)
        if compile_layers_wanted(config.compile, self.model, self.device) and not self.model.compiled:
            self.model.compile_layers()
        self.max_batch_size = config.batch_limit  # max_batch_size=auto: narrowed by tune_batch_size()
        block_bytes = kv_bytes_per_block(self.model, config.block_size)
        max_pos = self.model_config.max_position_embeddings
        num_blocks = self._kv_bytes(config, block_bytes, max_pos) // block_bytes
        capacity = num_blocks * config.block_size
        self.max_model_len = config.max_model_len or min(max_pos, capacity)
        if self.max_model_len > max_pos:
            raise ValueError(f"engine.max_model_len={self.max_model_len} exceeds the model's {max_pos} positions")
        if self.max_model_len > capacity:
            raise ValueError(
                f"engine.kv_cache_memory={config.kv_cache_memory!r} holds {capacity} tokens "
                f"({num_blocks} blocks of {block_bytes} bytes), fewer than max_model_len={self.max_model_len}"
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_batched_tokens, self.max_batch_size)
        if self.model.tp.size != config.tensor_parallel:
            raise ValueError(
                f"engine.tensor_parallel={config.tensor_parallel} but the model was loaded for {self.model.tp.size} "
                "rank(s); load it with pipeline.parallel.runner.open_model(..., tensor_parallel=N)"
            )
        if self.device.type == "cuda" and self.model.tp.size == 1:  # Triton attention, CUDA graphs
            from pipeline.engine.gpu_runner import GpuRunner

            if self.model.kv_dtype != self.model.dtype:
                raise ValueError(f"a {self.model.kv_dtype} KV cache for a {self.model.dtype} model runs on CPU only: "
                                 "on CUDA set model.kv_cache_dtype to the model dtype (or auto)")
            self.runner = GpuRunner(self.model, num_blocks, config.block_size, self.device, config.cuda_graphs,
                                    self.max_batch_size, self.max_model_len)
        else:
            self.runner = make_runner(self.model, num_blocks, config.block_size, self.device)
        self.adapters = AdapterManager(lora, self.model_config, self.runner.load_adapter) if lora else None
        if self.adapters is not None:
            self.adapters.preload()
        self.scheduler.adapters = self.adapters
        self.speculative = speculative or SpeculativeConfig()
        self.proposer = make_proposer(self.speculative, draft_model, self.model_config.vocab_size, num_blocks,
                                      config.block_size, self.device)
        self.gate = SpeculationGate(self.speculative)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._constraints: Constraints | None = None  # built at the first constrained request
        self.stats = EngineStats()
        self._update_gauges()
        self._rng = torch.Generator().manual_seed(config.seed)
        self._clock = StepClock(self.device)
        self._generate_start: float | None = None  # the first generate call's perf_counter (`first_token_s`)
        self._compiled_before = compile_seconds()  # torch.compile's seconds before this engine's steps
        self._next_seq_id = 0

    def _kv_bytes(self, config: EngineConfig, block_bytes: int, max_pos: int) -> int:
        """The KV budget: fixed, or on CUDA with kv_cache_memory=auto what free memory allows."""
        if not (config.kv_cache_auto and self.device.type == "cuda"):
            return config.kv_cache_bytes
        from pipeline.engine.memory import kv_cache_budget, measure_activation_peak

        peak = measure_activation_peak(self.model, config.max_batched_tokens, self.max_batch_size, self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        min_blocks = -(-(config.max_model_len or 1) // config.block_size)
        return kv_cache_budget(total, free, peak, config.gpu_memory_utilization, block_bytes, min_blocks)

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def waiting_window(self) -> int:
        """Requests read ahead of the running batch: engine.max_waiting, else 4 x the batch limit."""
        return self.config.max_waiting if self.config.max_waiting is not None else 4 * self.max_batch_size

    def tune_batch_size(self, max_tokens: int, rows: int | None = None) -> BatchChoice | None:
        """Resolve engine.max_batch_size=auto (None for a fixed size) for completions of up to `max_tokens`
        and a job of `rows` samples (if known): on CPU, measure decode steps at each candidate whose KV cache
        fits (`pipeline.engine.batch_tuning`) and keep the best, unless the run is too short to pay for it;
        elsewhere the largest that fits. Call it before any work: it runs steps of its own, and resets the
        stats after them."""
        if self.config.max_batch_size != "auto":
            return None
        if self.scheduler.has_work():
            raise RuntimeError("tune_batch_size runs on an idle engine, before any request")
        context = PROMPT_TOKENS + max_tokens
        sizes = candidates(self.kv.num_blocks * self.config.block_size, self.config.max_batched_tokens, context, rows)
        if self.device.type != "cpu":
            choice = unmeasured(sizes, f"{self.device.type}: the largest candidate that fits {context} positions per "
                                "sequence and the job's rows (decode stays bandwidth bound)", max(sizes))
        elif batch_tuning.short_run(rows, max_tokens):
            choice = unmeasured(sizes, f"a short run ({rows} samples x {max_tokens} new tokens): "
                                f"{batch_tuning.SHORT_RUN_BATCH} or less, not measured", batch_tuning.SHORT_RUN_BATCH)
        else:
            choice = batch_tuning.measure(self, sizes)
            self.stats = EngineStats()
            if self.model.kernel_choice is not None:
                self.model.kernel_choice.clear()
        self.max_batch_size = self.scheduler.max_batch_size = choice.batch
        self._update_gauges()
        return choice

    # -- public ---------------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request], on_step: Callable[[], None] | None = None) -> Iterator[Result]:
        """Yield one Result per sample of each request, in completion order. `on_step` is called after each
        step, once its results were taken: progress that must move before the first row finishes."""
        if self._generate_start is None:
            self._generate_start = time.perf_counter()
        source = iter(requests)
        exhausted = False
        window = self.waiting_window
        try:
            while True:
                while not exhausted and len(self.scheduler.waiting) < window:
                    request = next(source, None)
                    if request is None:
                        exhausted = True
                        break
                    yield from self.add_request(request)
                if not self.scheduler.has_work():
                    if exhausted:
                        return
                    continue
                yield from self.step()
                self.stats.compile_s = compile_seconds() - self._compiled_before
                if on_step is not None:
                    on_step()
        finally:  # the caller stopped early (or a step failed): drop unfinished work, free its blocks
            self.abort_all()

    def abort_all(self) -> None:
        """Drop every waiting and running sequence and return their blocks to the pool."""
        for seq in list(self.scheduler.running):
            self._finish(seq)
        if self.proposer is not None:
            for seq in self.scheduler.waiting:  # preempted ones may hold a draft cache
                self.proposer.release(seq)
        self.scheduler.waiting.clear()
        self.kv.pending_copies = []
        self._update_gauges()

    def _update_gauges(self) -> None:
        """The state part of `stats`: kept current after every step."""
        stats = self.stats
        stats.running = len(self.scheduler.running)
        stats.kv_blocks_used = self.kv.num_blocks - self.kv.num_free
        stats.kv_blocks_total = self.kv.num_blocks
        stats.block_size = self.config.block_size

    def add_request(self, request: Request) -> list[Result]:
        """Queue one request for the next steps; returns its error results if it cannot run (else [])."""
        seq_or_error = self._intake(request)
        if isinstance(seq_or_error, list):
            return seq_or_error
        self.scheduler.add(seq_or_error)
        return []

    def step(self) -> list[Result]:
        """Run one scheduling step; returns the samples that finished in it."""
        t0 = self._clock.stamp()
        work = self._schedule()
        if not work:
            return []
        rows = self._lay_out(work)
        out, t1, t2 = self._run_model(rows)
        self._advance(work, rows.batch)
        if rows.prompt_spans:
            self._prompt_logprobs(rows.prompt_logits(out), rows.prompt_spans)
        self._pool(rows)
        fork_rows, samplers = self._fork_children([seq for _, seq in rows.plain])
        t3 = self._clock.stamp()
        outcomes = self._sample(rows, out, fork_rows, samplers)
        t4 = self._clock.stamp()
        finished = []
        for seq, outcome in zip(samplers + rows.checking, outcomes):
            if self._emit(seq, outcome):
                self._finish(seq)
                finished.append(self._result(seq))
        for seq, _ in work:  # prefill-only requests end with their last position
            if seq.prefill is not None and seq.num_computed == seq.num_tokens:
                self._finish(seq)
                finished.append(self._result(seq))
        self._book(len(work), rows.batch.num_tokens, (t0, t1, t2, t3, t4))
        return finished

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, tokens) work, guesses proposed first; [] when nothing is queued or running."""
        self._propose()
        work = self.scheduler.schedule()
        if not work:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler found no work it could run although sequences are waiting")
            return work
        if self.scheduler.waiting:
            self.stats.steady_steps += 1
            self.stats.steady_running_sum += len(work)
        return work

    def _lay_out(self, work: list[tuple[Sequence, int]]) -> _StepRows:
        """The step's batch and what each logits row is for; the constrained rows' masks start computing
        here, beside the forward pass."""
        batch, samplers, spans = build_batch(work, self.config.block_size, self.kv.pending_copies)
        self.kv.pending_copies = []
        hidden_spans = [(seq, span) for seq, span in spans if seq.prefill is not None and seq.prefill.wants_hidden]
        prompt_spans = spans[: len(spans) - len(hidden_spans)]  # build_batch puts the embeddings' last
        # constrained rows never speculate (see _propose): they are all plain rows
        plain: list[tuple[int, Sequence]] = []
        checking: list[Sequence] = []
        check_rows: list[int] = []
        row = 0
        for seq in samplers:
            if seq.draft:
                checking.append(seq)
                check_rows.extend(range(row, row + 1 + len(seq.draft)))
            else:
                plain.append((row, seq))
            row += 1 + len(seq.draft)
        constrained = [i for i, (_, seq) in enumerate(plain) if seq.matcher is not None]
        masks = self._constraints.start_masks([plain[i][1].matcher for i in constrained]) if constrained else None
        # Every row plain greedy (the usual dataset job): the runner returns the argmaxes, and the int8 head
        # never writes the [rows, vocab] logits (`QuantLMHead.greedy`).
        greedy_only = not checking and not prompt_spans and not hidden_spans and all(
            seq.sampling.plain_greedy and not seq.num_children for _, seq in plain)
        return _StepRows(batch, plain, checking, check_rows, prompt_spans, constrained, masks, greedy_only,
                         hidden_spans)

    def _run_model(self, rows: _StepRows) -> tuple[torch.Tensor, Stamp, Stamp]:
        """The forward pass (the argmaxes when `rows.greedy_only`, else the logits), between the two stamps
        that time it."""
        t1 = self._clock.stamp()
        attention_before = self.runner.attn.attention_seconds
        if rows.hidden_spans:
            out = self._hidden_step(rows)
        else:
            out = self.runner.execute_greedy(rows.batch) if rows.greedy_only else self.runner.execute(rows.batch)
        t2 = self._clock.stamp()
        self.stats.attention_time += self.runner.attn.attention_seconds - attention_before
        return out, t1, t2

    def _hidden_step(self, rows: _StepRows) -> torch.Tensor:
        """The forward pass of a step with embedding rows: their final hidden states go to `rows.hidden`;
        returns the head's logits of the other wanted rows (samplers', prompt logprobs', scores')."""
        hidden = self.runner.execute_hidden(rows.batch)
        logit_rows = hidden.shape[0] - sum(len(span) for _, span in rows.hidden_spans)
        rows.hidden = hidden[logit_rows:]
        return self.model.compute_logits(hidden[:logit_rows]) if logit_rows else hidden[:0]

    @staticmethod
    def _pool(rows: _StepRows) -> None:
        """Record the embedding rows' final hidden states in their sequences."""
        row = 0
        for seq, span in rows.hidden_spans:
            seq.prefill.record_hidden(rows.hidden[row : row + len(span)], span)
            row += len(span)

    def _advance(self, work: list[tuple[Sequence, int]], batch: StepBatch) -> None:
        """Count the positions the forward pass computed and commit their KV blocks."""
        stats = self.stats
        for seq, n in work:
            stats.attention_pairs += n * seq.num_computed + n * (n + 1) // 2
            stats.prefill_tokens += max(0, min(seq.num_computed + n, seq.num_prompt_tokens) - seq.num_computed)
            seq.num_computed += n - len(seq.draft)  # guesses count once accepted (see _emit)
            self.kv.commit(seq)
        stats.computed_tokens += batch.num_tokens

    def _sample(self, rows: _StepRows, out: torch.Tensor, fork_rows: list[int],
                samplers: list[Sequence]) -> list[Sampled]:
        """Each sampler's tokens: one per plain sampler (forked samples draw from their parent's row), then
        the speculating rows' accepted guesses and next token."""
        if not samplers and not rows.checking:  # prefill chunks only
            return []
        # copies the sampled ids to the host: the step's one sync (verify's are extra, in speculating steps)
        if rows.greedy_only:
            sampled = Sampled(out.tolist(), [None] * len(samplers))
        else:
            sampled = sample(rows.plain_logits(out, fork_rows), samplers, self.eos_token_ids,
                             self._allowed(samplers, rows.constrained, rows.masks))
        outcomes = [Sampled([t], [lp]) for t, lp in zip(sampled.token_ids, sampled.logprobs)]
        if rows.checking:
            outcomes += verify(out[rows.check_rows], rows.checking)
            self.stats.spec_steps += 1
        return outcomes

    def _book(self, scheduled: int, num_tokens: int, stamps: tuple[Stamp, ...]) -> None:
        """The step's counts and times; `stamps`: its start, the forward pass's start and end, sampling's
        start and end (the rest is host work, counted as scheduling)."""
        t0, t1, t2, t3, t4 = stamps
        stats = self.stats
        stats.steps += 1
        stats.running_sum += scheduled
        stats.preemptions = self.scheduler.preemptions
        stats.held = self.scheduler.held
        stats.evictions = self.kv.evictions
        t5 = self._clock.stamp()
        model_seconds = self._clock.seconds(t1, t2)
        stats.model_time += model_seconds
        if stats.steps > 1:  # the first step also pays one-time costs (first touch of the KV pools)
            self.gate.observe_step(num_tokens, model_seconds)
        stats.sampling_time += self._clock.seconds(t3, t4)
        stats.schedule_time += (t1.wall - t0.wall) + (t3.wall - t2.wall) + (t5.wall - t4.wall)  # host work
        stats.total_time += t5.wall - t0.wall
        self._update_gauges()

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, spans: list[PromptSpan]) -> None:
        """Record each span's prompt logprobs, or a score's (once: a preempted sequence recomputes its
        positions)."""
        lp = torch.log_softmax(logits, dim=-1)
        row = 0
        for seq, span in spans:
            if seq.prefill is not None:
                seq.prefill.record_logprobs(lp[row : row + len(span)], span, seq.token_ids)
                row += len(span)
                continue
            k = seq.sampling.prompt_logprobs
            top_v, top_i = lp[row : row + len(span)].topk(k, dim=-1)
            for j, p in enumerate(span):
                if len(seq.prompt_logprobs) == p + 1:
                    entry = dict(zip(top_i[j].tolist(), top_v[j].tolist()))
                    actual = seq.token_ids[p + 1]
                    entry[actual] = float(lp[row + j, actual])
                    seq.prompt_logprobs.append(entry)
            row += len(span)

    def _allowed(self, samplers: list[Sequence], rows: list[int], masks: Future | None) -> Allowed | None:
        """The constrained rows and their masks: those computed during the forward pass, plus the samples
        forked in this step (computed now; it happens once per request with n > 1)."""
        known = set(rows)
        late = [i for i, seq in enumerate(samplers) if seq.matcher is not None and i not in known]
        if masks is None and not late:
            return None
        parts = [masks.result()] if masks is not None else []
        if late:
            parts.append(self._constraints.masks([samplers[i].matcher for i in late]))
        return rows + late, torch.cat(parts)

    # -- requests in ----------------------------------------------------------------------------------
    def _intake(self, request: Request) -> Sequence | list[Result]:
        """A waiting Sequence for a valid request, else its error results."""
        rid = getattr(request, "id", None)
        sampling = getattr(request, "sampling", None)
        try:
            if isinstance(sampling, Mapping):
                sampling = SamplingParams(**sampling)
            elif not isinstance(sampling, SamplingParams):
                raise ValueError(f"sampling must be SamplingParams or a mapping, got {type(sampling).__name__}")
            prefill = getattr(request, "prefill", None)
            problem = self._prompt_problem(getattr(request, "prompt_token_ids", None), prefill is not None)
            problem = problem or sampling.token_id_problem(self.model_config.vocab_size)
            if prefill is not None:
                problem = problem or self._prefill_problem(prefill, len(request.prompt_token_ids), sampling)
            matcher = None
            if sampling.constrained and not problem and prefill is None:  # a prefill request samples nothing
                try:
                    matcher = self._matcher(sampling)
                except ValueError as e:  # a bad schema or regex: this request's samples are error results
                    problem = str(e)
            if sampling.n > self.max_batch_size:
                problem = problem or f"n={sampling.n} exceeds engine.max_batch_size={self.max_batch_size}"
            adapter = getattr(request, "adapter", None)
            if adapter is not None and not problem:
                problem = self._adapter_problem(adapter)
        except (TypeError, ValueError) as exc:
            sampling, problem = None, str(exc)
        if problem:
            self.stats.errors += 1
            n = sampling.n if sampling is not None else 1
            return [Result(rid, i, [], "", 0, 0, 0, "error", error=problem) for i in range(n)]
        prompt = list(request.prompt_token_ids)
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        seq = self._sequence(rid, 0, prompt, sampling, seed)
        seq.matcher = matcher
        seq.num_children = sampling.n - 1
        if prefill is not None:
            seq.prefill = PrefillState(prefill, sampling.logprobs if isinstance(prefill, Score) else 0)
        if adapter is not None:
            seq.adapter = adapter
            use = self.stats.adapters.setdefault(adapter, {"rows": 0, "prompt_tokens": 0, "generated_tokens": 0})
            use["rows"] += 1
            use["prompt_tokens"] += len(prompt)
        return seq

    def _adapter_problem(self, adapter: Any) -> str | None:
        """Why a request's LoRA adapter cannot run here (None: it can)."""
        if self.adapters is None:
            return f"adapter {adapter!r} given, but this engine runs no LoRA adapters (model.lora)"
        if not isinstance(adapter, str) or not adapter:
            return f"adapter must be a non-empty name or folder, got {adapter!r}"
        try:
            self.adapters.resolve(adapter)
        except AdapterError as e:
            return str(e)
        return None

    def _prefill_problem(self, prefill: Any, prompt_len: int, sampling: SamplingParams) -> str | None:
        """Why a prefill-only request (`Request.prefill`) cannot run here (None: it can)."""
        if not isinstance(prefill, Score | Embed):
            return f"prefill must be Score, Embed or None, got {type(prefill).__name__}"
        if sampling.n != 1:
            return f"n={sampling.n}: a score or embedding request has one result"
        if isinstance(prefill, Score) and prefill.start >= prompt_len:
            return f"Score.start={prefill.start} leaves no token to score in a prompt of {prompt_len} tokens"
        if isinstance(prefill, Embed) and not hasattr(self.runner, "execute_hidden"):
            return "an embedding needs the final hidden states, which this runner does not return " \
                   "(tensor parallelism)"
        return None

    def _prompt_problem(self, prompt: Any, prefill_only: bool = False) -> str | None:
        """Why a prompt cannot run (None: it can); a prefill-only one may fill max_model_len."""
        if not isinstance(prompt, list | tuple) or not prompt:
            return "prompt_token_ids must be a non-empty list of token ids"
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            return f"prompt has token ids outside 0..{vocab - 1}: {bad[:5]}"
        if prefill_only:
            return None if len(prompt) <= self.max_model_len else \
                f"prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}"
        if len(prompt) >= self.max_model_len:
            return (
                f"prompt has {len(prompt)} tokens; max_model_len={self.max_model_len} leaves no room to generate"
            )
        return None

    def _matcher(self, sampling: SamplingParams) -> Any:
        """The request's grammar matcher; ValueError naming the constraint key when it cannot be used."""
        if self._constraints is None:
            hf = getattr(self.tokenizer, "hf", None)
            if hf is None:
                raise ValueError(f"{constraint_key(sampling)}: constrained decoding needs the model's own "
                                 "(Hugging Face `tokenizers`) tokenizer")
            self._constraints = Constraints(hf.to_str(), self.model_config.vocab_size, tuple(self.eos_token_ids))
        return self._constraints.matcher(sampling)

    def _sequence(self, rid: Any, index: int, tokens: list[int], sampling: SamplingParams, seed: int) -> Sequence:
        generator = None if sampling.greedy else torch.Generator().manual_seed(sample_seed(seed, index))
        seq = Sequence(
            seq_id=self._next_seq_id, request_id=rid, sample_index=index, token_ids=tokens,
            num_prompt_tokens=len(tokens), sampling=sampling, base_seed=seed, generator=generator,
        )
        self._next_seq_id += 1
        if sampling.stop:
            seq.decoder = self.tokenizer.incremental_decoder()
        if sampling.logprobs:
            seq.logprobs = []
        if sampling.prompt_logprobs:
            seq.prompt_logprobs = [None]  # the first prompt token has no context to be scored in
        return seq

    def _fork_children(self, samplers: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """Samples 1..n-1 of a request join right after sample 0's prefill and share its logits row."""
        rows, out = list(range(len(samplers))), list(samplers)
        for row, parent in enumerate(samplers):
            for index in range(1, parent.num_children + 1):
                child = self._sequence(
                    parent.request_id, index, parent.token_ids[: parent.num_prompt_tokens],
                    parent.sampling, parent.base_seed,
                )
                child.num_cached = parent.num_cached
                child.adapter = parent.adapter
                child.prompt_logprobs = parent.prompt_logprobs  # the same prompt, scored once
                if parent.matcher is not None:  # a fresh one: the parent's may be in the mask thread now
                    child.matcher = self._constraints.matcher(parent.sampling)
                if not self.kv.fork(parent, child):  # no block for its copy: recompute later instead
                    self.scheduler.waiting.appendleft(child)
                    continue
                child.status = Status.RUNNING
                if self.adapters is not None:
                    self.adapters.acquire(child)  # its parent holds the adapter's slot: it is resident
                self.scheduler.running.append(child)
                rows.append(row)
                out.append(child)
            parent.num_children = 0
        return rows, out

    # -- speculative decoding -------------------------------------------------------------------------
    def _propose(self) -> None:
        """Give decoding sequences guesses to check in this step, as many as the gate says pay."""
        spec = self.speculative
        running = self.scheduler.running
        if self.proposer is None:
            return
        for seq in running:  # guesses left over from a step that had no budget for them
            seq.draft = []
        allowed = self.gate.speculating(len(running))
        seqs, ks = [], []
        for seq in running:
            if len(seqs) == allowed:
                break
            if seq.num_uncomputed != 1 or seq.num_children or seq.prefill is not None or _adjusts_logits(seq):
                continue
            seq.spec_k = seq.spec_k or spec.k
            room = min(seq.sampling.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if min(seq.spec_k, room) > 0:
                seqs.append(seq)
                ks.append(min(seq.spec_k, room))
        if not seqs:
            return
        start = time.perf_counter()
        guesses = self.proposer.propose(seqs, ks)
        self.gate.observe_proposal(len(seqs), time.perf_counter() - start)
        for seq, guess in zip(seqs, guesses):
            seq.draft = guess

    def _emit(self, seq: Sequence, outcome: Sampled) -> bool:
        """Append a step's tokens (one, or the accepted guesses and one more) up to a finish; roll the KV
        cache back past the last kept token. True when the sample is finished."""
        guessed = len(seq.draft)
        finished = False
        use = self.stats.adapters[seq.adapter] if seq.adapter is not None else {}
        if self.stats.first_token_s is None and self._generate_start is not None:
            self.stats.first_token_s = time.perf_counter() - self._generate_start
        for token, logprobs in zip(outcome.token_ids, outcome.logprobs):
            self.stats.decode_tokens += 1
            if use:
                use["generated_tokens"] += 1
            if self._append(seq, token, logprobs):
                finished = True
                break
        if guessed:
            accepted = len(outcome.token_ids) - 1
            stats = self.stats
            stats.spec_checks += 1
            stats.spec_proposed += guessed
            stats.spec_accepted += accepted
            self.gate.observe_check(guessed, accepted)
            if self.speculative.adaptive_k:
                step = 1 if accepted == guessed else -1 if accepted == 0 else 0
                seq.spec_k = max(1, min(self.speculative.k, seq.spec_k + step))
            seq.num_computed += guessed
            seq.draft = []
            self.kv.truncate(seq, seq.num_tokens - 1)  # K/V of the kept tokens but the newest one
            self.kv.commit(seq)
        return finished

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    # -- tokens out -----------------------------------------------------------------------------------
    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> bool:
        """Add a sampled token; True when the sample is finished (finish_reason set)."""
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        sp = seq.sampling
        if self._stop_token(sp, token):
            seq.finish_reason = "stop"
            return True
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                seq.finish_reason = "error"
                return True
            if seq.matcher.is_stopped():  # the constraint is complete and allows nothing more
                seq.finish_reason = "stop"
                return True
        if seq.decoder is not None:
            tail = len(seq.text)
            seq.text += seq.decoder.push(token)
            for stop in sp.stop if seq.num_output_tokens > sp.min_tokens else ():
                at = seq.text.find(stop, max(0, tail - len(stop) + 1))
                if at >= 0:
                    seq.text = seq.text[:at]
                    seq.finish_reason = "stop"
                    return True
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            incomplete = seq.matcher is not None and not seq.matcher.is_accepting()
            seq.finish_reason = "incomplete" if incomplete else "length"
            return True
        return False

    def _stop_token(self, sp: SamplingParams, token: int) -> bool:
        return token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids)

    def _result(self, seq: Sequence) -> Result:
        if seq.prefill is not None:
            return self._prefill_result(seq)
        output = seq.output_ids
        if seq.decoder is not None:
            text = seq.text
        else:
            stopped_by_token = seq.finish_reason == "stop" and self._stop_token(seq.sampling, output[-1])
            text = self.tokenizer.decode(output[:-1] if stopped_by_token else output)
        if seq.sample_index == 0:
            self.stats.cached_tokens += max(0, seq.num_cached)
        return Result(
            id=seq.request_id, sample_index=seq.sample_index, token_ids=output, text=text,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=max(0, seq.num_cached),
            completion_tokens=len(output), finish_reason=seq.finish_reason, error=self._constraint_error(seq),
            logprobs=seq.logprobs, logprob_tokens=self._token_strings(seq.logprobs),
            prompt_logprobs=seq.prompt_logprobs,
        )

    def _prefill_result(self, seq: Sequence) -> Result:
        """A finished prefill-only request: its scored tokens' log-probabilities (and their top-k, with
        `logprobs`), or its embedding."""
        state = seq.prefill
        self.stats.cached_tokens += max(0, seq.num_cached)
        score = isinstance(state.task, Score)
        top = state.top if state.top_k else None
        return Result(
            id=seq.request_id, sample_index=0, token_ids=[], text="", prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=max(0, seq.num_cached), completion_tokens=0, finish_reason="stop",
            logprobs=top, logprob_tokens=self._token_strings(top), token_logprobs=state.logprobs if score else None,
            embedding=None if score else state.embedding(),
        )

    def _constraint_error(self, seq: Sequence) -> str | None:
        """Why a constrained sample's output does not satisfy its constraint (None when it does)."""
        key = constraint_key(seq.sampling) if seq.matcher is not None else None
        if seq.finish_reason == "incomplete":
            return f"output did not complete its {key} within max_tokens={seq.sampling.max_tokens}"
        if seq.finish_reason == "error" and key:
            return f"{key}: the grammar rejected a sampled token: {seq.matcher.get_error()}"
        return None

    def _token_strings(self, logprobs: list[dict[int, float]] | None) -> list[dict[int, str]] | None:
        """Each logprobs entry's tokens as text (special tokens spelled out), as OpenAI's `token` field."""
        if logprobs is None:
            return None
        return [{t: self.tokenizer.decode([t], skip_special_tokens=False) for t in entry} for entry in logprobs]


def _adjusts_logits(seq: Sequence) -> bool:
    """Whether the sampler changes this sequence's logits before drawing (a constraint, logit_bias,
    min_tokens or a penalty): verification checks guesses against the model's own distribution, so such
    sequences do not speculate."""
    sp = seq.sampling
    return seq.matcher is not None or bool(sp.logit_bias) or sp.min_tokens > 0 or sp.penalized


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (tracing and code generation: its
    `entire_frame_compile`), which a step that compiles a graph waits for; 0 before anything compiled."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0.0
    return float(sys.modules["torch._dynamo.utils"].calculate_time_spent().get("entire_frame_compile", 0.0))


def compile_layers_wanted(setting: str, model: LlamaModel, device: torch.device) -> bool:
    """engine.compile resolved: only on CPU (the GPU path has its own kernels and CUDA graphs); `auto`
    compiles single-rank models with W8A8 steps, whose activation quantization and scale epilogues are most
    of a CPU step outside the matmuls, where a C++ compiler is installed. The exact float32 path and the
    weight-only schemes stay eager: the compiled graphs' fused reductions round differently (last float32
    bits), which moves greedy tokens at near-ties."""
    if setting == "off" or device.type != "cpu":
        return False
    if setting == "on":
        return True
    choice = model.kernel_choice
    return choice is not None and choice.w8a8_rows is not None and model.tp.size == 1 and cpp_compiler() is not None
