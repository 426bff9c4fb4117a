"""Spawned tensor-parallel workers: same logits as one process, and failures that end the run cleanly."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pipeline.model.collectives import SINGLE
from pipeline.parallel.pool import WorkerFailed, WorkerPool
from tests.parallel.helpers import TinyLlamaSpec

pytestmark = pytest.mark.slow

PROMPT = torch.tensor([5, 812, 4021, 77, 19000, 3, 250, 9999])


def greedy_run(step, steps: int = 4) -> list[torch.Tensor]:
    """Prefill PROMPT, then decode `steps` greedy tokens; `step(inputs)` returns the last logits."""
    logits = [step([PROMPT, torch.arange(len(PROMPT))])]
    for i in range(steps):
        token = logits[-1].argmax().reshape(1)
        logits.append(step([token, torch.tensor([len(PROMPT) + i])]))
    return logits


def pool_step(pool: WorkerPool, executor):
    return lambda inputs: pool.step(inputs, lambda: executor.execute(inputs))


@pytest.mark.parametrize("size", [2])
def test_tp_logits_equal_single_process(size, no_orphans):
    spec = TinyLlamaSpec()
    reference = greedy_run(spec.build(SINGLE, "cpu").execute)
    with WorkerPool(size, spec) as pool:
        executor = spec.build(pool.group, "cpu")
        pool.wait_ready()
        got = greedy_run(pool_step(pool, executor))
    for ref, out in zip(reference, got):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert out.argmax() == ref.argmax()


def run_until_failure(pool: WorkerPool, spec: TinyLlamaSpec, steps: int = 20) -> WorkerFailed:
    executor = spec.build(pool.group, "cpu")
    with pytest.raises(WorkerFailed) as info:
        pool.wait_ready()
        greedy_run(pool_step(pool, executor), steps)
    return info.value


def test_exception_while_loading_names_rank(no_orphans):
    spec = TinyLlamaSpec(fail_rank=1)
    with WorkerPool(2, spec) as pool:
        err = run_until_failure(pool, spec)
    assert err.rank == 1
    assert "rank 1 (of 2)" in str(err) and "injected load failure on rank 1" in str(err)


def test_exception_mid_run_names_rank(no_orphans):
    spec = TinyLlamaSpec(fail_rank=1, fail_step=2)
    with WorkerPool(2, spec) as pool:
        err = run_until_failure(pool, spec)
    assert err.rank == 1 and "injected failure at step 2" in str(err)


def test_worker_killed_mid_run_ends_quickly(no_orphans):
    spec = TinyLlamaSpec()
    with WorkerPool(2, spec) as pool:
        executor = spec.build(pool.group, "cpu")
        pool.wait_ready()
        step = pool_step(pool, executor)
        greedy_run(step, 2)
        os.kill(pool.pids[0], signal.SIGKILL)
        with pytest.raises(WorkerFailed, match=r"rank 1 \(of 2\) was killed by signal SIGKILL") as info:
            greedy_run(step, 50)
    assert info.value.rank == 1


def test_bad_size():
    with pytest.raises(ValueError, match="tensor_parallel >= 2"):
        WorkerPool(1, TinyLlamaSpec())
