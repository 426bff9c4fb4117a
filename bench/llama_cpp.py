"""llama.cpp's server on the workloads of `bench/throughput.py`: generated tokens/s with continuous batching.

llama.cpp is not a dependency: build its `llama-server` yourself (CPU, native flags) and pass its path. The
same token ids as the engine's runs go to `/completion` from as many client threads as the server has
slots; greedy, EOS ignored, no prompt cache reuse across requests (as the engine's `distinct` workload;
the `shared` workload lets the server reuse a slot's cached prefix, its own prefix caching):

    python bench/llama_cpp.py --server ~/llama.cpp/build/bin/llama-server --workload distinct --slots 16,64
    python bench/llama_cpp.py --server ... --workload shared --new-tokens 64 --slots 16,32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from throughput import make_distinct_prompts, make_shared_prompts

from pipeline.model.loader import default_model_path, load_model
from pipeline.perf.probe import cpu_flags


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("llama-server did not become ready")


def complete(url: str, prompt: list[int], new_tokens: int, shared: bool) -> int:
    body = {"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0,
            "cache_prompt": shared}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.load(r)["tokens_predicted"]


def run(server: str, model: str, prompts: list[list[int]], slots: int, new_tokens: int, threads: int,
        shared: bool, port: int) -> float:
    ctx = slots * (max(map(len, prompts)) + new_tokens + 16)
    proc = subprocess.Popen([server, "-m", model, "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                             "-np", str(slots), "--port", str(port), "--host", "127.0.0.1", "-b", "512"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        complete(url, prompts[0], 4, shared)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            tokens = sum(pool.map(lambda p: complete(url, p, new_tokens, shared), prompts))
        return tokens / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True, help="path of a llama-server binary")
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--workload", default="distinct", choices=["distinct", "shared"])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--slots", default="16,64", help="comma-separated server slot counts (parallel sequences)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--port", type=int, default=18080)
    args = ap.parse_args()
    model = str(args.model or default_model_path())
    tok = load_model(model).tokenizer
    prompts = (make_distinct_prompts(tok, args.prompts) if args.workload == "distinct"
               else make_shared_prompts(tok, args.systems, args.questions))
    print(f"cpu flags: {cpu_flags()}; load {os.getloadavg()[0]:.1f}; threads {args.threads}; "
          f"workload {args.workload}: {len(prompts)} prompts, mean {sum(map(len, prompts)) / len(prompts):.0f} "
          f"tokens, {args.new_tokens} new tokens each")
    for slots in (int(s) for s in args.slots.split(",")):
        rate = run(args.server, model, prompts, slots, args.new_tokens, args.threads, args.workload == "shared",
                   args.port)
        print(f"llama-server {slots} slots: {rate:.1f} tok/s  load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
