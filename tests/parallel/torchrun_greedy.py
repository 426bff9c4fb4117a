"""Run under `torchrun --nproc-per-node N`: every rank calls `open_model`; ranks > 0 serve steps and exit
there, rank 0 decodes the prompts greedily and writes {id: tokens} as JSON. Usage: MODEL_DIR OUT N."""

from __future__ import annotations

import json
import sys

from pipeline.parallel.runner import open_model
from tests.parallel.engine_helpers import greedy, random_prompts


def main() -> None:
    model_dir, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = random_prompts(8, vocab=49152)
    with open_model(model_dir, tensor_parallel=n) as sharded:
        run = greedy(sharded.loaded, prompts, 6, tensor_parallel=n, make_runner=sharded.make_runner)
        tokens = {i: t for i, (t, _) in run.items()}
    with open(out, "w") as f:
        json.dump(tokens, f)


if __name__ == "__main__":
    main()
